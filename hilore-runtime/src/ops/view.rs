//! Shape ops: reshape, transpose, narrow, split_rows, cat. None of them saves anything.

use super::util::grad_if;
use super::{shape_of, Op};
use crate::error::shape_err;
use crate::{Cx, Result, Var};
use candle_core::shape::{Dim, ShapeWithOneHole};
use candle_core::{Shape, Tensor};

struct Reshape {
    input: Shape,
}

impl Op for Reshape {
    fn name(&self) -> &'static str {
        "reshape"
    }

    fn backward(&self, _: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grad_if(need[0], || Ok(g.reshape(&self.input)?))?])
    }
}

struct Transpose {
    d0: usize,
    d1: usize,
}

impl Op for Transpose {
    fn name(&self) -> &'static str {
        "transpose"
    }

    fn backward(&self, _: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        // A strided view of `g`, as the forward's output was of `x`; consumers that need a
        // dense layout (gemm, slice_set) make it contiguous themselves.
        Ok(vec![grad_if(need[0], || {
            Ok(g.transpose(self.d0, self.d1)?)
        })?])
    }
}

struct Narrow {
    dim: usize,
    start: usize,
    full: usize,
}

impl Op for Narrow {
    fn name(&self) -> &'static str {
        "narrow"
    }

    fn backward(&self, _: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grad_if(need[0], || {
            let len = g.dim(self.dim)?;
            Ok(g.pad_with_zeros(self.dim, self.start, self.full - self.start - len)?)
        })?])
    }
}

struct Cat {
    dim: usize,
    sizes: Vec<usize>,
}

impl Op for Cat {
    fn name(&self) -> &'static str {
        "cat"
    }

    fn backward(&self, _: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let mut start = 0;
        let mut out = Vec::with_capacity(self.sizes.len());
        for (&len, &n) in self.sizes.iter().zip(need) {
            out.push(grad_if(n, || Ok(g.narrow(self.dim, start, len)?))?);
            start += len;
        }
        Ok(out)
    }
}

impl<'m> Cx<'m> {
    /// `x` with a new shape of the same element count (one dimension may be `()`, inferred,
    /// as in candle). A view when `x` is contiguous, a copy otherwise. Saves nothing.
    pub fn reshape<S: ShapeWithOneHole>(&mut self, x: &Var, shape: S) -> Result<Var> {
        let y = x.tensor.reshape(shape)?;
        let op = Reshape {
            input: shape_of(&x.tensor),
        };
        self.record(op, &[x], y, vec![])
    }

    /// `x` with dimensions `d0` and `d1` swapped: a strided view (call `contiguous` on the
    /// tensor, or reshape, where a dense layout is needed). Saves nothing.
    pub fn transpose<D0: Dim, D1: Dim>(&mut self, x: &Var, d0: D0, d1: D1) -> Result<Var> {
        let d0 = d0.to_index(x.shape(), "transpose")?;
        let d1 = d1.to_index(x.shape(), "transpose")?;
        let y = x.tensor.transpose(d0, d1)?;
        self.record(Transpose { d0, d1 }, &[x], y, vec![])
    }

    /// `len` entries of `x` along `dim` from `start`: a view. Saves nothing (backward pads
    /// the gradient with zeros).
    pub fn narrow<D: Dim>(&mut self, x: &Var, dim: D, start: usize, len: usize) -> Result<Var> {
        let dim = dim.to_index(x.shape(), "narrow")?;
        let full = x.dims()[dim];
        let y = x.tensor.narrow(dim, start, len)?;
        self.record(Narrow { dim, start, full }, &[x], y, vec![])
    }

    /// The first `at` rows of `x` (its dimension 0) and the rest, each copied into a
    /// storage of its own: a unit that saves one part then holds only that part's rows
    /// (a [`Cx::narrow`] view would hold all of `x`). `0 < at < rows`. Saves nothing
    /// (backward pads each part's gradient with zeros, as `narrow`'s).
    pub fn split_rows(&mut self, x: &Var, at: usize) -> Result<(Var, Var)> {
        let full = x.dim(0)?;
        if at == 0 || at >= full {
            return shape_err(
                "split_rows",
                format!("splits {full} rows at {at}; it needs 0 < at < {full}"),
            );
        }
        let mut part = |start: usize, len: usize| -> Result<Var> {
            let y = x.tensor.narrow(0, start, len)?.force_contiguous()?;
            self.record(
                Narrow {
                    dim: 0,
                    start,
                    full,
                },
                &[x],
                y,
                vec![],
            )
        };
        let first = part(0, at)?;
        Ok((first, part(at, full - at)?))
    }

    /// Concatenation of `xs` (at least one) along `dim`. Saves nothing (backward slices the
    /// gradient).
    pub fn cat<D: Dim>(&mut self, xs: &[&Var], dim: D) -> Result<Var> {
        let Some(first) = xs.first() else {
            return shape_err("cat", "needs at least one input");
        };
        let dim = dim.to_index(first.shape(), "cat")?;
        let tensors: Vec<&Tensor> = xs.iter().map(|v| &v.tensor).collect();
        let y = Tensor::cat(&tensors, dim)?;
        let sizes = xs.iter().map(|v| v.dim(dim)).collect::<Result<Vec<_>>>()?;
        self.record(Cat { dim, sizes }, xs, y, vec![])
    }
}
