//! Fused row kernels: RMSNorm, SiLU, SwiGLU, RoPE and adds, forward and backward, each one
//! pass over its rows, parallel over fixed pieces of rows ([`super::rows_per_piece`]).

use super::{dot, rows_per_piece, sigmoid};
use rayon::prelude::*;

/// `1 / sqrt(mean(x^2) + eps)` of one row. The forward and the backward call this same
/// function, so the backward sees bit for bit the forward's value.
#[inline]
fn rstd(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt()
}

/// `y` with `f(n, y_n, x_n)` applied to every row `n` of `row` elements, in parallel pieces
/// of rows.
fn map_rows(x: &[f32], row: usize, f: impl Fn(usize, &mut [f32], &[f32]) + Sync) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    let per = rows_per_piece(row);
    y.par_chunks_mut(per * row)
        .zip(x.par_chunks(per * row))
        .enumerate()
        .for_each(|(p, (y, x))| {
            for (t, (y, x)) in y.chunks_exact_mut(row).zip(x.chunks_exact(row)).enumerate() {
                f(p * per + t, y, x);
            }
        });
    y
}

/// The sum of per-piece partial rows of `d` elements, in piece order.
fn sum_in_order(partials: impl IntoIterator<Item = Vec<f32>>, d: usize) -> Vec<f32> {
    let mut s = vec![0f32; d];
    for p in partials {
        for (a, b) in s.iter_mut().zip(p) {
            *a += b;
        }
    }
    s
}

/// `y = x * rstd(x) * w` per row of `d = w.len()` elements.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    map_rows(x, w.len(), |_, y, x| {
        let r = rstd(x, eps);
        for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
            *y = x * r * w;
        }
    })
}

/// The gradients of [`rms_norm`]: `dx = r (g w - xhat mean(g w xhat))` when `w` is given
/// (it is saved only when `dx` is wanted), and `dw = sum over rows of g xhat` when
/// `need_dw`. `dw` sums each piece's rows in order, then the pieces in order.
pub(crate) fn rms_norm_backward(
    x: &[f32],
    w: Option<&[f32]>,
    g: &[f32],
    d: usize,
    eps: f32,
    need_dw: bool,
) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
    let piece = rows_per_piece(d) * d;
    let mut dx = w.map(|_| vec![0f32; x.len()]);
    let work = |x: &[f32], g: &[f32], mut dx: Option<&mut [f32]>| -> Option<Vec<f32>> {
        let mut dw = need_dw.then(|| vec![0f32; d]);
        let mut xhat = vec![0f32; d];
        let mut gw = vec![0f32; d];
        for (i, (x, g)) in x.chunks_exact(d).zip(g.chunks_exact(d)).enumerate() {
            let r = rstd(x, eps);
            for (h, &x) in xhat.iter_mut().zip(x) {
                *h = x * r;
            }
            if let Some(dw) = dw.as_mut() {
                for ((a, &g), &h) in dw.iter_mut().zip(g).zip(&xhat) {
                    *a += g * h;
                }
            }
            if let (Some(dx), Some(w)) = (dx.as_deref_mut(), w) {
                for ((gw, &g), &w) in gw.iter_mut().zip(g).zip(w) {
                    *gw = g * w;
                }
                let m = dot(&gw, &xhat) / d as f32;
                let dx = &mut dx[i * d..(i + 1) * d];
                for ((dx, &gw), &h) in dx.iter_mut().zip(&gw).zip(&xhat) {
                    *dx = (gw - h * m) * r;
                }
            }
        }
        dw
    };
    let partials: Vec<Option<Vec<f32>>> = match dx.as_mut() {
        Some(dx) => dx
            .par_chunks_mut(piece)
            .zip(x.par_chunks(piece).zip(g.par_chunks(piece)))
            .map(|(dx, (x, g))| work(x, g, Some(dx)))
            .collect(),
        None => x
            .par_chunks(piece)
            .zip(g.par_chunks(piece))
            .map(|(x, g)| work(x, g, None))
            .collect(),
    };
    let dw = need_dw.then(|| sum_in_order(partials.into_iter().flatten(), d));
    (dx, dw)
}

/// `y[i] = f(a[i], b[i], c[i])` over one piece.
#[inline(always)]
fn apply<F: Fn(f32, f32, f32) -> f32>(y: &mut [f32], a: &[f32], b: &[f32], c: &[f32], f: &F) {
    for (((y, &a), &b), &c) in y.iter_mut().zip(a).zip(b).zip(c) {
        *y = f(a, b, c);
    }
}

