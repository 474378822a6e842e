//! SiLU and SwiGLU.

use super::util::{any_grad, grad_if};
use super::{cpu, Op, Saved};
use crate::error::shape_err;
use crate::{Cx, Error, Result, Var};
use candle_core::Tensor;

/// `sigmoid(x) = 1 / (1 + exp(-x))`; saturates to 0 (not NaN) for very negative `x`.
pub(crate) fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(x.neg()?.exp()?.affine(1.0, 1.0)?.recip()?)
}

/// `silu'(x) = s (1 + x (1 - s))` with `s = sigmoid(x)`.
fn silu_grad(x: &Tensor) -> Result<Tensor> {
    let s = sigmoid(x)?;
    let t = (x * s.affine(-1.0, 1.0)?)?.affine(1.0, 1.0)?;
    Ok((s * t)?)
}

struct Silu;

impl Op for Silu {
    fn name(&self) -> &'static str {
        "silu"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grad_if(need[0], || {
            if cpu::all_host_f32(&[&s[0], g]) {
                let (x, g) = (cpu::dense(&s[0])?, cpu::dense(g)?);
                let (xv, gv) = (cpu::values(&x)?, cpu::values(&g)?);
                return cpu::tensor(
                    cpu::rows::silu_backward(xv.get(), gv.get()),
                    x.shape().clone(),
                );
            }
            Ok((g * silu_grad(&s[0])?)?)
        })?])
    }
}

struct Swiglu;

impl Op for Swiglu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let gate = &s[0];
        if cpu::all_host_f32(&[gate, g]) && s.get(1).is_none_or(|u| cpu::all_host_f32(&[u])) {
            return swiglu_backward_cpu(s, g, need);
        }
        let dgate = grad_if(need[0], || {
            let up = s.get(1).ok_or_else(|| {
                Error::Tape(
                    "swiglu: d gate requested but gate wanted no gradient in the forward".into(),
                )
            })?;
            Ok(((g * up)? * silu_grad(gate)?)?)
        })?;
        let dup = grad_if(need[1], || Ok((g * gate.silu()?)?))?;
        Ok(vec![dgate, dup])
    }
}

/// The SwiGLU backward on the CPU kernels.
fn swiglu_backward_cpu(s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
    let (gate, g) = (cpu::dense(&s[0])?, cpu::dense(g)?);
    let (xv, gv) = (cpu::values(&gate)?, cpu::values(&g)?);
    let shape = gate.shape().clone();
    let dgate = grad_if(need[0], || {
        let up = s.get(1).ok_or_else(|| {
            Error::Tape(
                "swiglu: d gate requested but gate wanted no gradient in the forward".into(),
            )
        })?;
        let up = cpu::dense(up)?;
        let uv = cpu::values(&up)?;
        cpu::tensor(
            cpu::rows::swiglu_dgate(xv.get(), uv.get(), gv.get()),
            shape.clone(),
        )
    })?;
    let dup = grad_if(need[1], || {
        cpu::tensor(cpu::rows::swiglu_dup(xv.get(), gv.get()), shape.clone())
    })?;
    Ok(vec![dgate, dup])
}

impl<'m> Cx<'m> {
    /// `x * sigmoid(x)`. Saves `x` ([`Saved::for_var`]) when it wants a gradient.
    pub fn silu(&mut self, x: &Var) -> Result<Var> {
        let y = if cpu::all_host_f32(&[&x.tensor]) {
            let xt = cpu::dense(&x.tensor)?;
            let y = cpu::rows::silu_forward(cpu::values(&xt)?.get());
            cpu::tensor(y, x.shape().clone())?
        } else {
            x.tensor.silu()?
        };
        let saved = if x.requires_grad() {
            vec![Saved::for_var(x)]
        } else {
            vec![]
        };
        self.record(Silu, &[x], y, saved)
    }

    /// `silu(gate) * up` (same shapes). Saves `gate` ([`Saved::for_var`]) when either input
    /// wants a gradient (`d up` reads it) and `up` only when `gate` does (`d gate` reads both).
    pub fn swiglu(&mut self, gate: &Var, up: &Var) -> Result<Var> {
        if gate.dims() != up.dims() {
            return shape_err(
                "swiglu",
                format!(
                    "gate and up must have the same shape, got {:?} and {:?}",
                    gate.dims(),
                    up.dims()
                ),
            );
        }
        let y = if cpu::all_host_f32(&[&gate.tensor, &up.tensor]) {
            let (gt, ut) = (cpu::dense(&gate.tensor)?, cpu::dense(&up.tensor)?);
            let (gv, uv) = (cpu::values(&gt)?, cpu::values(&ut)?);
            cpu::tensor(cpu::rows::swiglu(gv.get(), uv.get()), gate.shape().clone())?
        } else {
            (gate.tensor.silu()? * &up.tensor)?
        };
        let mut saved = Vec::new();
        if any_grad(&[gate, up]) {
            saved.push(Saved::for_var(gate));
        }
        if gate.requires_grad() {
            saved.push(Saved::for_var(up));
        }
        self.record(Swiglu, &[gate, up], y, saved)
    }
}
