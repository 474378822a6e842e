//! The decoder's configuration, read from a Hugging Face `config.json`.

use crate::ModelError;
use candle_core::{DType, Device};
use hilore_runtime::RopeTables;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The model types this decoder implements exactly.
pub const SUPPORTED_MODEL_TYPES: [&str; 4] = ["llama", "qwen2", "qwen3", "mistral"];

/// The Hugging Face `architectures` entries this decoder implements, with their model type.
pub const SUPPORTED_ARCHITECTURES: [(&str, &str); 4] = [
    ("LlamaForCausalLM", "llama"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("MistralForCausalLM", "mistral"),
];

/// The RoPE scaling types this decoder implements (besides `default`, no scaling).
pub const SUPPORTED_ROPE_TYPES: [&str; 3] = ["default", "linear", "llama3"];

/// A RoPE frequency scaling, as Hugging Face's `rope_scaling` / `rope_parameters` describe it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// `linear`: every inverse frequency divided by `factor` (positions interpolated).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// `llama3`: low frequencies (wavelength above `original_max_position_embeddings /
    /// low_freq_factor`) divided by `factor`, high ones (below `original / high_freq_factor`)
    /// kept, and a smooth interpolation between the two in the middle band.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Where the low band starts.
        low_freq_factor: f64,
        /// Where the high band starts.
        high_freq_factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// The HF `rope_type` name.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
        }
    }

    /// The HF JSON object (`rope_scaling` in the classic layout).
    pub fn to_json(&self) -> Value {
        match *self {
            RopeScaling::Linear { factor } => serde_json::json!({
                "rope_type": "linear",
                "factor": factor,
            }),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        }
    }

    /// Scales the default inverse frequencies `theta^(-2i/D)` (Hugging Face's
    /// `_compute_linear_scaling_rope_parameters` / `_compute_llama3_parameters`).
    fn apply(&self, inv_freq: &mut [f64]) {
        match *self {
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen < high_wavelen {
                        // High frequency: unchanged.
                    } else if wavelen > low_wavelen {
                        *f /= factor;
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
    }
}

/// Shape and hyper-parameters of a Llama / Qwen2 / Qwen3 / Mistral decoder.
///
/// Field names are those of Hugging Face `config.json` files (and of candle-transformers'
/// `llama::LlamaConfig`, `qwen2::Config`, `qwen3::Config`, `mistral::Config`), so a model
/// directory's config reads directly. Deserializing fills the optional fields with their
/// HF defaults: `num_key_value_heads` = `num_attention_heads`, `head_dim` = `hidden_size /
/// num_attention_heads`, `rms_norm_eps` = 1e-6, `rope_theta` = 10000,
/// `tie_word_embeddings` = false, `max_position_embeddings` = 4096, and `attention_bias` =
/// false except for `model_type: "qwen2"`, whose q/k/v projections always carry a bias
/// (and `mistral`, whose projections never do).
///
/// What depends on the architecture:
/// - **Qwen3** normalizes every query and key head with its own RMSNorm (`q_norm`,
///   `k_norm`, weights of size `head_dim`) before RoPE: [`DecoderConfig::qk_norm`].
/// - **Llama and Qwen3** with `attention_bias: true` also give `o_proj` a bias (Qwen2's
///   `o_proj` never has one): [`DecoderConfig::o_proj_bias`].
/// - **Sliding-window attention**: Mistral applies `sliding_window` (when not null) to every
///   layer; Qwen2/Qwen3 apply it only with `use_sliding_window: true`, to the layers from
///   `max_window_layers` on (HF default 28): [`DecoderConfig::layer_window`].
/// - **RoPE scaling** (`linear`, `llama3`), read from the classic layout (top-level
///   `rope_theta` and `rope_scaling`) or the newer one (`rope_parameters` with `rope_type`,
///   `rope_theta` and the scaling fields): [`DecoderConfig::rope_inv_freq`].
///
/// Fields the decoder does not model (`torch_dtype`, token ids, ...) are kept in
/// [`DecoderConfig::extra`] and written back on serialization, so an exported config is
/// the original one. Fields that would change the math in ways the decoder does not
/// implement (another RoPE type, `mlp_bias`, an activation other than SiLU, a partial
/// rotary factor, an unknown architecture) are rejected with an error naming them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RawConfig", into = "Value")]
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
    /// Whether the q/k/v projections (and, for Llama and Qwen3, `o_proj`) have a bias.
    pub attention_bias: bool,
    /// The HF `model_type` (`llama`, `qwen2`, `qwen3`, `mistral`), if the config named one.
    pub model_type: Option<String>,
    /// RoPE frequency scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// HF `sliding_window`: keys per query in the layers that use a window (see
    /// [`DecoderConfig::layer_window`]).
    pub sliding_window: Option<usize>,
    /// HF `use_sliding_window` (Qwen2/Qwen3): whether `sliding_window` is in use.
    pub use_sliding_window: Option<bool>,
    /// HF `max_window_layers` (Qwen2/Qwen3): the first layer that uses the window.
    pub max_window_layers: Option<usize>,
    /// Every other field of the config.json, as it was (token ids, `torch_dtype`,
    /// `architectures`, ...): written back when the config is serialized.
    pub extra: BTreeMap<String, Value>,
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
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    partial_rotary_factor: Option<f64>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    #[serde(flatten)]
    extra: BTreeMap<String, Value>,
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

/// The HF default of `max_window_layers` (Qwen2Config, Qwen3Config).
const DEFAULT_MAX_WINDOW_LAYERS: usize = 28;

/// Reads a RoPE scaling object (`rope_scaling`, or `rope_parameters` of the newer layout).
/// `None` for the default (unscaled) RoPE.
fn parse_rope_scaling(
    origin: &str,
    field: &'static str,
    v: &Value,
) -> Result<Option<RopeScaling>, ModelError> {
    let Some(obj) = v.as_object() else {
        return Err(invalid(
            origin,
            field,
            format!("is `{v}`, not an object"),
            "expected an object such as {\"rope_type\": \"llama3\", \"factor\": 8.0, ...}",
        ));
    };
    let ty = match obj.get("rope_type").or_else(|| obj.get("type")) {
        None | Some(Value::Null) => "default",
        Some(Value::String(t)) => t.as_str(),
        Some(other) => {
            return Err(invalid(
                origin,
                field,
                format!("has rope_type `{other}`, not a name"),
                format!(
                    "give one of {} as a string",
                    SUPPORTED_ROPE_TYPES.join(", ")
                ),
            ))
        }
    };
    let num = |key: &str| -> Result<f64, ModelError> {
        obj.get(key).and_then(Value::as_f64).ok_or_else(|| {
            invalid(
                origin,
                field,
                format!("has rope_type `{ty}` but no numeric `{key}`"),
                format!("`{ty}` scaling needs `{key}`"),
            )
        })
    };
    let scaling = match ty {
        "default" => return Ok(None),
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        },
        other => {
            return Err(invalid(
                origin,
                field,
                format!("has rope_type `{other}`, which this decoder does not implement"),
                format!(
                    "the supported RoPE types are {}; other scalings would compute different positions than the checkpoint was trained with",
                    SUPPORTED_ROPE_TYPES.join(", ")
                ),
            ))
        }
    };
    let bad = match scaling {
        RopeScaling::Linear { factor } => {
            (!(factor.is_finite() && factor > 0.0)).then(|| format!("has factor {factor}"))
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            if !(factor.is_finite() && factor > 0.0) {
                Some(format!("has factor {factor}"))
            } else if !(low_freq_factor > 0.0 && high_freq_factor > low_freq_factor) {
                Some(format!(
                    "has low_freq_factor {low_freq_factor} and high_freq_factor {high_freq_factor}"
                ))
            } else if original_max_position_embeddings == 0 {
                Some("has original_max_position_embeddings 0".into())
            } else {
                None
            }
        }
    };
    match bad {
        Some(problem) => Err(invalid(
            origin,
            field,
            problem,
            "the factors must be positive, with high_freq_factor > low_freq_factor",
        )),
        None => Ok(Some(scaling)),
    }
}

