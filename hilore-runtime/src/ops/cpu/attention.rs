//! Flash attention on the CPU: a tiled forward with online softmax that saves the output
//! and the log-sum-exp, and the FlashAttention-2 backward from the log-sum-exp
//! (`dS = P * (dP - rowsum(dO * O))`). Never a `T x T` buffer: the work is done on
//! `BQ x BK` tiles of the scores, one tile at a time per task.
//!
//! Layout: `q: [N, Hq, D]`, `k, v: [N, Hkv, D]`, row-major and packed (the sequences of a
//! batch back to back on `N`); query head `h` reads kv head `h / G`, `G = Hq / Hkv`, and the
//! `G` query heads of a group share the group's K/V tiles (nothing is copied per query
//! head). The output is `[N, Hq, D]`, the log-sum-exp `[Hq, N]`.
//!
//! Masks are computed from positions, never stored: the query rows and the key rows of
//! attention come as [`Span`]s, a run of query rows with the runs of key rows it attends
//! to, each run with the positions of its rows. Key `kp` is visible to query `qp` when
//! `kp <= qp` and, with a sliding window `W`, `qp - kp < W`. A packed sequence is one span
//! whose keys are its own rows; a layout where several sequences attend to one shared
//! prefix is spans whose key runs are the prefix's rows and then their own (the prefix's
//! positions first), with no change to the tile loops. Each tile is classified from the
//! positions of its corners as hidden (skipped), fully visible, or partial (masked
//! element by element).
//!
//! Parallel work: the forward's tasks are (span, kv head, query block); the backward's
//! are (span, kv head), each owning its span's query rows of `dQ` (for the group's query
//! heads) and the key rows of `dK`, `dV` (for its kv head), so no two tasks write the
//! same element and every sum is taken in a fixed order (key blocks in order for `dQ`,
//! query blocks and then the group's heads in order for `dK` and `dV`). Spans that share
//! key rows (a shared prefix and its continuations, consecutive) go to one task, which sums
//! their contributions to those rows in span order: the prefix's own queries first, then
//! each continuation's.

use super::{dot, exp, exp_shift_scale, exp_shift_sum, gemm, max, MatRef, SharedMut, Threads};
use crate::{Error, Result};
use rayon::prelude::*;

/// Query rows per tile.
const BQ: usize = 64;
/// Key rows per tile.
const BK: usize = 64;

/// Consecutive rows `row..row + len` of the packed tensors, at positions
/// `pos..pos + len` of their sequence.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Run {
    pub row: usize,
    pub pos: usize,
    pub len: usize,
}

/// A run of query rows and the key runs they attend to.
#[derive(Clone, Debug)]
pub(crate) struct Span {
    pub queries: Run,
    pub keys: Vec<Run>,
}

/// One span per packed sequence of `packing`: causal attention within each sequence, and
/// a continuation of a shared prefix ([`crate::Packing::with_shared_prefixes`]) attending
/// to the prefix's rows (positions `0..P`) and then causally to its own (positions from
/// `P`). The spans come group by group, each prefix followed by its continuations in
/// packing order, wherever their rows lie (one group after another, or every prefix
/// first): the order in which the backward sums a prefix's `dK`, `dV`.
pub(crate) fn packing_spans(packing: &crate::Packing) -> Vec<Span> {
    let offsets = packing.offsets();
    let n = packing.num_sequences();
    let run = |i: usize, pos: usize| Run {
        row: offsets[i],
        pos,
        len: offsets[i + 1] - offsets[i],
    };
    let mut continuations = vec![Vec::new(); n];
    for i in 0..n {
        if let Some(j) = packing.prefix_of(i) {
            continuations[j].push(i);
        }
    }
    let mut spans = Vec::with_capacity(n);
    for j in (0..n).filter(|&j| packing.prefix_of(j).is_none()) {
        let prefix = run(j, 0);
        spans.push(Span {
            queries: prefix,
            keys: vec![prefix],
        });
        for &i in &continuations[j] {
            let own = run(i, prefix.len);
            spans.push(Span {
                queries: own,
                keys: vec![prefix, own],
            });
        }
    }
    spans
}

