//! The log-prob head: `logp[i] = logits[i, t_i] - logsumexp(logits[i])` with
//! `logits = hidden W^T`, fused per chunk (one logits buffer, the GEMM on the pool, then
//! one parallel pass over its rows for the max, the log-sum-exp and the gather), and its
//! backward per vocabulary chunk (the GEMM, `-g p` in place in one parallel pass, then
//! the two GEMMs that read it).

use super::{exp_shift_scale, gemm_into, max, sum_exp, MatRef};
use rayon::prelude::*;

/// `(logp [N], lse [N])` for `h: [N, d]`, `w: [V, d]` and targets `t: [N]` (each below
/// `V`), `chunk_rows` rows of logits at a time.
pub(crate) fn forward(
    h: &[f32],
    w: &[f32],
    t: &[usize],
    d: usize,
    chunk_rows: usize,
) -> (Vec<f32>, Vec<f32>) {
    let n = t.len();
    let vocab = w.len() / d.max(1);
    let mut out = vec![0f32; n];
    let mut lse = vec![0f32; n];
    let mut buf = vec![0f32; chunk_rows.min(n) * vocab];
    let mut r0 = 0;
    while r0 < n {
        let c = chunk_rows.min(n - r0);
        let logits = &mut buf[..c * vocab];
        gemm_into(
            logits,
            c,
            vocab,
            d,
            false,
            MatRef::rows(&h[r0 * d..], d),
            MatRef::rows_t(w, d),
            1.0,
        );
        logits
            .par_chunks(vocab)
            .zip(out[r0..r0 + c].par_iter_mut())
            .zip(lse[r0..r0 + c].par_iter_mut())
            .zip(t[r0..r0 + c].par_iter())
            .for_each(|(((row, out), lse), &t)| {
                let m = max(row);
                let log_se = sum_exp(row, m).ln();
                *out = (row[t] - m) - log_se;
                *lse = m + log_se;
            });
        r0 += c;
    }
    (out, lse)
}

/// The gradients `(dh [N, d], dW [V, d])` that are asked for, given `g = dL/dlogp`:
/// with `p = softmax(logits)`, `dlogits = g (onehot(t) - p)`, so `dh = g W[t] - (g p) W`
/// and `dW = scatter_t(g h) - (g p)^T h`. The `p` terms go over vocabulary chunks of
/// `ceil(chunk_rows V / N)` columns (the forward's transient budget), each chunk a
/// finished block of rows of `dW`; the one-hot terms are a gather and a scatter-add in
/// row order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    h: &[f32],
    w: &[f32],
    t: &[usize],
    lse: &[f32],
    g: &[f32],
    d: usize,
    chunk_rows: usize,
    need: [bool; 2],
) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
    let n = t.len();
    let vocab = w.len() / d.max(1);
    let cols = chunk_rows
        .saturating_mul(vocab)
        .div_ceil(n.max(1))
        .clamp(1, vocab.max(1));
    let mut dh = need[0].then(|| {
        let mut dh = vec![0f32; n * d];
        dh.par_chunks_mut(d)
            .zip(t.par_iter().zip(g.par_iter()))
            .for_each(|(row, (&t, &g))| {
                for (x, &wv) in row.iter_mut().zip(&w[t * d..(t + 1) * d]) {
                    *x = wv * g;
                }
            });
        dh
    });
    let mut dw = need[1].then(|| vec![0f32; vocab * d]);
    let mut buf = vec![0f32; n * cols.min(vocab)];
    let mut v0 = 0;
    while v0 < vocab {
        let c = cols.min(vocab - v0);
        let wc = &w[v0 * d..(v0 + c) * d];
        let q = &mut buf[..n * c];
        gemm_into(
            q,
            n,
            c,
            d,
            false,
            MatRef::rows(h, d),
            MatRef::rows_t(wc, d),
            1.0,
        );
        // -g p on this vocabulary block, [N, c].
        q.par_chunks_mut(c)
            .zip(lse.par_iter().zip(g.par_iter()))
            .for_each(|(row, (&ls, &g))| {
                exp_shift_scale(row, ls, -g);
            });
        if let Some(dh) = dh.as_mut() {
            gemm_into(
                dh,
                n,
                d,
                c,
                true,
                MatRef::rows(q, c),
                MatRef::rows(wc, d),
                1.0,
            );
        }
        if let Some(dw) = dw.as_mut() {
            let block = &mut dw[v0 * d..(v0 + c) * d];
            gemm_into(
                block,
                c,
                d,
                n,
                false,
                MatRef::rows_t(q, c),
                MatRef::rows(h, d),
                1.0,
            );
        }
        v0 += c;
    }
    if let Some(dw) = dw.as_mut() {
        for (i, (&t, &g)) in t.iter().zip(g).enumerate() {
            for (x, &hv) in dw[t * d..(t + 1) * d]
                .iter_mut()
                .zip(&h[i * d..(i + 1) * d])
            {
                *x += hv * g;
            }
        }
    }
    (dh, dw)
}
