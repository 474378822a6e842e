//! The allocator over shared-prefix microbatches: plans within the budget whose predicted
//! activation peak equals the measured one on every microbatch, for two steps (the first
//! calibrates), under a budget of 1.10 x full recompute's peak; and a unit's prompt and
//! response instances, planned apart, each with its own saved rows.

use candle_core::{Device, Tensor};
use hilore::train::update::TapeWorkload;
use hilore::train::ActorModel;
use hilore_models::rng::{normal_vec, SplitMix64};
use hilore_models::{Decoder, DecoderConfig, PromptGroup};
use hilore_runtime::allocator::risk::grad_error;
use hilore_runtime::allocator::{Allocator, MemoryBudget, OnlineAllocator, StateBytes, Workload};
use hilore_runtime::{Fidelity, Grads, Plan};

/// Four microbatches of two prompts (24-40 tokens) with 4 responses each (8-40 tokens),
/// seeded with random coefficients on the response tokens and 0 on the prompt's.
fn data(model: &Decoder, step: u64) -> Vec<(hilore_models::TokenBatch, Tensor)> {
    let vocab = model.config().vocab_size as u64;
    let mut r = SplitMix64::new(100 + step);
    (0..4)
        .map(|k| {
            let mut seq = |n: u64| -> Vec<u32> { (0..n).map(|_| r.below(vocab) as u32).collect() };
            let groups: Vec<PromptGroup> = (0..2)
                .map(|_| {
                    let p = 24 + SplitMix64::new(k).below(17);
                    PromptGroup {
                        prompt: seq(p),
                        responses: (0..4).map(|i| seq(8 + (i * 11 + k) % 33)).collect(),
                    }
                })
                .collect();
            let batch = model.shared_batch(&groups).unwrap();
            let mut c = normal_vec(batch.num_logprobs(), 0.0, 0.01, step * 10 + k);
            // Prompt tokens are not trained: zero their coefficients.
            let mut at = 0;
            for g in &groups {
                c[at..at + g.prompt.len() - 1].fill(0.0);
                at += g.prompt.len() - 1 + g.responses.iter().map(Vec::len).sum::<usize>();
            }
            let n = c.len();
            (batch, Tensor::from_vec(c, n, &Device::Cpu).unwrap())
        })
        .collect()
}

fn config() -> DecoderConfig {
    DecoderConfig {
        num_hidden_layers: 2,
        hidden_size: 128,
        intermediate_size: 344,
        ..DecoderConfig::tiny()
    }
}

/// The training loop's allocator for `model`: AdamW state, 1.10 x full recompute's peak,
/// a 1e-2 target, the codecs `hilore train` offers.
fn online_allocator(model: &Decoder) -> OnlineAllocator {
    let n_params: usize = model
        .named_params()
        .iter()
        .map(|(_, v)| v.elem_count())
        .sum();
    OnlineAllocator::new(
        StateBytes::adamw_f32(n_params),
        MemoryBudget::Factor(1.1),
        1e-2,
        &["bf16", "fp8-e4m3-b32", "int8-b32"],
    )
}

/// The decoder's row-wise units: run on the prompts' rows and the responses' rows apart.
const ROW_WISE: [&str; 6] = [
    "attn_norm",
    "qkv",
    "attn_out",
    "mlp_norm",
    "gate_up",
    "down",
];

#[test]
fn prompt_and_response_instances_are_planned_apart() {
    let cfg = config();
    let layers = cfg.num_hidden_layers;
    let model = Decoder::random(&cfg, 4, &Device::Cpu).unwrap();
    let mut work = TapeWorkload::new(&model);
    let (batch, seed) = data(&model, 0).swap_remove(0);
    let rows = batch.packing.total_tokens();
    let prompt_rows = batch
        .packing
        .shared_prefix_rows()
        .expect("every prompt first");
    assert!(0 < prompt_rows && prompt_rows < rows);
    work.push(batch, seed).unwrap();
    let (profile, inst) = work.profile(0).unwrap();
    let count = |u: &str| inst.iter().filter(|i| i.unit == u).count();
    assert_eq!(count("layer"), layers);
    assert_eq!(count("attn_core"), layers, "one instance over both parts");
    for u in ROW_WISE {
        assert_eq!(
            count(u),
            2 * layers,
            "{u}: a prompt and a response instance per layer"
        );
    }
    // Call 2l runs on the prompt rows, 2l + 1 on the response rows; qkv's cost expression
    // is linear in the rows (a multiple of them, exact in f64 for these small counts), so
    // cost(2l) * response rows == cost(2l + 1) * prompt rows. Relative tolerance: two
    // products of doubles, each rounded once (2 * 2^-53), and the expression's own
    // rounding of a multiply (2^-53 each), well inside 1e-12.
    for l in 0..layers {
        let cost = |call: usize| {
            inst.iter()
                .find(|i| i.unit == "qkv" && i.call == call)
                .unwrap()
                .cost
        };
        let (a, b) = (
            cost(2 * l) * (rows - prompt_rows) as f64,
            cost(2 * l + 1) * prompt_rows as f64,
        );
        assert!((a - b).abs() <= 1e-12 * a.abs(), "layer {l}: {a} vs {b}");
    }
    let n_params: usize = model
        .named_params()
        .iter()
        .map(|(_, v)| v.elem_count())
        .sum();
    let alloc = Allocator::new(
        profile,
        &inst,
        StateBytes::adamw_f32(n_params),
        &["int8-b32"],
    )
    .unwrap();
    let int8 = Fidelity::Compress("int8-b32");
    // Prompt instances stored, response instances compressed; and every instance of the
    // row-wise units compressed.
    let mut mixed = Plan::store_all().named("responses compressed");
    let mut all = Plan::store_all().named("row-wise units compressed");
    for u in ROW_WISE {
        for l in 0..layers {
            mixed.set_instance(u, 2 * l + 1, int8);
            all.set_instance(u, 2 * l, int8);
            all.set_instance(u, 2 * l + 1, int8);
        }
    }
    let exact = work.run(0, &Plan::store_all()).unwrap().grads;
    let mut peaks = Vec::new();
    let mut errors = Vec::new();
    for plan in [Plan::store_all(), mixed, all] {
        let mut g = Grads::new();
        let measured = work.run_into(0, &plan, &mut g).unwrap();
        assert_eq!(
            alloc.simulate_peak(&plan).unwrap(),
            measured,
            "{}",
            plan.name()
        );
        peaks.push(measured);
        errors.push(grad_error(&work.run(0, &plan).unwrap().grads, &exact).0);
    }
    // Compressing the response instances saves bytes, and the prompt instances' bytes
    // on top of that save more: each part holds only its own rows.
    assert!(
        peaks[0] > peaks[1] && peaks[1] > peaks[2],
        "peaks {peaks:?}"
    );
    // Store-all is exact; the mixed plan's error lies between it and the error of both
    // parts compressed (the prompt instances' errors add to the responses').
    assert_eq!(errors[0], 0.0);
    assert!(
        0.0 < errors[1] && errors[1] < errors[2],
        "errors {errors:?}"
    );
}

