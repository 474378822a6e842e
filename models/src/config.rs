//! The decoder's configuration, read from a Hugging Face `config.json`.

use crate::ModelError;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The model types this decoder implements exactly.
pub const SUPPORTED_MODEL_TYPES: [&str; 2] = ["llama", "qwen2"];

/// Shape and hyper-parameters of a Llama/Qwen2-family decoder.
///
/// Field names are those of Hugging Face `config.json` files (and of candle-transformers'
/// `llama::LlamaConfig` / `qwen2::Config`), so a model directory's config reads directly.
/// Deserializing fills the optional fields with their HF defaults: `num_key_value_heads`
/// = `num_attention_heads`, `head_dim` = `hidden_size / num_attention_heads`,
/// `rms_norm_eps` = 1e-6, `rope_theta` = 10000, `tie_word_embeddings` = false,
/// `max_position_embeddings` = 4096, and `attention_bias` = false except for
/// `model_type: "qwen2"`, whose q/k/v projections always carry a bias. Fields this decoder
/// does not model (`torch_dtype`, `architectures`, token ids, ...) are ignored; fields that
/// would change the math in ways it does not implement (`rope_scaling`, `mlp_bias`, a
/// sliding window in use, an activation other than SiLU) are rejected with an error
/// naming them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RawConfig")]
pub struct DecoderConfig {
    /// Number of token ids.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's gate and up projections.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Size of each head.
    pub head_dim: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// Base of the rotary embedding's frequencies.
    pub rope_theta: f64,
    /// Whether the LM head reuses the embedding matrix (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Longest sequence the model accepts.
    pub max_position_embeddings: usize,
    /// Whether the q/k/v projections have a bias.
    pub attention_bias: bool,
    /// The HF `model_type` (`llama`, `qwen2`), if the config named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
}

/// What a config.json may contain, before defaults and checks.
#[derive(Deserialize)]
struct RawConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    attention_bias: Option<bool>,
    model_type: Option<String>,
    hidden_act: Option<String>,
    mlp_bias: Option<bool>,
    rope_scaling: Option<serde_json::Value>,
    rope_parameters: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
}

fn invalid(
    origin: &str,
    field: &'static str,
    problem: impl Into<String>,
    fix: impl Into<String>,
) -> ModelError {
    ModelError::InvalidConfig {
        origin: origin.to_string(),
        field,
        problem: problem.into(),
        fix: fix.into(),
    }
}

impl RawConfig {
    /// Applies the HF defaults and rejects what the decoder does not implement.
    fn resolve(self, origin: &str) -> Result<DecoderConfig, ModelError> {
        if let Some(t) = &self.model_type {
            if !SUPPORTED_MODEL_TYPES.contains(&t.as_str()) {
                return Err(invalid(
                    origin,
                    "model_type",
                    format!("is `{t}`, which this decoder does not implement"),
                    format!(
                        "the supported model types are {}",
                        SUPPORTED_MODEL_TYPES.join(", ")
                    ),
                ));
            }
        }
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return Err(invalid(
                    origin,
                    "hidden_act",
                    format!("is `{act}`"),
                    "this decoder's MLP is SwiGLU, which needs `silu`",
                ));
            }
        }
        if self.mlp_bias == Some(true) {
            return Err(invalid(
                origin,
                "mlp_bias",
                "is true",
                "this decoder's MLP projections have no bias; use a config with `mlp_bias: false`",
            ));
        }
        if let Some(s) = self.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            return Err(invalid(
                origin,
                "rope_scaling",
                format!("is set ({s})"),
                "RoPE scaling is not implemented: the decoder would compute different positions than the checkpoint was trained with; use a config without `rope_scaling`",
            ));
        }
        if self.use_sliding_window == Some(true) {
            return Err(invalid(origin, "use_sliding_window", "is true", "sliding-window attention is not implemented; every layer attends to the whole causal prefix"));
        }
        let mut rope_theta = self.rope_theta;
        // The newer layout nests the RoPE settings under `rope_parameters`.
        if let Some(p) = self.rope_parameters.as_ref().filter(|v| !v.is_null()) {
            let ty = p
                .get("rope_type")
                .and_then(|t| t.as_str())
                .unwrap_or("default");
            if ty != "default" {
                return Err(invalid(
                    origin,
                    "rope_parameters",
                    format!("has rope_type `{ty}`"),
                    "only the default (unscaled) RoPE is implemented",
                ));
            }
            if rope_theta.is_none() {
                rope_theta = p.get("rope_theta").and_then(|t| t.as_f64());
            }
        }
        let heads = self.num_attention_heads;
        if heads == 0 {
            return Err(invalid(
                origin,
                "num_attention_heads",
                "is 0",
                "it must be a positive integer",
            ));
        }
        let head_dim = match self.head_dim {
            Some(d) => d,
            None => {
                if self.hidden_size % heads != 0 {
                    return Err(invalid(
                        origin,
                        "hidden_size",
                        format!("({}) is not a multiple of num_attention_heads ({heads})", self.hidden_size),
                        "set `head_dim` explicitly, or make hidden_size a multiple of the head count",
                    ));
                }
                self.hidden_size / heads
            }
        };
        let qwen2 = self.model_type.as_deref() == Some("qwen2");
        Ok(DecoderConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: self.num_key_value_heads.unwrap_or(heads),
            head_dim,
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope_theta.unwrap_or(10000.0),
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: self.max_position_embeddings.unwrap_or(4096),
            attention_bias: self.attention_bias.unwrap_or(qwen2),
            model_type: self.model_type,
        })
    }
}

