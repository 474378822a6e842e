//! The allocator: measured costs, exposure-conditioned risk, budgets and the plan solver.
//!
//! For every unit instance `u` and microbatch `m` each candidate fidelity `k` has a time
//! `t(u, k)` ([`costs`]: measured recompute, encode and decode times, modelled in the
//! token count and the sum of squared sequence lengths), exact bytes (from the
//! [`crate::Profile`] simulator) and a risk `r(u, k, m) = kappa(u, k) * exposure(u, m)`
//! ([`risk`]). The [`Allocator`] picks one fidelity per instance to minimise the summed
//! time under the whole actor-update memory budget ([`budget`]) and a risk budget, with a
//! multiple-choice knapsack ([`solver`]: Lagrangian on the risk, dynamic program over
//! memory) whose every plan is checked against the simulator, so the peak it predicts is
//! the peak the ledger measures, byte for byte. [`calibrate()`] measures the costs and
//! `kappa` on a [`Workload`]'s passes; the [`OnlineAllocator`] does all of it inside a training
//! loop (`hilore train --policy hilore`); `hilore bench` compares it with the baselines.
//!
//! ```
//! use hilore_runtime::allocator::solver::{Choice, Group, Problem, Solver};
//! use hilore_runtime::Fidelity;
//!
//! // Two instances; each may be stored (fast, 100 bytes) or recomputed (slow, 10 bytes).
//! let group = |name: &str| Group {
//!     name: name.into(),
//!     whole: vec![
//!         Choice::one(name, 0, Fidelity::Store, 0.0, 0.0, 100),
//!         Choice::one(name, 0, Fidelity::Recompute, 1.0, 0.0, 10),
//!     ],
//!     opened: None,
//! };
//! let p = Problem { groups: vec![group("a"), group("b")], capacity: 120, risk_budget: 0.0 };
//! let s = Solver::default().solve(&p).unwrap();
//! assert_eq!(s.seconds, 1.0); // one of the two is recomputed
//! assert!(s.bytes <= 120);
//! ```

pub mod budget;
pub mod calibrate;
pub mod costs;
pub mod online;
mod planner;
pub mod risk;
pub mod solver;
mod workload;

pub use budget::{MemoryBudget, StateBytes, DEFAULT_BUDGET_FACTOR};
pub use calibrate::{
    calibrate, calibration_passes, microbatch_input, CalibrationReport, PassResult,
};
pub use costs::{CostModel, MicrobatchShape, ProfileKey};
pub use online::{AllocatorState, OnlineAllocator, RiskState, StepPlan};
pub use planner::{baselines, Allocator, Decision, MicrobatchInput, Offer};
pub use risk::{RiskModel, DEFAULT_TARGET_REL_L2};
pub use solver::{Choice, Group, Infeasible, Opened, Pick, Problem, Selection, Solver};
pub use workload::Workload;