/// Head counts, head size, score scale and window.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub scale: f32,
    pub window: Option<usize>,
}

impl Geometry {
    fn group(&self) -> usize {
        self.hq / self.hkv
    }

    fn visible(&self, qp: usize, kp: usize) -> bool {
        kp <= qp && self.window.is_none_or(|w| qp - kp < w)
    }

    /// How a tile of queries at `qp..qp + ql` and keys at `kp..kp + kl` is masked.
    fn tile(&self, qp: usize, ql: usize, kp: usize, kl: usize) -> Tile {
        let (qmax, kmax) = (qp + ql - 1, kp + kl - 1);
        let hidden = kp > qmax || self.window.is_some_and(|w| qp >= kmax + w);
        if hidden {
            return Tile::Hidden;
        }
        let full = kmax <= qp && self.window.is_none_or(|w| qmax - kp < w);
        if full {
            Tile::Full
        } else {
            Tile::Partial
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tile {
    Hidden,
    Full,
    Partial,
}

/// The key tiles of `keys`: `(row, pos, len)`, at most [`BK`] keys each.
fn key_tiles(keys: &[Run]) -> impl Iterator<Item = Run> + '_ {
    keys.iter().flat_map(|r| {
        (0..r.len).step_by(BK).map(move |o| Run {
            row: r.row + o,
            pos: r.pos + o,
            len: BK.min(r.len - o),
        })
    })
}

/// The query tiles of `queries`, at most [`BQ`] rows each.
fn query_tiles(q: Run) -> impl Iterator<Item = Run> {
    (0..q.len).step_by(BQ).map(move |o| Run {
        row: q.row + o,
        pos: q.pos + o,
        len: BQ.min(q.len - o),
    })
}

/// Consecutive spans that share key rows (a shared prefix and its continuations): one
/// backward task per group and kv head sums their contributions to the shared rows, in
/// span order.
struct Group {
    spans: std::ops::Range<usize>,
    /// For each span of the group and each of its key runs, whether it is the first run
    /// of the group on those rows (it writes their `dK`, `dV`; the later ones add).
    first: Vec<Vec<bool>>,
}

/// Checks the spans against `n` packed rows and groups the ones that share key rows. Key
/// rows are shared only as one whole run, by consecutive spans.
fn check(n: usize, spans: &[Span]) -> Result<Vec<Group>> {
    // The group (1-based) whose run first covered each row; 0 for none yet.
    let mut owner = vec![0usize; n];
    let mut groups: Vec<Group> = Vec::new();
    // The key runs of the last group, as (row, len).
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (si, s) in spans.iter().enumerate() {
        for r in std::iter::once(&s.queries).chain(&s.keys) {
            if r.row + r.len > n || r.len == 0 {
                return Err(Error::Tape(format!(
                    "attention kernel: rows {}..{} outside the {n} packed rows (or empty)",
                    r.row,
                    r.row + r.len
                )));
            }
        }
        let shares = s
            .keys
            .iter()
            .any(|r| owner[r.row..r.row + r.len].iter().any(|&o| o != 0));
        match groups.last_mut() {
            Some(g) if shares => g.spans.end = si + 1,
            _ => {
                groups.push(Group {
                    spans: si..si + 1,
                    first: Vec::new(),
                });
                runs.clear();
            }
        }
        let gid = groups.len();
        let mut first = Vec::with_capacity(s.keys.len());
        for r in &s.keys {
            let rows = &mut owner[r.row..r.row + r.len];
            if rows.iter().all(|&o| o == 0) {
                rows.fill(gid);
                runs.push((r.row, r.len));
                first.push(true);
            } else if rows.iter().all(|&o| o == gid) && runs.contains(&(r.row, r.len)) {
                first.push(false);
            } else {
                return Err(Error::Tape(format!(
                    "attention kernel: span {si} shares key rows {}..{} other than as a whole run of the spans right before it; pack a shared prefix's continuations right after it",
                    r.row,
                    r.row + r.len
                )));
            }
        }
        if let Some(g) = groups.last_mut() {
            g.first.push(first);
        }
    }
    Ok(groups)
}

/// The scaled scores `S = scale * Q K^T` of a tile into `s` (`BQ x BK`, row stride `BK`):
/// the query tile's rows of one query head (`qa`) against the key tile's rows of their kv
/// head (`kb`, rows `Hkv * D` apart). The forward and the backward both call this, so the
/// backward's probabilities are the forward's bit for bit.
fn scores(s: &mut [f32], qa: MatRef<'_>, kb: &[f32], qt: Run, kt: Run, geo: Geometry) {
    assert!(s.len() >= BQ * BK && qt.len <= BQ && kt.len <= BK);
    // SAFETY: `s` is an exclusive slice holding the BQ x BK tile (checked above).
    unsafe {
        gemm(
            qt.len,
            kt.len,
            geo.d,
            s.as_mut_ptr(),
            BK,
            false,
            qa,
            MatRef::rows_t(kb, geo.hkv * geo.d),
            geo.scale,
            Threads::One,
        )
    };
}

/// The forward: `(o [N, Hq, D], lse [Hq, N])`.
pub(crate) fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    geo: Geometry,
    spans: &[Span],
) -> Result<(Vec<f32>, Vec<f32>)> {
    check(n, spans)?;
    let Geometry { hq, hkv, d, .. } = geo;
    let gs = geo.group();
    let mut out = vec![0f32; n * hq * d];
    let mut lse = vec![0f32; hq * n];
    let (o_ptr, lse_ptr) = (SharedMut::new(&mut out), SharedMut::new(&mut lse));
    let tasks: Vec<(usize, usize, Run)> = spans
        .iter()
        .enumerate()
        .flat_map(|(si, s)| {
            (0..hkv).flat_map(move |kh| query_tiles(s.queries).map(move |t| (si, kh, t)))
        })
        .collect();
    tasks.par_iter().for_each_init(
        || {
            (
                vec![0f32; BQ * BK],
                vec![0f32; BQ * d],
                [0f32; BQ],
                [0f32; BQ],
            )
        },
        |(s, acc, m, l), &(si, kh, qt)| {
            for g in 0..gs {
                let h = kh * gs + g;
                m.fill(f32::NEG_INFINITY);
                l.fill(0.0);
                acc.fill(0.0);
                let qa = MatRef::rows(&q[(qt.row * hq + h) * d..], hq * d);
                for kt in key_tiles(&spans[si].keys) {
                    let tile = geo.tile(qt.pos, qt.len, kt.pos, kt.len);
                    if tile == Tile::Hidden {
                        continue;
                    }
                    scores(s, qa, &k[(kt.row * hkv + kh) * d..], qt, kt, geo);
                    for i in 0..qt.len {
                        let row = &mut s[i * BK..i * BK + kt.len];
                        if tile == Tile::Partial {
                            for (j, x) in row.iter_mut().enumerate() {
                                if !geo.visible(qt.pos + i, kt.pos + j) {
                                    *x = f32::NEG_INFINITY;
                                }
                            }
                        }
                        let m_new = m[i].max(max(row));
                        if m_new == f32::NEG_INFINITY {
                            // Nothing visible to this query yet: its probabilities are 0.
                            row.fill(0.0);
                            continue;
                        }
                        let alpha = exp(m[i] - m_new);
                        l[i] = l[i] * alpha + exp_shift_sum(row, m_new);
                        if alpha != 1.0 {
                            for a in &mut acc[i * d..(i + 1) * d] {
                                *a *= alpha;
                            }
                        }
                        m[i] = m_new;
                    }
                    // acc += P V.
                    // SAFETY: `acc` is this task's own scratch of BQ x D.
                    unsafe {
                        gemm(
                            qt.len,
                            d,
                            kt.len,
                            acc.as_mut_ptr(),
                            d,
                            true,
                            MatRef::rows(s, BK),
                            MatRef::rows(&v[(kt.row * hkv + kh) * d..], hkv * d),
                            1.0,
                            Threads::One,
                        )
                    };
                }
                for i in 0..qt.len {
                    let r = qt.row + i;
                    // SAFETY: row `r`, head `h` of the output and `lse[h, r]` belong to this
                    // task alone (its query tile and its kv head's group).
                    let (o, ls) = unsafe {
                        (
                            o_ptr.slice((r * hq + h) * d, d),
                            lse_ptr.slice(h * n + r, 1),
                        )
                    };
                    if l[i] > 0.0 {
                        let inv = 1.0 / l[i];
                        for (o, &a) in o.iter_mut().zip(&acc[i * d..(i + 1) * d]) {
                            *o = a * inv;
                        }
                        ls[0] = m[i] + l[i].ln();
                    } else {
                        ls[0] = f32::NEG_INFINITY;
                    }
                }
            }
        },
    );
    Ok((out, lse))
}

/// What the backward reads besides `q`, `k`, the log-sum-exp and `dO`: `v` and `o`, which
/// only `dQ` and `dK` need.
pub(crate) struct VO<'a> {
    pub v: &'a [f32],
    pub o: &'a [f32],
}

