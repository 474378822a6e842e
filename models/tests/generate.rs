//! KV-cache generation against the decoder's training forward: cached logits equal a full
//! recompute, recorded log-probs equal `Decoder::token_logprobs` on the same sequences;
//! sampling is deterministic under a seed and respects the stop token and the length.

use candle_core::{Device, Tensor};
use hilore_models::generate::{generate, last_token_logits, Finish, SamplingConfig, Session};
use hilore_models::{Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::Cx;

/// Bound on `max |cached - recomputed|` of the logits, relative to the largest logit
/// magnitude (plus the same amount absolute for near-zero logits).
///
/// Both paths compute the same function in f32 (unit roundoff 6e-8) in a different order:
/// the cache attends over left-padded rows with masked slots (exact zeros after `exp`) and
/// one query per row, the training op over packed sequences in `T x T` blocks; projections
/// see different row counts (so different matmul blocking). Each value is a sum of at most
/// `hidden` = 24 or `T` <= 16 products, through 2 layers of about ten ops each: a few
/// tens of roundings of the value's magnitude, ~1e-6 relative. 1e-5 leaves a 10x margin;
/// a wrong position, a mask off by one or a misrouted kv head changes logits by O(1)
/// relative.
const LOGIT_BOUND: f64 = 1e-5;

/// Bound on `|recorded - training forward|` of the log-probs, absolute. They are about
/// `-ln(61) = -4.1` (ulp 4.8e-7); the recorded one is `logit - logsumexp` in f64 from the
/// cached f32 logits (error <= LOGIT_BOUND x |logit| plus one rounding), the training head
/// the same in f32 with chunked max-subtracted sums: a few ulps of 4 plus the logits'
/// difference, ~2e-6. 2e-5 (the reference tests' bound for log-probs) leaves a 10x margin.
const LOGP_BOUND: f64 = 2e-5;

fn config(bias: bool) -> DecoderConfig {
    DecoderConfig {
        vocab_size: 61,
        hidden_size: 24,
        intermediate_size: 40,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 6,
        max_position_embeddings: 32,
        attention_bias: bias,
        model_type: Some(if bias { "qwen2" } else { "llama" }.into()),
        ..DecoderConfig::tiny()
    }
}

/// A model whose logits are far from uniform (weights scaled up), so that comparisons are
/// not between near-constant rows.
fn model(bias: bool, seed: u64) -> Decoder {
    model_of(&config(bias), seed)
}

/// Mistral with a sliding window of 3 keys (shorter than the prompts, so it masks), and
/// Qwen3 with its per-head q/k norm and linear RoPE scaling: the cache must apply both.
fn zoo_variants() -> Vec<DecoderConfig> {
    let mut mistral = config(false);
    mistral.model_type = Some("mistral".into());
    mistral.sliding_window = Some(3);
    let mut qwen3 = config(false);
    qwen3.model_type = Some("qwen3".into());
    qwen3.rope_scaling = Some(hilore_models::RopeScaling::Linear { factor: 4.0 });
    vec![mistral, qwen3]
}

fn model_of(cfg: &DecoderConfig, seed: u64) -> Decoder {
    let m = Decoder::random(cfg, seed, &Device::Cpu).unwrap();
    let mut m = m;
    for (name, p) in m.named_params_mut() {
        if !name.contains("norm") {
            let t = (p.tensor() * 20.0).unwrap();
            p.set_tensor(t).unwrap();
        }
    }
    m
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2().unwrap()
}

fn assert_logits_close(got: &Tensor, want: &Tensor, what: &str) {
    let (g, w) = (rows(got), rows(want));
    assert_eq!(g.len(), w.len(), "{what}: row count");
    let scale = w
        .iter()
        .flatten()
        .fold(0f64, |m, &x| m.max((x as f64).abs()));
    assert!(
        scale > 0.5,
        "{what}: logits should not be near zero (max {scale})"
    );
    let mut worst = 0f64;
    for (a, b) in g.iter().flatten().zip(w.iter().flatten()) {
        worst = worst.max((*a as f64 - *b as f64).abs());
    }
    assert!(
        worst <= LOGIT_BOUND * (1.0 + scale),
        "{what}: max |cached - recomputed| = {worst:e}, bound {:e}",
        LOGIT_BOUND * (1.0 + scale)
    );
}

#[test]
fn kv_cache_logits_equal_full_recompute() {
    let mut cfgs = vec![config(false), config(true)];
    cfgs.extend(zoo_variants());
    for cfg in cfgs {
        let m = model_of(&cfg, 3);
        let bias = cfg.model_type.clone().unwrap_or_default();
        let prompts: Vec<Vec<u32>> = vec![
            vec![5, 9, 2],
            vec![1, 2, 3, 4, 5, 6, 7],
            vec![40],
            vec![8, 8, 30, 11, 59],
        ];
        let (mut session, logits) = Session::prefill(&m, &prompts, 8).unwrap();
        assert_logits_close(
            &logits,
            &last_token_logits(&m, &prompts).unwrap(),
            "prefill",
        );
        let mut seqs = prompts.clone();
        let mut active: Vec<usize> = (0..seqs.len()).collect();
        for step in 0..7u32 {
            // Drop row 1 after two steps, and the (then) first row after four: the cache
            // keeps the remaining rows' state.
            if step == 2 || step == 4 {
                let drop = if step == 2 { 1 } else { 0 };
                let keep: Vec<usize> = (0..active.len()).filter(|&r| r != drop).collect();
                session.retain(&keep).unwrap();
                active = keep.iter().map(|&r| active[r]).collect();
            }
            let toks: Vec<u32> = active
                .iter()
                .map(|&i| (7 * step + 3 * i as u32 + 1) % 61)
                .collect();
            for (&i, &t) in active.iter().zip(&toks) {
                seqs[i].push(t);
            }
            let cached = session.step(&toks).unwrap();
            let live: Vec<Vec<u32>> = active.iter().map(|&i| seqs[i].clone()).collect();
            let full = last_token_logits(&m, &live).unwrap();
            assert_logits_close(&cached, &full, &format!("bias {bias}, step {step}"));
        }
    }
}

/// A prompt given several times (a GRPO group) is prefilled once: the session runs the
/// distinct prompts, and every row, copies included, then decodes its own tokens with
/// logits equal to a full recompute of its sequence (the bound above).
#[test]
fn repeated_prompts_are_prefilled_once() {
    let m = model_of(&config(false), 4);
    let (a, b) = (vec![5, 9, 2, 17], vec![1, 2, 3]);
    let prompts = vec![a.clone(), b.clone(), a.clone(), a.clone(), b];
    let (mut session, logits) = Session::prefill(&m, &prompts, 6).unwrap();
    assert_eq!(session.prefilled_rows(), 2);
    assert_eq!(session.rows(), 5);
    assert_logits_close(
        &logits,
        &last_token_logits(&m, &prompts).unwrap(),
        "prefill",
    );
    let mut seqs = prompts.clone();
    for step in 0..5u32 {
        // Every row its own token: the copies part after the first step.
        let toks: Vec<u32> = (0..seqs.len() as u32)
            .map(|i| (11 * step + 5 * i + 2) % 61)
            .collect();
        for (s, &t) in seqs.iter_mut().zip(&toks) {
            s.push(t);
        }
        let cached = session.step(&toks).unwrap();
        let full = last_token_logits(&m, &seqs).unwrap();
        assert_logits_close(&cached, &full, &format!("step {step}"));
    }
    let distinct = vec![vec![3u32], vec![4], vec![3, 4]];
    let (s, _) = Session::prefill(&m, &distinct, 2).unwrap();
    assert_eq!(s.prefilled_rows(), 3);
}

#[test]
fn recorded_logprobs_equal_the_training_forward() {
    // The training forward at the sampling temperature (1 when greedy), as a GRPO trainer
    // that samples at T trains on logits / T.
    let mut m = model(false, 5);
    let cfg = m.config().clone();
    let prompts: Vec<Vec<u32>> = vec![
        vec![3, 4],
        vec![10, 11, 12, 13, 14, 15],
        vec![60],
        vec![7, 7, 7],
    ];
    for (temperature, top_p) in [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0), (1.3, 0.5)] {
        let s = SamplingConfig {
            max_new_tokens: 9,
            temperature,
            top_p,
            stop_token: Some(0),
            seed: 11,
        };
        let gens = generate(&m, &prompts, &s).unwrap();
        m.set_logit_temperature(if temperature > 0.0 { temperature } else { 1.0 })
            .unwrap();
        let seqs: Vec<Vec<u32>> = prompts
            .iter()
            .zip(&gens)
            .map(|(p, g)| [p.clone(), g.tokens.clone()].concat())
            .collect();
        let batch = TokenBatch::from_sequences(&seqs, &cfg, &Device::Cpu).unwrap();
        let mut cx = Cx::inference();
        let logp: Vec<f32> = m
            .token_logprobs(&mut cx, &batch)
            .unwrap()
            .tensor()
            .to_vec1()
            .unwrap();
        let mut row = 0;
        let mut worst = 0f64;
        for (p, g) in prompts.iter().zip(&gens) {
            // Targets p.len() .. of this sequence sit at rows p.len() - 1 ..
            let start = row + p.len() - 1;
            for (k, &lp) in g.logprobs.iter().enumerate() {
                worst = worst.max((lp as f64 - logp[start + k] as f64).abs());
            }
            row += p.len() + g.tokens.len() - 1;
        }
        assert!(
            worst <= LOGP_BOUND,
            "T {temperature}, top_p {top_p}: max |recorded - training| = {worst:e}"
        );
    }
}

