//! The parameter gradient of the GRPO actor update, computed the HiLoRe way (tape forward,
//! analytic coefficients `dL/dlogp`, backward seeded with them), against the gradient of
//! the GRPO loss written in candle ops on the candle-autograd reference model and
//! differentiated by candle in one backward pass.

use candle_core::{Device, Tensor};
use hilore_models::reference::CandleDecoder;
use hilore_models::rng::SplitMix64;
use hilore_models::{plans, Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::grpo::{
    advantages, aggregation_weights, AdvantageNorm, Aggregation, Coefficients, GrpoConfig,
    Sequences, TokenLogprobs,
};
use hilore_runtime::{Cx, Grads, Plan};

/// Relative L2 bound per parameter gradient, `||g_tape - g_candle|| / ||g_candle||`.
///
/// The two sides differ only in f32 evaluation order: the model's forward and backward
/// (the reference tests bound that part by 1e-5, see `models/tests/reference.rs`: sums of
/// a few hundred products through 2 layers, ~1e-6 typical) and the loss's derivative
/// (analytic in f64 rounded once to f32, against candle's op-by-op f32 chain through
/// exp/min/clamp: a few roundings, ~1e-7 relative per token). 1e-5 leaves a 10x margin;
/// a wrong sign, a missing KL term, a clipped token let through or a misaligned response
/// row is an O(1e-1..1) relative error.
const GRAD_BOUND: f64 = 1e-5;

fn config() -> DecoderConfig {
    DecoderConfig {
        vocab_size: 29,
        hidden_size: 24,
        intermediate_size: 40,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 6,
        max_position_embeddings: 64,
        ..DecoderConfig::tiny()
    }
}

/// Two groups of three sequences: prompts of 2..=4 tokens, responses of 1..=7 tokens (one
/// of exactly one token, one of the maximum), token ids uniform.
fn sequences(rng: &mut SplitMix64) -> (Vec<Vec<u32>>, Vec<usize>) {
    let response_lens = [1usize, 5, 7, 3, 7, 2];
    let mut seqs = Vec::new();
    let mut prompt_lens = Vec::new();
    for &r in &response_lens {
        let p = 2 + rng.below(3) as usize;
        seqs.push((0..p + r).map(|_| rng.below(29) as u32).collect());
        prompt_lens.push(p);
    }
    (seqs, prompt_lens)
}

fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(&b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    assert!(den > 0.0, "reference gradient is exactly zero");
    (num / den).sqrt()
}

struct Case {
    cfg: GrpoConfig,
    /// Later epoch: old log-probs differ from the current ones (rho != 1, clipping).
    later_epoch: bool,
    plan: Plan,
}

fn check(case: &Case, seed: u64) {
    let dev = Device::Cpu;
    let mcfg = config();
    let model = Decoder::random(&mcfg, seed, &dev).unwrap();
    let mut rng = SplitMix64::new(seed + 1);
    let (seqs, prompt_lens) = sequences(&mut rng);
    let response_lens: Vec<usize> = seqs
        .iter()
        .zip(&prompt_lens)
        .map(|(s, p)| s.len() - p)
        .collect();
    let rewards = [1.0f32, 0.0, 0.1, 0.0, 1.0, 1.0];
    let adv = advantages(&rewards, 3, case.cfg.advantage_norm, case.cfg.std_eps).unwrap();
    let w = aggregation_weights(&response_lens, case.cfg.aggregation);
    let batch = TokenBatch::from_sequences(&seqs, &mcfg, &dev).unwrap();
    let n = batch.num_tokens();
    // Row of each response token: target k of sequence i sits at row off_i + k - 1.
    let mut rows = Vec::new();
    let mut seq_of_row = vec![usize::MAX; n];
    let mut off = 0;
    for (i, s) in seqs.iter().enumerate() {
        for k in prompt_lens[i]..s.len() {
            rows.push(off + k - 1);
            seq_of_row[off + k - 1] = i;
        }
        off += s.len() - 1;
    }

    // HiLoRe: forward on the tape, analytic coefficients, backward seeded with them.
    let mut cx = Cx::new(case.plan.clone());
    let logp = model.token_logprobs(&mut cx, &batch).unwrap();
    let all: Vec<f32> = logp.tensor().to_vec1().unwrap();
    let cur: Vec<f32> = rows.iter().map(|&r| all[r]).collect();
    // Old log-probs put rho in [0.6, 1.5] (both clip sides hit); the reference within +-0.7.
    let old: Vec<f32> = cur
        .iter()
        .map(|&l| l - (0.6 + 0.9 * rng.uniform()).ln() as f32)
        .collect();
    let reference: Vec<f32> = cur
        .iter()
        .map(|&l| l + (1.4 * rng.uniform() - 0.7) as f32)
        .collect();
    let seqs_view = Sequences {
        lengths: &response_lens,
        advantages: &adv,
        weights: &w,
    };
    let coeffs = Coefficients::after_forward(
        &case.cfg,
        seqs_view,
        TokenLogprobs {
            logp: &cur,
            old: case.later_epoch.then_some(old.as_slice()),
            reference: Some(&reference),
        },
    )
    .unwrap();
    if case.later_epoch {
        assert!(
            coeffs.stats.clipped_low + coeffs.stats.clipped_high > 0,
            "some token is clipped"
        );
    }
    let mut seed_rows = vec![0f32; n];
    for (&r, &c) in rows.iter().zip(&coeffs.per_token) {
        seed_rows[r] = c;
    }
    let mut grads = Grads::new();
    cx.backward(
        &logp,
        &Tensor::from_vec(seed_rows, n, &dev).unwrap(),
        &mut grads,
    )
    .unwrap();

    // Candle: the GRPO loss written in candle ops, differentiated by candle in one pass.
    let cand = CandleDecoder::from_decoder(&model).unwrap();
    let lp = cand.token_logprobs(&batch).unwrap();
    let per_row = |f: &dyn Fn(usize, usize) -> f32| -> Tensor {
        let mut v = vec![0f32; n];
        for (t, &r) in rows.iter().enumerate() {
            v[r] = f(t, seq_of_row[r]);
        }
        Tensor::from_vec(v, n, &dev).unwrap()
    };
    let mask = per_row(&|_, _| 1.0);
    let a = per_row(&|_, i| adv[i]);
    let wt = per_row(&|_, i| w[i]);
    // First epoch: the old log-probs are the current values, detached.
    let old_t = if case.later_epoch {
        per_row(&|t, _| old[t])
    } else {
        lp.detach()
    };
    let ref_t = per_row(&|t, _| reference[t]);
    let rho = (&lp - &old_t).unwrap().exp().unwrap();
    let lo = 1.0 - case.cfg.eps_low as f64;
    let hi = 1.0 + case.cfg.eps_high as f64;
    let unclipped = (&rho * &a).unwrap();
    let clipped = (rho.clamp(lo, hi).unwrap() * &a).unwrap();
    let surrogate = unclipped.minimum(&clipped).unwrap();
    let d = (&ref_t - &lp).unwrap();
    let k3 = ((d.exp().unwrap() - &d).unwrap() - 1.0).unwrap();
    // TRL's use_bias_correction_kl: the KL estimate importance-weighted by the ratio,
    // differentiated through it.
    let kl = if case.cfg.kl_bias_correction {
        (&rho * &k3).unwrap()
    } else {
        k3
    };
    let per_token = ((kl * case.cfg.beta as f64).unwrap() - surrogate).unwrap();
    let loss = (per_token * wt)
        .unwrap()
        .mul(&mask)
        .unwrap()
        .sum_all()
        .unwrap();
    let store = loss.backward().unwrap();
    let vars: Vec<&Tensor> = loss
        .sorted_nodes()
        .into_iter()
        .filter(|t| t.is_variable())
        .collect();

    let mut worst = (0f64, String::new());
    for (name, p) in model.named_params() {
        // The reference's copy of this parameter: the variable with the same values.
        let want: Vec<f32> = p.tensor().flatten_all().unwrap().to_vec1().unwrap();
        let var = vars
            .iter()
            .find(|v| {
                v.dims() == p.dims() && v.flatten_all().unwrap().to_vec1::<f32>().unwrap() == want
            })
            .unwrap_or_else(|| panic!("no candle variable holds {name}"));
        let g_candle = store
            .get(var)
            .unwrap_or_else(|| panic!("candle: no gradient for {name}"));
        let g_tape = grads
            .get(p.id())
            .unwrap_or_else(|| panic!("tape: no gradient for {name}"));
        let e = rel_l2(g_tape, g_candle);
        if e > worst.0 {
            worst = (e, name.clone());
        }
    }
    assert!(
        worst.0 <= GRAD_BOUND,
        "{:?} later_epoch={} plan {}: worst gradient rel L2 {:e} at {}",
        case.cfg,
        case.later_epoch,
        case.plan.name(),
        worst.0,
        worst.1
    );
}

#[test]
fn tape_gradient_from_coefficients_equals_candle_autograd_of_the_grpo_loss() {
    let mut seed = 100;
    for aggregation in [
        Aggregation::TokenMean,
        Aggregation::SeqMeanTokenMean,
        Aggregation::DrGrpo {
            max_completion_length: 9,
        },
    ] {
        for (beta, advantage_norm, kl_bias_correction) in [
            (0.0, AdvantageNorm::GroupStd, true),
            (0.2, AdvantageNorm::None, true),
            (0.2, AdvantageNorm::BatchStd, false),
        ] {
            for later_epoch in [false, true] {
                let cfg = GrpoConfig {
                    beta,
                    aggregation,
                    advantage_norm,
                    kl_bias_correction,
                    ..GrpoConfig::default()
                };
                check(
                    &Case {
                        cfg,
                        later_epoch,
                        plan: plans::store_all(),
                    },
                    seed,
                );
                seed += 1;
            }
        }
    }
}

#[test]
fn same_gradient_under_recompute() {
    // The fidelity policy does not change the math: per-layer recompute is bit-identical
    // to store-all, so it meets the same bound.
    let cfg = GrpoConfig {
        beta: 0.1,
        ..GrpoConfig::default()
    };
    check(
        &Case {
            cfg,
            later_epoch: true,
            plan: plans::gradient_checkpointing(),
        },
        7,
    );
}