/// The gradients `(dQ, dK, dV)` that `need` asks for.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(crate) fn backward(
    q: &[f32],
    k: &[f32],
    vo: Option<VO<'_>>,
    lse: &[f32],
    g: &[f32],
    n: usize,
    geo: Geometry,
    spans: &[Span],
    need: [bool; 3],
) -> Result<(Option<Vec<f32>>, Option<Vec<f32>>, Option<Vec<f32>>)> {
    let groups = check(n, spans)?;
    let Geometry { hq, hkv, d, .. } = geo;
    let gs = geo.group();
    let need_ds = need[0] || need[1];
    if need_ds && vo.is_none() {
        return Err(Error::Tape(
            "attention kernel: dQ/dK need v and o, which were not saved".into(),
        ));
    }
    let mut dq = need[0].then(|| vec![0f32; n * hq * d]);
    let mut dk = need[1].then(|| vec![0f32; n * hkv * d]);
    let mut dv = need[2].then(|| vec![0f32; n * hkv * d]);
    let dq_ptr = dq.as_deref_mut().map(SharedMut::new);
    let dk_ptr = dk.as_deref_mut().map(SharedMut::new);
    let dv_ptr = dv.as_deref_mut().map(SharedMut::new);
    let mut tasks: Vec<(usize, usize)> = (0..groups.len())
        .flat_map(|gi| (0..hkv).map(move |kh| (gi, kh)))
        .collect();
    // Longest groups first, so that the last task to start is a short one.
    let rows = |g: &Group| -> usize { spans[g.spans.clone()].iter().map(|s| s.queries.len).sum() };
    tasks.sort_by_key(|&(gi, _)| std::cmp::Reverse(rows(&groups[gi])));
    tasks.par_iter().for_each(|&(gi, kh)| {
        let group = &groups[gi];
        for si in group.spans.clone() {
            let span = &spans[si];
            let qs = span.queries;
            let mut p = vec![0f32; BQ * BK];
            let mut dp = vec![0f32; BQ * BK];
            let mut dk_acc = vec![0f32; BK * d];
            let mut dv_acc = vec![0f32; BK * d];
            // D_i = rowsum(dO_i * O_i) for the group's heads, `[G, len]`.
            let dvec: Vec<f32> = match &vo {
                Some(vo) if need_ds => (0..gs)
                    .flat_map(|gi| {
                        let h = kh * gs + gi;
                        (0..qs.len).map(move |i| {
                            let at = ((qs.row + i) * hq + h) * d;
                            dot(&g[at..at + d], &vo.o[at..at + d])
                        })
                    })
                    .collect(),
                _ => Vec::new(),
            };
            for (kt, first) in span
                .keys
                .iter()
                .zip(&group.first[si - group.spans.start])
                .flat_map(|(r, &first)| {
                    key_tiles(std::slice::from_ref(r)).map(move |kt| (kt, first))
                })
            {
                dk_acc.fill(0.0);
                dv_acc.fill(0.0);
                let kb = &k[(kt.row * hkv + kh) * d..];
                for qt in query_tiles(qs) {
                    let tile = geo.tile(qt.pos, qt.len, kt.pos, kt.len);
                    if tile == Tile::Hidden {
                        continue;
                    }
                    for gi in 0..gs {
                        let h = kh * gs + gi;
                        let qa = MatRef::rows(&q[(qt.row * hq + h) * d..], hq * d);
                        let doa = MatRef::rows(&g[(qt.row * hq + h) * d..], hq * d);
                        // P = exp(S - lse), exactly the forward's probabilities (masked: 0).
                        scores(&mut p, qa, kb, qt, kt, geo);
                        for i in 0..qt.len {
                            let ls = lse[h * n + qt.row + i];
                            let row = &mut p[i * BK..i * BK + kt.len];
                            exp_shift_scale(row, ls, 1.0);
                            if tile == Tile::Partial {
                                for (j, x) in row.iter_mut().enumerate() {
                                    if !geo.visible(qt.pos + i, kt.pos + j) {
                                        *x = 0.0;
                                    }
                                }
                            }
                        }
                        if dv_ptr.is_some() {
                            // dV += P^T dO.
                            // SAFETY: `dv_acc` is this task's own scratch of BK x D.
                            unsafe {
                                gemm(
                                    kt.len,
                                    d,
                                    qt.len,
                                    dv_acc.as_mut_ptr(),
                                    d,
                                    true,
                                    MatRef::rows_t(&p, BK),
                                    doa,
                                    1.0,
                                    Threads::One,
                                )
                            };
                        }
                        let Some(vo) = vo.as_ref().filter(|_| need_ds) else {
                            continue;
                        };
                        // dP = dO V^T, then dS = P * (dP - D) in place.
                        // SAFETY: `dp` is this task's own scratch of BQ x BK.
                        unsafe {
                            gemm(
                                qt.len,
                                kt.len,
                                d,
                                dp.as_mut_ptr(),
                                BK,
                                false,
                                doa,
                                MatRef::rows_t(&vo.v[(kt.row * hkv + kh) * d..], hkv * d),
                                1.0,
                                Threads::One,
                            )
                        };
                        for i in 0..qt.len {
                            let di = dvec[gi * qs.len + (qt.row - qs.row) + i];
                            let (pr, dr) = (&p[i * BK..i * BK + kt.len], &mut dp[i * BK..]);
                            for (x, &pv) in dr.iter_mut().zip(pr) {
                                *x = pv * (*x - di);
                            }
                        }
                        if let Some(dq) = &dq_ptr {
                            // dQ += scale * dS K.
                            // SAFETY: rows of this span, heads of this kv head's group: this
                            // task's alone.
                            unsafe {
                                gemm(
                                    qt.len,
                                    d,
                                    kt.len,
                                    dq.at((qt.row * hq + h) * d),
                                    hq * d,
                                    true,
                                    MatRef::rows(&dp, BK),
                                    MatRef::rows(kb, hkv * d),
                                    geo.scale,
                                    Threads::One,
                                )
                            };
                        }
                        if dk_ptr.is_some() {
                            // dK += scale * dS^T Q.
                            // SAFETY: `dk_acc` is this task's own scratch of BK x D.
                            unsafe {
                                gemm(
                                    kt.len,
                                    d,
                                    qt.len,
                                    dk_acc.as_mut_ptr(),
                                    d,
                                    true,
                                    MatRef::rows_t(&dp, BK),
                                    qa,
                                    geo.scale,
                                    Threads::One,
                                )
                            };
                        }
                    }
                }
                for (ptr, acc) in [(&dk_ptr, &dk_acc), (&dv_ptr, &dv_acc)] {
                    if let Some(ptr) = ptr {
                        for j in 0..kt.len {
                            // SAFETY: key rows of this span's group (groups own their keys, see
                            // `check`) at this task's kv head.
                            let dst = unsafe { ptr.slice(((kt.row + j) * hkv + kh) * d, d) };
                            let src = &acc[j * d..(j + 1) * d];
                            if first {
                                dst.copy_from_slice(src);
                            } else {
                                for (x, &a) in dst.iter_mut().zip(src) {
                                    *x += a;
                                }
                            }
                        }
                    }
                }
            }
        }
    });
    Ok((dq, dk, dv))
}
