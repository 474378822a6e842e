//! # hilore-models
//!
//! A Llama/Qwen2-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, optional
//! q/k/v bias, tied or untied embeddings) written on HiLoRe's tape with recovery units, so
//! that every piece of state its backward needs can be stored, compressed or recomputed
//! per unit instance. The config reads Hugging Face `config.json` field names and the
//! parameters carry the Hugging Face / candle-transformers tensor names.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use hilore_models::{plans, Decoder, DecoderConfig, TokenBatch};
//! use hilore_runtime::{Cx, Grads};
//!
//! # fn main() -> Result<(), hilore_models::ModelError> {
//! let dev = Device::Cpu;
//! let cfg = DecoderConfig::tiny();
//! let model = Decoder::random(&cfg, 0, &dev)?;
//! // Two sequences of 9 and 5 tokens: 8 + 4 = 12 predicted tokens.
//! let batch = TokenBatch::random(&[9, 5], &cfg, 1, &dev)?;
//!
//! // Per-layer gradient checkpointing: only each layer's input survives the forward.
//! let mut cx = Cx::new(plans::gradient_checkpointing());
//! let logp = model.token_logprobs(&mut cx, &batch)?;
//! assert_eq!(logp.dims(), &[12]);
//!
//! // Backward starts from dL/dlogp, one coefficient per token (here: maximize the sum).
//! let coeffs = Tensor::ones(12, candle_core::DType::F32, &dev)?;
//! let mut grads = Grads::new();
//! cx.backward(&logp, &coeffs, &mut grads)?;
//! for (name, p) in model.named_params() {
//!     assert!(grads.get(p.id()).is_some(), "{name}");
//! }
//! println!("peak saved bytes: {}", cx.memory().peak_bytes());
//! # Ok(())
//! # }
//! ```
//!
//! ## Units, and why this granularity
//!
//! A unit is the smallest piece of the forward an allocator can give its own fidelity,
//! so the cut follows what the pieces save and what they cost to rebuild. Per layer
//! (`L` layers, `N` tokens, widths `d` hidden, `I` MLP, `Hq`/`Hkv` heads of size `D`):
//!
//! | unit | ops | saves (f32 unless noted) | recompute cost |
//! |---|---|---|---|
//! | `attn_norm` | RMSNorm | layer input `N x d` | elementwise |
//! | `qkv` | q/k/v projections (+bias), RoPE on q, k | normed input `N x d`; RoPE tables (exact, shared by all layers) | 3 matmuls |
//! | `attn_core` | causal GQA attention over the packed batch | q `N x Hq D`, k, v `N x Hkv D`, o `N x Hq D`, log-sum-exp `Hq x N` (exact) | `O(sum T^2)`: the expensive one |
//! | `attn_out` | o projection + residual | o (the storage `attn_core` saves) | 1 matmul |
//! | `mlp_norm` | RMSNorm | residual after attention `N x d` | elementwise |
//! | `gate_up` | gate, up projections + SwiGLU | normed input `N x d`, gate and up `N x I` each | 2 matmuls: the widest state |
//! | `down` | down projection + residual | SwiGLU output `N x I` | 1 matmul |
//!
//! and around the layers `embed` (saves the ids, `u32 N`, exact) and `head` (final norm +
//! chunked token log-probs; saves the last layer's output and the normed hidden state,
//! `N x d` each, the targets and the per-token log-sum-exp, exact). So the allocator can
//! trade cheap elementwise recomputes (the norms: `N x d` each for a few ops per element)
//! against matmul outputs (the MLP's `3 N x I` for two or three matmuls) against the
//! attention core, whose recompute grows with the squared sequence lengths while its
//! saved state grows linearly; exact slots (ids, log-sum-exps, RoPE tables) are never
//! compressed, and what two units share (o) is one buffer in the accounting.
//!
//! `layer` encloses the seven layer units and records no op of its own. Recompute on it is
//! classic per-layer gradient checkpointing: after the forward only its input (plus the
//! batch's positions and RoPE tables, shared by all layers) is kept, and backward re-runs
//! the layer with each inner unit's own fidelity. See [`plans`] for the baseline plans and
//! [`plans::UNIT_NAMES`] for the names a plan refers to; the call index of a layer unit is
//! its layer's index.
//!
//! [`reference::CandleDecoder`] is the same model on candle's own autograd, the reference
//! that the tape's gradients are tested and benchmarked against.

pub mod atomic;
mod batch;
mod config;
mod decoder;
mod error;
pub mod generate;
pub mod plans;
pub mod reference;
pub mod rng;
mod tokenizer;
pub mod zoo;

pub use batch::{PromptGroup, TokenBatch};
pub use config::{
    DecoderConfig, RopeScaling, SUPPORTED_ARCHITECTURES, SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
};
pub use decoder::{
    Attention, Decoder, DecoderLayer, Dims, Linear, Lora, LoraConfig, Mlp,
    DEFAULT_LOGITS_CHUNK_ELEMS, INIT_STD, NORM_INIT_STD, PROJECTIONS,
};
pub use error::ModelError;

/// Reads a text file (JSON, JSONL): refuses what is not a regular file (a FIFO or device
/// would block the read or never end it) and drops a leading UTF-8 byte-order mark, which
/// editors on some systems write and which JSON parsers reject.
pub fn read_text_file(path: &std::path::Path) -> std::io::Result<String> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a directory, FIFO or device); give a plain file",
        ));
    }
    let text = std::fs::read_to_string(path)?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

/// This machine's memory in bytes (`MemTotal` of `/proc/meminfo`), `None` where it cannot
/// be read: what sizes are checked against before anything is allocated.
pub fn machine_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
pub use tokenizer::Tokenizer;
