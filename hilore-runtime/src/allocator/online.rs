//! The allocator inside a training loop: profiles each microbatch size once, calibrates on
//! the first step, plans every step's microbatches under one risk budget, and folds the
//! measured times back into the cost model.
//!
//! Byte figures of a profile are exact for microbatches of the profiled token count, so a
//! training loop that wants exact peaks pads its microbatches to a few sizes (e.g. the
//! token budget); each new size costs one profiling pass (a store-all forward and
//! backward that keeps every tensor: do it where memory allows).

use super::budget::{MemoryBudget, StateBytes};
use super::calibrate::{calibrate, CalibrationReport, PassResult};
use super::costs::CostModel;
use super::planner::{Allocator, Decision, MicrobatchInput, Offer};
use super::risk::RiskModel;
use crate::{Error, Fidelity, Plan, Profile, Result, TapeTimes, UnitInstanceInfo};
use std::collections::BTreeMap;

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
    /// One forward + backward of microbatch `i` under `plan` (calibration).
    fn run(&mut self, i: usize, plan: &Plan) -> Result<PassResult>;
}

struct Adapter<'a> {
    w: &'a mut dyn Workload,
    map: Vec<usize>,
}

impl super::calibrate::Runner for Adapter<'_> {
    fn run(&mut self, mb: usize, plan: &Plan) -> Result<PassResult> {
        self.w.run(self.map[mb], plan)
    }
}

/// Plans a training run's steps; see the module docs.
pub struct OnlineAllocator {
    state: StateBytes,
    budget: MemoryBudget,
    target_rel_l2: f64,
    codecs: Vec<&'static str>,
    costs: CostModel,
    risk: RiskModel,
    by_tokens: BTreeMap<usize, Allocator>,
    calibration: Option<CalibrationReport>,
    gc_peak: BTreeMap<usize, usize>,
}

impl std::fmt::Debug for OnlineAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnlineAllocator")
            .field("budget", &self.budget)
            .field("target_rel_l2", &self.target_rel_l2)
            .field("profiles", &self.by_tokens.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// The plan of one step.
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// One decision per microbatch.
    pub decisions: Vec<Decision>,
    /// The budget in bytes it was planned under.
    pub budget_bytes: usize,
}

