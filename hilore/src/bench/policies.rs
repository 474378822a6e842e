//! The policies `hilore bench` compares and how each plans the measured step: the fixed
//! baselines, the budgeted ones, HiLoRe and its exposure-blind ablation.

use super::workload::Microbatch;
use hilore_models::plans::SELECTIVE_RECOMPUTE_UNITS;
use hilore_runtime::allocator::baselines;
use hilore_runtime::allocator::{Allocator, MicrobatchInput, Offer};
use hilore_runtime::Plan;
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum Kind {
    StoreAll,
    Gc,
    Selective,
    BudgetedRecompute,
    CompressAll,
    AdaccStyle,
    Hilore,
    /// HiLoRe's planner with every microbatch at the step's mean exposure: an ablation
    /// (not a baseline) that separates what exposure buys from what the solver buys.
    HiloreBlind,
}

impl Kind {
    pub(super) const ALL: [Kind; 8] = [
        Kind::StoreAll,
        Kind::Gc,
        Kind::Selective,
        Kind::BudgetedRecompute,
        Kind::CompressAll,
        Kind::AdaccStyle,
        Kind::Hilore,
        Kind::HiloreBlind,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::StoreAll => "store-all",
            Kind::Gc => "full-recompute (GC)",
            Kind::Selective => "selective (Megatron)",
            Kind::BudgetedRecompute => "budgeted-recompute",
            Kind::CompressAll => "compress-all (fp8)",
            Kind::AdaccStyle => "adacc-style",
            Kind::Hilore => "hilore",
            Kind::HiloreBlind => "hilore (exposure-blind)",
        }
    }

    pub(super) fn budgeted(self) -> bool {
        matches!(
            self,
            Kind::Selective
                | Kind::BudgetedRecompute
                | Kind::AdaccStyle
                | Kind::Hilore
                | Kind::HiloreBlind
        )
    }

    /// The policies HiLoRe is compared with (not HiLoRe, not its ablation).
    pub(super) fn baseline(self) -> bool {
        !matches!(self, Kind::Hilore | Kind::HiloreBlind)
    }

    pub(super) fn of_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// Plans of one policy for every microbatch.
pub(super) struct Planned {
    pub(super) plans: Vec<Plan>,
    pub(super) predicted_activation: Vec<usize>,
    pub(super) predicted_risk: Vec<Option<f64>>,
    /// The cost model's recompute + encode + decode seconds of the step (knapsack
    /// policies only).
    pub(super) predicted_overhead_seconds: Option<f64>,
    pub(super) solve_seconds: f64,
    pub(super) note: String,
}

/// The step's microbatches and their allocators: one per profile key
/// ([`hilore_runtime::allocator::MicrobatchShape::profile_key`]: the rows and, with every
/// prompt first, the prompt rows), whose byte figures are exact for its microbatches.
pub(super) struct Ctx<'a> {
    pub(super) allocs: &'a [Allocator],
    /// Microbatch `i`'s allocator: `allocs[of[i]]`.
    pub(super) of: Vec<usize>,
    pub(super) mbs: &'a [Microbatch],
    pub(super) codecs: Vec<&'static str>,
}

impl<'a> Ctx<'a> {
    /// One allocator for every microbatch (all of one profile key).
    pub(super) fn single(
        alloc: &'a Allocator,
        mbs: &'a [Microbatch],
        codecs: Vec<&'static str>,
    ) -> Self {
        Ctx {
            allocs: std::slice::from_ref(alloc),
            of: vec![0; mbs.len()],
            mbs,
            codecs,
        }
    }

    fn alloc(&self, i: usize) -> &Allocator {
        &self.allocs[self.of[i]]
    }

    /// Per-microbatch plans, each made by its allocator, and their exact peaks.
    fn per_microbatch(
        &self,
        plan_of: impl Fn(&Allocator) -> anyhow::Result<Plan>,
    ) -> anyhow::Result<Planned> {
        let mut plans = Vec::with_capacity(self.mbs.len());
        let mut peaks = Vec::with_capacity(self.mbs.len());
        for i in 0..self.mbs.len() {
            let plan = plan_of(self.alloc(i))?;
            peaks.push(self.alloc(i).simulate_peak(&plan)?);
            plans.push(plan);
        }
        Ok(Planned {
            plans,
            predicted_activation: peaks,
            predicted_risk: vec![None; self.mbs.len()],
            predicted_overhead_seconds: None,
            solve_seconds: 0.0,
            note: String::new(),
        })
    }

    pub(super) fn fixed(&self, plan: Plan) -> anyhow::Result<Planned> {
        self.per_microbatch(|_| Ok(plan.clone()))
    }

