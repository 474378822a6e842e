//! Causal attention with grouped-query heads over packed variable-length sequences,
//! flash-attention style: the backward recomputes the probabilities from the saved
//! log-sum-exp instead of keeping them.
//!
//! Host `f32` tensors take the tiled CPU kernel ([`super::cpu::attention`]: `BQ x BK`
//! tiles, never a `T x T` buffer); other tensors (a GPU's, other dtypes) take the candle
//! path below, which works one sequence at a time with `T x (P + T)` transients (`P` the
//! shared prefix a continuation reads, 0 otherwise). Both save the same tensors and sum a
//! shared prefix's `dK`, `dV` in the same order.

use super::util::{any_grad, causal_mask, grad_if, mm, write_at};
use super::{cpu, Op, Saved};
use crate::error::shape_err;
use crate::{Cx, Error, Packing, Result, Var};
use candle_core::Tensor;

/// Head-major copy `[H, len, D]` of tokens `start..start + len` of `t: [N, H, D]`, times
/// `scale` (the copy and the scaling are one pass).
fn heads(t: &Tensor, start: usize, len: usize, scale: f64) -> Result<Tensor> {
    let v = t.narrow(0, start, len)?.transpose(0, 1)?;
    if scale == 1.0 {
        Ok(v.contiguous()?)
    } else {
        Ok(v.affine(scale, 0.0)?)
    }
}

/// Shapes shared by the forward and the backward.
#[derive(Clone, Copy)]
struct Dims {
    hq: usize,
    hkv: usize,
    d: usize,
}

impl Dims {
    /// Query heads per kv head.
    fn group(self) -> usize {
        self.hq / self.hkv
    }
}

/// Masked, scaled scores `[Hq, T, P + T]` of one sequence's `T` queries from its scaled
/// queries `qs: [Hq, T, D]` and the keys it reads, `k: [Hkv, P + T, D]`: its shared
/// prefix's `P` (0 for a sequence of its own) then its own. Query `i` sits at position
/// `P + i`, so its mask is row `P + i` of the concatenation's. Query head `h` reads kv
/// head `h / G`: with the heads laid out `h = kv * G + g`, `qs` viewed as
/// `[Hkv, G * T, D]` multiplies each kv head's keys once, without copying the keys `G`
/// times.
fn scores(qs: &Tensor, k: &Tensor, mask: &Tensor, dims: Dims) -> Result<Tensor> {
    let (t, tk) = (qs.dim(1)?, k.dim(1)?);
    let q3 = qs.reshape((dims.hkv, dims.group() * t, dims.d))?;
    let s = mm(&q3, &k.t()?)?.reshape((dims.hq, t, tk))?;
    Ok(s.broadcast_add(&mask.narrow(0, tk - t, t)?.narrow(1, 0, tk)?)?)
}

/// One sequence of a packing on candle's path: its rows, and its shared prefix's rows
/// (`0..0` for a sequence of its own), whose keys and values it reads first.
struct Span {
    start: usize,
    len: usize,
    prefix: std::ops::Range<usize>,
}

fn spans(packing: &Packing) -> Vec<Span> {
    let offsets = packing.offsets();
    (0..packing.num_sequences())
        .map(|i| Span {
            start: offsets[i],
            len: offsets[i + 1] - offsets[i],
            prefix: packing
                .prefix_of(i)
                .map_or(0..0, |j| offsets[j]..offsets[j + 1]),
        })
        .collect()
}

impl Span {
    /// Head-major keys (or values) `[H, P + T, D]` the span reads: its prefix's, then its own.
    fn keys(&self, t: &Tensor) -> Result<Tensor> {
        let own = heads(t, self.start, self.len, 1.0)?;
        if self.prefix.is_empty() {
            return Ok(own);
        }
        let pre = heads(t, self.prefix.start, self.prefix.len(), 1.0)?;
        Ok(Tensor::cat(&[&pre, &own], 1)?)
    }

    /// Writes a key-side gradient `x: [H, P + T, D]` into `dst: [N, H, D]`: the span's own
    /// rows written, the prefix's added to what the prefix's own span (earlier in the
    /// packing) and its earlier continuations left there, in span order.
    fn write_keys(&self, dst: &Tensor, x: &Tensor) -> Result<()> {
        let p = self.prefix.len();
        let own = x.narrow(1, p, self.len)?.transpose(0, 1)?;
        write_at(dst, &own, 0, self.start)?;
        if p > 0 {
            let pre = x.narrow(1, 0, p)?.transpose(0, 1)?;
            let sum = (dst.narrow(0, self.prefix.start, p)? + pre)?;
            write_at(dst, &sum, 0, self.prefix.start)?;
        }
        Ok(())
    }
}

