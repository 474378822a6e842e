//! The GPT-2-style example model, used as a model author would: gradients against the
//! same model on candle's autograd, every fidelity through `check_recovery`, the
//! allocator in a training loop of one's own, and GRPO through the library's actor
//! update.

use candle_core::{Device, Tensor};
use hilore::train::optimizer::{AdamW, AdamWConfig};
use hilore::train::rollout::Rollout;
use hilore::train::update::{actor_update, TapeWorkload, UpdateSettings};
use hilore::train::ActorModel;
use hilore_example_gpt2::{keep_registered, reference::CandleGpt2, Gpt2, Gpt2Config};
use hilore_models::rng::{normal_vec, SplitMix64};
use hilore_runtime::allocator::{MemoryBudget, OnlineAllocator, StateBytes};
use hilore_runtime::grpo::{advantages, GrpoConfig, StepLayout};
use hilore_runtime::{check::check_recovery, Cx, Grads, Plan};
use std::cell::RefCell;
use std::rc::Rc;

fn seqs(seed: u64, n: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut r = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let len = 6 + r.below(20) as usize;
            (0..len).map(|_| r.below(vocab as u64) as u32).collect()
        })
        .collect()
}

fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let num: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Relative L2 bound per parameter gradient, `||g_tape - g_candle|| / ||g_candle||`.
///
/// Both sides compute in f32 (unit roundoff `u = 2^-24 ~ 6e-8`) the same function in a
/// different order: the tape's attention per sequence tile from the log-sum-exp, its
/// LayerNorm and GELU backward in closed form, its head in chunks through
/// `dlogits = g (onehot - p)`; candle differentiates op by op. A gradient entry is a sum
/// of at most a few hundred products (tokens x width: 60 rows, 128 MLP columns) whose
/// f32 error is `~sqrt(n) u` typically and `n u` at worst, carried through 2 blocks:
/// `sqrt(300) * 6e-8 * (a few)` is about 1e-6; 1e-5 leaves 10x for the cancelling sums of
/// biases and LayerNorm weights, while a real error (a missing term, a wrong head split,
/// a position off by one) is O(1e-2..1).
const GRAD_BOUND: f64 = 1e-5;

#[test]
fn gradients_equal_candle_autograd_within_the_f32_bound() {
    let dev = Device::Cpu;
    let m = Gpt2::new(Gpt2Config::tiny(), 1, &dev).unwrap();
    let batch = m.batch(&seqs(2, 3, m.cfg.vocab_size)).unwrap();
    let n = batch.num_tokens();
    let seed = Tensor::from_vec(normal_vec(n, 0.0, 1.0, 3), n, &dev).unwrap();
    let mut cx = Cx::new(Plan::store_all());
    let logp = m.token_logprobs(&mut cx, &batch).unwrap();
    let mut g = Grads::new();
    cx.backward(&logp, &seed, &mut g).unwrap();
    let want = CandleGpt2::new(&m)
        .unwrap()
        .gradients(&batch, &seed)
        .unwrap();
    let params = m.named_params();
    assert_eq!(params.len(), want.len());
    for ((name, p), w) in params.iter().zip(&want) {
        let got = g
            .get(p.id())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let e = rel_l2(got, w);
        assert!(e <= GRAD_BOUND, "{name}: rel L2 {e:e} > {GRAD_BOUND:e}");
    }
}

#[test]
fn every_fidelity_recovers_the_gradient() {
    // The model's three units are registered in this binary.
    assert_eq!(keep_registered(), 3);
    let dev = Device::Cpu;
    let m = Gpt2::new(Gpt2Config::tiny(), 4, &dev).unwrap();
    let batch = m.batch(&seqs(5, 3, m.cfg.vocab_size)).unwrap();
    let n = batch.num_tokens();
    let seed = Tensor::from_vec(normal_vec(n, 0.0, 1.0, 6), n, &dev).unwrap();
    let params: Vec<_> = m.named_params().into_iter().map(|(_, v)| v).collect();
    let report = check_recovery(|cx| m.token_logprobs(cx, &batch), &params, &seed).unwrap();
    assert!(report.exact_plans_bit_identical(), "{report:#?}");
    // Recompute of each unit alone and of all, and compress-all per codec, were run.
    let plans: Vec<&str> = report.rows.iter().map(|r| r.plan.as_str()).collect();
    for want in [
        "recompute gpt2.block",
        "recompute gpt2.attn",
        "recompute gpt2.mlp",
    ] {
        assert!(
            plans.iter().any(|p| p.contains(want)),
            "{want} not in {plans:?}"
        );
    }
    // A lossy plan's error is bounded by its codec: bf16 keeps 8 significand bits
    // (relative error <= 2^-9 per value), the block-scaled int4 codec 3 bits of a block's
    // maximum (<= 2^-4 of it); the gradient's relative error stays below those per-value
    // bounds times a small propagation factor (a few), far below 1.
    for r in report.rows.iter().filter(|r| !r.exact) {
        assert!(r.rel_l2 > 0.0 && r.rel_l2 < 0.5, "{}: {}", r.plan, r.rel_l2);
    }
}

