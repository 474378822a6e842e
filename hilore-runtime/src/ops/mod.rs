//! The ops of the tape. Every op has an explicit backward and declares its saved tensors:
//! the exact values its backward reads, and nothing else.
//!
//! An op is a struct holding its static configuration (shapes, flags) and implementing
//! [`Op`]. Its forward is a method on [`crate::Cx`] that computes the output with candle,
//! then calls [`crate::Cx::record`] with the inputs, the output and the saved tensors. The
//! same method runs during a recompute: `record` then fills the recorded op's slots
//! instead of appending a new op, so forward code never needs to know which pass it is in.
//!
//! A model can add its own op the same way, outside this crate:
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use hilore_runtime::ops::{grad_if, Op, Saved};
//! use hilore_runtime::{Cx, Grads, Plan, Result, Var};
//!
//! /// `x^2`: saves `x`, whose value its backward reads.
//! struct Square;
//!
//! impl Op for Square {
//!     fn name(&self) -> &'static str {
//!         "square" // checked on recompute: the replay must run the same ops
//!     }
//!     fn backward(&self, saved: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
//!         Ok(vec![grad_if(need[0], || Ok((g * saved[0].affine(2.0, 0.0)?)?))?])
//!     }
//! }
//!
//! fn square(cx: &mut Cx, x: &Var) -> Result<Var> {
//!     let out = x.tensor().sqr()?;
//!     // An activation slot: stored, compressed or recomputed with the enclosing unit.
//!     cx.record(Square, &[x], out, vec![Saved::for_var(x)])
//! }
//!
//! # fn main() -> Result<()> {
//! let x = Var::param(Tensor::new(&[1f32, -2.0, 3.0], &Device::Cpu)?);
//! let mut cx = Cx::new(Plan::store_all());
//! let y = square(&mut cx, &x)?;
//! let mut grads = Grads::new();
//! cx.backward(&y, &Tensor::ones(3, candle_core::DType::F32, &Device::Cpu)?, &mut grads)?;
//! assert_eq!(grads.get(x.id()).unwrap().to_vec1::<f32>()?, [2.0, -4.0, 6.0]);
//! # Ok(())
//! # }
//! ```

use crate::Result;
use candle_core::{Shape, Tensor};

mod activation;
mod attention;
mod cpu;
mod dropout;
mod elementwise;
mod embedding;
mod linear;
mod logprobs;
mod math;
mod norm;
mod rope;
mod util;
mod view;

pub(crate) use elementwise::add_same;
pub use elementwise::reduce_to_shape;
pub use rope::RopeTables;
pub use util::{any_grad, grad_if};

/// A value that an op's backward reads.
#[derive(Debug, Clone)]
pub enum Saved {
    /// An activation: managed by the enclosing unit's fidelity (stored, compressed or
    /// dropped and recomputed).
    Act(Tensor),
    /// An activation that must stay exact even under `Compress` (indices, log-sum-exps):
    /// stored or recomputed, never encoded.
    Exact(Tensor),
    /// A parameter (or other long-lived value owned by the model): a reference, never
    /// counted as activation memory, never encoded.
    Param(Tensor),
}

impl Saved {
    pub(crate) fn tensor(&self) -> &Tensor {
        match self {
            Saved::Act(t) | Saved::Exact(t) | Saved::Param(t) => t,
        }
    }
}

/// An op's backward.
pub trait Op {
    /// Stable name, used to check that a recompute replays the same ops.
    fn name(&self) -> &'static str;

    /// Gradients of the inputs, given the saved tensors (in the order the forward declared
    /// them) and the gradient of the output. `needs_grad[i]` says whether input `i` wants
    /// a gradient; return `None` for those that do not.
    fn backward(
        &self,
        saved: &[Tensor],
        grad: &Tensor,
        needs_grad: &[bool],
    ) -> Result<Vec<Option<Tensor>>>;
}

/// The shape of a tensor, owned (ops keep input shapes for broadcasting backward).
pub(crate) fn shape_of(t: &Tensor) -> Shape {
    t.shape().clone()
}

impl Saved {
    /// The right kind of slot for an input: weights (trained or frozen) are referenced,
    /// everything else is an activation.
    pub fn for_var(v: &crate::Var) -> Saved {
        if v.kind.is_weight() {
            Saved::Param(v.tensor.clone())
        } else {
            Saved::Act(v.tensor.clone())
        }
    }
}