/// The additive mask `[t, t]` of `dtype` for causal attention, optionally restricted to a
/// sliding window: key `j` is visible to query `i` when `j <= i` and, with a window `W`,
/// `i - j < W` (the `W` most recent keys, the query's own included: Hugging Face's
/// `sliding_window` semantics). 0 where visible, `-inf` elsewhere; the diagonal is always
/// visible (`W >= 1`), so every row's maximum stays finite.
fn attention_mask(
    t: usize,
    window: Option<usize>,
    dtype: candle_core::DType,
    dev: &candle_core::Device,
) -> Result<Tensor> {
    let Some(w) = window.filter(|&w| w < t) else {
        return causal_mask(t, dtype, dev);
    };
    let mut m = vec![f32::NEG_INFINITY; t * t];
    for i in 0..t {
        let first = (i + 1).saturating_sub(w);
        for v in &mut m[i * t + first..=i * t + i] {
            *v = 0.0;
        }
    }
    Ok(Tensor::from_vec(m, (t, t), dev)?.to_dtype(dtype)?)
}

/// The forward on candle's ops (GPU tensors, other dtypes): `(o, lse)`.
fn attention_candle(
    q: &Var,
    k: &Var,
    v: &Var,
    packing: &Packing,
    scale: f64,
    window: Option<usize>,
    dims: Dims,
) -> Result<(Tensor, Tensor)> {
    let Dims { hq, hkv, d } = dims;
    let gs = dims.group();
    let n = q.dim(0)?;
    let (dt, dev) = (q.dtype(), q.device());
    let out = Tensor::zeros((n, hq, d), dt, dev)?;
    let lse = Tensor::zeros((hq, n), dt, dev)?;
    let spans = spans(packing);
    let tmax = spans
        .iter()
        .map(|s| s.prefix.len() + s.len)
        .max()
        .unwrap_or(0);
    let mask = attention_mask(tmax, window, dt, dev)?;
    for sp in &spans {
        let (start, t, tk) = (sp.start, sp.len, sp.prefix.len() + sp.len);
        let qs = heads(&q.tensor, start, t, scale)?;
        let kh = sp.keys(&k.tensor)?;
        let vh = sp.keys(&v.tensor)?;
        let s = scores(&qs, &kh, &mask, dims)?;
        drop((qs, kh));
        // Stable softmax: the diagonal is never masked, so every row max is finite.
        let m = s.max_keepdim(2)?;
        let e = s.broadcast_sub(&m)?.exp()?;
        drop(s);
        let l = e.sum_keepdim(2)?;
        let p = e.broadcast_div(&l)?.reshape((hkv, gs * t, tk))?;
        drop(e);
        let o = mm(&p, &vh)?.reshape((hq, t, d))?;
        write_at(&out, &o.transpose(0, 1)?, 0, start)?;
        write_at(&lse, &(m + l.log()?)?.squeeze(2)?, 1, start)?;
    }
    Ok((out, lse))
}

struct Attention {
    packing: Packing,
    dims: Dims,
    scale: f64,
    /// Sliding window (keys per query), if any.
    window: Option<usize>,
    /// Whether `v` and `o` were saved (only `dQ` and `dK` read them).
    saved_vo: bool,
}

