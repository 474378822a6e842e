//! SiLU and SwiGLU.

use super::util::{any_grad, grad_if};
use super::{Op, Saved};
use crate::error::shape_err;
use crate::{Cx, Error, Result, Var};
use candle_core::Tensor;

/// `sigmoid(x) = 1 / (1 + exp(-x))`; saturates to 0 (not NaN) for very negative `x`.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
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
        Ok(vec![grad_if(need[0], || Ok((g * silu_grad(&s[0])?)?))?])
    }
}

struct Swiglu;

impl Op for Swiglu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let gate = &s[0];
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

impl<'m> Cx<'m> {
    /// `x * sigmoid(x)`. Saves `x` ([`Saved::for_var`]) when it wants a gradient.
    pub fn silu(&mut self, x: &Var) -> Result<Var> {
        let y = x.tensor.silu()?;
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
        let y = (gate.tensor.silu()? * &up.tensor)?;
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
