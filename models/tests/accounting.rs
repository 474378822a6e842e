//! The ledger's peak equals a hand count of the saved tensors, and per-layer gradient
//! checkpointing keeps at most a third of store-all's peak on the default check config.

use candle_core::Device;
use hilore_models::{plans, rng, Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::{Cx, Grads, Plan};

/// Peak saved bytes of one forward+backward under `plan`.
fn peak(model: &Decoder, batch: &TokenBatch, plan: Plan) -> usize {
    let mut cx = Cx::new(plan);
    let logp = model.token_logprobs(&mut cx, batch).unwrap();
    let coeffs = rng::normal_tensor(batch.num_tokens(), 0.0, 1.0, 3, &Device::Cpu).unwrap();
    let mut grads = Grads::new();
    cx.backward(&logp, &coeffs, &mut grads).unwrap();
    assert_eq!(
        cx.memory().live_bytes(),
        0,
        "backward left saved state alive"
    );
    cx.memory().peak_saved_bytes()
}

fn small(tied: bool, bias: bool) -> DecoderConfig {
    DecoderConfig {
        vocab_size: 16,
        hidden_size: 8,
        intermediate_size: 12,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 4,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        tie_word_embeddings: tied,
        max_position_embeddings: 32,
        attention_bias: bias,
        model_type: None,
        ..DecoderConfig::tiny()
    }
}

#[test]
fn peak_equals_the_hand_count() {
    for (tied, bias) in [(false, false), (true, false), (false, true), (true, true)] {
        let cfg = small(tied, bias);
        let dev = Device::Cpu;
        let model = Decoder::random(&cfg, 1, &dev).unwrap();
        // Sequences of 5 and 3 tokens: N = 4 + 2 = 6 rows.
        let batch = TokenBatch::random(&[5, 3], &cfg, 2, &dev).unwrap();
        let (n, d, i) = (6, cfg.hidden_size, cfg.intermediate_size);
        let (hq, hkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let layers = cfg.num_hidden_layers;
        const F32: usize = 4;
        const U32: usize = 4;

        // What each op saves (the ops' docs), in bytes. Parameters (weights, norm weights,
        // the tied head) are references, never counted; biases save nothing. Each storage
        // counts once however many slots hold it.
        let ids = n * U32; // embedding: the input ids (exact)
        let targets = n * U32; // token log-probs: the targets (exact)
        let positions = n * U32; // the packing's positions: only a Recompute unit's input
        let rope = 2 * n * (hd / 2) * F32; // cos and sin, saved by every rope op: one storage each
        let layer_input = n * d * F32; // attn_norm's RMSNorm input
                                       // One layer's saved tensors other than its input and the shared RoPE tables:
        let layer_inner = n * d * F32 // qkv: the normed input, read by q, k and v's dW (one storage)
            + n * hq * hd * F32 // attn_core: q after RoPE
            + n * hkv * hd * F32 // attn_core: k after RoPE
            + n * hkv * hd * F32 // attn_core: v (a view of v_proj's output; same size)
            + hq * n * F32 // attn_core: per-row log-sum-exp (exact)
            + n * hq * hd * F32 // attn_core: o; attn_out's o_proj saves the same storage (reshape is a view)
            + n * d * F32 // mlp_norm: the residual stream after attention
            + n * d * F32 // gate_up: the normed input, read by gate and up's dW (one storage)
            + 2 * n * i * F32 // gate_up: gate and up, read by SwiGLU's backward
            + n * i * F32; // down: the SwiGLU output
        let head = n * d * F32 // final RMSNorm: the last layer's output
            + n * d * F32 // token log-probs: the normed hidden state
            + targets
            + n * F32; // token log-probs: per-token log-sum-exp (exact)

        // Store-all: nothing is freed before backward, and backward only frees, so the peak
        // is everything at the end of the forward. Positions are held by no op.
        let store_all = ids + layers * (layer_input + layer_inner) + rope + head;

        // Gradient checkpointing: each closed layer keeps only its inputs (x, and the
        // packing's positions and RoPE tables, shared by every layer: counted once).
        // Two candidate peaks:
        // (a) the end of the forward: ids, every layer's input, positions, tables, head;
        let end_of_forward = ids + layers * layer_input + positions + rope + head;
        // (b) the last layer's recompute in backward (the head's slots are freed by then;
        //     the forward's last layer, before it closed, held the same set): ids, every
        //     layer's input (the last one's also read by the recomputed attn_norm), the
        //     shared tables and positions, and the layer's own saved tensors.
        let last_layer_recompute = ids + layers * layer_input + positions + rope + layer_inner;
        let gc = end_of_forward.max(last_layer_recompute);

        let measured_store = peak(&model, &batch, plans::store_all());
        let measured_gc = peak(&model, &batch, plans::gradient_checkpointing());
        println!(
            "tied={tied} bias={bias}: store-all hand count {store_all} B, peak {measured_store} B; \
             GC hand count {gc} B (end of forward {end_of_forward}, last-layer recompute {last_layer_recompute}), peak {measured_gc} B"
        );
        assert_eq!(
            measured_store, store_all,
            "store-all (tied={tied}, bias={bias})"
        );
        assert_eq!(
            measured_gc, gc,
            "gradient checkpointing (tied={tied}, bias={bias})"
        );
    }
}

#[test]
fn gradient_checkpointing_keeps_at_most_a_third_of_store_all() {
    let cfg = DecoderConfig::tiny();
    let dev = Device::Cpu;
    let model = Decoder::random(&cfg, 1, &dev).unwrap();
    // Four sequences of about 64 tokens.
    let batch = TokenBatch::random(&[65, 49, 81, 64], &cfg, 2, &dev).unwrap();
    let store = peak(&model, &batch, plans::store_all());
    let gc = peak(&model, &batch, plans::gradient_checkpointing());
    let ratio = gc as f64 / store as f64;
    println!(
        "tiny, {} tokens: store-all {store} B, GC {gc} B, ratio {ratio:.3}",
        batch.num_tokens()
    );
    assert!(
        3 * gc <= store,
        "GC peak {gc} B is more than a third of store-all's {store} B"
    );
}
