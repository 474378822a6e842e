//! What the allocator needs from a training loop: its microbatches of one step, each
//! profiled or run under a plan. One trait for planning ([`super::OnlineAllocator`]) and
//! for calibration ([`super::calibrate()`]).

use super::calibrate::PassResult;
use super::planner::MicrobatchInput;
use crate::{Plan, Profile, Result, UnitInstanceInfo};

/// What the training loop provides: its microbatches of one step.
pub trait Workload {
    /// Number of microbatches.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Shape and exposure of microbatch `i` (before its forward).
    fn input(&self, i: usize) -> MicrobatchInput;
    /// A profiled store-all forward + backward of microbatch `i`.
    fn profile(&mut self, i: usize) -> Result<(Profile, Vec<UnitInstanceInfo>)>;
    /// One forward + backward of microbatch `i` under `plan` (calibration: every
    /// parameter gradient, flattened in a fixed order, and the tape's times).
    fn run(&mut self, i: usize, plan: &Plan) -> Result<PassResult>;
}