/// [`apply`] compiled for AVX2 (see [`super::wide_fn`]: the same bits, twice the lanes).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn apply_avx2<F: Fn(f32, f32, f32) -> f32>(
    y: &mut [f32],
    a: &[f32],
    b: &[f32],
    c: &[f32],
    f: &F,
) {
    apply(y, a, b, c, f)
}

/// An elementwise map of up to three inputs of the same length (pass `a` again for an
/// unused one), in parallel pieces, each piece on AVX2 where the CPU has it.
fn map(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32 + Sync) -> Vec<f32> {
    let mut y = vec![0f32; a.len()];
    let piece = rows_per_piece(1);
    y.par_chunks_mut(piece)
        .zip(
            a.par_chunks(piece)
                .zip(b.par_chunks(piece).zip(c.par_chunks(piece))),
        )
        .for_each(|(y, (a, (b, c)))| {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2 (checked just above).
                return unsafe { apply_avx2(y, a, b, c, &f) };
            }
            apply(y, a, b, c, &f)
        });
    y
}

/// `silu(x) = x sigmoid(x)`.
#[inline(always)]
fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `silu'(x) = s (1 + x (1 - s))`, `s = sigmoid(x)`.
#[inline(always)]
fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (x * (1.0 - s) + 1.0)
}

/// `silu(x)` elementwise.
pub(crate) fn silu_forward(x: &[f32]) -> Vec<f32> {
    map(x, x, x, |x, _, _| silu(x))
}

/// `g silu'(x)`.
pub(crate) fn silu_backward(x: &[f32], g: &[f32]) -> Vec<f32> {
    map(x, g, x, |x, g, _| g * silu_grad(x))
}

/// `silu(gate) * up`.
pub(crate) fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    map(gate, up, gate, |g, u, _| silu(g) * u)
}

/// `d gate = g up silu'(gate)`.
pub(crate) fn swiglu_dgate(gate: &[f32], up: &[f32], g: &[f32]) -> Vec<f32> {
    map(gate, up, g, |x, u, g| g * u * silu_grad(x))
}

/// `d up = g silu(gate)`.
pub(crate) fn swiglu_dup(gate: &[f32], g: &[f32]) -> Vec<f32> {
    map(gate, g, gate, |x, g, _| g * silu(x))
}

/// `a + b` (same length).
pub(crate) fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    map(a, b, a, |a, b, _| a + b)
}

/// `x + b` with `b` broadcast over the rows of `x` (a bias).
pub(crate) fn add_rows(x: &[f32], b: &[f32]) -> Vec<f32> {
    map_rows(x, b.len(), |_, y, x| {
        for ((y, &x), &b) in y.iter_mut().zip(x).zip(b) {
            *y = x + b;
        }
    })
}

/// The sum over rows of `g: [rows, d]` (a bias gradient), by pieces in order.
pub(crate) fn sum_rows(g: &[f32], d: usize) -> Vec<f32> {
    let piece = rows_per_piece(d) * d;
    let partials: Vec<Vec<f32>> = g
        .par_chunks(piece)
        .map(|g| {
            let mut s = vec![0f32; d];
            for row in g.chunks_exact(d) {
                for (s, &v) in s.iter_mut().zip(row) {
                    *s += v;
                }
            }
            s
        })
        .collect();
    sum_in_order(partials, d)
}

/// Rotary embedding of `x: [N, H, D]` with `cos, sin: [N, D/2]`:
/// `[x1 c - x2 s, x2 c + x1 s]` per head (the rotate-half convention). With `inverse`,
/// the rotation by `-angle` (`s` negated), which is the backward.
pub(crate) fn rope(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    h: usize,
    d: usize,
    inverse: bool,
) -> Vec<f32> {
    let half = d / 2;
    map_rows(x, h * d, |n, y, x| {
        let c = &cos[n * half..(n + 1) * half];
        let s = &sin[n * half..(n + 1) * half];
        for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let (x1, x2) = x.split_at(half);
            let (y1, y2) = y.split_at_mut(half);
            if inverse {
                for i in 0..half {
                    y1[i] = x1[i] * c[i] + x2[i] * s[i];
                    y2[i] = x2[i] * c[i] - x1[i] * s[i];
                }
            } else {
                for i in 0..half {
                    y1[i] = x1[i] * c[i] - x2[i] * s[i];
                    y2[i] = x2[i] * c[i] + x1[i] * s[i];
                }
            }
        }
    })
}
