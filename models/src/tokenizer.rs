//! A model directory's `tokenizer.json`, through the Hugging Face `tokenizers` crate.

use crate::ModelError;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The tokenizer of a zoo model: a `tokenizer.json` read by the `tokenizers` crate.
///
/// Prompts and completions are encoded separately, as GRPO trainers do: a prompt gets the
/// special tokens the tokenizer's post-processor adds (a BOS token, say), a completion
/// none, and the two id lists are concatenated. The original JSON text is kept, so an
/// export writes the same file back byte for byte.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    json: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Reads a `tokenizer.json`. Errors name the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let json = crate::read_text_file(path).map_err(|e| ModelError::File {
            path: path.to_path_buf(),
            problem: format!("cannot read the tokenizer: {e}"),
        })?;
        Self::from_json(&json, path)
    }

    /// A tokenizer from `tokenizer.json` text; `path` is what errors name.
    pub fn from_json(json: &str, path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_str(json).map_err(|e| ModelError::File {
            path: path.to_path_buf(),
            problem: format!(
                "is not a tokenizer the `tokenizers` library can read ({e}); expected a Hugging Face tokenizer.json"
            ),
        })?;
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
            json: json.to_string(),
        })
    }

    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `tokenizer.json` text as read.
    pub fn json(&self) -> &str {
        &self.json
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The largest token id the tokenizer can produce, with its token.
    pub fn max_id(&self) -> Option<(u32, String)> {
        self.inner
            .get_vocab(true)
            .into_iter()
            .max_by_key(|(_, id)| *id)
            .map(|(tok, id)| (id, tok))
    }

    fn encode(&self, text: &str, special: bool, what: &str) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .inner
            .encode(text, special)
            .map_err(|e| ModelError::File {
                path: self.path.clone(),
                problem: format!("cannot encode the {what}: {e}"),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// The ids of a prompt, with the special tokens the tokenizer's post-processor adds
    /// (e.g. a leading BOS).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        self.encode(text, true, "prompt")
    }

    /// The ids of a completion, without special tokens (it continues a prompt).
    pub fn encode_completion(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        self.encode(text, false, "completion")
    }

    /// The token string of `id` (as in the vocabulary, e.g. `Ġthe` for byte-level BPE), or
    /// `<id>` if the tokenizer has no such id.
    pub fn token(&self, id: u32) -> String {
        self.inner
            .id_to_token(id)
            .unwrap_or_else(|| format!("<{id}>"))
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Decodes ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::File {
                path: self.path.clone(),
                problem: format!("cannot decode ids {ids:?}: {e}"),
            })
    }

    /// Checks that every id the tokenizer can produce is below `vocab_size` (the model's
    /// embedding rows); the error names the tokenizer file and the config field.
    pub fn check_vocab(&self, vocab_size: usize, config: &Path) -> Result<(), ModelError> {
        if let Some((id, tok)) = self.max_id() {
            if id as usize >= vocab_size {
                return Err(ModelError::File {
                    path: self.path.clone(),
                    problem: format!(
                        "has token id {id} (`{tok}`), but `vocab_size` in {} is {vocab_size}: \
                         expected every token id below {vocab_size}; the tokenizer does not \
                         belong to this model",
                        config.display()
                    ),
                });
            }
        }
        Ok(())
    }

    /// Writes the `tokenizer.json` text, as read, to `path`.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), ModelError> {
        let path = path.as_ref();
        crate::atomic::write_bytes_atomic(path, self.json.as_bytes()).map_err(|e| {
            ModelError::File {
                path: path.to_path_buf(),
                problem: format!("cannot write the tokenizer: {e}"),
            }
        })
    }
}
