//! Plans for the decoder's units: the baselines and random mixes for checks.

use crate::rng::SplitMix64;
use hilore_runtime::{Fidelity, Plan, Result};

/// The seven units inside each `layer`, in forward order.
pub const LAYER_UNITS: [&str; 7] = [
    "attn_norm",
    "qkv",
    "attn_core",
    "attn_out",
    "mlp_norm",
    "gate_up",
    "down",
];

/// Every unit of the decoder: `embed`, `layer` (which encloses [`LAYER_UNITS`]), the
/// seven layer units, and `head`.
pub const UNIT_NAMES: [&str; 10] = [
    "embed",
    "layer",
    "attn_norm",
    "qkv",
    "attn_core",
    "attn_out",
    "mlp_norm",
    "gate_up",
    "down",
    "head",
];

/// The units Megatron-style selective recompute recomputes inside a layer (the attention
/// core and the cheap elementwise norms; the matmul outputs stay stored): the decoder's
/// argument to [`hilore_runtime::allocator::baselines::selective_recompute`].
pub const SELECTIVE_RECOMPUTE_UNITS: [&str; 3] = ["attn_core", "attn_norm", "mlp_norm"];

/// Every unit stored: the exact, most memory-hungry plan.
pub fn store_all() -> Plan {
    Plan::store_all()
}

/// Classic per-layer gradient checkpointing: every `layer` is recomputed (only its input
/// is kept between forward and backward), everything else is stored. This is
/// [`hilore_runtime::allocator::baselines::gradient_checkpointing`] for the decoder (its
/// only units with children are the layers), written without an allocator so a plain
/// training run needs no profile; a test holds the two to the same fidelity on every unit
/// instance.
pub fn gradient_checkpointing() -> Plan {
    Plan::store_all()
        .with_unit("layer", Fidelity::Recompute)
        .named("gradient-checkpointing")
}

/// Every unit compressed with `codec` (a unit's exact slots, like ids and log-sum-exps,
/// stay exact).
pub fn compress_all(codec: &str) -> Result<Plan> {
    Plan::compress_all(codec)
}

/// Each unit instance (unit name x call index, for a decoder of `num_layers` layers) gets
/// Store or Recompute, or also Compress with `allow_compress`'s codec, uniformly at random
/// from `seed`. Recompute instances nested in a recomputed `layer` are re-run twice in
/// backward (once inside the layer's recompute, once on their own), which is what these
/// plans are for: every combination must give store-all's gradients (bit for bit without
/// Compress).
///
/// # Panics
///
/// If `allow_compress` names no codec; [`try_random_mixed`] returns the error instead.
pub fn random_mixed(seed: u64, num_layers: usize, allow_compress: Option<&str>) -> Plan {
    match try_random_mixed(seed, num_layers, allow_compress) {
        Ok(p) => p,
        Err(e) => panic!("random_mixed: {e}"),
    }
}

/// [`random_mixed`], with an unknown codec reported as an error.
pub fn try_random_mixed(
    seed: u64,
    num_layers: usize,
    allow_compress: Option<&str>,
) -> Result<Plan> {
    let mut choices = vec![Fidelity::Store, Fidelity::Recompute];
    if let Some(codec) = allow_compress {
        choices.push(Fidelity::parse(&format!("compress-{codec}"))?);
    }
    let name = match allow_compress {
        Some(c) => format!("random-mixed(seed={seed}, store/recompute/{c})"),
        None => format!("random-mixed(seed={seed}, store/recompute)"),
    };
    let mut rng = SplitMix64::for_stream(seed, "random-mixed-plan");
    let mut plan = Plan::store_all().named(name);
    let mut pick = |plan: &mut Plan, unit: &str, call: usize| {
        let f = choices[rng.below(choices.len() as u64) as usize];
        plan.set_instance(unit, call, f);
    };
    pick(&mut plan, "embed", 0);
    for l in 0..num_layers {
        pick(&mut plan, "layer", l);
        for u in LAYER_UNITS {
            pick(&mut plan, u, l);
        }
    }
    pick(&mut plan, "head", 0);
    Ok(plan)
}