/// The allocator in a loop of one's own (the README's example): every microbatch within
/// the budget, its measured activation peak the predicted one byte for byte.
#[test]
fn the_allocator_plans_a_loop_of_ones_own() {
    let dev = Device::Cpu;
    let cfg = Gpt2Config {
        n_embd: 64,
        ..Gpt2Config::tiny()
    };
    let mut model = Gpt2::new(cfg, 7, &dev).unwrap();
    let n_params: usize = model
        .named_params()
        .iter()
        .map(|(_, v)| v.elem_count())
        .sum();
    let mut opt = AdamW::new(adamw(), &model);
    let before = model.wte.tensor().to_vec2::<f32>().unwrap();
    // -- the README's loop, 15 lines beyond the model and the data
    let state = StateBytes::adamw_f32(n_params);
    let mut alloc = OnlineAllocator::new(state, MemoryBudget::Factor(1.1), 1e-2, &CODECS);
    for step in 0..2u64 {
        let mut work = TapeWorkload::new(&model);
        for (batch, seed) in data(&model, step) {
            work.push(batch, seed).unwrap();
        }
        let plan = alloc.plan_step(&mut work).unwrap();
        let mut grads = Grads::new();
        for (i, d) in plan.decisions.iter().enumerate() {
            let peak = work.run_into(i, &d.plan, &mut grads).unwrap();
            assert_eq!(peak, d.predicted_peak_bytes, "step {step} microbatch {i}");
            assert!(d.predicted_total_bytes <= plan.budget_bytes);
        }
        opt.step(&mut model, &grads).unwrap();
    }
    assert_ne!(before, model.wte.tensor().to_vec2::<f32>().unwrap());
    assert!(alloc.is_calibrated());
}

const CODECS: [&str; 3] = ["bf16", "fp8-e4m3-b32", "int8-b32"];

fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.0,
        max_grad_norm: 1.0,
    }
}

/// Two microbatches of a step: packed sequences and GRPO-like seeds (one coefficient per
/// response row, of either sign; 0 on the first rows, the prompt).
fn data(model: &Gpt2, step: u64) -> Vec<(hilore_models::TokenBatch, Tensor)> {
    (0..2)
        .map(|k| {
            let s = seqs(100 + 10 * step + k, 6, model.cfg.vocab_size);
            let batch = model.batch(&s).unwrap();
            let n = batch.num_tokens();
            let mut v = normal_vec(n, 0.0, 0.05, 200 + step * 10 + k);
            for off in batch.packing.offsets().windows(2) {
                v[off[0]..off[0] + 3].fill(0.0);
            }
            (batch, Tensor::from_vec(v, n, &Device::Cpu).unwrap())
        })
        .collect()
}

/// GRPO through the library's actor update with the allocator: the model trains (the
/// weights move, the gradient is finite and nonzero), every microbatch planned.
#[test]
fn trains_with_grpo_through_the_actor_update() {
    let dev = Device::Cpu;
    let mut m = Gpt2::new(Gpt2Config::tiny(), 9, &dev).unwrap();
    let s = seqs(10, 8, m.cfg.vocab_size);
    let rewards: Vec<f32> = (0..s.len()).map(|i| (i % 3 == 0) as u8 as f32).collect();
    let prompt_lens = vec![3; s.len()];
    let rollout = Rollout::scored(s, prompt_lens, rewards.clone());
    let adv = advantages(&rewards, 4, Default::default(), 1e-4).unwrap();
    let n_params: usize = m.named_params().iter().map(|(_, v)| v.elem_count()).sum();
    let alloc = OnlineAllocator::new(
        StateBytes::adamw_f32(n_params),
        MemoryBudget::Factor(1.1),
        1e-2,
        &["bf16", "fp8-e4m3-b32"],
    );
    let settings = UpdateSettings {
        grpo: GrpoConfig::default(),
        layout: StepLayout::single(8),
        token_budget: 128,
        plan: Plan::store_all(),
        skip_zero_exposure: false,
        shared_prefix: false,
        allocator: Some(Rc::new(RefCell::new(alloc))),
    };
    let before = m.wte.tensor().to_vec2::<f32>().unwrap();
    let mut opt = AdamW::new(adamw(), &m);
    let rep = actor_update(&mut m, None, &mut opt, &rollout, &adv, &settings).unwrap();
    assert!(
        rep.grad_norm.is_finite() && rep.grad_norm > 0.0,
        "{}",
        rep.grad_norm
    );
    assert!(
        rep.planned_microbatches > 0,
        "the allocator planned nothing"
    );
    assert_ne!(before, m.wte.tensor().to_vec2::<f32>().unwrap());
}
