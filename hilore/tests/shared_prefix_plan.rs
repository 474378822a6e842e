//! The allocator over shared-prefix microbatches: plans within the budget whose predicted
//! activation peak equals the measured one on every microbatch, for two steps (the first
//! calibrates), under a budget of 1.10 x full recompute's peak.

use candle_core::{Device, Tensor};
use hilore::train::update::TapeWorkload;
use hilore::train::ActorModel;
use hilore_models::rng::{normal_vec, SplitMix64};
use hilore_models::{Decoder, DecoderConfig, PromptGroup};
use hilore_runtime::allocator::{MemoryBudget, OnlineAllocator, StateBytes};
use hilore_runtime::Grads;

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

#[test]
fn predicted_peak_equals_measured_on_shared_prefix_microbatches() {
    let cfg = DecoderConfig {
        num_hidden_layers: 2,
        hidden_size: 128,
        intermediate_size: 344,
        ..DecoderConfig::tiny()
    };
    let model = Decoder::random(&cfg, 4, &Device::Cpu).unwrap();
    let n_params: usize = model
        .named_params()
        .iter()
        .map(|(_, v)| v.elem_count())
        .sum();
    let mut alloc = OnlineAllocator::new(
        StateBytes::adamw_f32(n_params),
        MemoryBudget::Factor(1.1),
        1e-2,
        &["bf16", "fp8-e4m3-b32", "int8-b32"],
    );
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