impl OnlineAllocator {
    /// An allocator for a model whose fixed state is `state`.
    pub fn new(
        state: StateBytes,
        budget: MemoryBudget,
        target_rel_l2: f64,
        codecs: &[&'static str],
    ) -> Self {
        OnlineAllocator {
            state,
            budget,
            target_rel_l2,
            codecs: codecs.to_vec(),
            costs: CostModel::default(),
            risk: RiskModel::default(),
            by_tokens: BTreeMap::new(),
            calibration: None,
            gc_peak: BTreeMap::new(),
        }
    }

    /// The calibration, once done.
    pub fn calibration(&self) -> Option<&CalibrationReport> {
        self.calibration.as_ref()
    }

    /// The cost model (measured, refreshed).
    pub fn costs(&self) -> &CostModel {
        &self.costs
    }

    /// Plans every microbatch of a step (profiling new sizes and calibrating on the
    /// first call).
    pub fn plan_step(&mut self, w: &mut dyn Workload) -> Result<StepPlan> {
        if w.is_empty() {
            return Ok(StepPlan {
                decisions: Vec::new(),
                budget_bytes: 0,
            });
        }
        let inputs: Vec<MicrobatchInput> = (0..w.len()).map(|i| w.input(i)).collect();
        for (i, mb) in inputs.iter().enumerate() {
            let n = mb.shape.tokens;
            if !self.by_tokens.contains_key(&n) {
                let (profile, inst) = w.profile(i)?;
                let mut a = Allocator::new(profile, &inst, self.state, &self.codecs)?;
                let gc = gc_plan(&a);
                self.gc_peak.insert(n, a.simulate_peak(&gc)?);
                a.costs = self.costs.clone();
                a.risk = self.risk.clone();
                self.by_tokens.insert(n, a);
            }
        }
        if self.calibration.is_none() {
            // Calibrate on (up to) the two microbatches with exposure and the most
            // different squared lengths, with the allocator of the first one's size.
            let mut idx: Vec<usize> = (0..inputs.len())
                .filter(|&i| inputs[i].exposure > 0.0)
                .collect();
            if !idx.is_empty() {
                let n = inputs[idx[0]].shape.tokens;
                idx.retain(|&i| inputs[i].shape.tokens == n);
                idx.sort_by_key(|&i| inputs[i].shape.sum_sq_lengths);
                let pick: Vec<usize> = if idx.len() > 1 {
                    vec![idx[0], idx[idx.len() - 1]]
                } else {
                    idx
                };
                let cal_inputs: Vec<MicrobatchInput> = pick.iter().map(|&i| inputs[i]).collect();
                let a = self
                    .by_tokens
                    .get_mut(&n)
                    .ok_or_else(|| Error::Tape("allocator: no profile".into()))?;
                let mut adapter = Adapter { w, map: pick };
                let report = calibrate(
                    a,
                    &mut adapter,
                    &cal_inputs,
                    cal_inputs.len() - 1,
                    &self.codecs.clone(),
                    &mut |_| {},
                )?;
                self.costs = a.costs.clone();
                self.risk = a.risk.clone();
                for a in self.by_tokens.values_mut() {
                    a.costs = self.costs.clone();
                    a.risk = self.risk.clone();
                }
                self.calibration = Some(report);
            }
        }
        if self.calibration.is_none() {
            // Nothing measured yet (no microbatch with exposure to calibrate on): full
            // recompute, which fits by construction of the budget.
            let decisions = inputs
                .iter()
                .map(|m| {
                    let a = &self.by_tokens[&m.shape.tokens];
                    a.fixed_decision(gc_plan(a))
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(StepPlan {
                decisions,
                budget_bytes: 0,
            });
        }
        // The budget: a factor of full recompute's total peak at the step's largest size.
        let gc_total = inputs
            .iter()
            .map(|m| self.gc_peak[&m.shape.tokens])
            .max()
            .unwrap_or(0)
            + self.state.total();
        let budget_bytes = self.budget.bytes(gc_total);
        let exposures: Vec<f64> = inputs.iter().map(|m| m.exposure).collect();
        let risk_budget = self
            .risk
            .step_budget(self.target_rel_l2, &exposures)
            .unwrap_or(0.0);
        // Risks of different microbatches add in quadrature (see `risk`), so each size
        // gets the share of the budget whose squares sum to the whole.
        let step_sq: f64 = exposures.iter().map(|e| e * e).sum();
        let offer = Offer {
            codecs: self.codecs.clone(),
            recompute: true,
            open_groups: true,
        };
        // One solve per microbatch size, the step's risk budget shared by exposure.
        let mut decisions: Vec<Option<Decision>> = vec![None; inputs.len()];
        let sizes: Vec<usize> = self.by_tokens.keys().copied().collect();
        for n in sizes {
            let members: Vec<usize> = (0..inputs.len())
                .filter(|&i| inputs[i].shape.tokens == n)
                .collect();
            if members.is_empty() {
                continue;
            }
            let sq: f64 = members.iter().map(|&i| inputs[i].exposure.powi(2)).sum();
            let share = if step_sq > 0.0 {
                risk_budget * (sq / step_sq).sqrt()
            } else {
                0.0
            };
            let mbs: Vec<MicrobatchInput> = members.iter().map(|&i| inputs[i]).collect();
            let a = &self.by_tokens[&n];
            let ds = a.plan_step(&mbs, budget_bytes, share, &offer, None)?;
            for (&i, d) in members.iter().zip(ds) {
                decisions[i] = Some(d);
            }
        }
        Ok(StepPlan {
            decisions: decisions.into_iter().map(|d| d.expect("planned")).collect(),
            budget_bytes,
        })
    }

    /// Folds one microbatch's measured times into the cost model's corrections.
    pub fn observe(&mut self, decision: &Decision, times: &TapeTimes) {
        let c = &self.costs.corrections;
        self.costs.refresh(
            decision.predicted_recompute_seconds / c.recompute.max(1e-12),
            times.recompute.as_secs_f64(),
            decision.predicted_codec_seconds / c.codec.max(1e-12),
            (times.encode + times.decode).as_secs_f64(),
        );
        for a in self.by_tokens.values_mut() {
            a.costs.corrections = self.costs.corrections.clone();
        }
    }
}

/// Full recompute: every top-level instance with children recomputed.
fn gc_plan(a: &Allocator) -> Plan {
    let mut plan = Plan::store_all().named("gradient-checkpointing");
    for (top, children) in a.groups() {
        if !children.is_empty() && a.descriptor(top).offers(Fidelity::Recompute) {
            let b = &a.instances()[top];
            plan.set_instance(b.unit, b.call, Fidelity::Recompute);
        }
    }
    plan
}