impl Op for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (q, k, lse) = (&s[0], &s[1], &s[2]);
        let need_ds = need[0] || need[1];
        if need_ds && !self.saved_vo {
            return Err(Error::Tape(
                "attention: dQ/dK requested but neither q nor k wanted a gradient in the forward, \
                 so v and o were not saved"
                    .into(),
            ));
        }
        if cpu::all_host_f32(&[q, k, lse, g])
            && (!self.saved_vo || cpu::all_host_f32(&[&s[3], &s[4]]))
        {
            return self.backward_cpu(s, g, need);
        }
        let Dims { hq, hkv, d } = self.dims;
        let gs = self.dims.group();
        let n = q.dim(0)?;
        let (dt, dev) = (q.dtype(), q.device());
        let alloc = |h: usize, need: bool| -> Result<Option<Tensor>> {
            grad_if(need, || Ok(Tensor::zeros((n, h, d), dt, dev)?))
        };
        let (dq, dk, dv) = (
            alloc(hq, need[0])?,
            alloc(hkv, need[1])?,
            alloc(hkv, need[2])?,
        );
        // Span by span in packing order: a prefix's own span writes its rows' dK and dV
        // first, each of its continuations then adds its share (the CPU kernel's order).
        let spans = spans(&self.packing);
        let tmax = spans
            .iter()
            .map(|s| s.prefix.len() + s.len)
            .max()
            .unwrap_or(0);
        let mask = attention_mask(tmax, self.window, dt, dev)?;
        for sp in &spans {
            let (start, t, tk) = (sp.start, sp.len, sp.prefix.len() + sp.len);
            let qs = heads(q, start, t, self.scale)?;
            let kh = sp.keys(k)?;
            let do3 = heads(g, start, t, 1.0)?.reshape((hkv, gs * t, d))?;
            // P = exp(S - lse), exactly the forward's probabilities (masked entries: 0).
            let lse_s = lse.narrow(1, start, t)?.unsqueeze(2)?;
            let p = scores(&qs, &kh, &mask, self.dims)?
                .broadcast_sub(&lse_s)?
                .exp()?
                .reshape((hkv, gs * t, tk))?;
            if let Some(dv) = &dv {
                // dV = P^T dO, summed over each kv head's query group by the product itself.
                let x = mm(&p.t()?, &do3)?;
                sp.write_keys(dv, &x)?;
            }
            if need_ds {
                // dS = P * (dO V^T - rowsum(dO * O)).
                let (v, o) = (&s[3], &s[4]);
                let vh = sp.keys(v)?;
                let oh = heads(o, start, t, 1.0)?.reshape((hkv, gs * t, d))?;
                let dvec = (&do3 * &oh)?.sum_keepdim(2)?;
                drop(oh);
                let dp = mm(&do3, &vh.t()?)?;
                let ds = (p * dp.broadcast_sub(&dvec)?)?;
                if let Some(dq) = &dq {
                    // dQ = dS K * scale.
                    let x = mm(&ds, &kh)?.affine(self.scale, 0.0)?;
                    write_at(dq, &x.reshape((hq, t, d))?.transpose(0, 1)?, 0, start)?;
                }
                if let Some(dk) = &dk {
                    // dK = dS^T (Q * scale), summed over the group.
                    let q3 = qs.reshape((hkv, gs * t, d))?;
                    let x = mm(&ds.t()?, &q3)?;
                    sp.write_keys(dk, &x)?;
                }
            }
        }
        Ok(vec![dq, dk, dv])
    }
}

impl Dims {
    /// The CPU kernel's view of the shapes, scale and window.
    fn geometry(self, scale: f64, window: Option<usize>) -> cpu::attention::Geometry {
        cpu::attention::Geometry {
            hq: self.hq,
            hkv: self.hkv,
            d: self.d,
            scale: scale as f32,
            window,
        }
    }
}

impl Attention {
    /// The backward on the CPU flash-attention kernel.
    fn backward_cpu(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (q, k, lse, g) = (
            cpu::dense(&s[0])?,
            cpu::dense(&s[1])?,
            cpu::dense(&s[2])?,
            cpu::dense(g)?,
        );
        let vo = if self.saved_vo {
            Some((cpu::dense(&s[3])?, cpu::dense(&s[4])?))
        } else {
            None
        };
        let (qv, kv, lv, gv) = (
            cpu::values(&q)?,
            cpu::values(&k)?,
            cpu::values(&lse)?,
            cpu::values(&g)?,
        );
        let vo_vals = match &vo {
            Some((v, o)) => Some((cpu::values(v)?, cpu::values(o)?)),
            None => None,
        };
        let n = q.dim(0)?;
        let spans = cpu::attention::packing_spans(&self.packing);
        let (dq, dk, dv) = cpu::attention::backward(
            qv.get(),
            kv.get(),
            vo_vals.as_ref().map(|(v, o)| cpu::attention::VO {
                v: v.get(),
                o: o.get(),
            }),
            lv.get(),
            gv.get(),
            n,
            self.dims.geometry(self.scale, self.window),
            &spans,
            [need[0], need[1], need[2]],
        )?;
        let Dims { hq, hkv, d } = self.dims;
        Ok(vec![
            dq.map(|x| cpu::tensor(x, (n, hq, d))).transpose()?,
            dk.map(|x| cpu::tensor(x, (n, hkv, d))).transpose()?,
            dv.map(|x| cpu::tensor(x, (n, hkv, d))).transpose()?,
        ])
    }
}

