//! The planner on the benchmark decoder's shapes (4 layers, hidden 192, MLP 512, 896 rows
//! per microbatch), with fixed costs and sensitivities of the size measured on a 2-core
//! CPU: at every budget from full recompute's peak up, HiLoRe's plan is at least as fast
//! (predicted) as the greedy by cost per byte with the same exposure and risk budget (the
//! simulations are not priced here, so every greedy start runs), and its predicted peak is
//! the simulator's and within the budget.

use candle_core::{Device, Tensor};
use hilore_models::{plans, Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::allocator::{
    baselines, Allocator, MicrobatchInput, MicrobatchShape, Offer, StateBytes,
};
use hilore_runtime::{Cx, Fidelity, Grads, Plan};

const CODECS: [&str; 4] = ["bf16", "fp8-e4m3-b32", "int8-b32", "int4-g32"];

/// An allocator profiled on one 896-row microbatch, with recompute seconds per instance,
/// codec rates and per-instance sensitivities fixed (deterministic plans).
fn allocator() -> (Allocator, MicrobatchShape) {
    allocator_with_codec_scale(1.0)
}

/// [`allocator`] with every codec's time scaled by `codec_scale`.
fn allocator_with_codec_scale(codec_scale: f64) -> (Allocator, MicrobatchShape) {
    let dev = Device::Cpu;
    let cfg = DecoderConfig::bench();
    let model = Decoder::random(&cfg, 7, &dev).unwrap();
    // Eight sequences, 896 rows.
    let batch = TokenBatch::random(&[161, 97, 129, 65, 193, 81, 113, 65], &cfg, 3, &dev).unwrap();
    let n = batch.num_tokens();
    assert_eq!(n, 896);
    let coeffs =
        Tensor::from_vec(hilore_models::rng::normal_vec(n, 0.0, 1e-3, 5), n, &dev).unwrap();
    let mut cx = Cx::new(plans::store_all()).profiling(true);
    let logp = model.token_logprobs(&mut cx, &batch).unwrap();
    cx.backward(&logp, &coeffs, &mut Grads::new()).unwrap();
    let profile = cx.profile().unwrap();
    let state = StateBytes::adamw_f32(model.num_params());
    let mut a = Allocator::new(profile, &cx.unit_instances(), state, &CODECS).unwrap();
    let shape = MicrobatchShape::of(&batch.packing);
    // Seconds per recomputed instance at this shape (the order of what the benchmark
    // measures on a 2-core CPU).
    for (unit, secs) in [
        ("embed", 1.0e-4),
        ("attn_norm", 7.0e-4),
        ("qkv", 4.4e-3),
        ("attn_core", 1.7e-2),
        ("attn_out", 1.0e-3),
        ("mlp_norm", 7.0e-4),
        ("gate_up", 4.8e-3),
        ("down", 2.0e-3),
        ("layer", 3.1e-2),
        ("head", 1.0e-2),
    ] {
        a.costs.observe_recompute(unit, shape, secs);
    }
    // Encode and decode seconds per value (the tape's, copies included).
    for (codec, enc, dec) in [
        ("bf16", 0.45e-9, 0.35e-9),
        ("fp8-e4m3-b32", 0.74e-9, 0.44e-9),
        ("int8-b32", 0.57e-9, 0.35e-9),
        ("int4-g32", 0.58e-9, 0.40e-9),
    ] {
        let (enc, dec) = (enc * codec_scale, dec * codec_scale);
        a.costs
            .observe_codec(codec, 1_000_000, enc * 1e6, dec * 1e6);
    }
    // Gradient error per unit of exposure, per instance (the calibration's kappa).
    let kappa = |unit: &str, codec: &str| -> f64 {
        let unit_scale = match unit {
            "gate_up" => 3.0,
            "qkv" | "attn_out" | "head" => 1.6,
            "down" => 1.0,
            _ => 0.4,
        };
        let codec_scale = match codec {
            "bf16" => 0.015,
            "int8-b32" => 0.05,
            "fp8-e4m3-b32" => 0.25,
            _ => 1.0,
        };
        0.5 * unit_scale * codec_scale
    };
    for b in a.instances().to_vec() {
        for codec in CODECS {
            a.risk
                .set_kappa(b.unit, b.call, codec, kappa(b.unit, codec));
        }
    }
    (a, shape)
}

/// Every codec, recompute and opened groups.
fn every_fidelity() -> Offer {
    Offer {
        codecs: CODECS.to_vec(),
        recompute: true,
        open_groups: true,
    }
}

#[test]
fn never_slower_than_the_greedy_by_cost_per_byte() {
    let (a, shape) = allocator();
    let offer = every_fidelity();
    let gc = a.simulate_peak(&plans::gradient_checkpointing()).unwrap() + a.state().total();
    let store = a.simulate_peak(&Plan::store_all()).unwrap() + a.state().total();
    assert!(gc < store);
    let mut compared = 0;
    for factor in [1.0, 1.025, 1.05, 1.075, 1.1, 1.15, 1.25, 1.4] {
        let budget = (gc as f64 * factor) as usize;
        for (exposure, risk) in [
            (0.0, 0.0),
            (2e-3, 2e-3),
            (2e-3, 1e-3),
            (4e-3, 5e-4),
            (2e-3, 0.0),
        ] {
            let mb = MicrobatchInput { shape, exposure };
            let d = a.plan(&mb, budget, risk, &offer).unwrap();
            assert!(d.predicted_total_bytes <= budget, "factor {factor}");
            assert_eq!(a.simulate_peak(&d.plan).unwrap(), d.predicted_peak_bytes);
            // Risks are sums of at most 40 squared f64 terms: 1e-9 relative covers the
            // rounding of the square root.
            assert!(d.predicted_risk <= risk * (1.0 + 1e-9) + 1e-18);
            let Ok(g) = baselines::adacc_style(&a, &mb, budget, risk, exposure, &CODECS) else {
                // The greedy ran out of changes within the risk budget before it fit.
                continue;
            };
            // Sums of at most 40 f64 costs on both sides: 1e-9 relative covers their
            // rounding.
            assert!(
                d.predicted_seconds <= g.predicted_seconds * (1.0 + 1e-9),
                "factor {factor}, exposure {exposure}, risk {risk}: planned {:e} s ({:?}), the greedy {:e} s ({:?})",
                d.predicted_seconds,
                d.counts,
                g.predicted_seconds,
                g.counts
            );
            compared += 1;
        }
    }
    assert!(compared >= 24, "only {compared} comparisons");
}

/// When compression costs next to nothing, the DP's fastest plans at the capacities its
/// search settles on compress a lot; under a tight risk budget none of the DP's plans
/// within those capacities may meet it although an exact plan (full recompute at its own
/// peak) fits. The planner then starts from the exact plans and adds what compression
/// the risk budget allows, instead of failing.
#[test]
fn a_tight_risk_budget_starts_from_an_exact_plan() {
    let (a, shape) = allocator_with_codec_scale(1e-9);
    let offer = every_fidelity();
    let gc = a.simulate_peak(&plans::gradient_checkpointing()).unwrap() + a.state().total();
    for factor in [1.0, 1.05, 1.1] {
        let budget = (gc as f64 * factor) as usize;
        for risk in [0.0, 1e-4, 2e-3] {
            let mb = MicrobatchInput {
                shape,
                exposure: 2e-3,
            };
            let d = a
                .plan(&mb, budget, risk, &offer)
                .unwrap_or_else(|e| panic!("factor {factor}, risk {risk}: {e}"));
            assert!(d.predicted_total_bytes <= budget);
            assert_eq!(a.simulate_peak(&d.plan).unwrap(), d.predicted_peak_bytes);
            // See `never_slower_than_the_greedy_by_cost_per_byte`.
            assert!(d.predicted_risk <= risk * (1.0 + 1e-9) + 1e-18);
        }
    }
}

/// Gradient checkpointing is defined once, for any model, by the allocator's groups
/// ([`baselines::gradient_checkpointing`]); the decoder's allocator-free plan
/// (`plans::gradient_checkpointing`, every `layer`) gives every unit instance the same
/// fidelity, and so the same peak.
#[test]
fn the_decoders_gradient_checkpointing_is_the_baseline() {
    let (a, _) = allocator();
    let generic = baselines::gradient_checkpointing(&a);
    let decoder = plans::gradient_checkpointing();
    let mut recomputed = 0;
    for (i, b) in a.instances().iter().enumerate() {
        let d = a.descriptor(i);
        assert_eq!(
            generic.fidelity_for(d, b.call),
            decoder.fidelity_for(d, b.call),
            "{}#{}",
            b.unit,
            b.call
        );
        recomputed += usize::from(generic.fidelity_for(d, b.call) == Fidelity::Recompute);
    }
    // Every layer and nothing else is recomputed.
    let layers = a.groups().iter().filter(|(_, ch)| !ch.is_empty()).count();
    assert!(layers > 0);
    assert_eq!(recomputed, layers);
    assert_eq!(
        a.simulate_peak(&generic).unwrap(),
        a.simulate_peak(&decoder).unwrap()
    );
}

/// Microbatches of one allocator in a step start their searches from the plan the
/// previous one ended with where that is faster for them (its exact peak is theirs too):
/// without exposure (no risk), each microbatch's plan is at least as fast, by the cost
/// model at its own shape, as the previous microbatch's plan. The shapes differ only in
/// their squared sequence lengths, so only attention's recompute time differs between
/// them, and no microbatch takes another's plan unplanned.
#[test]
fn a_microbatch_is_no_slower_than_the_previous_ones_plan() {
    let (a, shape) = allocator();
    let offer = every_fidelity();
    let gc = a.simulate_peak(&plans::gradient_checkpointing()).unwrap() + a.state().total();
    let mbs: Vec<MicrobatchInput> = (0..6)
        .map(|k| MicrobatchInput {
            shape: MicrobatchShape {
                sum_sq_lengths: shape.sum_sq_lengths + 4096 * k,
                ..shape
            },
            exposure: 0.0,
        })
        .collect();
    for factor in [1.0, 1.05, 1.1, 1.25] {
        let budget = (gc as f64 * factor) as usize;
        let ds = a.plan_step(&mbs, budget, 0.0, &offer, None).unwrap();
        for (k, d) in ds.iter().enumerate() {
            assert!(d.predicted_total_bytes <= budget);
            assert_eq!(a.simulate_peak(&d.plan).unwrap(), d.predicted_peak_bytes);
            let own = a.plan_seconds(&d.plan, mbs[k].shape);
            // Sums of at most 40 f64 costs, in different orders: 1e-9 relative covers
            // their rounding.
            assert!(
                (own - d.predicted_seconds).abs() <= 1e-9 * own,
                "factor {factor}, microbatch {k}: {own:e} s by plan_seconds, {:e} s predicted",
                d.predicted_seconds
            );
            if k > 0 {
                let previous = a.plan_seconds(&ds[k - 1].plan, mbs[k].shape);
                assert!(
                    own <= previous * (1.0 + 1e-9),
                    "factor {factor}, microbatch {k}: {own:e} s, the previous plan {previous:e} s"
                );
            }
        }
    }
}
