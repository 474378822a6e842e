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
//! - time of a choice: measured recompute time of the instance, or encode + decode time
//!   of its activation values; Store costs nothing;
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
//! ([`Allocator::selective_candidates`]: the last `k` groups with children opened, each
//! recomputing its `j` children cheapest to recompute per saved byte and storing the
//! rest, the other groups recomputed whole), checked with the simulator, and takes one
//! for a microbatch when it fits and is faster than the DP's fastest plan at the capacity
//! found. Such a plan carries no risk, so it is never worse than the DP's under the risk
//! budget either.
//!
//! Last, an exact local search ([`Allocator`]'s `refine`) starts from each microbatch's
//! plan and applies, one at a time, the change of one group (another whole choice, opening
//! it, or one child's fidelity) that saves the most predicted time among those whose exact
//! peak still fits and whose risk stays within what the step's risk budget leaves. The
//! capacity bisection lands where the DP's plan fits, which can be well below the
//! capacity the additive model offers and leaves part of the budget unused per
//! microbatch; the search spends it. It is bounded to 32 new simulations per microbatch
//! (most changes it takes come early), a change whose plan did not fit is not simulated
//! again in the same search, and simulated peaks are shared between the microbatches of
//! a step (keyed by every instance's fidelity; the simulator takes those directly,
//! without a [`Plan`]), so it stays a small part of the solve time.
//!
//! The search only moves one group at a time, so it cannot leave the shape of the plan it
//! starts from. Where the budget is tight the knapsack's plan can be of a slow shape (a
//! few instances compressed and many recomputed, where a greedy by cost per byte finds a
//! faster plan with most instances compressed). So the search also starts from the
//! greedy's plans: from every instance stored, the change of one group that adds the least
//! `seconds + lambda * risk` per byte saved, with the step's multiplier `lambda` and with
//! none (the Adacc-style order), within the risk the step leaves the microbatch, until the
//! exact peak fits (bisected along the greedy's path, a few simulations); the fastest of
//! the searched plans is kept. For one microbatch the planner's plan is therefore never
//! slower, by its own cost model, than the greedy's with the same exposure and risk
//! budget.
//!
//! The capacities are searched for the DP's fastest plans, ignoring the risk. When no DP
//! plan within them meets the risk budget (a tight budget, compression that costs next to
//! nothing), every microbatch starts instead from its exact Store / Recompute plan (which
//! carries no risk) and the searches add what compression the risk budget allows; only
//! when no exact plan fits either is the risk budget reported infeasible.

use super::budget::StateBytes;
use super::costs::{CostModel, MicrobatchShape};
use super::risk::RiskModel;
use super::solver::{Choice, Group, Infeasible, Opened, Pick, Problem, Selection, Solver};
use crate::simulate::{InstanceBytes, Profile};
use crate::unit::UnitDescriptor;
use crate::{Error, Fidelity, Plan, Result, UnitInstanceInfo};
use serde::Serialize;
use std::collections::HashMap;
use std::time::Instant;

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
    /// Fidelity counts: (fidelity, instances).
    pub counts: Vec<(String, usize)>,
}

/// Exact peaks already simulated, by every instance's fidelity (byte figures do not depend
/// on the microbatch, so a step's microbatches share them).
type Peaks = HashMap<Vec<Fidelity>, usize, foldhash::fast::RandomState>;

