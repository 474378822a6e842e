//! The policies HiLoRe is compared with, as plans on the same tape, kernels and budget.
//!
//! - **store-all**: every unit stored; the exact, fastest, most memory-hungry ceiling.
//! - **full recompute (GC)**: every decoder `layer` recomputed, only its input kept:
//!   classic per-layer gradient checkpointing (Chen et al. 2016, "Training Deep Nets with
//!   Sublinear Memory Cost"; `torch.utils.checkpoint` per block, the default of TRL/verl
//!   actors under memory pressure).
//! - **selective recompute**: Megatron-LM's selective activation recomputation
//!   (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
//!   Models"): recompute the attention core and the cheap elementwise units (here
//!   `attn_core`, `attn_norm`, `mlp_norm`), store the matmul outputs; as many layers as
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
//! - **HiLoRe** itself is [`hilore_runtime::allocator::Allocator::plan_step`].

use crate::plans;
use hilore_runtime::allocator::{Allocator, Decision, MicrobatchInput, Offer};
use hilore_runtime::{Fidelity, Plan, Result};

/// FP8 with per-32 scales: the compress-all codec.
pub const COMPRESS_ALL_CODEC: &str = "fp8-e4m3-b32";

/// Store-all.
pub fn store_all() -> Plan {
    plans::store_all()
}

/// Full recompute.
pub fn gradient_checkpointing() -> Plan {
    plans::gradient_checkpointing()
}

/// Compress-all with [`COMPRESS_ALL_CODEC`].
pub fn compress_all() -> Result<Plan> {
    Ok(plans::compress_all(COMPRESS_ALL_CODEC)?.named("compress-all"))
}

/// Selective recompute in as many layers as fit `activation_budget` ledger bytes (exact,
/// by the simulator); `None` when not even full recompute fits. The layers that keep
/// selective recompute are the last ones: their state is freed first in backward, so
/// storing them costs the least peak.
pub fn selective_recompute(
    alloc: &Allocator,
    num_layers: usize,
    activation_budget: usize,
) -> Result<Option<(Plan, usize)>> {
    for k in (0..=num_layers).rev() {
        let mut plan = Plan::store_all().named(format!("selective({k}/{num_layers} layers)"));
        for l in 0..num_layers {
            if l >= num_layers - k {
                plan.set_instance("layer", l, Fidelity::Store);
                for u in ["attn_core", "attn_norm", "mlp_norm"] {
                    plan.set_instance(u, l, Fidelity::Recompute);
                }
            } else {
                plan.set_instance("layer", l, Fidelity::Recompute);
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

/// Adacc-style: greedy by cost per byte, exposure-blind risk (`mean_exposure` for every
/// microbatch) against `risk_budget` (this microbatch's equal share of the step's).
pub fn adacc_style(
    alloc: &Allocator,
    mb: &MicrobatchInput,
    total_budget: usize,
    risk_budget: f64,
    mean_exposure: f64,
    codecs: &[&'static str],
) -> Result<Decision> {
    let offer = Offer {
        codecs: codecs.to_vec(),
        recompute: true,
        open_groups: true,
    };
    let mut d = alloc.plan_greedy(mb, total_budget, risk_budget, &offer, mean_exposure)?;
    d.plan = d.plan.named("adacc-style");
    Ok(d)
}