impl RawConfig {
    /// Applies the HF defaults and rejects what the decoder does not implement.
    fn resolve(self, origin: &str) -> Result<DecoderConfig, ModelError> {
        let mut extra = self.extra;
        // The architecture: `model_type`, checked against `architectures` when both exist.
        let archs: Vec<String> = match extra.get("architectures") {
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
            Some(Value::String(s)) => vec![s.clone()],
            _ => Vec::new(),
        };
        let mut model_type = self.model_type;
        for a in &archs {
            match SUPPORTED_ARCHITECTURES.iter().find(|(n, _)| n == a) {
                Some((_, t)) => match &model_type {
                    None => model_type = Some(t.to_string()),
                    // Another family's weights read as this one would lose what tells
                    // them apart (Qwen2's q/k/v biases, Qwen3's q/k norms).
                    Some(m) if m != t => {
                        return Err(invalid(
                            origin,
                            "architectures",
                            format!("names `{a}` (model_type `{t}`) but model_type is `{m}`"),
                            "the two must name the same family: fix whichever is wrong",
                        ))
                    }
                    Some(_) => {}
                },
                None => {
                    return Err(invalid(
                        origin,
                        "architectures",
                        format!("names `{a}`, which this decoder does not implement"),
                        format!(
                            "the supported architectures are {}",
                            SUPPORTED_ARCHITECTURES
                                .iter()
                                .map(|(n, _)| *n)
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    ))
                }
            }
        }
        if let Some(t) = &model_type {
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
        let ty = model_type.as_deref();
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
        if let Some(f) = self.partial_rotary_factor.filter(|&f| f != 1.0) {
            return Err(invalid(
                origin,
                "partial_rotary_factor",
                format!("is {f}"),
                "this decoder rotates the whole head (factor 1.0)",
            ));
        }
        // RoPE: the newer layout nests theta and the scaling under `rope_parameters`.
        let mut rope_theta = self.rope_theta;
        let rope_scaling = match self.rope_parameters.as_ref().filter(|v| !v.is_null()) {
            Some(p) => {
                if let Some(t) = p.get("rope_theta").and_then(Value::as_f64) {
                    rope_theta = Some(t);
                }
                if let Some(f) = p
                    .get("partial_rotary_factor")
                    .and_then(Value::as_f64)
                    .filter(|&f| f != 1.0)
                {
                    return Err(invalid(
                        origin,
                        "rope_parameters",
                        format!("has partial_rotary_factor {f}"),
                        "this decoder rotates the whole head (factor 1.0)",
                    ));
                }
                parse_rope_scaling(origin, "rope_parameters", p)?
            }
            None => match self.rope_scaling.as_ref().filter(|v| !v.is_null()) {
                Some(s) => parse_rope_scaling(origin, "rope_scaling", s)?,
                None => None,
            },
        };
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
        let attention_bias = match ty {
            // HF's Mistral attention has no biases, whatever the config says.
            Some("mistral") => {
                if let Some(b) = self.attention_bias {
                    extra.insert("attention_bias".into(), Value::Bool(b));
                }
                false
            }
            _ => self.attention_bias.unwrap_or(ty == Some("qwen2")),
        };
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
            attention_bias,
            model_type,
            rope_scaling,
            sliding_window: self.sliding_window,
            use_sliding_window: self.use_sliding_window,
            max_window_layers: self.max_window_layers,
            extra,
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

impl From<DecoderConfig> for Value {
    /// The HF config.json object: [`DecoderConfig::extra`] plus every modelled field in
    /// the classic layout (top-level `rope_theta`, `rope_scaling`), `hidden_act: "silu"`.
    fn from(c: DecoderConfig) -> Value {
        let mut m: serde_json::Map<String, Value> = c.extra.into_iter().collect();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        put("vocab_size", c.vocab_size.into());
        put("hidden_size", c.hidden_size.into());
        put("intermediate_size", c.intermediate_size.into());
        put("num_hidden_layers", c.num_hidden_layers.into());
        put("num_attention_heads", c.num_attention_heads.into());
        put("num_key_value_heads", c.num_key_value_heads.into());
        put("head_dim", c.head_dim.into());
        put("rms_norm_eps", c.rms_norm_eps.into());
        put("rope_theta", c.rope_theta.into());
        put("tie_word_embeddings", c.tie_word_embeddings.into());
        put("max_position_embeddings", c.max_position_embeddings.into());
        if c.model_type.as_deref() != Some("mistral") {
            put("attention_bias", c.attention_bias.into());
        }
        put("hidden_act", "silu".into());
        put(
            "rope_scaling",
            c.rope_scaling.map_or(Value::Null, |s| s.to_json()),
        );
        if let Some(t) = c.model_type {
            put("model_type", t.into());
        }
        if let Some(w) = c.sliding_window {
            put("sliding_window", w.into());
        }
        if let Some(u) = c.use_sliding_window {
            put("use_sliding_window", u.into());
        }
        if let Some(l) = c.max_window_layers {
            put("max_window_layers", l.into());
        }
        Value::Object(m)
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
            rope_scaling: None,
            sliding_window: None,
            use_sliding_window: None,
            max_window_layers: None,
            extra: BTreeMap::new(),
        }
    }

    /// The benchmark decoder of `hilore bench`: 4 layers, hidden 192, MLP 512, 6 query
    /// heads sharing 2 key/value heads of size 32, vocabulary 1024, untied head (2.0 M
    /// parameters). Big enough that recompute is a real share of the step on a small CPU;
    /// with 896-row microbatches, under full recompute the ledger's peak (saved
    /// activations, transients, activation gradients) is about a third of the total
    /// actor-update peak, as in a single-GPU GRPO run of a small model (the rest being
    /// parameters, gradients and AdamW state at 16 bytes per parameter).
    pub fn bench() -> Self {
        DecoderConfig {
            vocab_size: 1024,
            hidden_size: 192,
            intermediate_size: 512,
            num_hidden_layers: 4,
            num_attention_heads: 6,
            num_key_value_heads: 2,
            head_dim: 32,
            ..DecoderConfig::tiny()
        }
    }

    /// Reads an HF `config.json`. Errors name the file and the field.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let text = crate::read_text_file(path).map_err(|source| ModelError::ConfigIo {
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

    /// The config as HF config.json text (pretty-printed).
    pub fn to_json_string(&self) -> String {
        let v: Value = self.clone().into();
        serde_json::to_string_pretty(&v).unwrap_or_else(|_| "{}".into())
    }

    /// Checks that the decoder can be built from this config: positive sizes, query heads
    /// a multiple of the key/value heads, an even head size (RoPE rotates pairs), a
    /// positive epsilon and RoPE base, a positive sliding window.
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
        // Sizes against the machine, before anything is allocated: the f32 weights alone
        // must fit in its memory (training needs about five times that).
        let weights = self.param_count().saturating_mul(4);
        if let Some(mem) = crate::machine_memory_bytes() {
            if weights > mem as u128 {
                return Err(invalid(
                    origin,
                    "num_hidden_layers",
                    format!(
                        "with hidden_size {}, intermediate_size {} and vocab_size {} gives {} parameters, {:.1} GiB of f32 weights, more than this machine's {:.1} GiB of memory",
                        self.hidden_size,
                        self.intermediate_size,
                        self.vocab_size,
                        self.param_count(),
                        weights as f64 / (1u64 << 30) as f64,
                        mem as f64 / (1u64 << 30) as f64
                    ),
                    "use a config whose sizes fit this machine",
                ));
            }
        }
        if self.layers_windowed() && self.sliding_window == Some(0) {
            return Err(invalid(
                origin,
                "sliding_window",
                "is 0",
                "a window must hold at least the query's own position: use a positive size, or null for full attention",
            ));
        }
        if self.use_sliding_window == Some(true)
            && self.model_type.as_deref() != Some("mistral")
            && self.sliding_window.is_none()
        {
            return Err(invalid(
                origin,
                "sliding_window",
                "is missing while use_sliding_window is true",
                "give the window size, or set use_sliding_window to false",
            ));
        }
        Ok(())
    }

    fn layers_windowed(&self) -> bool {
        self.model_type.as_deref() == Some("mistral") || self.use_sliding_window == Some(true)
    }

    /// The decoder's parameter count, in `u128` so that absurd sizes do not overflow:
    /// per layer the q/k/v/o projections (with q/k/v biases where the family has them,
    /// q/k norms for Qwen3), the three MLP matrices and two norms; the embedding, the
    /// final norm and an untied head.
    pub fn param_count(&self) -> u128 {
        let (h, i, v) = (
            self.hidden_size as u128,
            self.intermediate_size as u128,
            self.vocab_size as u128,
        );
        let (q, kv, d) = (
            (self.num_attention_heads as u128).saturating_mul(self.head_dim as u128),
            (self.num_key_value_heads as u128).saturating_mul(self.head_dim as u128),
            self.head_dim as u128,
        );
        let attn = h
            .saturating_mul(q.saturating_add(2 * kv))
            .saturating_add(q.saturating_mul(h))
            .saturating_add(if self.attention_bias { q + 2 * kv } else { 0 })
            .saturating_add(if self.o_proj_bias() { h } else { 0 })
            .saturating_add(if self.qk_norm() { 2 * d } else { 0 });
        let layer = attn
            .saturating_add(h.saturating_mul(i).saturating_mul(3))
            .saturating_add(2 * h);
        let head = if self.tie_word_embeddings {
            0
        } else {
            v.saturating_mul(h)
        };
        layer
            .saturating_mul(self.num_hidden_layers as u128)
            .saturating_add(v.saturating_mul(h))
            .saturating_add(h)
            .saturating_add(head)
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

    /// Whether every query and key head goes through its own RMSNorm before RoPE (Qwen3:
    /// `self_attn.q_norm.weight`, `self_attn.k_norm.weight`, `[head_dim]` each).
    pub fn qk_norm(&self) -> bool {
        self.model_type.as_deref() == Some("qwen3")
    }

    /// Whether `o_proj` has a bias: `attention_bias` for Llama and Qwen3 (Hugging Face
    /// gives their output projection the same bias flag), never for Qwen2 and Mistral.
    pub fn o_proj_bias(&self) -> bool {
        self.attention_bias && matches!(self.model_type.as_deref(), Some("llama" | "qwen3"))
    }

    /// The sliding window of layer `layer` (keys per query: query `i` sees keys `j` with
    /// `i - W < j <= i`), or `None` for full causal attention. Mistral: `sliding_window`
    /// on every layer. Qwen2/Qwen3 (and configs without a model type): only with
    /// `use_sliding_window: true`, on layers `max_window_layers` (default 28) and up.
    /// Llama: never.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match self.model_type.as_deref() {
            Some("llama") => None,
            Some("mistral") => self.sliding_window,
            _ => {
                let first = self.max_window_layers.unwrap_or(DEFAULT_MAX_WINDOW_LAYERS);
                if self.use_sliding_window == Some(true) && layer >= first {
                    self.sliding_window
                } else {
                    None
                }
            }
        }
    }

    /// RoPE's `head_dim / 2` inverse frequencies: `rope_theta^(-2i/head_dim)`, then
    /// [`DecoderConfig::rope_scaling`] applied, in f64.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        let mut f: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| self.rope_theta.powf(-((2 * i) as f64) / d))
            .collect();
        if let Some(s) = &self.rope_scaling {
            s.apply(&mut f);
        }
        f
    }

    /// The RoPE tables of this model for tokens at `positions` (scaling included). Every
    /// caller that builds tables for the decoder (training batches, generation) should use
    /// this rather than [`RopeTables::from_positions`], which knows no scaling.
    pub fn rope_tables(
        &self,
        positions: &[u32],
        dtype: DType,
        device: &Device,
    ) -> Result<RopeTables, ModelError> {
        Ok(RopeTables::from_inv_freq(
            positions,
            &self.rope_inv_freq(),
            dtype,
            device,
        )?)
    }

    /// The Hugging Face architecture name of the model type (`LlamaForCausalLM`, ...).
    pub fn architecture(&self) -> Option<&'static str> {
        let t = self.model_type.as_deref()?;
        SUPPORTED_ARCHITECTURES
            .iter()
            .find(|(_, m)| *m == t)
            .map(|(a, _)| *a)
    }

    /// `eos_token_id` from the config (a number or a list), empty if absent.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        match self.extra.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|v| v as u32).into_iter().collect(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// `bos_token_id` from the config, if present.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.extra
            .get("bos_token_id")
            .and_then(Value::as_u64)
            .map(|v| v as u32)
    }
}
