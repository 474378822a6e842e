//! From a profile, measured costs and calibrated risk to a plan per microbatch.
//!
//! The [`Allocator`] holds the [`Profile`] of one store-all pass (its byte figures are
//! exact for every microbatch with the same token count: every saved tensor of the
//! decoder is linear in the rows, none depends on how they split into sequences), the
//! [`CostModel`] and the [`RiskModel`]. For a microbatch it builds the knapsack:
//!
//! - one group per top-level unit instance (`embed`, every `layer`, `head`); a group with
//!   children is either recomputed whole (classic checkpointing: only its inputs are kept)
//!   or *opened* into its children, each of which gets Store, Compress(codec) or
//!   Recompute (only where its descriptor offers it: a unit that is not `deterministic`
//!   never gets Recompute);
//! - time of a choice: measured recompute time of the instance (its unit's fit, times the
//!   instance's share of the unit's cost at the profile), or encode + decode time of its
//!   activation values; Store costs nothing;
//! - risk: `kappa * exposure` for Compress (exposure: the L2 norm of the rows'
//!   `dL/dlogp`), 0 for the exact fidelities;
//! - bytes: what the choice changes in the bytes kept after the forward, measured exactly
//!   by simulating the profile with that one choice changed from a reference plan
//!   (every group recomputed), once per allocator.
//!
//! The DP works on that additive model; the transient of the unit being recovered in
//! backward and any sharing between units are not additive, so every plan the solver
//! returns is checked with [`Profile::simulate`], which gives the exact ledger peak, and
//! the DP's capacity is searched (bisection on the capacity, largest one whose plan's
//! exact peak fits). The predicted peak is therefore the simulated one: byte-exact.
//!
//! Where the additive model overstates a plan's peak, the DP cannot see that the plan
//! fits: at a budget of full recompute's own peak, Megatron-style selective recompute (one
//! layer kept, its cheap units recomputed) fits in a few KiB of slack the additive sum
//! does not have. So the planner also weighs a small family of exact plans of that shape
//! ([`Allocator::selective_candidates`], in [`baselines`]: the last `k` groups with children opened, each
//! recomputing its `j` children cheapest to recompute per saved byte and storing the
//! rest, the other groups recomputed whole), checked with the simulator, and takes one
//! for a microbatch when it fits and is faster than the DP's fastest plan at the capacity
//! found. Such a plan carries no risk, so it is never worse than the DP's under the risk
//! budget either.
//!
//! Last, an exact local search ([`Allocator`]'s `refine`) starts from each microbatch's
//! plan (or from the plan the step's previous microbatch of the same allocator ended
//! with, where that is faster for this one and within the risk left: its exact peak is
//! known, being this microbatch's too, and so are most of the peaks its search tries)
//! and applies, one at a time, the change of one group (another whole choice, opening
//! it, or one child's fidelity) that saves the most predicted time among those whose exact
//! peak still fits and whose risk stays within what the step's risk budget leaves. The
//! capacity bisection lands where the DP's plan fits, which can be well below the
//! capacity the additive model offers and leaves part of the budget unused per
//! microbatch; the search spends it. The plan's solve is part of the step it plans, so
//! the search pays for itself: a simulation is run only while the predicted time the
//! search has saved, plus what the change simulated would save, covers the time of every
//! simulation it has run with this one (calibration measures a simulation's seconds per
//! profile event, [`CostModel::simulation_seconds_per_event`]; before calibration the
//! search is not limited this way). It is also bounded to 32 new simulations per call
//! (most changes it takes come early), a change whose plan did not fit is not simulated
//! again in the same search, and simulated peaks are shared between the microbatches of
//! a step that have one allocator (keyed by every instance's fidelity; the simulator
//! takes those directly, without a [`Plan`]).
//!
//! A step whose microbatches have profiles of their own (the shared-prefix layout, whose
//! microbatches differ in prompt rows) is planned as one by
//! [`Allocator::plan_step_across`], each microbatch by its own allocator: one risk
//! multiplier for the whole step, and one time-risk frontier for knapsacks of the same
//! structure, each member adding its own vertices at the multipliers the step tries.
//!
//! The search only moves one group at a time, so it cannot leave the shape of the plan it
//! starts from. Where the budget is tight the knapsack's plan can be of a slow shape (a
//! few instances compressed and many recomputed, where a greedy by cost per byte finds a
//! faster plan with most instances compressed). So the search also starts from the
//! greedy's plans: from every instance stored, the change of one group that adds the least
//! `seconds + lambda * risk` per byte saved, with the step's multiplier `lambda` and with
//! none (the Adacc-style order), within the risk the step leaves the microbatch, until the
//! exact peak fits (bisected along the greedy's path, a few simulations); the fastest of
//! the searched plans is kept. The starts pay for themselves across the step: each kind
//! (with the multiplier, without it) runs on a microbatch only while its simulations so
//! far in the step, with one more, are covered by what it has saved the step's plans plus
//! the most it could save this one (the plan's whole predicted seconds); a kind that finds
//! no faster plans stops after costing about one microbatch's overhead. Before
//! calibration prices simulations every start runs, and the planner's plan for one
//! microbatch is never slower, by its own cost model, than the greedy's with the same
//! exposure and risk budget.
//!
//! The capacities are searched for the DP's fastest plans, ignoring the risk. When no DP
//! plan within them meets the risk budget (a tight budget, compression that costs next to
//! nothing), every microbatch starts instead from its exact Store / Recompute plan (which
//! carries no risk) and the searches add what compression the risk budget allows; only
//! when no exact plan fits either is the risk budget reported infeasible.

