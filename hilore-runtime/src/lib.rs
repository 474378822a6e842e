//! # hilore-runtime
//!
//! The runtime of HiLoRe: a reverse-mode tape over candle tensors whose saved state is
//! managed per **recovery unit**. Each unit instance gets a **fidelity** from a **plan**:
//! [`Fidelity::Store`] keeps its saved tensors, [`Fidelity::Compress`] keeps them encoded
//! by a codec, [`Fidelity::Recompute`] drops them and re-runs the unit in backward. The
//! memory [`Ledger`] counts exactly what the tape keeps alive.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Plan, Result, Var};
//!
//! struct Mlp { w1: Var, w2: Var }
//!
//! impl Mlp {
//!     #[recovery_unit(cost = 4 * x.dim(0)? * x.dim(1)?, deterministic)]
//!     fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
//!         let h = cx.linear(x, &self.w1, None)?;
//!         let h = cx.silu(&h)?;
//!         cx.linear(&h, &self.w2, None)
//!     }
//! }
//!
//! # fn main() -> Result<()> {
//! let dev = Device::Cpu;
//! let mlp = Mlp {
//!     w1: Var::param(Tensor::randn(0f32, 1.0, (8, 4), &dev)?),
//!     w2: Var::param(Tensor::randn(0f32, 1.0, (4, 8), &dev)?),
//! };
//! let x = Var::constant(Tensor::randn(0f32, 1.0, (3, 4), &dev)?);
//! let plan = Plan::store_all().with_unit("forward", Fidelity::Recompute);
//! let mut cx = Cx::new(plan);
//! let y = mlp.forward(&mut cx, &x)?;
//! let mut grads = Grads::new();
//! cx.backward(&y, &Tensor::ones((3, 4), candle_core::DType::F32, &dev)?, &mut grads)?;
//! assert!(grads.get(mlp.w1.id()).is_some());
//! # Ok(())
//! # }
//! ```

extern crate self as hilore_runtime;

pub mod allocator;
pub mod check;
mod encoding;
mod error;
mod fidelity;
mod grads;
pub mod grpo;
pub mod memory;
pub mod opaque;
pub mod ops;
mod packing;
pub mod simulate;
mod tape;
mod unit;
mod var;

pub use error::{Error, Result};
pub use fidelity::{Fidelity, Plan};
pub use grads::Grads;
pub use hilore_macros::recovery_unit;
pub use memory::{Ledger, MemClass, MemoryEvent};
pub use opaque::OpaqueUnit;
pub use ops::{RopeTables, Saved};
pub use packing::Packing;
pub use simulate::{InstanceBytes, Profile, Simulated};
pub use tape::{BackwardReport, Cx, RecomputeCheck, TapeTimes, UnitInstanceInfo};
pub use unit::{
    registered_units, ParamInfo, ParamKind, ReplayOwned, Replayable, UnitDescriptor, UnitOutput,
};
pub use var::{Var, VarId, VarKind};

/// What `#[recovery_unit]` expands to refers to these. Not a public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::unit::{run_unit, IntoCost, UnitRegistration};
    pub use inventory;
    pub use std::rc::Rc;
}
