//! The policies HiLoRe is compared with, as plans on the same tape, kernels and budget.
//!
//! - **store-all**: every unit stored; the exact, fastest, most memory-hungry ceiling.
//! - **full recompute (GC)**: every top-level unit with children (a decoder `layer`)
//!   recomputed, only its input kept:
//!   classic per-layer gradient checkpointing (Chen et al. 2016, "Training Deep Nets with
//!   Sublinear Memory Cost"; `torch.utils.checkpoint` per block, the default of TRL/verl
//!   actors under memory pressure).
//! - **selective recompute**: Megatron-LM's selective activation recomputation
//!   (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
//!   Models"): recompute the attention core and the cheap elementwise units (for the
//!   built-in decoder `attn_core`, `attn_norm`, `mlp_norm`), store the matmul outputs; as
//!   many layers as
//!   fit the budget get it, the rest are fully recomputed (Megatron's
//!   `--recompute-granularity selective` plus `full` for the remainder). With a
//!   flash-style attention that never saves the `T x T` probabilities this saves little:
//!   the point of the paper's selective mode was exactly those probabilities.
//! - **budgeted recompute**: store/recompute only, the fastest plan under the budget by
//!   the same knapsack with compression disabled; the policy of torch.compile's
//!   `activation_memory_budget` (a min-cut / knapsack over which activations to save,
//!   minimising recompute time under a memory fraction).
//! - **compress-all**: every activation compressed with FP8 (E4M3, per-32 scales), no
//!   recompute; COAT (Xi et al. 2024) / ActNN (Chen et al. 2021) style. Unbudgeted: it
//!   fits or it does not.
//! - **Adacc-style**: store / compress / recompute chosen greedily by time added per
//!   byte saved, with a compression sensitivity that is per unit but blind to the GRPO
//!   coefficients (every microbatch is assumed to carry the mean exposure, and gets an
//!   equal share of the step's risk budget); after Adacc (Adaptive Compression and
//!   Activation Checkpointing, 2025), which mixes compression and checkpointing by cost
//!   per byte under a fixed accuracy model.
//! - **HiLoRe** itself is [`Allocator::plan_step`]; among its candidates it weighs the
//!   exact selective-shaped plans of [`Allocator::selective_candidates`] (defined here:
//!   the Megatron shape with the children ranked by recompute time per byte instead of by
//!   name).
//!
//! Every baseline is defined here once, for any model's units (the groups are the
//! allocator's: top-level unit instances and their direct children); the planner's exact
//! fallbacks, the online allocator's plan without exposure and `hilore bench`'s baseline
//! are the one [`gradient_checkpointing`].

use super::{Allocator, Decision, Layout, MicrobatchInput, Offer, Peaks};
use crate::allocator::costs::MicrobatchShape;
use crate::{Fidelity, Plan, Result};
use std::collections::HashMap;
use std::time::Instant;

/// FP8 with per-32 scales: the compress-all codec.
pub const COMPRESS_ALL_CODEC: &str = "fp8-e4m3-b32";

/// Store-all: every unit stored.
pub fn store_all() -> Plan {
    Plan::store_all()
}

/// Full recompute (gradient checkpointing) of `alloc`'s model: every group with children
/// whose top unit offers Recompute is recomputed, only its inputs kept; the rest stored.
pub fn gradient_checkpointing(alloc: &Allocator) -> Plan {
    let mut plan = Plan::store_all().named("gradient-checkpointing");
    for i in alloc.gc_assignment().into_keys() {
        let b = &alloc.instances()[i];
        plan.set_instance(b.unit, b.call, Fidelity::Recompute);
    }
    plan
}

/// Compress-all with [`COMPRESS_ALL_CODEC`] (a unit's exact slots stay exact).
pub fn compress_all() -> Result<Plan> {
    Ok(Plan::compress_all(COMPRESS_ALL_CODEC)?.named("compress-all"))
}