impl<'m> Cx<'m> {
    /// Causal self-attention within each sequence of `packing` (a continuation of a shared
    /// prefix also attending to all of the prefix, [`Packing::with_shared_prefixes`]), with
    /// grouped-query heads:
    /// `q: [N, Hq, D]`, `k, v: [N, Hkv, D]` (`Hq` a multiple of `Hkv`; query head `h` reads
    /// kv head `h / (Hq / Hkv)`), scores scaled by `scale`; returns `[N, Hq, D]`.
    ///
    /// Saves, when any input wants a gradient, `q` and `k` ([`Saved::for_var`]) and the
    /// per-row log-sum-exp of the scaled, masked scores (`Saved::Exact`, `[Hq, N]`, in
    /// `q`'s dtype): all that `dV = P^T dO` reads; and, when `q` or `k` wants a gradient,
    /// also `v` ([`Saved::for_var`]) and the output `o` (`Saved::Act`), which `dQ` and
    /// `dK` read through `dS = P * (dO V^T - rowsum(dO * O))`. Never the `T x T`
    /// probabilities: the backward recomputes them tile by tile on the CPU kernel (one
    /// sequence at a time, `T x T` transients, on candle's path).
    pub fn attention(
        &mut self,
        q: &Var,
        k: &Var,
        v: &Var,
        packing: &Packing,
        scale: f64,
    ) -> Result<Var> {
        self.attention_windowed(q, k, v, packing, scale, None)
    }

    /// [`Cx::attention`] with an optional sliding window: with `Some(W)`, query `i` of a
    /// sequence sees keys `j` with `i - W < j <= i` (the `W` most recent positions, itself
    /// included, as Hugging Face's `sliding_window` for Mistral and Qwen2), `None` is plain
    /// causal attention. Same saved state as [`Cx::attention`]; the window only changes the
    /// mask, which the backward rebuilds from `W`. `W` must be at least 1.
    pub fn attention_windowed(
        &mut self,
        q: &Var,
        k: &Var,
        v: &Var,
        packing: &Packing,
        scale: f64,
        window: Option<usize>,
    ) -> Result<Var> {
        if window == Some(0) {
            return shape_err(
                "attention",
                "a sliding window of 0 keys hides every key; use at least 1 (or no window)",
            );
        }
        let (n, hq, d) = match q.dims() {
            [n, h, d] => (*n, *h, *d),
            dims => return shape_err("attention", format!("q must be [N, Hq, D], got {dims:?}")),
        };
        let hkv = k.dim(1).unwrap_or(0);
        if k.dims() != [n, hkv, d] || v.dims() != k.dims() || hkv == 0 || hq % hkv != 0 {
            return shape_err(
                "attention",
                format!(
                    "k and v must both be [N, Hkv, D] with Hq a multiple of Hkv; got q {:?}, k {:?}, v {:?}",
                    q.dims(),
                    k.dims(),
                    v.dims()
                ),
            );
        }
        if packing.total_tokens() != n {
            return shape_err(
                "attention",
                format!(
                    "the packing has {} tokens but q has {n}",
                    packing.total_tokens()
                ),
            );
        }
        let dims = Dims { hq, hkv, d };
        let (out, lse) = if cpu::all_host_f32(&[&q.tensor, &k.tensor, &v.tensor]) {
            let (qt, kt, vt) = (
                cpu::dense(&q.tensor)?,
                cpu::dense(&k.tensor)?,
                cpu::dense(&v.tensor)?,
            );
            let (qv, kv, vv) = (cpu::values(&qt)?, cpu::values(&kt)?, cpu::values(&vt)?);
            let geo = dims.geometry(scale, window);
            let spans = cpu::attention::packing_spans(packing);
            let (o, l) = cpu::attention::forward(qv.get(), kv.get(), vv.get(), n, geo, &spans)?;
            (cpu::tensor(o, (n, hq, d))?, cpu::tensor(l, (hq, n))?)
        } else {
            attention_candle(q, k, v, packing, scale, window, dims)?
        };
        let saved_vo = any_grad(&[q, k]);
        let mut saved = Vec::new();
        if any_grad(&[q, k, v]) {
            saved.extend([Saved::for_var(q), Saved::for_var(k), Saved::Exact(lse)]);
            if saved_vo {
                saved.extend([Saved::for_var(v), Saved::Act(out.clone())]);
            }
        }
        let op = Attention {
            packing: packing.clone(),
            dims,
            scale,
            window,
            saved_vo,
        };
        self.record(op, &[q, k, v], out, saved)
    }
}
