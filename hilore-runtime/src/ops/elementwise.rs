//! Broadcasting add and mul, and scaling.

use super::{cpu, shape_of, Op, Saved};
use crate::{Cx, Result, Var};
use candle_core::{Shape, Tensor};

/// Sums `grad` over the dimensions that broadcasting expanded, so it has `shape`.
pub fn reduce_to_shape(grad: &Tensor, shape: &Shape) -> Result<Tensor> {
    if grad.shape() == shape {
        return Ok(grad.clone());
    }
    let gd = grad.dims();
    let sd = shape.dims();
    let lead = gd.len() - sd.len();
    let mut g = grad.clone();
    // Leading dims that the target does not have at all.
    for _ in 0..lead {
        g = g.sum(0)?;
    }
    // Dims that the target has with size 1.
    let mut dims = Vec::new();
    for (i, &s) in sd.iter().enumerate() {
        if s == 1 && g.dims()[i] != 1 {
            dims.push(i);
        }
    }
    if !dims.is_empty() {
        g = g.sum_keepdim(dims)?;
    }
    Ok(g.reshape(shape)?)
}

/// `a + b` with broadcasting. Host `f32` tensors of the same shape (a residual add), or a
/// row vector added to every row (a bias), take the parallel kernels.
pub(crate) fn add_tensors(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if cpu::all_host_f32(&[a, b]) {
        let row_of = |x: &Tensor, y: &Tensor| {
            x.rank() == 1 && y.rank() >= 1 && y.dims()[y.rank() - 1] == x.dims()[0]
        };
        if a.shape() == b.shape() {
            let (at, bt) = (cpu::dense(a)?, cpu::dense(b)?);
            let (av, bv) = (cpu::values(&at)?, cpu::values(&bt)?);
            return cpu::tensor(cpu::rows::add(av.get(), bv.get()), a.shape().clone());
        }
        if row_of(b, a) || row_of(a, b) {
            let (x, r) = if row_of(b, a) { (a, b) } else { (b, a) };
            let (xt, rt) = (cpu::dense(x)?, cpu::dense(r)?);
            let (xv, rv) = (cpu::values(&xt)?, cpu::values(&rt)?);
            return cpu::tensor(cpu::rows::add_rows(xv.get(), rv.get()), x.shape().clone());
        }
    }
    Ok(a.broadcast_add(b)?)
}

/// `a + b` of two tensors of the same shape (gradient accumulation); the parallel kernel
/// for host `f32` tensors, candle's add (which rejects other shapes) otherwise.
pub(crate) fn add_same(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() == b.shape() {
        add_tensors(a, b)
    } else {
        Ok((a + b)?)
    }
}

struct Add {
    a: Shape,
    b: Shape,
}

impl Op for Add {
    fn name(&self) -> &'static str {
        "add"
    }
    fn backward(&self, _: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![
            if need[0] {
                Some(reduce_to_shape(g, &self.a)?)
            } else {
                None
            },
            if need[1] {
                Some(reduce_to_shape(g, &self.b)?)
            } else {
                None
            },
        ])
    }
}

struct Mul {
    a: Shape,
    b: Shape,
}

impl Op for Mul {
    fn name(&self) -> &'static str {
        "mul"
    }
    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (a, b) = (&s[0], &s[1]);
        Ok(vec![
            if need[0] {
                Some(reduce_to_shape(&g.broadcast_mul(b)?, &self.a)?)
            } else {
                None
            },
            if need[1] {
                Some(reduce_to_shape(&g.broadcast_mul(a)?, &self.b)?)
            } else {
                None
            },
        ])
    }
}

struct Scale(f64);

impl Op for Scale {
    fn name(&self) -> &'static str {
        "scale"
    }
    fn backward(&self, _: &[Tensor], g: &Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g.affine(self.0, 0.0)?)])
    }
}

impl<'m> Cx<'m> {
    /// `a + b` with broadcasting. Saves nothing.
    pub fn add(&mut self, a: &Var, b: &Var) -> Result<Var> {
        let out = add_tensors(&a.tensor, &b.tensor)?;
        let op = Add {
            a: shape_of(&a.tensor),
            b: shape_of(&b.tensor),
        };
        self.record(op, &[a, b], out, vec![])
    }

    /// `a * b` with broadcasting. Saves both factors.
    pub fn mul(&mut self, a: &Var, b: &Var) -> Result<Var> {
        let out = a.tensor.broadcast_mul(&b.tensor)?;
        let op = Mul {
            a: shape_of(&a.tensor),
            b: shape_of(&b.tensor),
        };
        let saved = vec![Saved::for_var(a), Saved::for_var(b)];
        self.record(op, &[a, b], out, saved)
    }

    /// `x * s`. Saves nothing.
    pub fn scale(&mut self, x: &Var, s: f64) -> Result<Var> {
        let out = x.tensor.affine(s, 0.0)?;
        self.record(Scale(s), &[x], out, vec![])
    }
}
