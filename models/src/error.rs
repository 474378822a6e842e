//! Errors of the models crate.

use std::path::PathBuf;

/// Every error building a model, reading its config, or packing a batch can report.
///
/// Config errors name the file (or `config` for a config built in code), the field, what
/// was found and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The config file could not be read.
    #[error("cannot read model config {}: {source}", path.display())]
    ConfigIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid JSON, or a field has the wrong JSON type (the message
    /// names the field and gives the line and column).
    #[error(
        "cannot parse model config {}: {source}; expected a Hugging Face config.json of the \
         Llama/Qwen2/Qwen3/Mistral family (fields vocab_size, hidden_size, intermediate_size, \
         num_hidden_layers, num_attention_heads, and optionally num_key_value_heads, head_dim, \
         rms_norm_eps, rope_theta, tie_word_embeddings, max_position_embeddings, \
         attention_bias, model_type)",
        path.display()
    )]
    ConfigParse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A config field has a value this decoder cannot use.
    #[error("{origin}: field `{field}` {problem}; {fix}")]
    InvalidConfig {
        /// The config file, or `config` for a config built in code.
        origin: String,
        /// The HF field name.
        field: &'static str,
        /// What is wrong with its value.
        problem: String,
        /// How to fix it.
        fix: String,
    },
    /// A parameter tensor that does not fit the config.
    #[error("parameter `{name}`: {problem}")]
    Param { name: String, problem: String },
    /// A model file (weights, shard index, tokenizer, output directory) that is missing,
    /// unreadable, truncated or inconsistent: the message names the file and says what was
    /// expected.
    #[error("{}: {problem}", path.display())]
    File { path: PathBuf, problem: String },
    /// A tensor of a weights file that does not fit the config (shape, dtype, missing).
    #[error("{}: tensor `{tensor}` {problem}", path.display())]
    Tensor {
        /// The weights file (or shard index) that holds or should hold it.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong and what was expected.
        problem: String,
    },
    /// Token sequences that cannot form a batch for this model.
    #[error("token batch: {0}")]
    Batch(String),
    /// An error of the tape or of the tensor library.
    #[error(transparent)]
    Runtime(#[from] hilore_runtime::Error),
}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::Runtime(hilore_runtime::Error::Candle(e))
    }
}