#[test]
fn sampling_is_seeded_and_respects_stop_and_length() {
    let m = model(true, 7);
    let prompts: Vec<Vec<u32>> = (0..12)
        .map(|i| vec![1 + i as u32, 2 * i as u32 + 3])
        .collect();
    let stop = 4;
    let s = SamplingConfig {
        max_new_tokens: 6,
        temperature: 1.0,
        top_p: 1.0,
        stop_token: Some(stop),
        seed: 42,
    };
    let a = generate(&m, &prompts, &s).unwrap();
    let b = generate(&m, &prompts, &s).unwrap();
    assert_eq!(a, b, "same seed, same output bit for bit");
    let c = generate(
        &m,
        &prompts,
        &SamplingConfig {
            seed: 43,
            ..s.clone()
        },
    )
    .unwrap();
    assert_ne!(a, c, "another seed samples other tokens");
    for g in &a {
        assert_eq!(g.tokens.len(), g.logprobs.len());
        assert!(g.logprobs.iter().all(|&l| l <= 0.0 && l.is_finite()));
        match g.finish {
            Finish::Stop => assert_eq!(g.tokens.last(), Some(&stop)),
            Finish::Length => assert_eq!(g.tokens.len(), 6),
        }
        assert!(
            !g.tokens[..g.tokens.len() - 1].contains(&stop),
            "nothing after the stop token"
        );
    }
    // Greedy picks the argmax of the full-recompute logits at every step.
    let greedy = generate(
        &m,
        &prompts[..3],
        &SamplingConfig {
            temperature: 0.0,
            stop_token: None,
            ..s.clone()
        },
    )
    .unwrap();
    for (p, g) in prompts[..3].iter().zip(&greedy) {
        let mut seq = p.clone();
        for &t in &g.tokens {
            let l = rows(&last_token_logits(&m, std::slice::from_ref(&seq)).unwrap()).remove(0);
            let best = (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b });
            assert_eq!(t as usize, best);
            seq.push(t);
        }
    }
    // A tiny nucleus keeps only the most probable token: greedy.
    let nucleus = generate(
        &m,
        &prompts[..3],
        &SamplingConfig {
            top_p: 1e-9,
            stop_token: None,
            ..s.clone()
        },
    )
    .unwrap();
    for (g, n) in greedy.iter().zip(&nucleus) {
        assert_eq!(g.tokens, n.tokens);
    }
    // No new tokens: empty responses.
    let none = generate(
        &m,
        &prompts,
        &SamplingConfig {
            max_new_tokens: 0,
            ..s
        },
    )
    .unwrap();
    assert!(none
        .iter()
        .all(|g| g.tokens.is_empty() && g.finish == Finish::Length));
}

