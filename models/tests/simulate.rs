//! The memory simulator predicts the ledger peak of any plan exactly, from one profiled
//! store-all pass.

use candle_core::{Device, Tensor};
use hilore_models::{plans, rng::SplitMix64, Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::{Cx, Fidelity, Grads, Plan};

fn cfg() -> DecoderConfig {
    let mut c = DecoderConfig::tiny();
    c.num_hidden_layers = 3;
    c
}

/// Runs `plan` for real: (ledger peak, saved bytes alive at the end of the forward).
fn measure(model: &Decoder, batch: &TokenBatch, coeffs: &Tensor, plan: Plan) -> (usize, usize) {
    let mut cx = Cx::new(plan);
    let logp = model.token_logprobs(&mut cx, batch).unwrap();
    let end_fwd = cx.memory().live_bytes();
    let mut grads = Grads::new();
    cx.backward(&logp, coeffs, &mut grads).unwrap();
    assert_eq!(
        cx.memory().live_bytes(),
        0,
        "backward releases everything it counted"
    );
    (cx.memory().peak_bytes(), end_fwd)
}

fn random_plan(seed: u64, layers: usize) -> Plan {
    let mut rng = SplitMix64::new(seed);
    let codecs = hilore_kernels::codec_names();
    let mut plan = Plan::store_all().named(format!("random-{seed}"));
    for unit in plans::UNIT_NAMES {
        let calls = if plans::LAYER_UNITS.contains(&unit) || unit == "layer" {
            layers
        } else {
            1
        };
        for call in 0..calls {
            let f = match rng.below(4) {
                0 => Fidelity::Store,
                1 => Fidelity::Recompute,
                _ => Fidelity::Compress(codecs[rng.below(codecs.len() as u64) as usize]),
            };
            plan.set_instance(unit, call, f);
        }
    }
    plan
}

#[test]
fn simulated_peak_equals_measured_peak_for_every_plan() {
    let dev = Device::Cpu;
    let cfg = cfg();
    let model = Decoder::random(&cfg, 3, &dev).unwrap();
    let batch = TokenBatch::random(&[17, 9, 30, 4], &cfg, 4, &dev).unwrap();
    let n = batch.num_tokens();
    let coeffs = Tensor::from_vec(hilore_models::rng::normal_vec(n, 0.0, 1.0, 5), n, &dev).unwrap();

    let mut cx = Cx::new(plans::store_all()).profiling(true);
    let logp = model.token_logprobs(&mut cx, &batch).unwrap();
    let mut grads = Grads::new();
    cx.backward(&logp, &coeffs, &mut grads).unwrap();
    let profiled_peak = cx.memory().peak_bytes();
    let profile = cx.profile().unwrap();
    drop(cx);

    let mut named: Vec<Plan> = vec![
        plans::store_all(),
        plans::gradient_checkpointing(),
        plans::compress_all("bf16").unwrap(),
        plans::compress_all("int4-g32").unwrap(),
        Plan::uniform("recompute-everything", Fidelity::Recompute),
    ];
    for seed in 0..24 {
        named.push(random_plan(seed, cfg.num_hidden_layers));
        named.push(plans::random_mixed(
            seed,
            cfg.num_hidden_layers,
            Some("fp8-e4m3-b32"),
        ));
    }
    let store_sim = profile.simulate(&plans::store_all()).unwrap();
    assert_eq!(store_sim.peak_bytes, profiled_peak);
    for plan in named {
        let sim = profile.simulate(&plan).unwrap();
        let (peak, end_fwd) = measure(&model, &batch, &coeffs, plan.clone());
        assert_eq!(
            sim.end_of_forward_bytes,
            end_fwd,
            "end-of-forward bytes of {}",
            plan.name()
        );
        assert_eq!(sim.peak_bytes, peak, "peak of {}", plan.name());
    }
}

#[test]
fn simulation_refuses_what_the_tape_refuses() {
    let dev = Device::Cpu;
    let cfg = cfg();
    let model = Decoder::random(&cfg, 3, &dev).unwrap();
    let batch = TokenBatch::random(&[6, 5], &cfg, 4, &dev).unwrap();
    let n = batch.num_tokens();
    let coeffs = Tensor::ones(n, candle_core::DType::F32, &dev).unwrap();
    let mut cx = Cx::new(plans::store_all()).profiling(true);
    let logp = model.token_logprobs(&mut cx, &batch).unwrap();
    cx.backward(&logp, &coeffs, &mut Grads::new()).unwrap();
    let profile = cx.profile().unwrap();
    let err = profile
        .simulate(
            &Plan::uniform("bad", Fidelity::Compress("int4-g64"))
                .with_unit("embed", Fidelity::Compress("nope")),
        )
        .unwrap_err();
    assert!(err.to_string().contains("nope"), "{err}");
    // Every instance is listed with exact bytes.
    let inst = profile.instances();
    assert_eq!(inst.len(), 2 + 8 * cfg.num_hidden_layers);
    assert!(inst
        .iter()
        .filter(|i| i.unit == "attn_core")
        .all(|i| i.own_saved_bytes > 0));
}