pub mod baselines;
mod capacity;
mod decision;
mod problem;
mod search;

use super::budget::StateBytes;
use super::costs::{CostModel, MicrobatchShape};
use super::risk::RiskModel;
use super::solver::{Pick, Problem, Solver};
use crate::simulate::{InstanceBytes, Profile};
use crate::unit::UnitDescriptor;
use crate::{Error, Fidelity, Plan, Result, UnitInstanceInfo};
use serde::Serialize;
use std::collections::HashMap;

/// What the allocator needs to know about one microbatch before its forward.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MicrobatchInput {
    /// Its shape (costs depend on it).
    pub shape: MicrobatchShape,
    /// Its exposure: `sqrt(sum (dL/dlogp)^2)` over its rows ([`crate::grpo`]).
    pub exposure: f64,
}

/// Which fidelities a strategy may use.
#[derive(Debug, Clone, PartialEq)]
pub struct Offer {
    /// Codecs Compress may use (empty: no compression).
    pub codecs: Vec<&'static str>,
    /// Whether Recompute may be used (where the unit offers it).
    pub recompute: bool,
    /// Whether children of a group may get their own fidelity (false: only whole groups,
    /// plus Store / Compress / Recompute of childless groups).
    pub open_groups: bool,
}

/// The allocator's plan for one microbatch.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// The plan to run the microbatch with.
    #[serde(skip)]
    pub plan: Plan,
    /// The ledger peak the plan will measure (exact, from the simulator).
    pub predicted_peak_bytes: usize,
    /// Plus the fixed state: the whole actor-update peak.
    pub predicted_total_bytes: usize,
    /// Predicted recompute + encode + decode seconds.
    pub predicted_seconds: f64,
    /// Of which recompute.
    pub predicted_recompute_seconds: f64,
    /// Of which encode + decode.
    pub predicted_codec_seconds: f64,
    /// Predicted risk: the compressed instances' risks added in quadrature.
    pub predicted_risk: f64,
    /// The Lagrange multiplier of the risk.
    pub lambda: f64,
    /// Seconds spent solving (DPs and exact checks).
    pub solve_seconds: f64,
    /// Exact simulations run while solving.
    pub exact_checks: usize,
    /// Of the exact simulations, those this microbatch's searches ran: at most one to
    /// check a warm start (none when its peak is already known), and those of its local
    /// search and greedy starts, which run only while they pay for themselves.
    pub search_checks: usize,
    /// Unit instances per fidelity, in the order of the fidelities' names.
    pub counts: Vec<(Fidelity, usize)>,
}

/// Exact peaks already simulated, by every instance's fidelity (byte figures do not depend
/// on the microbatch, so a step's microbatches share them).
type Peaks = HashMap<Vec<Fidelity>, usize, foldhash::fast::RandomState>;

/// What [`Allocator::plan_step`]'s exact checks and searches of one microbatch depend on
/// (the `to_bits` of its exposure and of the squared risk the other microbatches leave,
/// 0 for the latter without exposure).
#[derive(PartialEq)]
struct Replan {
    alloc: usize,
    shape: MicrobatchShape,
    capacity: i64,
    exposure: u64,
    room: u64,
    picks: Vec<Pick>,
    seed: Option<Vec<Pick>>,
}

