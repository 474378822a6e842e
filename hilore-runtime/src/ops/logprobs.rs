//! Log-probabilities of target tokens under the language-model head, computed in chunks so
//! the full `[tokens x vocab]` logits never exist at once.

use super::util::{any_grad, mm, write_at};
use super::{cpu, Op, Saved};
use crate::error::shape_err;
use crate::{Cx, Result, Var};
use candle_core::Tensor;

struct TokenLogprobs {
    chunk_rows: usize,
}

impl Op for TokenLogprobs {
    fn name(&self) -> &'static str {
        "token_logprobs"
    }

    /// With `p = softmax(logits)` and `g = dL/dlogp`, `dlogits = g (onehot(t) - p)`, so
    ///
    /// - `dhidden = g * W[t] - (g p) W`
    /// - `dW = scatter_t(g * hidden) - (g p)^T hidden`.
    ///
    /// The `p` terms are computed over **vocabulary** chunks of `ceil(chunk_rows * V / N)`
    /// columns (the same `chunk_rows x V` transient budget as the forward): each chunk
    /// yields a finished block of rows of `dW`, written in place into one `[V, d]` buffer,
    /// where row chunks would need a running `[V, d]` sum (three `[V, d]` buffers at the
    /// moment of each addition). The one-hot terms are a gather and an in-place scatter-add.
    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (h, w, targets, lse) = (&s[0], &s[1], &s[2], &s[3]);
        if cpu::all_host_f32(&[h, w, lse, g]) {
            let (h, w, lse, g) = (
                cpu::dense(h)?,
                cpu::dense(w)?,
                cpu::dense(lse)?,
                cpu::dense(g)?,
            );
            let t = target_indices(targets, w.dim(0)?)?;
            let (hv, wv, lv, gv) = (
                cpu::values(&h)?,
                cpu::values(&w)?,
                cpu::values(&lse)?,
                cpu::values(&g)?,
            );
            let d = h.dim(1)?;
            let (dh, dw) = cpu::head::backward(
                hv.get(),
                wv.get(),
                &t,
                lv.get(),
                gv.get(),
                d,
                self.chunk_rows,
                [need[0], need[1]],
            );
            return Ok(vec![
                dh.map(|x| cpu::tensor(x, h.shape().clone())).transpose()?,
                dw.map(|x| cpu::tensor(x, w.shape().clone())).transpose()?,
            ]);
        }
        let h = h.contiguous()?;
        let (n, d) = h.dims2()?;
        let vocab = w.dim(0)?;
        let g1 = g.contiguous()?.unsqueeze(1)?; // [N, 1]
        let neg_g = g1.neg()?;
        let lse1 = lse.unsqueeze(1)?; // [N, 1]
        let cols = (self.chunk_rows.saturating_mul(vocab))
            .div_ceil(n.max(1))
            .clamp(1, vocab.max(1));
        let mut dh = if need[0] {
            Some(w.index_select(targets, 0)?.broadcast_mul(&g1)?)
        } else {
            None
        };
        let dw = if need[1] {
            Some(Tensor::zeros((vocab, d), w.dtype(), w.device())?)
        } else {
            None
        };
        let mut v0 = 0;
        while v0 < vocab {
            let c = cols.min(vocab - v0);
            let wc = w.narrow(0, v0, c)?;
            // -g p on this vocabulary block, [N, c].
            let q = mm(&h, &wc.t()?)?
                .broadcast_sub(&lse1)?
                .exp()?
                .broadcast_mul(&neg_g)?;
            if let Some(acc) = dh.take() {
                dh = Some((acc + mm(&q, &wc)?)?);
            }
            if let Some(dw) = &dw {
                write_at(dw, &mm(&q.t()?, &h)?, 0, v0)?;
            }
            v0 += c;
        }
        if let Some(dw) = &dw {
            let idx = targets.unsqueeze(1)?.broadcast_as((n, d))?.contiguous()?;
            dw.scatter_add_set(&idx, &h.broadcast_mul(&g1)?, 0)?;
        }
        Ok(vec![dh, dw])
    }
}

/// The targets as indices, each checked to be below `vocab`.
fn target_indices(targets: &Tensor, vocab: usize) -> Result<Vec<usize>> {
    let t = targets
        .to_dtype(candle_core::DType::U32)?
        .to_vec1::<u32>()?;
    if let Some((i, &bad)) = t.iter().enumerate().find(|(_, &v)| v as usize >= vocab) {
        return shape_err(
            "token_logprobs",
            format!("target {i} is token {bad}, outside the vocabulary of {vocab}"),
        );
    }
    Ok(t.into_iter().map(|v| v as usize).collect())
}