/// What [`Allocator::plan_step`]'s exact checks and searches of one microbatch depend on
/// (the `to_bits` of its exposure and of the squared risk the other microbatches leave,
/// 0 for the latter without exposure).
#[derive(PartialEq)]
struct Replan {
    shape: MicrobatchShape,
    capacity: i64,
    exposure: u64,
    room: u64,
    picks: Vec<Pick>,
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
        let mut a = Allocator {
            profile,
            costs_at_profile: instances.iter().map(|u| u.cost).collect(),
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

    /// The exact ledger peak of a plan.
    pub fn simulate_peak(&self, plan: &Plan) -> Result<usize> {
        Ok(self.profile.simulate(plan)?.peak_bytes)
    }

    fn eof(&self, assign: &HashMap<usize, Fidelity>) -> Result<i64> {
        Ok(self
            .profile
            .simulate(&self.plan_of("probe", assign))?
            .end_of_forward_bytes as i64)
    }

    /// Measures the marginal bytes of every choice by exact simulation.
    fn probe(&mut self, codecs: &[&'static str]) -> Result<()> {
        let all = Offer {
            codecs: codecs.to_vec(),
            recompute: true,
            open_groups: true,
        };
        // Reference: every top-level group recomputed where it can be, stored otherwise.
        let mut reference = HashMap::new();
        for l in &self.layout {
            let f = if self.descs[l.top].offers(Fidelity::Recompute) {
                Fidelity::Recompute
            } else {
                Fidelity::Store
            };
            reference.insert(l.top, f);
        }
        let ref_eof = self.eof(&reference)?;
        let layout = self.layout.clone();
        for l in &layout {
            if l.children.is_empty() {
                for f in self.candidates(l.top, &all) {
                    let mut a = reference.clone();
                    a.insert(l.top, f);
                    let m = self.eof(&a)? - ref_eof;
                    self.marginal.insert((l.top, f), m);
                }
                continue;
            }
            if self.descs[l.top].offers(Fidelity::Recompute) {
                let mut a = reference.clone();
                a.insert(l.top, Fidelity::Recompute);
                let m = self.eof(&a)? - ref_eof;
                self.marginal.insert((l.top, Fidelity::Recompute), m);
            }
            let mut open = reference.clone();
            open.insert(l.top, Fidelity::Store);
            let open_eof = self.eof(&open)?;
            self.opened_base.insert(l.top, open_eof - ref_eof);
            for &c in &l.children {
                for f in self.candidates(c, &all) {
                    if f == Fidelity::Store {
                        self.marginal.insert((c, f), 0);
                        continue;
                    }
                    let mut a = open.clone();
                    a.insert(c, f);
                    let m = self.eof(&a)? - open_eof;
                    self.marginal.insert((c, f), m);
                }
            }
        }
        self.reference = reference;
        self.reference_eof = ref_eof;
        Ok(())
    }

    fn seconds(&self, i: usize, f: Fidelity, shape: MicrobatchShape) -> Option<f64> {
        match f {
            Fidelity::Store => Some(0.0),
            Fidelity::Compress(c) => self.costs.codec_seconds(c, self.act_values(i)),
            Fidelity::Recompute => self.costs.recompute_seconds(
                self.instances[i].unit,
                shape,
                Some(self.costs_at_profile[i]),
            ),
        }
    }

    fn choice(
        &self,
        i: usize,
        f: Fidelity,
        mb: &MicrobatchInput,
        exposure_for_risk: f64,
    ) -> Option<Choice> {
        let b = &self.instances[i];
        let seconds = self.seconds(i, f, mb.shape)?;
        // The knapsack adds squared risks: independent errors add in quadrature.
        let risk = match f {
            Fidelity::Compress(c) => self
                .risk
                .risk(b.unit, b.call, c, exposure_for_risk)?
                .powi(2),
            _ => 0.0,
        };
        let bytes = *self.marginal.get(&(i, f))?;
        Some(Choice::one(b.unit, b.call, f, seconds, risk, bytes))
    }

    /// The knapsack for one microbatch. `exposure_for_risk` is the exposure the risk is
    /// computed with (the microbatch's own for HiLoRe; an assumed one for exposure-blind
    /// strategies).
    pub fn problem(
        &self,
        mb: &MicrobatchInput,
        exposure_for_risk: f64,
        offer: &Offer,
        capacity: i64,
        risk_budget: f64,
    ) -> Result<Problem> {
        let mut groups = Vec::with_capacity(self.layout.len());
        for l in &self.layout {
            let b = &self.instances[l.top];
            let name = format!("{}#{}", b.unit, b.call);
            let mut whole = Vec::new();
            let mut opened = None;
            if l.children.is_empty() {
                for f in self.candidates(l.top, offer) {
                    if let Some(c) = self.choice(l.top, f, mb, exposure_for_risk) {
                        whole.push(c);
                    }
                }
            } else {
                if offer.recompute && self.descs[l.top].offers(Fidelity::Recompute) {
                    if let Some(mut c) = self.choice(l.top, Fidelity::Recompute, mb, 0.0) {
                        // Children stored inside the recomputed group.
                        for &ch in &l.children {
                            let cb = &self.instances[ch];
                            c.fidelities
                                .push((cb.unit.to_string(), cb.call, Fidelity::Store));
                        }
                        whole.push(c);
                    }
                }
                let base = Choice::one(
                    b.unit,
                    b.call,
                    Fidelity::Store,
                    0.0,
                    0.0,
                    self.opened_base[&l.top],
                );
                let child_offer = if offer.open_groups {
                    offer.clone()
                } else {
                    Offer {
                        codecs: Vec::new(),
                        recompute: false,
                        open_groups: false,
                    }
                };
                let mut parts = Vec::with_capacity(l.children.len());
                for &ch in &l.children {
                    let cs: Vec<Choice> = self
                        .candidates(ch, &child_offer)
                        .into_iter()
                        .filter_map(|f| self.choice(ch, f, mb, exposure_for_risk))
                        .collect();
                    parts.push(cs);
                }
                opened = Some(Opened { base, parts });
            }
            groups.push(Group {
                name,
                whole,
                opened,
            });
        }
        let problem = Problem {
            groups,
            capacity,
            risk_budget,
        };
        for g in &problem.groups {
            let ok = !g.whole.is_empty()
                || g.opened
                    .as_ref()
                    .is_some_and(|o| o.parts.iter().all(|p| !p.is_empty()));
            if !ok {
                return Err(Error::Tape(format!(
                    "allocator: group `{}` has no choice with a known time; measure its recompute time or set a cost prior",
                    g.name
                )));
            }
        }
        Ok(problem)
    }

    /// Every instance's fidelity under a selection (`[i]` for instance `i`; Store where
    /// the selection sets nothing). A problem lists its groups' choices in layout order,
    /// each group's instance first and then its children, so the selection's fidelities
    /// fall on the layout's instances in that order.
    fn fids_of(&self, problem: &Problem, picks: &[Pick]) -> Vec<Fidelity> {
        let mut fids = vec![Fidelity::Store; self.instances.len()];
        let order = self
            .layout
            .iter()
            .flat_map(|l| std::iter::once(l.top).chain(l.children.iter().copied()));
        let mut chosen = problem
            .chosen(picks)
            .flat_map(|c| c.fidelities.iter().map(|f| f.2));
        for i in order {
            match chosen.next() {
                Some(f) => fids[i] = f,
                None => debug_assert!(false, "a selection sets fewer fidelities than the layout"),
            }
        }
        debug_assert!(
            chosen.next().is_none(),
            "a selection sets more fidelities than the layout"
        );
        fids
    }

    /// The exact ledger peak of a selection.
    fn peak_of(&self, problem: &Problem, picks: &[Pick]) -> Result<usize> {
        Ok(self
            .profile
            .simulate_fidelities(&self.fids_of(problem, picks))?
            .peak_bytes)
    }

    fn plan_of_selection(&self, name: &str, problem: &Problem, picks: &[Pick]) -> Plan {
        let mut plan = Plan::store_all().named(name);
        for b in &self.instances {
            plan.set_instance(b.unit, b.call, Fidelity::Store);
        }
        for (u, c, f) in problem.fidelities(picks) {
            plan.set_instance(&u, c, f);
        }
        plan
    }

    /// A decision that is a given plan (no solve): its exact peak, no risk model.
    pub fn fixed_decision(&self, plan: Plan) -> Result<Decision> {
        let peak = self.simulate_peak(&plan)?;
        Ok(Decision {
            plan,
            predicted_peak_bytes: peak,
            predicted_total_bytes: peak + self.state.total(),
            predicted_seconds: 0.0,
            predicted_recompute_seconds: 0.0,
            predicted_codec_seconds: 0.0,
            predicted_risk: 0.0,
            lambda: 0.0,
            solve_seconds: 0.0,
            exact_checks: 1,
            counts: Vec::new(),
        })
    }

    /// Exact fallback assignments, fastest first: every group with children recomputed
    /// (the rest stored), then the same with their children recomputed as well.
    fn fallbacks(&self, offer: &Offer) -> Vec<HashMap<usize, Fidelity>> {
        let mut gc = HashMap::new();
        for l in &self.layout {
            if !l.children.is_empty()
                && offer.recompute
                && self.descs[l.top].offers(Fidelity::Recompute)
            {
                gc.insert(l.top, Fidelity::Recompute);
            }
        }
        let mut deep = gc.clone();
        for l in &self.layout {
            if gc.contains_key(&l.top) {
                for &c in &l.children {
                    if self.descs[c].offers(Fidelity::Recompute) {
                        deep.insert(c, Fidelity::Recompute);
                    }
                }
            }
        }
        vec![gc, deep, self.reference.clone()]
    }

    /// Exact plans shaped like Megatron-style selective recompute (see the module docs):
    /// for `k` in `1..=G` (`G` groups with children that may be recomputed), the last `k`
    /// opened and each recomputing its `j` children (for `j` in `0..=n`) that are
    /// cheapest to recompute per byte they save at `shape`, the other groups recomputed
    /// whole. Empty when the offer allows no recompute or no opened groups.
    pub fn selective_candidates(
        &self,
        offer: &Offer,
        shape: MicrobatchShape,
    ) -> Vec<HashMap<usize, Fidelity>> {
        if !offer.recompute || !offer.open_groups {
            return Vec::new();
        }
        let groups: Vec<&Layout> = self
            .layout
            .iter()
            .filter(|l| !l.children.is_empty() && self.descs[l.top].offers(Fidelity::Recompute))
            .collect();
        let ranked: Vec<Vec<usize>> = groups
            .iter()
            .map(|l| {
                let mut ch: Vec<(f64, usize)> = l
                    .children
                    .iter()
                    .filter(|&&c| self.descs[c].offers(Fidelity::Recompute))
                    .filter_map(|&c| {
                        let secs = self.seconds(c, Fidelity::Recompute, shape)?;
                        Some((secs / self.instances[c].own_saved_bytes.max(1) as f64, c))
                    })
                    .collect();
                ch.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                ch.into_iter().map(|(_, c)| c).collect()
            })
            .collect();
        let mut out = Vec::new();
        for k in 1..=groups.len() {
            let split = groups.len() - k;
            let n = ranked[split..].iter().map(Vec::len).max().unwrap_or(0);
            for j in 0..=n {
                let mut a = HashMap::new();
                for l in &groups[..split] {
                    a.insert(l.top, Fidelity::Recompute);
                }
                for r in &ranked[split..] {
                    for &c in r.iter().take(j) {
                        a.insert(c, Fidelity::Recompute);
                    }
                }
                out.push(a);
            }
        }
        out
    }

    /// An exact plan (`assign`: instance -> fidelity, Store where absent) as picks in
    /// `p` (a problem from [`Allocator::problem`]), when `p` offers every fidelity it sets.
    fn picks_of(&self, p: &Problem, assign: &HashMap<usize, Fidelity>) -> Option<Vec<Pick>> {
        let find = |cs: &[Choice], f: Fidelity| cs.iter().position(|c| c.fidelities[0].2 == f);
        let get = |i: usize| assign.get(&i).copied().unwrap_or(Fidelity::Store);
        self.layout
            .iter()
            .zip(&p.groups)
            .map(|(l, g)| {
                if l.children.is_empty() || get(l.top) == Fidelity::Recompute {
                    return find(&g.whole, get(l.top)).map(Pick::Whole);
                }
                let o = g.opened.as_ref()?;
                let ks: Option<Vec<usize>> = l
                    .children
                    .iter()
                    .zip(&o.parts)
                    .map(|(&ch, part)| find(part, get(ch)))
                    .collect();
                ks.map(Pick::Opened)
            })
            .collect()
    }

    /// A plan as an assignment: every instance's fidelity under it (Store ones left out).
    fn assignment_of(&self, plan: &Plan) -> HashMap<usize, Fidelity> {
        self.instances
            .iter()
            .enumerate()
            .map(|(i, b)| (i, plan.fidelity_for(self.descs[i], b.call)))
            .filter(|(_, f)| *f != Fidelity::Store)
            .collect()
    }

    /// Predicted seconds of an exact plan (`assign`: instance -> fidelity, Store where
    /// absent) on a microbatch of `shape`.
    fn assignment_seconds(&self, assign: &HashMap<usize, Fidelity>, shape: MicrobatchShape) -> f64 {
        assign
            .iter()
            .map(|(&i, &f)| self.seconds(i, f, shape).unwrap_or(f64::INFINITY))
            .sum()
    }

    /// A knapsack with one choice per group: exactly `assign`.
    fn fixed_problem(
        &self,
        mb: &MicrobatchInput,
        exposure: f64,
        assign: &HashMap<usize, Fidelity>,
    ) -> Result<Problem> {
        let mut groups = Vec::with_capacity(self.layout.len());
        for l in &self.layout {
            let mut c = Choice {
                fidelities: Vec::new(),
                seconds: 0.0,
                risk: 0.0,
                bytes: 0,
            };
            for &i in std::iter::once(&l.top).chain(&l.children) {
                let f = assign.get(&i).copied().unwrap_or(Fidelity::Store);
                let b = &self.instances[i];
                c.fidelities.push((b.unit.to_string(), b.call, f));
                c.seconds += self.seconds(i, f, mb.shape).unwrap_or(0.0);
                if let Fidelity::Compress(k) = f {
                    c.risk += self
                        .risk
                        .risk(b.unit, b.call, k, exposure)
                        .unwrap_or(0.0)
                        .powi(2);
                }
            }
            let b = &self.instances[l.top];
            groups.push(Group {
                name: format!("{}#{}", b.unit, b.call),
                whole: vec![c],
                opened: None,
            });
        }
        Ok(Problem {
            groups,
            capacity: 0,
            risk_budget: f64::INFINITY,
        })
    }

    /// The ledger bytes available to activations under a total budget.
    pub fn activation_budget(&self, total_budget: usize) -> Option<usize> {
        total_budget.checked_sub(self.state.total())
    }

    /// The smallest ledger peak among the least-memory plans the allocator can build
    /// (every group recomputed, with and without its children recomputed too, and with
    /// every compressible instance at each codec), and that plan.
    pub fn least_memory(&self, offer: &Offer) -> Result<(usize, Plan)> {
        let mut cands: Vec<HashMap<usize, Fidelity>> = vec![self.reference.clone()];
        let mut deep = self.reference.clone();
        for l in &self.layout {
            if deep.get(&l.top) == Some(&Fidelity::Recompute) {
                for &c in &l.children {
                    if offer.recompute && self.descs[c].offers(Fidelity::Recompute) {
                        deep.insert(c, Fidelity::Recompute);
                    }
                }
            }
        }
        cands.push(deep.clone());
        for codec in &offer.codecs {
            for base in [&self.reference, &deep] {
                let mut a = base.clone();
                for (i, _) in self.instances.iter().enumerate() {
                    let f = Fidelity::Compress(codec);
                    if self.act_values(i) > 0
                        && self.descs[i].offers(f)
                        && a.get(&i) != Some(&Fidelity::Recompute)
                    {
                        a.insert(i, f);
                    }
                }
                cands.push(a);
            }
        }
        let mut best: Option<(usize, Plan)> = None;
        for a in cands {
            let plan = self.plan_of("least-memory", &a);
            let p = self.simulate_peak(&plan)?;
            if best.as_ref().is_none_or(|(b, _)| p < *b) {
                best = Some((p, plan));
            }
        }
        best.ok_or_else(|| Error::Tape("allocator: no unit instances".into()))
    }

    fn infeasible_memory(&self, total_budget: usize, offer: &Offer) -> Error {
        match self.least_memory(offer) {
            Ok((p, _)) => Error::InfeasibleMemory {
                budget_bytes: total_budget,
                fixed_bytes: self.state.total(),
                param_bytes: self.state.params,
                grad_bytes: self.state.grads,
                optimizer_bytes: self.state.optimizer,
                least_activation_bytes: p,
                smallest_feasible_bytes: self.state.total() + p,
            },
            Err(e) => e,
        }
    }

    /// Plans one microbatch for the fastest predicted step under `total_budget` (the whole
    /// actor-update peak) and `risk_budget`, with the risk computed from the microbatch's
    /// own exposure.
    pub fn plan(
        &self,
        mb: &MicrobatchInput,
        total_budget: usize,
        risk_budget: f64,
        offer: &Offer,
    ) -> Result<Decision> {
        Ok(self
            .plan_step(
                std::slice::from_ref(mb),
                total_budget,
                risk_budget,
                offer,
                None,
            )?
            .remove(0))
    }

    /// Plans every microbatch of a step under one shared risk budget (one Lagrange
    /// multiplier for the whole step, so risk goes where it buys the most time: to the
    /// microbatches with little exposure). `assumed_exposure`, when given, replaces every
    /// microbatch's exposure in the risk (an exposure-blind planner).
    pub fn plan_step(
        &self,
        mbs: &[MicrobatchInput],
        total_budget: usize,
        risk_budget: f64,
        offer: &Offer,
        assumed_exposure: Option<f64>,
    ) -> Result<Vec<Decision>> {
        let t0 = Instant::now();
        let avail = self
            .activation_budget(total_budget)
            .ok_or_else(|| self.infeasible_memory(total_budget, offer))? as i64;
        let mut checks = 0usize;
        // 1. Per microbatch, the DP capacity whose memory-first plan fits exactly.
        let hi0 = avail - self.reference_eof;
        let mut last_cap: Option<i64> = None;
        let mut problems = Vec::with_capacity(mbs.len());
        // Every microbatch's full problem (the greedy start of step 5 works in it).
        let mut fulls: Vec<Problem> = Vec::with_capacity(mbs.len());
        // For a microbatch given an exact selective-shaped plan: the plan as picks in its
        // full problem, where the exact local search (step 4) starts.
        let mut seeds: Vec<Option<Vec<Pick>>> = Vec::with_capacity(mbs.len());
        // Selective-recompute-shaped exact plans and whether each fits (byte figures do
        // not depend on the microbatch, so each is simulated at most once per step).
        let selective = mbs
            .first()
            .map(|mb| self.selective_candidates(offer, mb.shape))
            .unwrap_or_default();
        let mut selective_fits: Vec<Option<bool>> = vec![None; selective.len()];
        for mb in mbs {
            let e = assumed_exposure.unwrap_or(mb.exposure);
            let mut p = self.problem(mb, e, offer, hi0, f64::INFINITY)?;
            let min = p.min_bytes();
            if min > hi0 {
                return Err(self.infeasible_memory(total_budget, offer));
            }
            let fits = |p: &Problem, checks: &mut usize| -> Result<Option<Selection>> {
                match self.solver.solve(p) {
                    Ok(s) => {
                        *checks += 1;
                        Ok((self.peak_of(p, &s.picks)? as i64 <= avail).then_some(s))
                    }
                    Err(Infeasible::Memory { .. }) => Ok(None),
                    Err(e) => Err(Error::Tape(e.to_string())),
                }
            };
            // Microbatches of one size share their byte figures, so the capacity found
            // for the previous one is tried before bisecting again.
            // The DP's fastest selection at the capacity chosen (kept for the selective
            // candidates below).
            let mut at_cap: Option<Selection> = fits(&p, &mut checks)?;
            let cap = if at_cap.is_some() {
                hi0
            } else if let Some(c) = last_cap.filter(|&c| {
                p.capacity = c;
                at_cap = fits(&p, &mut checks).ok().flatten();
                at_cap.is_some()
            }) {
                c
            } else {
                let (mut lo, mut hi) = (min, hi0);
                p.capacity = lo;
                at_cap = fits(&p, &mut checks)?;
                if at_cap.is_none() {
                    // The additive model's least-bytes selection does not fit (exact
                    // peaks are not monotone in it: recomputing the last units saves
                    // bytes but not peak). Fall back to the first exact plan that fits
                    // among full recompute of the groups with children, and the same
                    // with their children recomputed too.
                    let mut found = None;
                    for a in self.fallbacks(offer) {
                        let plan = self.plan_of("fallback", &a);
                        checks += 1;
                        if self.simulate_peak(&plan)? as i64 <= avail {
                            found = Some(self.fixed_problem(mb, e, &a)?);
                            break;
                        }
                    }
                    match found {
                        Some(fp) => {
                            problems.push(fp);
                            fulls.push(p);
                            seeds.push(None);
                            continue;
                        }
                        None => return Err(self.infeasible_memory(total_budget, offer)),
                    }
                }
                while hi - lo > ((hi0 - min) / 512).max(1) {
                    let mid = lo + (hi - lo) / 2;
                    p.capacity = mid;
                    if let Some(s) = fits(&p, &mut checks)? {
                        lo = mid;
                        at_cap = Some(s);
                    } else {
                        hi = mid;
                    }
                }
                lo
            };
            last_cap = Some(cap);
            p.capacity = cap;
            // An exact selective-shaped plan faster than the DP's fastest at this capacity
            // (its additive bytes may exceed the capacity while its exact peak fits).
            if let Some(dp) = at_cap.filter(|_| !selective.is_empty()) {
                let mut faster: Vec<(f64, usize)> = selective
                    .iter()
                    .enumerate()
                    .map(|(i, a)| (self.assignment_seconds(a, mb.shape), i))
                    .filter(|(t, _)| *t < dp.seconds)
                    .collect();
                faster.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                let mut taken = None;
                for (_, i) in faster {
                    let fits = match selective_fits[i] {
                        Some(f) => f,
                        None => {
                            checks += 1;
                            let plan = self.plan_of("selective", &selective[i]);
                            let f = self.simulate_peak(&plan)? as i64 <= avail;
                            selective_fits[i] = Some(f);
                            f
                        }
                    };
                    if fits {
                        taken = Some(i);
                        break;
                    }
                }
                if let Some(i) = taken {
                    problems.push(self.fixed_problem(mb, e, &selective[i])?);
                    seeds.push(self.picks_of(&p, &selective[i]));
                    fulls.push(p);
                    continue;
                }
            }
            problems.push(p.clone());
            fulls.push(p);
            seeds.push(None);
        }
        // 2. Risks add in quadrature (errors of different units and microbatches are
        // independent): the choices carry squared risks, and the step keeps their sum
        // within `B^2`. Every microbatch's time-risk frontier comes from the Lagrangian
        // (one frontier per byte shape, its picks evaluated on each member's own times
        // and risks); one multiplier for the step then picks a frontier point per
        // microbatch.
        let b2 = if risk_budget.is_finite() {
            risk_budget.max(0.0).powi(2)
        } else {
            f64::INFINITY
        };
        let infeasible = |e: Infeasible| match e {
            Infeasible::Risk { min_risk, budget } => Error::InfeasibleRisk {
                budget: budget.sqrt(),
                least_risk: sqrt_at_least(min_risk),
            },
            e => Error::Tape(e.to_string()),
        };
        let step = match self.solver.solve_step(&problems, b2) {
            Ok(step) => step,
            Err(e @ Infeasible::Risk { .. }) if !offer.codecs.is_empty() => {
                // The capacities were searched for the DP's fastest plans; where those
                // carry too much risk, a plan with less may still fit exactly (e.g. full
                // recompute at its own peak) that the additive model does not show. Start
                // every microbatch from the exact (Store / Recompute) plan, which carries
                // none; the searches of steps 4 and 5 then add compression within the
                // risk budget.
                let exact = Offer {
                    codecs: Vec::new(),
                    ..offer.clone()
                };
                let Ok(plans) = self.plan_step(mbs, total_budget, f64::INFINITY, &exact, None)
                else {
                    return Err(infeasible(e));
                };
                for (k, d) in plans.iter().enumerate() {
                    let assign = self.assignment_of(&d.plan);
                    let e = assumed_exposure.unwrap_or(mbs[k].exposure);
                    problems[k] = self.fixed_problem(&mbs[k], e, &assign)?;
                    seeds[k] = self.picks_of(&fulls[k], &assign);
                    checks += d.exact_checks;
                }
                self.solver.solve_step(&problems, b2).map_err(infeasible)?
            }
            Err(e) => return Err(infeasible(e)),
        };
        checks += step.solves;
        let sel = step.selections;
        // 3. Exact check of every plan (the capacity was searched without the risk
        // term; a different selection may have another transient).
        let mut out: Vec<Decision> = Vec::with_capacity(mbs.len());
        let mut risks: Vec<f64> = sel.iter().map(|s| s.risk).collect();
        // Exact peaks by plan (byte figures do not depend on the microbatch).
        let mut peaks = Peaks::default();
        // Steps 3-5 are a function of the microbatch's shape, exposure and capacity, its
        // selection and seed, and the risk the others leave it. Microbatches that agree on all of
        // these (those without exposure, whose choices carry no risk, need not agree on
        // the last) take the plan found for the first of them.
        let mut planned: Vec<(Replan, usize)> = Vec::new();
        for (k, ((p, mut s), seed)) in problems.iter().zip(sel).zip(seeds).enumerate() {
            let e = assumed_exposure.unwrap_or(mbs[k].exposure);
            let key = Replan {
                shape: mbs[k].shape,
                capacity: p.capacity,
                exposure: e.to_bits(),
                room: if e == 0.0 {
                    0
                } else {
                    (b2 - others_risk(&risks, k)).to_bits()
                },
                picks: s.picks.clone(),
                seed: seed.clone(),
            };
            if let Some(&(_, j)) = planned.iter().find(|(r, _)| *r == key) {
                let d: Decision = out[j].clone();
                risks[k] = risks[j];
                out.push(d);
                continue;
            }
            planned.push((key, k));
            let full = &fulls[k];
            let mut peak = self.peak_of(p, &s.picks)?;
            checks += 1;
            let mut q = p.clone();
            let mut tries = 0;
            while peak as i64 > avail {
                // Shrink this microbatch's capacity by the overshoot and re-solve it within
                // the risk the other microbatches leave.
                tries += 1;
                q.capacity -= (peak as i64 - avail).max(1);
                if tries > 32 || q.capacity < q.min_bytes() {
                    // Exact fallbacks (no risk), fastest first.
                    let mut found = None;
                    for a in self.fallbacks(offer) {
                        let fplan = self.plan_of("fallback", &a);
                        checks += 1;
                        let fpeak = self.simulate_peak(&fplan)?;
                        if fpeak as i64 <= avail {
                            found = Some((self.fixed_problem(&mbs[k], 0.0, &a)?, fpeak));
                            break;
                        }
                    }
                    let Some((fq, fpeak)) = found else {
                        return Err(self.infeasible_memory(total_budget, offer));
                    };
                    q = fq;
                    s = self
                        .solver
                        .solve(&q)
                        .map_err(|e| Error::Tape(e.to_string()))?;
                    risks[k] = s.risk;
                    peak = fpeak;
                    break;
                }
                q.risk_budget = (b2 - others_risk(&risks, k)).max(0.0);
                // The step's multiplier first (one DP table); where its selection takes
                // more risk than is left, the least multiplier that meets it.
                s = match self.solver.solve_at(&q, step.lambda) {
                    Ok(at) if at.risk <= q.risk_budget => at,
                    _ => self.solver.solve_near(&q, step.lambda).map_err(|e| {
                        Error::Tape(format!(
                            "no plan fits the memory budget of {total_budget} bytes within the risk budget: {e}"
                        ))
                    })?,
                };
                risks[k] = s.risk;
                peak = self.peak_of(&q, &s.picks)?;
                checks += 1;
            }
            // 4. Exact local search: the additive byte model is only a proxy for the
            // exact peak (and the DP rounds bytes up), so the plan usually leaves memory
            // unused. Take time-saving changes while the exact peak and the step's risk
            // budget allow.
            let risk_cap = if b2.is_finite() {
                (b2 - others_risk(&risks, k)).max(risks[k])
            } else {
                f64::INFINITY
            };
            if let Some(picks) = seed.filter(|_| tries == 0) {
                // The fixed plan fitted as it was: search from it in the full problem.
                s = full.selection(picks, s.lambda);
                q = full.clone();
            }
            let refined = self.refine(&q, &s.picks, avail, risk_cap, &mut peaks, &mut checks)?;
            if let Some((picks, rpeak)) = refined {
                s = q.selection(picks, s.lambda);
                risks[k] = s.risk;
                peak = rpeak;
            }
            // 5. Other starts: the greedy by time per byte saved (with the step's risk
            // multiplier on the risk, and without it: the Adacc-style order, within the
            // same risk), walked down from every instance stored until the exact peak
            // fits, then searched the same way. They reach plans of another shape than the
            // knapsack's (many instances compressed where the budget is tight); the
            // fastest is kept.
            let mut lambdas = vec![step.lambda];
            if step.lambda > 0.0 {
                lambdas.push(0.0);
            }
            for lambda in lambdas {
                let cap = (risk_cap, lambda);
                let Some((gpicks, gpeak)) =
                    self.greedy(full, avail, cap, true, &mut peaks, &mut checks)?
                else {
                    continue;
                };
                let (gpicks, gpeak) = self
                    .refine(full, &gpicks, avail, risk_cap, &mut peaks, &mut checks)?
                    .unwrap_or((gpicks, gpeak));
                let g = full.selection(gpicks, step.lambda);
                if g.seconds < s.seconds - 1e-9 {
                    s = g;
                    q = full.clone();
                    risks[k] = s.risk;
                    peak = gpeak;
                }
            }
            out.push(self.decision("hilore", &q, &s, peak, checks));
        }
        let per = t0.elapsed().as_secs_f64() / mbs.len().max(1) as f64;
        for d in &mut out {
            d.solve_seconds = per;
        }
        Ok(out)
    }

    /// Exact local search from `picks` (whose exact peak fits `avail`): repeatedly apply
    /// the change of one group (another whole choice, opening it, or one part's choice)
    /// that saves the most predicted time among those whose summed squared risk stays
    /// within `risk_cap` and whose exact peak fits. `None` when no change helps. At most
    /// [`REFINE_SIMULATIONS`] new simulations per call; `peaks` caches them by plan.
    fn refine(
        &self,
        p: &Problem,
        picks: &[Pick],
        avail: i64,
        risk_cap: f64,
        peaks: &mut Peaks,
        checks: &mut usize,
    ) -> Result<Option<(Vec<Pick>, usize)>> {
        let mut cur = picks.to_vec();
        let mut found: Option<usize> = None;
        let mut sims = 0;
        // Changes whose plan did not fit: the changes taken mostly add bytes, so they are not
        // simulated again.
        let mut failed: std::collections::HashSet<(usize, Pick)> = Default::default();
        'search: loop {
            let (_, risk, _) = p.totals(&cur);
            let mut moves: Vec<(f64, usize, Pick)> = Vec::new();
            for (g, group) in p.groups.iter().enumerate() {
                let (cs, cr, _) = group.totals(&cur[g]);
                let mut push = |pick: Pick| {
                    let (s, r, _) = group.totals(&pick);
                    if s < cs - 1e-12 && risk - cr + r <= risk_cap {
                        moves.push((s - cs, g, pick));
                    }
                };
                for k in 0..group.whole.len() {
                    if cur[g] != Pick::Whole(k) {
                        push(Pick::Whole(k));
                    }
                }
                if let Some(o) = &group.opened {
                    // From a whole choice, open the group at its least-bytes parts, alone
                    // or with one part changed; from an opened one, change one part.
                    let base: Vec<usize> = match &cur[g] {
                        Pick::Opened(ks) => ks.clone(),
                        Pick::Whole(_) => {
                            let least = o.parts.iter().map(|part| {
                                (0..part.len()).min_by_key(|&k| part[k].bytes).unwrap_or(0)
                            });
                            let ks: Vec<usize> = least.collect();
                            push(Pick::Opened(ks.clone()));
                            ks
                        }
                    };
                    for (pi, part) in o.parts.iter().enumerate() {
                        for k in (0..part.len()).filter(|&k| k != base[pi]) {
                            let mut ks = base.clone();
                            ks[pi] = k;
                            push(Pick::Opened(ks));
                        }
                    }
                }
            }
            moves.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for (_, g, pick) in moves {
                if failed.contains(&(g, pick.clone())) {
                    continue;
                }
                let mut trial = cur.clone();
                trial[g] = pick.clone();
                let key = self.fids_of(p, &trial);
                let peak = match peaks.get(&key) {
                    Some(&pk) => pk,
                    None => {
                        if sims >= REFINE_SIMULATIONS {
                            break 'search;
                        }
                        sims += 1;
                        *checks += 1;
                        let pk = self.profile.simulate_fidelities(&key)?.peak_bytes;
                        peaks.insert(key, pk);
                        pk
                    }
                };
                if peak as i64 <= avail {
                    cur = trial;
                    found = Some(peak);
                    continue 'search;
                }
                failed.insert((g, pick));
            }
            break;
        }
        Ok(found.map(|peak| (cur, peak)))
    }

    /// Greedy by cost per byte (the Adacc-style baseline): starting from every instance
    /// stored, repeatedly take the change that adds the least predicted time per byte
    /// saved, among changes whose risk (with `assumed_exposure`) keeps the total under
    /// `risk_budget`, until the exact peak fits.
    pub fn plan_greedy(
        &self,
        mb: &MicrobatchInput,
        total_budget: usize,
        risk_budget: f64,
        offer: &Offer,
        assumed_exposure: f64,
    ) -> Result<Decision> {
        let t0 = Instant::now();
        let avail = self
            .activation_budget(total_budget)
            .ok_or_else(|| self.infeasible_memory(total_budget, offer))?;
        // Risks in the knapsack are squared (they add in quadrature).
        let risk_budget = risk_budget * risk_budget;
        let p = self.problem(mb, assumed_exposure, offer, i64::MAX, risk_budget)?;
        let mut checks = 0;
        let mut peaks = Peaks::default();
        let cap = (risk_budget, 0.0);
        let Some((picks, peak)) =
            self.greedy(&p, avail as i64, cap, false, &mut peaks, &mut checks)?
        else {
            return Err(self.infeasible_memory(total_budget, offer));
        };
        let mut d = self.decision("adacc-style", &p, &p.selection(picks, 0.0), peak, checks);
        d.solve_seconds = t0.elapsed().as_secs_f64();
        Ok(d)
    }

    /// The decision of a selection `s` of `p` whose exact peak is `peak` (solve seconds
    /// left at 0 for the caller).
    fn decision(
        &self,
        name: &str,
        p: &Problem,
        s: &Selection,
        peak: usize,
        checks: usize,
    ) -> Decision {
        let mut counts: HashMap<String, usize> = HashMap::new();
        for (_, _, f) in p.fidelities(&s.picks) {
            *counts.entry(f.to_string()).or_default() += 1;
        }
        let mut counts: Vec<_> = counts.into_iter().collect();
        counts.sort();
        let (rc, codec) = split_seconds(p, &s.picks);
        Decision {
            plan: self.plan_of_selection(name, p, &s.picks),
            predicted_peak_bytes: peak,
            predicted_total_bytes: peak + self.state.total(),
            predicted_seconds: s.seconds,
            predicted_recompute_seconds: rc,
            predicted_codec_seconds: codec,
            predicted_risk: s.risk.sqrt(),
            lambda: s.lambda,
            solve_seconds: 0.0,
            exact_checks: checks,
            counts,
        }
    }

    /// Every instance stored (every group opened where it can be): where the greedy by
    /// cost per byte starts.
    fn store_picks(p: &Problem) -> Vec<Pick> {
        let store_idx = |part: &Vec<Choice>| {
            part.iter()
                .position(|c| c.fidelities[0].2 == Fidelity::Store)
                .unwrap_or(0)
        };
        p.groups
            .iter()
            .map(|g| match &g.opened {
                Some(o) => Pick::Opened(o.parts.iter().map(store_idx).collect()),
                None => Pick::Whole(store_idx(&g.whole)),
            })
            .collect()
    }

    /// The greedy's next change by cost per byte from `picks`: the change of one group
    /// that adds the least `seconds + lambda * risk` per byte saved (additive bytes),
    /// among changes whose summed squared risk stays within `risk_cap`. `None` when no
    /// change saves bytes.
    fn greedy_step(
        p: &Problem,
        picks: &[Pick],
        risk_cap: f64,
        lambda: f64,
    ) -> Option<(usize, Pick)> {
        let (_, risk, _) = p.totals(picks);
        // Best move: (cost per byte saved, group, whole choice or (part, choice)).
        enum Move {
            Whole(usize),
            Part(usize, usize),
        }
        let mut best: Option<(f64, usize, Move)> = None;
        for (g, group) in p.groups.iter().enumerate() {
            let cur = group.totals(&picks[g]);
            let mut consider = |(s, r, b): (f64, f64, i64), m: Move| {
                let saved = cur.2 - b;
                if saved <= 0 || risk - cur.1 + r > risk_cap {
                    return;
                }
                let cost = (s - cur.0) + lambda * (r - cur.1);
                let rate = cost.max(0.0) / saved as f64;
                if best.as_ref().is_none_or(|(br, _, _)| rate < *br) {
                    best = Some((rate, g, m));
                }
            };
            for (k, c) in group.whole.iter().enumerate() {
                consider((c.seconds, c.risk, c.bytes), Move::Whole(k));
            }
            if let (Some(o), Pick::Opened(ks)) = (&group.opened, &picks[g]) {
                // One part changed: the group's totals move by that part's difference.
                for (pi, part) in o.parts.iter().enumerate() {
                    let was = &part[ks[pi]];
                    for (k, c) in part.iter().enumerate().filter(|&(k, _)| k != ks[pi]) {
                        let t = (
                            cur.0 - was.seconds + c.seconds,
                            cur.1 - was.risk + c.risk,
                            cur.2 - was.bytes + c.bytes,
                        );
                        consider(t, Move::Part(pi, k));
                    }
                }
            }
        }
        let (_, g, m) = best?;
        let pick = match (m, &picks[g]) {
            (Move::Whole(k), _) => Pick::Whole(k),
            (Move::Part(pi, k), Pick::Opened(ks)) => {
                let mut ks = ks.clone();
                ks[pi] = k;
                Pick::Opened(ks)
            }
            (Move::Part(..), Pick::Whole(_)) => unreachable!("a part change of an opened pick"),
        };
        Some((g, pick))
    }

    /// The exact peak of `picks`, from `peaks` or simulated (and kept there).
    fn cached_peak(
        &self,
        p: &Problem,
        picks: &[Pick],
        peaks: &mut Peaks,
        checks: &mut usize,
    ) -> Result<usize> {
        let key = self.fids_of(p, picks);
        if let Some(&pk) = peaks.get(&key) {
            return Ok(pk);
        }
        *checks += 1;
        let pk = self.profile.simulate_fidelities(&key)?.peak_bytes;
        peaks.insert(key, pk);
        Ok(pk)
    }

    /// The greedy by cost per byte ([`Allocator::greedy_step`] from
    /// [`Allocator::store_picks`]), stopped at the first plan along its path whose exact
    /// peak fits `avail` (each step simulated, as the Adacc-style baseline does), or, with
    /// `bisect`, at a plan found by galloping then bisecting along the path (a fitting plan
    /// right after one that does not: the first when exact peaks fall along the path, in a
    /// logarithmic number of simulations). `None` when no plan on the path fits.
    fn greedy(
        &self,
        p: &Problem,
        avail: i64,
        (risk_cap, lambda): (f64, f64),
        bisect: bool,
        peaks: &mut Peaks,
        checks: &mut usize,
    ) -> Result<Option<(Vec<Pick>, usize)>> {
        let mut path = vec![Self::store_picks(p)];
        // Extends the path to hold index `i` (or as far as it goes); whether it does.
        let extend = |path: &mut Vec<Vec<Pick>>, i: usize| -> bool {
            while path.len() <= i {
                let last = &path[path.len() - 1];
                match Self::greedy_step(p, last, risk_cap, lambda) {
                    Some((g, pick)) => {
                        let mut next = last.clone();
                        next[g] = pick;
                        path.push(next);
                    }
                    None => return false,
                }
            }
            true
        };
        let mut fits = |picks: &[Pick]| -> Result<Option<usize>> {
            let pk = self.cached_peak(p, picks, peaks, checks)?;
            Ok((pk as i64 <= avail).then_some(pk))
        };
        if !bisect {
            let mut i = 0;
            loop {
                if let Some(pk) = fits(&path[i])? {
                    return Ok(Some((path.swap_remove(i), pk)));
                }
                i += 1;
                if !extend(&mut path, i) {
                    return Ok(None);
                }
            }
        }
        if let Some(pk) = fits(&path[0])? {
            return Ok(Some((path.swap_remove(0), pk)));
        }
        // Gallop: path[lo] does not fit; find an index that does.
        let (mut lo, mut step) = (0, 1);
        let (mut hi, mut hi_peak) = loop {
            let i = lo + step;
            let i = if extend(&mut path, i) {
                i
            } else {
                path.len() - 1
            };
            if i == lo {
                return Ok(None);
            }
            match fits(&path[i])? {
                Some(pk) => break (i, pk),
                None if i < lo + step => return Ok(None),
                None => (lo, step) = (i, step * 2),
            }
        };
        // Bisect: path[lo] does not fit, path[hi] does.
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match fits(&path[mid])? {
                Some(pk) => (hi, hi_peak) = (mid, pk),
                None => lo = mid,
            }
        }
        Ok(Some((path.swap_remove(hi), hi_peak)))
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
