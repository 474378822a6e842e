//! Linear layers and (batched) matrix products.

use super::util::{grad_if, mm};
use super::{cpu, elementwise, shape_of, Op, Saved};
use crate::error::shape_err;
use crate::{Cx, Error, Result, Var};
use candle_core::{Shape, Tensor};

/// Where the forward put each saved tensor (the saved list depends on which inputs want a
/// gradient).
#[derive(Clone, Copy)]
struct Slots {
    /// Index of the left operand (`x` / `a`) in the saved list, if saved.
    left: Option<usize>,
    /// Index of the right operand (`w` / `b`) in the saved list, if saved.
    right: Option<usize>,
}

impl Slots {
    /// The left operand is saved only when the right one wants a gradient, and vice versa.
    fn plan(left: &Var, right: &Var) -> (Slots, Vec<Saved>) {
        let mut saved = Vec::new();
        let mut slots = Slots {
            left: None,
            right: None,
        };
        if right.requires_grad() {
            slots.left = Some(saved.len());
            saved.push(Saved::for_var(left));
        }
        if left.requires_grad() {
            slots.right = Some(saved.len());
            saved.push(Saved::for_var(right));
        }
        (slots, saved)
    }

    fn get<'a>(at: Option<usize>, saved: &'a [Tensor], op: &str, what: &str) -> Result<&'a Tensor> {
        at.and_then(|i| saved.get(i)).ok_or_else(|| {
            Error::Tape(format!(
                "{op}: backward asked for a gradient that needs `{what}`, which the forward did not \
                 save because no input needing it required a gradient at record time"
            ))
        })
    }
}

struct Linear {
    /// Shape of `x`, `[..., in]`.
    x_shape: Shape,
    has_bias: bool,
    slots: Slots,
}

impl Op for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let d_in = self.x_shape.dims()[self.x_shape.rank() - 1];
        let rows = self.x_shape.elem_count() / d_in.max(1);
        let d_out = g.dim(g.rank() - 1)?;
        let g2 = g.reshape((rows, d_out))?;
        let dx = grad_if(need[0], || {
            let w = Slots::get(self.slots.right, s, "linear", "w")?;
            Ok(mm(&g2, w)?.reshape(&self.x_shape)?)
        })?;
        let dw = grad_if(need[1], || {
            let x = Slots::get(self.slots.left, s, "linear", "x")?;
            let x2 = x.reshape((rows, d_in))?;
            mm(&g2.t()?, &x2)
        })?;
        let mut out = vec![dx, dw];
        if self.has_bias {
            out.push(grad_if(need[2], || {
                if cpu::all_host_f32(&[&g2]) {
                    let gt = cpu::dense(&g2)?;
                    let s = cpu::rows::sum_rows(cpu::values(&gt)?.get(), d_out);
                    return cpu::tensor(s, d_out);
                }
                Ok(g2.sum(0)?)
            })?);
        }
        Ok(out)
    }
}

struct Matmul {
    slots: Slots,
}

impl Op for Matmul {
    fn name(&self) -> &'static str {
        "matmul"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let da = grad_if(need[0], || {
            let b = Slots::get(self.slots.right, s, "matmul", "b")?;
            mm(g, &b.t()?)
        })?;
        let db = grad_if(need[1], || {
            let a = Slots::get(self.slots.left, s, "matmul", "a")?;
            mm(&a.t()?, g)
        })?;
        Ok(vec![da, db])
    }
}

impl<'m> Cx<'m> {
    /// `x @ w^T + b` for `x: [..., in]`, `w: [out, in]`, `b: [out]`; returns `[..., out]`.
    ///
    /// Saves `x` only if `w` wants a gradient (for `dW = g^T x`) and `w` only if `x` wants one
    /// (for `dx = g w`), each through [`Saved::for_var`] (a parameter is referenced, not
    /// counted). The bias's gradient needs nothing saved.
    pub fn linear(&mut self, x: &Var, w: &Var, b: Option<&Var>) -> Result<Var> {
        let xd = x.dims();
        let (d_out, d_in) = match w.dims() {
            [o, i] => (*o, *i),
            d => return shape_err("linear", format!("w must be [out, in], got {d:?}")),
        };
        if xd.is_empty() || xd[xd.len() - 1] != d_in {
            return shape_err(
                "linear",
                format!("x must be [..., {d_in}] to match w [{d_out}, {d_in}], got {xd:?}"),
            );
        }
        if let Some(b) = b {
            if b.dims() != [d_out] {
                return shape_err("linear", format!("b must be [{d_out}], got {:?}", b.dims()));
            }
        }
        let rows = x.elem_count() / d_in.max(1);
        let x2 = x.tensor.reshape((rows, d_in))?;
        let mut y = mm(&x2, &w.tensor.t()?)?;
        if let Some(b) = b {
            y = elementwise::add_tensors(&y, &b.tensor)?;
        }
        let mut out_dims = xd[..xd.len() - 1].to_vec();
        out_dims.push(d_out);
        let y = y.reshape(out_dims)?;
        let (slots, saved) = Slots::plan(x, w);
        let op = Linear {
            x_shape: shape_of(&x.tensor),
            has_bias: b.is_some(),
            slots,
        };
        match b {
            Some(b) => self.record(op, &[x, w, b], y, saved),
            None => self.record(op, &[x, w], y, saved),
        }
    }

    /// Batched matrix product `[..., M, K] x [..., K, N] -> [..., M, N]` (equal batch
    /// dimensions, no broadcasting).
    ///
    /// Saves `a` only if `b` wants a gradient and `b` only if `a` wants one
    /// ([`Saved::for_var`]).
    pub fn matmul(&mut self, a: &Var, b: &Var) -> Result<Var> {
        let (ad, bd) = (a.dims(), b.dims());
        let r = ad.len();
        if r < 2 || bd.len() != r || ad[..r - 2] != bd[..r - 2] || ad[r - 1] != bd[r - 2] {
            return shape_err(
                "matmul",
                format!(
                    "expected [..., M, K] x [..., K, N] with equal batch dims, got {ad:?} x {bd:?}"
                ),
            );
        }
        let y = mm(&a.tensor, &b.tensor)?;
        let (slots, saved) = Slots::plan(a, b);
        self.record(Matmul { slots }, &[a, b], y, saved)
    }
}