impl<'m> Cx<'m> {
    /// `logp[i] = logits[i, targets[i]] - logsumexp(logits[i])` with
    /// `logits = hidden @ w^T`, for `hidden: [N, d]`, `w: [V, d]` (the LM head) and integer
    /// `targets: [N]`; returns `[N]`. The logits are computed `chunk_rows` rows at a time
    /// (max-subtracted log-sum-exp), so at most a `chunk_rows x V` block is alive.
    ///
    /// Saves `hidden` and `w` ([`Saved::for_var`]), `targets` (`Saved::Exact`) and the
    /// per-token log-sum-exp (`Saved::Exact`, `[N]`, `hidden`'s dtype) when either input
    /// wants a gradient; backward recomputes the logits chunk by chunk from them.
    pub fn token_logprobs(
        &mut self,
        hidden: &Var,
        w: &Var,
        targets: &Tensor,
        chunk_rows: usize,
    ) -> Result<Var> {
        let (n, d) = match hidden.dims() {
            [n, d] => (*n, *d),
            dims => {
                return shape_err(
                    "token_logprobs",
                    format!("hidden must be [N, d], got {dims:?}"),
                )
            }
        };
        if w.dims().len() != 2 || w.dims()[1] != d {
            return shape_err(
                "token_logprobs",
                format!("w must be [V, {d}], got {:?}", w.dims()),
            );
        }
        if targets.dims() != [n] || !targets.dtype().is_int() {
            return shape_err(
                "token_logprobs",
                format!(
                    "targets must be an integer tensor [{n}], got {:?} {:?}",
                    targets.dims(),
                    targets.dtype()
                ),
            );
        }
        if chunk_rows == 0 {
            return shape_err("token_logprobs", "chunk_rows must be at least 1");
        }
        if cpu::all_host_f32(&[&hidden.tensor, &w.tensor]) {
            let (h, wt) = (cpu::dense(&hidden.tensor)?, cpu::dense(&w.tensor)?);
            let t = target_indices(targets, w.dims()[0])?;
            let (hv, wv) = (cpu::values(&h)?, cpu::values(&wt)?);
            let (out, lse) = cpu::head::forward(hv.get(), wv.get(), &t, d, chunk_rows);
            let (out, lse) = (cpu::tensor(out, n)?, cpu::tensor(lse, n)?);
            return self.record_token_logprobs(hidden, w, targets, chunk_rows, out, lse);
        }
        let (dt, dev) = (hidden.dtype(), hidden.device());
        let h = hidden.tensor.contiguous()?;
        let wt = w.tensor.t()?;
        let out = Tensor::zeros(n, dt, dev)?;
        let lse = Tensor::zeros(n, dt, dev)?;
        let mut r0 = 0;
        while r0 < n {
            let c = chunk_rows.min(n - r0);
            let logits = mm(&h.narrow(0, r0, c)?, &wt)?;
            let m = logits.max_keepdim(1)?;
            let z = logits.broadcast_sub(&m)?;
            drop(logits);
            let t = targets.narrow(0, r0, c)?.unsqueeze(1)?.contiguous()?;
            let zt = z.gather(&t, 1)?;
            let log_se = z.exp()?.sum_keepdim(1)?.log()?;
            drop(z);
            write_at(&out, &(zt - &log_se)?.squeeze(1)?, 0, r0)?;
            write_at(&lse, &(m + log_se)?.squeeze(1)?, 0, r0)?;
            r0 += c;
        }
        self.record_token_logprobs(hidden, w, targets, chunk_rows, out, lse)
    }

    fn record_token_logprobs(
        &mut self,
        hidden: &Var,
        w: &Var,
        targets: &Tensor,
        chunk_rows: usize,
        out: Tensor,
        lse: Tensor,
    ) -> Result<Var> {
        let saved = if any_grad(&[hidden, w]) {
            vec![
                Saved::for_var(hidden),
                Saved::for_var(w),
                Saved::Exact(targets.clone()),
                Saved::Exact(lse),
            ]
        } else {
            vec![]
        };
        self.record(TokenLogprobs { chunk_rows }, &[hidden, w], out, saved)
    }
}
