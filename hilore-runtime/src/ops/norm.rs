//! RMSNorm.

use super::util::{any_grad, grad_if};
use super::{cpu, Op, Saved};
use crate::error::shape_err;
use crate::{Cx, Error, Result, Var};
use candle_core::{Tensor, D};

/// Per-row `1 / sqrt(mean(x^2) + eps)`, shape `[..., 1]`. The forward and the backward call
/// this same function, so the backward sees bit-for-bit the forward's value.
fn rstd(x: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(x.sqr()?
        .mean_keepdim(D::Minus1)?
        .affine(1.0, eps)?
        .sqrt()?
        .recip()?)
}

struct RmsNorm {
    eps: f64,
}

impl Op for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let x = &s[0];
        if cpu::all_host_f32(&[x, g]) && s.get(1).is_none_or(|w| cpu::all_host_f32(&[w])) {
            return self.backward_cpu(s, g, need);
        }
        let r = rstd(x, self.eps)?;
        let xhat = x.broadcast_mul(&r)?;
        // dx = r * (g w - xhat * mean(g w xhat))
        let dx = grad_if(need[0], || {
            let w = s.get(1).ok_or_else(|| {
                Error::Tape("rms_norm: dx requested but x wanted no gradient in the forward".into())
            })?;
            let gw = g.broadcast_mul(w)?;
            let m = (&gw * &xhat)?.mean_keepdim(D::Minus1)?;
            Ok((gw - xhat.broadcast_mul(&m)?)?.broadcast_mul(&r)?)
        })?;
        // dw = sum over rows of g * xhat
        let dw = grad_if(need[1], || {
            let d = x.dim(x.rank() - 1)?;
            let gx = (g * &xhat)?;
            let rows = gx.elem_count() / d.max(1);
            Ok(gx.reshape((rows, d))?.sum(0)?)
        })?;
        Ok(vec![dx, dw])
    }
}

impl RmsNorm {
    /// The backward on the CPU kernel ([`cpu::rows::rms_norm_backward`]).
    fn backward_cpu(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let x = cpu::dense(&s[0])?;
        let d = x.dim(x.rank() - 1)?;
        let g = cpu::dense(g)?;
        let w = match (need[0], s.get(1)) {
            (true, Some(w)) => Some(cpu::dense(w)?),
            (true, None) => {
                return Err(Error::Tape(
                    "rms_norm: dx requested but x wanted no gradient in the forward".into(),
                ))
            }
            (false, _) => None,
        };
        let (xv, gv) = (cpu::values(&x)?, cpu::values(&g)?);
        let wv = w.as_ref().map(cpu::values).transpose()?;
        let (dx, dw) = cpu::rows::rms_norm_backward(
            xv.get(),
            wv.as_ref().map(|w| w.get()),
            gv.get(),
            d,
            self.eps as f32,
            need[1],
        );
        Ok(vec![
            dx.map(|v| cpu::tensor(v, x.shape().clone())).transpose()?,
            dw.map(|v| cpu::tensor(v, d)).transpose()?,
        ])
    }
}

impl<'m> Cx<'m> {
    /// `x * rsqrt(mean(x^2, last dim) + eps) * w` for `x: [..., d]`, `w: [d]`.
    ///
    /// Saves `x` ([`Saved::for_var`]) when `x` or `w` wants a gradient, and `w` only when
    /// `x` does (`dw` does not read it). The per-row
    /// `rstd` is **not** saved: backward recomputes it from `x` (one square, one row mean:
    /// a small fraction of the backward's own elementwise work), so the saved state is
    /// exactly `x`, and under a lossy fidelity `rstd` stays consistent with the decoded `x`.
    pub fn rms_norm(&mut self, x: &Var, w: &Var, eps: f64) -> Result<Var> {
        let xd = x.dims();
        if xd.is_empty() || w.dims() != [xd[xd.len() - 1]] {
            return shape_err(
                "rms_norm",
                format!(
                    "x must be [..., d] and w [d], got {xd:?} and {:?}",
                    w.dims()
                ),
            );
        }
        let y = if cpu::all_host_f32(&[&x.tensor, &w.tensor]) {
            let (xt, wt) = (cpu::dense(&x.tensor)?, cpu::dense(&w.tensor)?);
            let (xv, wv) = (cpu::values(&xt)?, cpu::values(&wt)?);
            cpu::tensor(
                cpu::rows::rms_norm(xv.get(), wv.get(), eps as f32),
                x.shape().clone(),
            )?
        } else {
            let r = rstd(&x.tensor, eps)?;
            x.tensor.broadcast_mul(&r)?.broadcast_mul(&w.tensor)?
        };
        let mut saved = Vec::new();
        if any_grad(&[x, w]) {
            saved.push(Saved::for_var(x));
        }
        if x.requires_grad() {
            saved.push(Saved::for_var(w));
        }
        self.record(RmsNorm { eps }, &[x, w], y, saved)
    }
}
