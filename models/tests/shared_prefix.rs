//! The decoder over a shared-prefix batch (each prompt held once,
//! [`TokenBatch::from_shared_prefixes`]) against the same decoder over the concatenations
//! `prompt ++ response` it replaces: every log-prob, and every parameter gradient when
//! each concatenation's log-probs get their own coefficients (a prompt token's
//! coefficients summed over its copies, as the shared batch holds it once). On random
//! decoders of each family (GQA, biases, q/k norms, a sliding window that cuts into the
//! prompt) and on a zoo model directory; recompute bit-identical to store.

mod support;

use candle_core::{DType, Device, Tensor};
use hilore_models::{plans, rng, zoo, Decoder, DecoderConfig, PromptGroup, TokenBatch};
use hilore_runtime::{Cx, Grads, Plan};
use support::{bits, max_abs, rel_l2};

/// Relative L2 bound per parameter gradient. Both sides compute the same function in f32
/// in another order (attention over the prompt's key tiles and then the response's instead
/// of one run of keys; a prompt row's gradient summed once over its responses instead of
/// per copy and then over copies by the embedding's scatter): the derivation of
/// `reference.rs`'s `GRAD_BOUND` (sums of a few hundred products, `sqrt(n) u` each,
/// through a few layers: about 1e-6) holds as it is, and so its 1e-5.
const GRAD_BOUND: f64 = 1e-5;

/// Max abs difference of the log-probs (about `-ln(61) ~ -4`, a few ulps of 4 per op over
/// tens of ops), as `reference.rs`'s `LOGP_BOUND`.
const LOGP_BOUND: f64 = 2e-5;

fn config(model_type: &str, bias: bool, tied: bool) -> DecoderConfig {
    DecoderConfig {
        vocab_size: 61,
        hidden_size: 24,
        intermediate_size: 40,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        tie_word_embeddings: tied,
        max_position_embeddings: 64,
        attention_bias: bias,
        model_type: Some(model_type.into()),
        ..DecoderConfig::tiny()
    }
}

/// Prompts of 9, 1 and 3 tokens with responses of 5, 1 and 12; 4 and 2; 7 tokens: a
/// one-token prompt (no prompt log-probs) and a one-token response (no rows of its own).
fn groups(vocab: usize, seed: u64) -> Vec<PromptGroup> {
    let mut r = rng::SplitMix64::new(seed);
    let mut seq = |n: usize| -> Vec<u32> { (0..n).map(|_| r.below(vocab as u64) as u32).collect() };
    [(9, vec![5, 1, 12]), (1, vec![4, 2]), (3, vec![7])]
        .into_iter()
        .map(|(p, rs)| PromptGroup {
            prompt: seq(p),
            responses: rs.into_iter().map(&mut seq).collect(),
        })
        .collect()
}

/// The concatenations and, for each of their log-probs in order, the shared batch's
/// log-prob it equals.
fn concatenations(groups: &[PromptGroup]) -> (Vec<Vec<u32>>, Vec<usize>) {
    let (mut seqs, mut index, mut at) = (Vec::new(), Vec::new(), 0);
    for g in groups {
        let prompt_part = at..at + g.prompt.len() - 1;
        at = prompt_part.end;
        for r in &g.responses {
            seqs.push([g.prompt.clone(), r.clone()].concat());
            index.extend(prompt_part.clone());
            index.extend(at..at + r.len());
            at += r.len();
        }
    }
    (seqs, index)
}

fn grads_of(model: &Decoder, plan: Plan, batch: &TokenBatch, coeffs: &Tensor) -> (Tensor, Grads) {
    let mut cx = Cx::new(plan).verify_recompute(true);
    let logp = model.token_logprobs(&mut cx, batch).unwrap();
    let mut grads = Grads::new();
    cx.backward(&logp, coeffs, &mut grads).unwrap();
    (logp.tensor().clone(), grads)
}

