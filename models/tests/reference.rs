//! The tape's decoder against the same model on candle's own autograd
//! ([`hilore_models::reference::CandleDecoder`]): forward log-probs and every parameter
//! gradient, for GQA configs tied and untied, with and without q/k/v bias.

mod support;

use candle_core::{DType, Device};
use hilore_models::reference::CandleDecoder;
use hilore_models::{plans, rng, Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::{Cx, Grads};
use support::{bits, max_abs, rel_l2};

/// Relative L2 bound per parameter gradient, `||g_tape - g_candle|| / ||g_candle||`.
///
/// Both sides compute in f32 (unit roundoff `u = 2^-24 ~ 6e-8`) the same mathematical
/// function in a different order: the tape sums attention per kv-group block and its
/// backward from the log-sum-exp, the head in chunks and through `dlogits = g(onehot - p)`,
/// RMSNorm's backward in closed form; candle differentiates op by op. Each gradient entry
/// is a sum of a few hundred products (tokens x width) whose f32 error is at most
/// `~n u` in the worst case and `~sqrt(n) u` typically, propagated through a few layers:
/// `sqrt(300) * 6e-8 * (a few)` is about 1e-6. 1e-5 leaves a 10x margin for the
/// gradients with cancellation (biases, norm weights) while any real error (a missing
/// term, a wrong head mapping, a misplaced sequence boundary) is O(1e-2..1).
const GRAD_BOUND: f64 = 1e-5;

/// Max abs difference of the log-probs. They are about `-ln(vocab) ~ -4`, computed in f32
/// through 2 layers: a few ulps of 4 (ulp 4.8e-7) per op, over tens of ops: ~1e-5 at worst.
const LOGP_BOUND: f64 = 2e-5;

fn config(tied: bool, bias: bool) -> DecoderConfig {
    DecoderConfig {
        vocab_size: 61,
        hidden_size: 24,
        intermediate_size: 40,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        tie_word_embeddings: tied,
        max_position_embeddings: 64,
        attention_bias: bias,
        model_type: Some(if bias { "qwen2" } else { "llama" }.into()),
        ..DecoderConfig::tiny()
    }
}

/// Returns (logp max abs diff, worst per-tensor gradient rel L2, its name).
fn compare(cfg: &DecoderConfig, seed: u64) -> (f64, f64, String) {
    let dev = Device::Cpu;
    let model = Decoder::random(cfg, seed, &dev).unwrap();
    let reference = CandleDecoder::from_decoder(&model).unwrap();
    // Sequences of 5, 9 and 13 tokens: 4 + 8 + 12 = 24 rows.
    let batch = TokenBatch::random(&[5, 9, 13], cfg, seed + 1, &dev).unwrap();
    let n = batch.num_tokens();
    assert_eq!(n, 24);
    // Random nonzero per-token coefficients dL/dlogp.
    let coeffs = rng::normal_tensor(n, 0.0, 1.0, seed + 2, &dev).unwrap();

    let mut cx = Cx::new(plans::store_all());
    let logp = model.token_logprobs(&mut cx, &batch).unwrap();
    let mut grads = Grads::new();
    cx.backward(&logp, &coeffs, &mut grads).unwrap();

    let (ref_logp, ref_grads) = reference.logprobs_and_gradients(&batch, &coeffs).unwrap();
    let logp_diff = max_abs(logp.tensor(), &ref_logp);
    assert!(
        logp_diff <= LOGP_BOUND,
        "log-probs differ from candle's by {logp_diff:e} (bound {LOGP_BOUND:e})"
    );

    let params = model.named_params();
    assert_eq!(params.len(), ref_grads.len());
    let mut worst = (0.0, String::new());
    for ((name, p), (ref_name, g_ref)) in params.iter().zip(&ref_grads) {
        assert_eq!(name, ref_name);
        let g = grads
            .get(p.id())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_eq!(g.dims(), g_ref.dims(), "{name}");
        assert_eq!(g.dtype(), DType::F32);
        let e = rel_l2(g, g_ref);
        // f32 arithmetic in two different orders; see GRAD_BOUND for the derivation.
        assert!(
            e <= GRAD_BOUND,
            "{name}: relative L2 error {e:e} > {GRAD_BOUND:e}"
        );
        if e > worst.0 {
            worst = (e, name.clone());
        }
    }
    println!(
        "tied={} bias={}: logp max abs diff {logp_diff:e}, worst grad rel L2 {:e} ({})",
        cfg.tie_word_embeddings, cfg.attention_bias, worst.0, worst.1
    );
    (logp_diff, worst.0, worst.1)
}

#[test]
fn untied_without_bias_matches_candle() {
    compare(&config(false, false), 11);
}

#[test]
fn tied_with_bias_matches_candle() {
    compare(&config(true, true), 12);
}

#[test]
fn untied_with_bias_matches_candle() {
    compare(&config(false, true), 13);
}

#[test]
fn tied_without_bias_matches_candle() {
    compare(&config(true, false), 14);
}

#[test]
fn named_params_follow_hf_names() {
    let dev = Device::Cpu;
    let cfg = config(false, true);
    let model = Decoder::random(&cfg, 1, &dev).unwrap();
    let names: Vec<String> = model.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names[0], "model.embed_tokens.weight");
    assert_eq!(
        &names[1..12],
        &[
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.0.self_attn.v_proj.bias",
            "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        ]
    );
    assert_eq!(names[names.len() - 2], "model.norm.weight");
    assert_eq!(names[names.len() - 1], "lm_head.weight");
    assert_eq!(names.len(), 1 + 2 * 12 + 2);
    let tied = Decoder::random(&config(true, false), 1, &dev).unwrap();
    let tnames: Vec<String> = tied.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(tnames.last().unwrap(), "model.norm.weight");
    assert!(!tnames
        .iter()
        .any(|n| n.contains("bias") || n == "lm_head.weight"));
    // The seeded init reproduces bit for bit.
    let again = Decoder::random(&cfg, 1, &dev).unwrap();
    for ((n, a), (_, b)) in model.named_params().iter().zip(again.named_params()) {
        assert_eq!(bits(a.tensor()), bits(b.tensor()), "{n}");
    }
    let counted: usize = model
        .named_params()
        .iter()
        .map(|(_, v)| v.elem_count())
        .sum();
    assert_eq!(model.num_params(), counted);
}
