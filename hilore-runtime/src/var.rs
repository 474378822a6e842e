//! Tape values.

use crate::Result;
use candle_core::{DType, Device, Shape, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};

/// Identity of a tape value. Unique for the life of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VarId(pub(crate) u64);

impl VarId {
    pub(crate) fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        VarId(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// The raw number, for reports.
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

/// What a tape value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VarKind {
    /// A trainable parameter: gradients accumulate in [`crate::Grads`]; never activation memory.
    Param,
    /// An intermediate value produced by an op on the tape.
    Activation,
    /// A value with no gradient (inputs, masks, tables).
    Constant,
    /// A weight that is not trained (a LoRA base, a frozen embedding): saved by
    /// reference like a parameter, so never activation memory and never compressed, and
    /// given no gradient.
    Frozen,
}

impl VarKind {
    /// Whether this is a weight (a parameter, trained or frozen): saved by reference,
    /// never counted as activation memory.
    pub fn is_weight(self) -> bool {
        matches!(self, VarKind::Param | VarKind::Frozen)
    }
}

/// A value on the tape: a candle tensor plus its identity.
///
/// Cloning is cheap (the tensor is reference-counted). Holding a `Var` keeps its tensor
/// alive; the tape itself keeps only what backward needs, in the slots of its ops.
#[derive(Clone, Debug)]
pub struct Var {
    pub(crate) id: VarId,
    pub(crate) tensor: Tensor,
    pub(crate) kind: VarKind,
}

impl Var {
    /// A trainable parameter.
    pub fn param(tensor: Tensor) -> Self {
        Var {
            id: VarId::fresh(),
            tensor,
            kind: VarKind::Param,
        }
    }

    /// A weight that is not trained: no gradient, and ops keep a reference to it as they
    /// do to a parameter's, so it is never activation memory and never compressed (see
    /// [`VarKind::Frozen`]). A frozen weight made a [`Var::constant`] would be saved as an
    /// activation: counted, and compressed under a Compress fidelity.
    pub fn frozen(tensor: Tensor) -> Self {
        Var {
            id: VarId::fresh(),
            tensor,
            kind: VarKind::Frozen,
        }
    }

    /// A value that needs no gradient.
    pub fn constant(tensor: Tensor) -> Self {
        Var {
            id: VarId::fresh(),
            tensor,
            kind: VarKind::Constant,
        }
    }

    pub(crate) fn activation(id: VarId, tensor: Tensor, requires_grad: bool) -> Self {
        Var {
            id,
            tensor,
            kind: if requires_grad {
                VarKind::Activation
            } else {
                VarKind::Constant
            },
        }
    }

    /// The identity of this value.
    pub fn id(&self) -> VarId {
        self.id
    }

    /// The value.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// What kind of value this is.
    pub fn kind(&self) -> VarKind {
        self.kind
    }

    /// Whether a gradient flows to this value.
    pub fn requires_grad(&self) -> bool {
        !matches!(self.kind, VarKind::Constant | VarKind::Frozen)
    }

    /// Size of dimension `d`.
    pub fn dim(&self, d: usize) -> Result<usize> {
        Ok(self.tensor.dim(d)?)
    }

    /// All dimensions.
    pub fn dims(&self) -> &[usize] {
        self.tensor.dims()
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        self.tensor.shape()
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.tensor.elem_count()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.tensor.dtype()
    }

    /// Device.
    pub fn device(&self) -> &Device {
        self.tensor.device()
    }

    /// Replaces a parameter's value in place (after an optimizer step), keeping its identity.
    pub fn set_tensor(&mut self, tensor: Tensor) -> Result<()> {
        if tensor.shape() != self.tensor.shape() || tensor.dtype() != self.tensor.dtype() {
            return Err(crate::Error::Tape(format!(
                "set_tensor: new value has shape {:?} {:?}, the variable has {:?} {:?}",
                tensor.dims(),
                tensor.dtype(),
                self.tensor.dims(),
                self.tensor.dtype()
            )));
        }
        self.tensor = tensor;
        Ok(())
    }
}