    pub(super) fn plan(
        &self,
        kind: Kind,
        total_budget: usize,
        target: f64,
    ) -> anyhow::Result<Planned> {
        let a = &self.allocs[0];
        let inputs: Vec<_> = self.mbs.iter().map(|m| m.input).collect();
        let step_exposure: f64 = inputs.iter().map(|m| m.exposure).sum();
        // The exposure-blind policies plan every microbatch at the step's mean exposure.
        let mean = step_exposure / inputs.len() as f64;
        let exposures: Vec<f64> = inputs.iter().map(|m| m.exposure).collect();
        let risk_budget = a
            .risk
            .step_budget(target, &exposures)
            .unwrap_or(f64::INFINITY);
        let full = Offer {
            codecs: self.codecs.clone(),
            recompute: true,
            open_groups: true,
        };
        let t0 = Instant::now();
        let decisions = match kind {
            Kind::StoreAll => return self.fixed(baselines::store_all()),
            Kind::Gc => return self.per_microbatch(|a| Ok(baselines::gradient_checkpointing(a))),
            Kind::CompressAll => return self.fixed(baselines::compress_all()?),
            Kind::Selective => {
                // The layers kept and units recomputed, found for each microbatch's profile.
                let found = self.per_microbatch(|a| {
                    let avail = a.activation_budget(total_budget).unwrap_or(0);
                    match baselines::selective_recompute(a, &SELECTIVE_RECOMPUTE_UNITS, avail)? {
                        Some((plan, _)) => Ok(plan),
                        None => anyhow::bail!(
                            "not even full recompute fits the budget of {total_budget} bytes"
                        ),
                    }
                });
                let mut out = found?;
                let mut names: Vec<&str> = out.plans.iter().map(|p| p.name()).collect();
                names.dedup();
                out.note = names.join("; ");
                out.solve_seconds = t0.elapsed().as_secs_f64();
                return Ok(out);
            }
            Kind::BudgetedRecompute => inputs
                .iter()
                .enumerate()
                .map(|(i, mb)| baselines::budgeted_recompute(self.alloc(i), mb, total_budget))
                .collect::<hilore_runtime::Result<Vec<_>>>()?,
            Kind::AdaccStyle => {
                // Equal shares whose squares add up to the step's budget (microbatch
                // risks add in quadrature), each planned at the mean exposure.
                let share = risk_budget / (inputs.len() as f64).sqrt();
                inputs
                    .iter()
                    .enumerate()
                    .map(|(i, mb)| {
                        baselines::adacc_style(
                            self.alloc(i),
                            mb,
                            total_budget,
                            share,
                            mean,
                            &self.codecs,
                        )
                    })
                    .collect::<hilore_runtime::Result<Vec<_>>>()?
            }
            Kind::Hilore | Kind::HiloreBlind => {
                let assumed = (kind == Kind::HiloreBlind).then_some(mean);
                // One solve for the step across the allocators (one per profile key): one
                // risk multiplier over every microbatch, as the training loop plans it.
                let allocs: Vec<&Allocator> = (0..inputs.len()).map(|i| self.alloc(i)).collect();
                Allocator::plan_step_across(
                    &allocs,
                    &inputs,
                    total_budget,
                    risk_budget,
                    &full,
                    assumed,
                )?
            }
        };
        let secs = t0.elapsed().as_secs_f64();
        // Instances per fidelity over the whole step (every microbatch's plan).
        let mut per_step: std::collections::BTreeMap<String, usize> = Default::default();
        for (f, n) in decisions.iter().flat_map(|d| &d.counts) {
            *per_step.entry(f.to_string()).or_default() += n;
        }
        let note = per_step
            .iter()
            .map(|(f, n)| format!("{n} {f}"))
            .collect::<Vec<_>>()
            .join(", ");
        // The risk each plan carries on its real microbatch: the exposure-blind
        // policies planned with the mean exposure; risk is linear in exposure.
        let real_risk = |d: &hilore_runtime::allocator::Decision, mb: &MicrobatchInput| match kind {
            Kind::AdaccStyle | Kind::HiloreBlind if mean > 0.0 => {
                d.predicted_risk * mb.exposure / mean
            }
            _ => d.predicted_risk,
        };
        Ok(Planned {
            plans: decisions.iter().map(|d| d.plan.clone()).collect(),
            predicted_activation: decisions.iter().map(|d| d.predicted_peak_bytes).collect(),
            predicted_risk: decisions
                .iter()
                .zip(&inputs)
                .map(|(d, mb)| (kind != Kind::BudgetedRecompute).then(|| real_risk(d, mb)))
                .collect(),
            predicted_overhead_seconds: Some(decisions.iter().map(|d| d.predicted_seconds).sum()),
            solve_seconds: secs,
            note,
        })
    }
}

/// A planned policy: its kind, its plan, its budget in bytes and its budget factor.
pub(super) type PlannedPolicy = (Kind, Planned, Option<usize>, Option<f64>);
