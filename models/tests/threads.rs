//! The tape's results do not depend on the number of threads: every parameter gradient of
//! a decoder (GQA, a sliding window, qkv biases, q/k norms: every CPU kernel) is bit for
//! bit the same on pools of 1, 2 and 3 threads, under store-all and under per-layer
//! recompute, and the two plans agree bit for bit too.
//!
//! This is its own test binary because it sets `RAYON_NUM_THREADS`, which candle's matmul
//! reads on every call to decide how many pieces to cut a GEMM's output into: each pool
//! size is paired with the same count there, so both candle's GEMM split and the kernels'
//! pools change.

use candle_core::{Device, Tensor};
use hilore_models::{plans, rng, Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::{Cx, Grads, Plan};

fn gradients(model: &Decoder, batch: &TokenBatch, coeffs: &Tensor, plan: Plan) -> Vec<Vec<u32>> {
    let mut cx = Cx::new(plan);
    let logp = model.token_logprobs(&mut cx, batch).unwrap();
    let mut grads = Grads::new();
    cx.backward(&logp, coeffs, &mut grads).unwrap();
    let mut out = vec![logp
        .tensor()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()];
    for (name, v) in model.named_params() {
        let g = grads
            .get(v.id())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        out.push(
            g.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect(),
        );
    }
    out
}

#[test]
fn gradients_do_not_depend_on_the_thread_count() {
    let dev = Device::Cpu;
    // Qwen3: q/k norms; layer 0 full causal, layer 1 a window of 40 keys.
    let cfg = DecoderConfig {
        model_type: Some("qwen3".into()),
        num_hidden_layers: 2,
        attention_bias: true,
        sliding_window: Some(40),
        use_sliding_window: Some(true),
        max_window_layers: Some(1),
        ..DecoderConfig::bench()
    };
    assert!(cfg.qk_norm() && cfg.layer_window(0).is_none() && cfg.layer_window(1) == Some(40));
    let model = Decoder::random(&cfg, 3, &dev).unwrap();
    // Sequences longer than an attention tile (64 rows), one shorter than a lane group.
    let batch = TokenBatch::random(&[150, 7, 90], &cfg, 4, &dev).unwrap();
    let coeffs = rng::normal_tensor(batch.num_tokens(), 0.0, 1.0, 5, &dev).unwrap();
    let mut reference = None;
    for threads in [1, 2, 3] {
        // SAFETY (of the environment): this binary's only test, so no other thread reads
        // the environment while it is set.
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for (plan_name, plan) in [
            ("store-all", plans::store_all()),
            ("recompute-all", plans::gradient_checkpointing()),
        ] {
            let got = pool.install(|| gradients(&model, &batch, &coeffs, plan));
            match &reference {
                None => reference = Some(got),
                Some(want) => {
                    for (i, (g, w)) in got.iter().zip(want).enumerate() {
                        assert!(
                            g == w,
                            "tensor {i} (0: log-probs, then named_params order) differs with \
                             {threads} threads under {plan_name}"
                        );
                    }
                }
            }
        }
    }
}