#[test]
fn predicted_peak_equals_measured_on_shared_prefix_microbatches() {
    let cfg = config();
    let model = Decoder::random(&cfg, 4, &Device::Cpu).unwrap();
    let mut alloc = online_allocator(&model);
    for step in 0..2u64 {
        let mut work = TapeWorkload::new(&model);
        for (batch, seed) in data(&model, step) {
            assert!(batch.packing.has_shared_prefixes());
            work.push(batch, seed).unwrap();
        }
        let plan = alloc.plan_step(&mut work).unwrap();
        let mut grads = Grads::new();
        for (i, d) in plan.decisions.iter().enumerate() {
            let peak = work.run_into(i, &d.plan, &mut grads).unwrap();
            assert_eq!(peak, d.predicted_peak_bytes, "step {step} microbatch {i}");
            assert!(
                d.predicted_total_bytes <= plan.budget_bytes,
                "step {step} microbatch {i}"
            );
        }
        assert!(model
            .named_params()
            .iter()
            .all(|(_, p)| grads.get(p.id()).is_some()));
    }
    assert!(alloc.is_calibrated());
}

#[test]
fn log_probs_are_part_of_the_profile_key() {
    // Two shared microbatches of the same rows and prompt rows, the second with one more
    // one-token response (a log-prob and no row): the head saves per log-prob, so their
    // profiles' byte figures differ and their profile keys must too; planned in one step
    // (twice: the first calibrates), every predicted peak is the measured one.
    let cfg = config();
    let model = Decoder::random(&cfg, 4, &Device::Cpu).unwrap();
    let vocab = cfg.vocab_size as u64;
    let mut r = SplitMix64::new(7);
    let mut seq = |n: usize| -> Vec<u32> { (0..n).map(|_| r.below(vocab) as u32).collect() };
    let (prompt, a, b) = (seq(20), seq(10), seq(10));
    let one = seq(1);
    let batches = [
        vec![PromptGroup {
            prompt: prompt.clone(),
            responses: vec![a.clone(), b.clone()],
        }],
        vec![PromptGroup {
            prompt,
            responses: vec![a, b, one],
        }],
    ];
    let mut work = TapeWorkload::new(&model);
    for (k, groups) in batches.iter().enumerate() {
        let batch = model.shared_batch(groups).unwrap();
        let n = batch.num_logprobs();
        let c = normal_vec(n, 0.0, 0.01, 40 + k as u64);
        work.push(batch, Tensor::from_vec(c, n, &Device::Cpu).unwrap())
            .unwrap();
    }
    let (x, y) = (work.input(0).shape, work.input(1).shape);
    assert_eq!((x.tokens, x.prompt_rows), (y.tokens, y.prompt_rows));
    assert_eq!(y.logprobs, x.logprobs + 1);
    assert_ne!(x.profile_key(), y.profile_key());
    // The head's own saved bytes (what the profile holds per instance) differ.
    let mut head_bytes = |i: usize| {
        let (profile, _) = work.profile(i).unwrap();
        profile
            .instances()
            .into_iter()
            .find(|b| b.unit == "head")
            .expect("a head instance")
            .own_saved_bytes
    };
    let (h0, h1) = (head_bytes(0), head_bytes(1));
    assert!(
        h1 > h0,
        "one more log-prob: the head saves {h1} bytes, against {h0}"
    );
    let mut grads = Grads::new();
    let mut alloc = online_allocator(&model);
    for step in 0..2 {
        let plan = alloc.plan_step(&mut work).unwrap();
        for (i, d) in plan.decisions.iter().enumerate() {
            let peak = work.run_into(i, &d.plan, &mut grads).unwrap();
            assert_eq!(peak, d.predicted_peak_bytes, "step {step} microbatch {i}");
        }
    }
}