/// What one [`Allocator::plan_step`] call plans: its microbatches, budget and offer, the
/// ledger bytes its activations may take, and the exact simulations run so far.
struct StepContext<'a> {
    mbs: &'a [MicrobatchInput],
    /// Microbatch `k`'s allocator.
    allocs: &'a [&'a Allocator],
    total_budget: usize,
    offer: &'a Offer,
    assumed_exposure: Option<f64>,
    avail: i64,
    checks: usize,
    /// The greedy starts' account over the step, per kind (with the step's multiplier,
    /// without it).
    starts: [StartAccount; 2],
}

/// What one kind of greedy start has cost a step so far (its exact simulations, priced by
/// [`Allocator::simulation_seconds`]) and what it has saved (predicted seconds of the
/// plans it bettered), so the starts pay for themselves across the step as the local
/// search does within a microbatch.
#[derive(Debug, Default, Clone, Copy)]
struct StartAccount {
    spent: f64,
    saved: f64,
}

/// Where a microbatch's searches start (step 1 of [`Allocator::plan_step`]): the problem
/// the step's multiplier solves (its full knapsack at the capacity found, or one fixed
/// exact plan), the full knapsack the searches work in, and for a fixed plan its picks in
/// the full problem.
struct Start {
    problem: Problem,
    full: Problem,
    seed: Option<Vec<Pick>>,
}

/// The summed (squared) risks of every microbatch but `k`.
fn others_risk(risks: &[f64], k: usize) -> f64 {
    risks
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != k)
        .map(|(_, r)| r)
        .sum()
}

/// New exact simulations one [`Allocator::refine`] call may run.
const REFINE_SIMULATIONS: usize = 32;

/// Predicted recompute and codec seconds of a selection.
fn split_seconds(p: &Problem, picks: &[Pick]) -> (f64, f64) {
    let (mut rc, mut codec) = (0.0, 0.0);
    for c in p.chosen(picks) {
        match c.fidelities.first().map(|f| f.2) {
            Some(Fidelity::Recompute) => rc += c.seconds,
            Some(Fidelity::Compress(_)) => codec += c.seconds,
            _ => {}
        }
    }
    (rc, codec)
}

#[derive(Debug, Clone)]
struct Layout {
    top: usize,
    children: Vec<usize>,
}

/// Plans microbatches; see the module docs.
#[derive(Debug, Clone)]
pub struct Allocator {
    profile: Profile,
    instances: Vec<InstanceBytes>,
    descs: Vec<&'static UnitDescriptor>,
    costs_at_profile: Vec<f64>,
    /// Instance `i`'s share of its unit's measured recompute time, relative to the mean
    /// instance: `cost_i * n / sum of the unit's n costs` at the profile (1 where the
    /// unit's costs are all equal, or sum to nothing). A unit's fit predicts the mean
    /// instance; in a layout whose row-wise units run on the prompts' and the responses'
    /// rows apart, a unit's prompt and response instances cost what their rows do.
    recompute_share: Vec<f64>,
    layout: Vec<Layout>,
    state: StateBytes,
    /// Measured costs.
    pub costs: CostModel,
    /// Calibrated risk.
    pub risk: RiskModel,
    /// The knapsack solver's settings.
    pub solver: Solver,
    reference: HashMap<usize, Fidelity>,
    reference_eof: i64,
    /// Marginal bytes: (instance, fidelity) -> change of end-of-forward bytes from the
    /// reference (for children: from their group opened with every child stored).
    marginal: HashMap<(usize, Fidelity), i64>,
    opened_base: HashMap<usize, i64>,
}

