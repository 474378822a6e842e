//! Errors of the runtime.

/// Every error the tape, the units and the plans can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error of the tensor library.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// An error of a codec.
    #[error("codec error in unit `{unit}`: {source}")]
    Codec {
        unit: String,
        #[source]
        source: hilore_kernels::CodecError,
    },
    /// The GPU could not run a codec (CUDA library, driver or kernel compilation error).
    #[error("GPU codec error in unit `{unit}`: {source}")]
    Device {
        unit: String,
        #[source]
        source: hilore_kernels::DeviceError,
    },
    /// A codec name that no codec answers to.
    #[error(transparent)]
    UnknownCodec(#[from] hilore_kernels::CodecError),
    /// The plan asked for `Recompute` on a unit that is not declared `deterministic`.
    #[error("unit `{unit}` is not declared `deterministic`, so it cannot be recomputed; give it the Store or Compress fidelity, or mark it `#[recovery_unit(..., deterministic)]` if its body replays bit-identically")]
    NotDeterministic { unit: String },
    /// The plan asked for a codec the unit restricts away.
    #[error("the plan gives unit `{unit}` codec `{codec}`, which its `#[recovery_unit(codecs = [...])]` leaves out (it allows {allowed}): plan one of those (or Store) for it, or add `{codec}` to its list")]
    CodecNotAllowed {
        unit: String,
        codec: String,
        allowed: String,
    },
    /// A recompute did not replay the recorded forward.
    #[error("recompute of unit `{unit}` diverged from its forward: {detail}")]
    ReplayDiverged { unit: String, detail: String },
    /// A deterministic unit's recompute produced different bits ([`crate::Cx::verify_recompute`]).
    #[error("recompute of deterministic unit `{unit}` (call {call}) is not bit-identical to its forward: its output, from op {op_index} (`{op}`), differs; the unit's body reads something besides its inputs (a counter, a clock, a random draw, mutable state), so it must not be recomputed: drop `deterministic` or make the body a function of its inputs")]
    NotBitIdentical {
        unit: String,
        call: usize,
        /// The op that produced the unit's (last) output, and its index on the tape.
        op: &'static str,
        op_index: usize,
    },
    /// A unit's body failed while it was being recomputed.
    #[error("unit `{unit}` failed while being recomputed: {message}")]
    Recompute { unit: String, message: String },
    /// The allocator's memory budget is below what any plan needs: the fixed state
    /// (parameters, gradients, optimizer) plus the least activation peak any plan reaches.
    #[error("memory budget of {budget_bytes} bytes is infeasible: the fixed state alone is {fixed_bytes} bytes (parameters {param_bytes}, gradients {grad_bytes}, optimizer {optimizer_bytes}) and the least activation peak any plan reaches is {least_activation_bytes} bytes; the smallest feasible budget is {smallest_feasible_bytes} bytes")]
    InfeasibleMemory {
        budget_bytes: usize,
        fixed_bytes: usize,
        param_bytes: usize,
        grad_bytes: usize,
        optimizer_bytes: usize,
        least_activation_bytes: usize,
        /// `fixed_bytes + least_activation_bytes`: ask for at least this much.
        smallest_feasible_bytes: usize,
    },
    /// The allocator's risk budget cannot be met by any plan that fits the memory budget.
    #[error("risk budget {budget:.4e} is infeasible under this memory budget: the least risk any plan that fits reaches is {least_risk:.4e} (risks added in quadrature)")]
    InfeasibleRisk {
        /// The risk budget asked for (relative gradient error).
        budget: f64,
        /// The least risk of any plan that fits: ask for at least this much.
        least_risk: f64,
    },
    /// Misuse of the tape (a description of what and how to fix it).
    #[error("{0}")]
    Tape(String),
    /// A shape that an op cannot take.
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
}

/// The runtime's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn shape_err<T>(op: &'static str, detail: impl Into<String>) -> Result<T> {
    Err(Error::Shape {
        op,
        detail: detail.into(),
    })
}