/// Shared against concatenated on `model`; recompute plans against store on the shared
/// batch, bit for bit. Returns the worst gradient error.
fn compare(label: &str, model: &Decoder, seed: u64) -> f64 {
    let dev = Device::Cpu;
    let cfg = model.config();
    let groups = groups(cfg.vocab_size, seed);
    let shared = TokenBatch::from_shared_prefixes(&groups, cfg, &dev).unwrap();
    let (seqs, index) = concatenations(&groups);
    let plain = TokenBatch::from_sequences(&seqs, cfg, &dev).unwrap();
    assert_eq!(plain.num_logprobs(), index.len());
    // Rows: the prompt, then each response less its last token: 9 + (4 + 0 + 11),
    // 1 + (3 + 1), 3 + 6. Log-probs: the prompt's tokens after its first, then every
    // response token: 8 + (5 + 1 + 12), 0 + (4 + 2), 2 + 7.
    assert_eq!(shared.num_tokens(), 24 + 5 + 9);
    assert_eq!(shared.num_logprobs(), 26 + 6 + 9);

    // Each concatenation's log-probs get their own coefficients; the shared batch's are
    // their sums over copies.
    let c_plain: Vec<f32> = rng::normal_vec(index.len(), 0.0, 1.0, seed + 1);
    let mut c_shared = vec![0f32; shared.num_logprobs()];
    for (u, &s) in index.iter().enumerate() {
        c_shared[s] += c_plain[u];
    }
    let c_plain = Tensor::from_vec(c_plain, index.len(), &dev).unwrap();
    let c_shared = Tensor::from_vec(c_shared, shared.num_logprobs(), &dev).unwrap();

    let (lp_s, g_s) = grads_of(model, plans::store_all(), &shared, &c_shared);
    let (lp_p, g_p) = grads_of(model, plans::store_all(), &plain, &c_plain);
    let idx = Tensor::from_vec(
        index.iter().map(|&i| i as u32).collect::<Vec<_>>(),
        index.len(),
        &dev,
    )
    .unwrap();
    let d = max_abs(&lp_s.index_select(&idx, 0).unwrap(), &lp_p);
    assert!(
        d <= LOGP_BOUND,
        "{label}: log-probs differ by {d:e} > {LOGP_BOUND:e}"
    );
    let mut worst = (0.0, String::new());
    for (name, p) in model.named_params() {
        let (a, b) = (g_s.get(p.id()).unwrap(), g_p.get(p.id()).unwrap());
        let e = rel_l2(a, b);
        assert!(
            e <= GRAD_BOUND,
            "{label}: {name}: relative L2 {e:e} > {GRAD_BOUND:e}"
        );
        if e > worst.0 {
            worst = (e, name);
        }
    }
    println!(
        "{label}: log-probs max abs {d:.2e}, worst gradient rel L2 {:.2e} ({})",
        worst.0, worst.1
    );

    // Recompute replays the shared layout bit for bit (verify_recompute checks every unit
    // instance's replay; the gradients equal store's).
    for plan in [
        plans::gradient_checkpointing(),
        plans::random_mixed(seed, cfg.num_hidden_layers, None),
    ] {
        let (lp, g) = grads_of(model, plan, &shared, &c_shared);
        assert_eq!(bits(&lp), bits(&lp_s), "{label}");
        for (name, p) in model.named_params() {
            assert_eq!(
                bits(g.get(p.id()).unwrap()),
                bits(g_s.get(p.id()).unwrap()),
                "{label}: {name}"
            );
        }
    }
    worst.0
}

#[test]
fn llama_gqa() {
    let m = Decoder::random(&config("llama", false, false), 21, &Device::Cpu).unwrap();
    compare("llama", &m, 21);
}

#[test]
fn qwen2_bias_tied() {
    let m = Decoder::random(&config("qwen2", true, true), 22, &Device::Cpu).unwrap();
    compare("qwen2", &m, 22);
}

#[test]
fn qwen3_qk_norm() {
    let m = Decoder::random(&config("qwen3", true, false), 23, &Device::Cpu).unwrap();
    compare("qwen3", &m, 23);
}

#[test]
fn mistral_window_cutting_into_the_prompt() {
    // A window of 6 keys: the 9-token prompt's first rows fall out of its responses' view.
    let cfg = DecoderConfig {
        sliding_window: Some(6),
        ..config("mistral", false, false)
    };
    assert_eq!(cfg.layer_window(0), Some(6));
    let m = Decoder::random(&cfg, 24, &Device::Cpu).unwrap();
    compare("mistral", &m, 24);
}

#[test]
fn zoo_model_directory() {
    let dir = std::env::temp_dir().join(format!("hilore-shared-prefix-{}", std::process::id()));
    let m = Decoder::random(&config("qwen3", false, true), 25, &Device::Cpu).unwrap();
    zoo::export_with(&m, m.config(), None, &dir, DType::F32).unwrap();
    let cfg = zoo::load_config(&dir).unwrap();
    let w = zoo::load_weights(&dir, &cfg, &Device::Cpu).unwrap();
    let loaded = Decoder::from_tensors(&cfg, &w).unwrap();
    compare("zoo qwen3", &loaded, 25);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_groups_are_refused() {
    let cfg = config("llama", false, false);
    let dev = Device::Cpu;
    let g = |prompt: Vec<u32>, responses: Vec<Vec<u32>>| PromptGroup { prompt, responses };
    let cases = [
        (vec![], "no prompt groups"),
        (vec![g(vec![], vec![vec![1]])], "prompt of at least 1 token"),
        (vec![g(vec![1], vec![])], "at least 1 response"),
        (
            vec![g(vec![1, 2], vec![vec![]])],
            "response 0 has no tokens",
        ),
        (
            vec![g(vec![1, 99], vec![vec![1]])],
            "prompt, token 1 is id 99",
        ),
        (
            vec![g(vec![1], vec![vec![2], vec![3, 70]])],
            "response 1, token 1 is id 70",
        ),
        (
            vec![g(vec![1; 40], vec![vec![2; 30]])],
            "more than the model's 64 positions",
        ),
    ];
    for (groups, expected) in cases {
        let e = TokenBatch::from_shared_prefixes(&groups, &cfg, &dev)
            .unwrap_err()
            .to_string();
        assert!(e.contains(expected), "{expected}: {e}");
    }
}