impl TryFrom<RawConfig> for DecoderConfig {
    type Error = ModelError;

    fn try_from(raw: RawConfig) -> Result<Self, ModelError> {
        let cfg = raw.resolve("config")?;
        cfg.validate()?;
        Ok(cfg)
    }
}

impl DecoderConfig {
    /// The built-in check config: 6 layers, hidden 64, MLP 176, 4 query heads sharing 2
    /// key/value heads of size 16, vocabulary 256, untied head. Forward and backward of a
    /// few hundred tokens take a fraction of a second on two CPU cores, and every feature
    /// the allocator cares about is present (GQA, a real MLP ratio, several layers).
    pub fn tiny() -> Self {
        DecoderConfig {
            vocab_size: 256,
            hidden_size: 64,
            intermediate_size: 176,
            num_hidden_layers: 6,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            tie_word_embeddings: false,
            max_position_embeddings: 4096,
            attention_bias: false,
            model_type: Some("llama".into()),
        }
    }

    /// Reads an HF `config.json`. Errors name the file and the field.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::ConfigIo {
            path: path.to_path_buf(),
            source,
        })?;
        let raw: RawConfig =
            serde_json::from_str(&text).map_err(|source| ModelError::ConfigParse {
                path: path.to_path_buf(),
                source,
            })?;
        let origin = path.display().to_string();
        let cfg = raw.resolve(&origin)?;
        cfg.validate_as(&origin)?;
        Ok(cfg)
    }

    /// Checks that the decoder can be built from this config: positive sizes, query heads
    /// a multiple of the key/value heads, an even head size (RoPE rotates pairs), a
    /// positive epsilon and RoPE base.
    pub fn validate(&self) -> Result<(), ModelError> {
        self.validate_as("config")
    }

    fn validate_as(&self, origin: &str) -> Result<(), ModelError> {
        let positive: [(&'static str, usize); 8] = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(invalid(
                    origin,
                    field,
                    "is 0",
                    "it must be a positive integer",
                ));
            }
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(invalid(
                origin,
                "vocab_size",
                format!("is {}", self.vocab_size),
                "token ids are u32: the vocabulary must have at most 2^32 - 1 entries",
            ));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(invalid(
                origin,
                "num_key_value_heads",
                format!(
                    "({}) does not divide num_attention_heads ({})",
                    self.num_key_value_heads, self.num_attention_heads
                ),
                "grouped-query attention shares each key/value head among an equal number of query heads: use a divisor of num_attention_heads",
            ));
        }
        if self.head_dim % 2 != 0 {
            return Err(invalid(
                origin,
                "head_dim",
                format!("is {}, which is odd", self.head_dim),
                "RoPE rotates pairs of dimensions: the head size must be even",
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(invalid(
                origin,
                "rms_norm_eps",
                format!("is {}", self.rms_norm_eps),
                "it must be a positive number (1e-6 and 1e-5 are usual)",
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(invalid(
                origin,
                "rope_theta",
                format!("is {}", self.rope_theta),
                "it must be a positive number (10000 or 1000000 are usual)",
            ));
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn kv_group(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Width of the concatenated query heads (`q_proj`'s output).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of the concatenated key (or value) heads (`k_proj`'s output).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
}