impl Allocator {
    /// An allocator for microbatches of the profiled token count. `instances` are the
    /// profiled tape's [`crate::Cx::unit_instances`] (their cost-expression values are the
    /// prior); `state` the fixed bytes of the update; `codecs` every codec that may be
    /// offered (byte figures are precomputed for them).
    pub fn new(
        profile: Profile,
        instances: &[UnitInstanceInfo],
        state: StateBytes,
        codecs: &[&'static str],
    ) -> Result<Self> {
        let bytes = profile.instances();
        if bytes.len() != instances.len() {
            return Err(Error::Tape(format!(
                "allocator: the profile has {} unit instances, the tape listed {}; pass the profiled tape's unit_instances()",
                bytes.len(),
                instances.len()
            )));
        }
        let descs: Vec<_> = (0..bytes.len()).map(|i| profile.descriptor(i)).collect();
        let mut layout: Vec<Layout> = Vec::new();
        let mut top_of = vec![usize::MAX; bytes.len()];
        for (i, b) in bytes.iter().enumerate() {
            match b.parent {
                None => {
                    top_of[i] = layout.len();
                    layout.push(Layout {
                        top: i,
                        children: Vec::new(),
                    });
                }
                Some(p) => {
                    // Only direct children of a top-level instance are planned separately;
                    // deeper nesting inherits its child's fidelity.
                    if bytes[p].parent.is_none() {
                        layout[top_of[p]].children.push(i);
                    }
                }
            }
        }
        for c in codecs {
            hilore_kernels::codec_by_name(c)?;
        }
        let costs_at_profile: Vec<f64> = instances.iter().map(|u| u.cost).collect();
        let mut unit_cost: HashMap<&str, (f64, usize)> = HashMap::new();
        for (b, &c) in bytes.iter().zip(&costs_at_profile) {
            let e = unit_cost.entry(b.unit).or_default();
            e.0 += c;
            e.1 += 1;
        }
        let recompute_share = bytes
            .iter()
            .zip(&costs_at_profile)
            .map(|(b, &c)| {
                let (sum, n) = unit_cost[b.unit];
                let share = c * n as f64 / sum;
                if share.is_finite() && share >= 0.0 {
                    share
                } else {
                    1.0
                }
            })
            .collect();
        let mut a = Allocator {
            profile,
            costs_at_profile,
            recompute_share,
            instances: bytes,
            descs,
            layout,
            state,
            costs: CostModel::default(),
            risk: RiskModel::default(),
            solver: Solver::default(),
            reference: HashMap::new(),
            reference_eof: 0,
            marginal: HashMap::new(),
            opened_base: HashMap::new(),
        };
        a.probe(codecs)?;
        Ok(a)
    }

    /// The fixed state bytes.
    pub fn state(&self) -> StateBytes {
        self.state
    }

    /// The profile.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Byte figures of every instance.
    pub fn instances(&self) -> &[InstanceBytes] {
        &self.instances
    }

    /// The cost-expression value of instance `i` in the profiled pass.
    pub fn cost_at_profile(&self, i: usize) -> f64 {
        self.costs_at_profile[i]
    }

    /// The descriptor of instance `i`.
    pub fn descriptor(&self, i: usize) -> &'static UnitDescriptor {
        self.descs[i]
    }

    /// Top-level instances and their direct children (instance indices).
    pub fn groups(&self) -> Vec<(usize, Vec<usize>)> {
        self.layout
            .iter()
            .map(|l| (l.top, l.children.clone()))
            .collect()
    }

    fn act_values(&self, i: usize) -> usize {
        self.instances[i].own_act_elems.iter().sum()
    }

    /// The fidelities instance `i` can take under `offer`.
    pub fn candidates(&self, i: usize, offer: &Offer) -> Vec<Fidelity> {
        let d = self.descs[i];
        let mut v = vec![Fidelity::Store];
        if self.act_values(i) > 0 {
            for c in &offer.codecs {
                let f = Fidelity::Compress(c);
                if d.offers(f) {
                    v.push(f);
                }
            }
        }
        if offer.recompute && d.offers(Fidelity::Recompute) {
            v.push(Fidelity::Recompute);
        }
        v
    }

    /// A full plan from per-instance fidelities (every instance set explicitly).
    pub fn plan_of(&self, name: &str, assign: &HashMap<usize, Fidelity>) -> Plan {
        let mut plan = Plan::store_all().named(name);
        for (i, b) in self.instances.iter().enumerate() {
            let f = assign.get(&i).copied().unwrap_or(Fidelity::Store);
            plan.set_instance(b.unit, b.call, f);
        }
        plan
    }

    /// Predicted seconds of one exact simulation of this allocator's profile (0 before
    /// calibration has measured it): what each step of the planner's exact searches
    /// costs the step it plans.
    pub fn simulation_seconds(&self) -> f64 {
        self.costs
            .simulation_seconds_per_event
            .map_or(0.0, |s| s * self.profile.num_events() as f64)
    }

    /// The exact ledger peak of a plan.
    pub fn simulate_peak(&self, plan: &Plan) -> Result<usize> {
        Ok(self.profile.simulate(plan)?.peak_bytes)
    }

    /// The ledger bytes available to activations under a total budget.
    pub fn activation_budget(&self, total_budget: usize) -> Option<usize> {
        total_budget.checked_sub(self.state.total())
    }
}

/// The smallest `r` with `r * r >= x` (x >= 0, finite): the step keeps squared risks, so
/// a risk figure reported to a caller must square back to at least the squared risk, or
/// asking for exactly that figure would fail by a rounding.
fn sqrt_at_least(x: f64) -> f64 {
    let mut r = x.sqrt();
    while r.is_finite() && r * r < x {
        r = f64::from_bits(r.to_bits() + 1);
    }
    r
}