#[test]
fn bad_inputs_are_errors() {
    let m = model(false, 1);
    let ok = SamplingConfig::default();
    let err = |prompts: &[Vec<u32>], s: &SamplingConfig| {
        generate(&m, prompts, s).unwrap_err().to_string()
    };
    assert!(err(&[vec![1], vec![]], &ok).contains("prompt 1 is empty"));
    assert!(err(&[vec![1, 61]], &ok).contains("outside the vocabulary"));
    assert!(err(
        &[vec![1]],
        &SamplingConfig {
            temperature: -1.0,
            ..ok.clone()
        }
    )
    .contains("temperature"));
    assert!(err(
        &[vec![1]],
        &SamplingConfig {
            top_p: 0.0,
            ..ok.clone()
        }
    )
    .contains("top_p"));
    assert!(err(
        &[vec![1]],
        &SamplingConfig {
            stop_token: Some(99),
            ..ok.clone()
        }
    )
    .contains("stop token"));
    // 30 prompt tokens + 8 new ones need 37 positions; the model has 32.
    let long = vec![vec![1u32; 30]];
    assert!(err(
        &long,
        &SamplingConfig {
            max_new_tokens: 8,
            ..ok.clone()
        }
    )
    .contains("max_position_embeddings"));
    assert!(generate(&m, &[], &ok).unwrap().is_empty());
}