/// Megatron-style selective recompute in as many layers (groups with children) as fit
/// `activation_budget` ledger bytes (exact, by the simulator): in those, the children
/// whose unit is one of `recompute_units` are recomputed and the rest stored; the other
/// layers are recomputed whole. `None` when not even full recompute fits. The layers that
/// keep selective recompute are the last ones: their state is freed first in backward,
/// so storing them costs the least peak.
pub fn selective_recompute(
    alloc: &Allocator,
    recompute_units: &[&str],
    activation_budget: usize,
) -> Result<Option<(Plan, usize)>> {
    let layers: Vec<&Layout> = alloc
        .layout
        .iter()
        .filter(|l| !l.children.is_empty())
        .collect();
    let n = layers.len();
    for k in (0..=n).rev() {
        let mut plan = Plan::store_all().named(format!("selective({k}/{n} layers)"));
        for (j, l) in layers.iter().enumerate() {
            let top = &alloc.instances[l.top];
            if j >= n - k {
                plan.set_instance(top.unit, top.call, Fidelity::Store);
                for &c in &l.children {
                    let b = &alloc.instances[c];
                    if recompute_units.contains(&b.unit) {
                        plan.set_instance(b.unit, b.call, Fidelity::Recompute);
                    }
                }
            } else {
                plan.set_instance(top.unit, top.call, Fidelity::Recompute);
            }
        }
        let peak = alloc.simulate_peak(&plan)?;
        if peak <= activation_budget {
            return Ok(Some((plan, peak)));
        }
    }
    Ok(None)
}

/// Budgeted recompute: the fastest store/recompute plan under `total_budget`.
pub fn budgeted_recompute(
    alloc: &Allocator,
    mb: &MicrobatchInput,
    total_budget: usize,
) -> Result<Decision> {
    let offer = Offer {
        codecs: Vec::new(),
        recompute: true,
        open_groups: true,
    };
    let mut d = alloc.plan(mb, total_budget, f64::INFINITY, &offer)?;
    d.plan = d.plan.named("budgeted-recompute");
    Ok(d)
}

/// Adacc-style: greedy by cost per byte. Starting from every instance stored, repeatedly
/// take the change that adds the least predicted time per byte saved, among changes whose
/// risk (exposure-blind: `assumed_exposure`, the step's mean, for every microbatch) keeps
/// the total under `risk_budget` (this microbatch's equal share of the step's), until the
/// exact peak fits.
pub fn adacc_style(
    alloc: &Allocator,
    mb: &MicrobatchInput,
    total_budget: usize,
    risk_budget: f64,
    assumed_exposure: f64,
    codecs: &[&'static str],
) -> Result<Decision> {
    let offer = &Offer {
        codecs: codecs.to_vec(),
        recompute: true,
        open_groups: true,
    };
    let t0 = Instant::now();
    let avail = alloc
        .activation_budget(total_budget)
        .ok_or_else(|| alloc.infeasible_memory(total_budget, offer))?;
    // Risks in the knapsack are squared (they add in quadrature).
    let risk_budget = risk_budget * risk_budget;
    let p = alloc.problem(mb, assumed_exposure, offer, i64::MAX, risk_budget)?;
    let mut checks = 0;
    let mut peaks = Peaks::default();
    let cap = (risk_budget, 0.0);
    let Some((picks, peak)) =
        alloc.greedy(&p, avail as i64, cap, false, &mut peaks, &mut checks)?
    else {
        return Err(alloc.infeasible_memory(total_budget, offer));
    };
    let mut d = alloc.decision("adacc-style", &p, &p.selection(picks, 0.0), peak, checks);
    d.solve_seconds = t0.elapsed().as_secs_f64();
    Ok(d)
}

impl Allocator {
    /// Gradient checkpointing as an assignment: every group with children whose top unit
    /// offers Recompute, recomputed (the instances of [`gradient_checkpointing`]).
    pub fn gc_assignment(&self) -> HashMap<usize, Fidelity> {
        self.layout
            .iter()
            .filter(|l| !l.children.is_empty() && self.descs[l.top].offers(Fidelity::Recompute))
            .map(|l| (l.top, Fidelity::Recompute))
            .collect()
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
}
