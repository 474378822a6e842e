//! Zoo models: Hugging Face model directories in, Hugging Face model directories out.
//!
//! A model directory holds `config.json` (Llama, Qwen2, Qwen3 or Mistral: see
//! [`DecoderConfig`]), the weights as `model.safetensors` or as shards listed in
//! `model.safetensors.index.json`, and optionally `tokenizer.json`. [`load`] reads all
//! three into a [`Decoder`] whose parameters are `f32` tape parameters (bf16 and f16
//! weights are converted exactly), [`export`] writes a decoder back with the same tensor
//! names, so the result loads in candle-transformers and in Hugging Face `transformers`.
//!
//! Tensor names are those candle-transformers' `llama`, `qwen2`, `qwen3` and `mistral`
//! models read: `model.embed_tokens.weight`, per layer `model.layers.{i}.input_layernorm.weight`,
//! `self_attn.{q,k,v,o}_proj.weight` (and `.bias` where the architecture has one),
//! `self_attn.{q,k}_norm.weight` (Qwen3), `post_attention_layernorm.weight`,
//! `mlp.{gate,up,down}_proj.weight`, then `model.norm.weight` and `lm_head.weight` (absent
//! when the embeddings are tied). Other tensors in the files (e.g. `rotary_emb.inv_freq`)
//! are ignored.
//!
//! Every error names the file, the tensor or field, and what was expected; nothing here
//! panics on bad input.
//!
//! ```no_run
//! use candle_core::Device;
//! use hilore_models::zoo;
//! use hilore_runtime::Cx;
//!
//! # fn main() -> Result<(), hilore_models::ModelError> {
//! let (model, cfg, tokenizer) = zoo::load("path/to/Qwen3-0.6B", &Device::Cpu)?;
//! let tok = tokenizer.expect("the directory has a tokenizer.json");
//! let mut ids = tok.encode_prompt("The capital of France is")?;
//! ids.extend(tok.encode_completion(" Paris")?);
//! let batch = hilore_models::TokenBatch::from_sequences(&[ids], &cfg, &Device::Cpu)?;
//! let logp = model.token_logprobs(&mut Cx::inference(), &batch)?;
//! println!("{}", logp.tensor());
//! zoo::export(&model, &cfg, "out/")?;
//! # Ok(())
//! # }
//! ```

use crate::decoder::param_shapes;
use crate::{Decoder, DecoderConfig, ModelError, Tokenizer};
use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The config file of a model directory.
pub const CONFIG_FILE: &str = "config.json";
/// The single-file weights.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of sharded weights (`{"weight_map": {tensor: shard file}}`).
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";
/// The tokenizer.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

fn file_err(path: &Path, problem: impl Into<String>) -> ModelError {
    ModelError::File {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// Loads a model directory: its config, its weights (converted to `f32` on `device`) and,
/// if the directory has one, its tokenizer, whose ids are checked against the config's
/// `vocab_size`.
pub fn load(
    dir: impl AsRef<Path>,
    device: &Device,
) -> Result<(Decoder, DecoderConfig, Option<Tokenizer>), ModelError> {
    let dir = dir.as_ref();
    let cfg = load_config(dir)?;
    let tensors = load_weights(dir, &cfg, device)?;
    let model = Decoder::from_tensors(&cfg, &tensors)?;
    drop(tensors);
    let tokenizer = load_tokenizer(dir, &cfg)?;
    Ok((model, cfg, tokenizer))
}

/// Reads `dir/config.json`.
pub fn load_config(dir: impl AsRef<Path>) -> Result<DecoderConfig, ModelError> {
    let dir = dir.as_ref();
    if !dir.is_dir() {
        return Err(file_err(
            dir,
            "is not a directory; expected a model directory with config.json and model.safetensors (or model.safetensors.index.json)",
        ));
    }
    DecoderConfig::from_json_file(dir.join(CONFIG_FILE))
}

/// Reads `dir/tokenizer.json` if it exists, and checks that every id it can produce is
/// below `cfg.vocab_size`.
pub fn load_tokenizer(
    dir: impl AsRef<Path>,
    cfg: &DecoderConfig,
) -> Result<Option<Tokenizer>, ModelError> {
    let dir = dir.as_ref();
    let path = dir.join(TOKENIZER_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let tok = Tokenizer::from_file(&path)?;
    tok.check_vocab(cfg.vocab_size, &dir.join(CONFIG_FILE))?;
    Ok(Some(tok))
}

/// Where each needed tensor is: the files to read and, per file, the tensors it holds.
fn weight_files(dir: &Path) -> Result<(PathBuf, BTreeMap<PathBuf, Vec<String>>), ModelError> {
    let single = dir.join(WEIGHTS_FILE);
    // Hugging Face looks for the single file first, then the index: so do we.
    if single.exists() {
        return Ok((single.clone(), BTreeMap::from([(single, Vec::new())])));
    }
    let index = dir.join(WEIGHTS_INDEX_FILE);
    if !index.exists() {
        return Err(file_err(
            dir,
            format!("has no weights: expected {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} (sharded safetensors)"),
        ));
    }
    let text = crate::read_text_file(&index)
        .map_err(|e| file_err(&index, format!("cannot read the shard index: {e}")))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        file_err(
            &index,
            format!(
                "is not valid JSON ({e}); expected {{\"weight_map\": {{tensor name: shard file}}}}"
            ),
        )
    })?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(file_err(
            &index,
            "has no `weight_map` object; expected {\"weight_map\": {tensor name: shard file}}",
        ));
    };
    let mut files: BTreeMap<PathBuf, Vec<String>> = BTreeMap::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else {
            return Err(ModelError::Tensor {
                path: index.clone(),
                tensor: tensor.clone(),
                problem: format!("maps to `{file}`; expected a shard file name"),
            });
        };
        if file.contains("..") || Path::new(file).is_absolute() {
            return Err(ModelError::Tensor {
                path: index.clone(),
                tensor: tensor.clone(),
                problem: format!("maps to `{file}`; expected a file inside the model directory"),
            });
        }
        files
            .entry(dir.join(file))
            .or_default()
            .push(tensor.clone());
    }
    Ok((index, files))
}

/// The first non-finite value of `t` (flat index and value), if any.
fn first_non_finite(t: &Tensor) -> Option<(usize, f32)> {
    let v: Vec<f32> = t.flatten_all().ok()?.to_vec1().ok()?;
    v.iter().position(|x| !x.is_finite()).map(|i| (i, v[i]))
}

/// Checks that `path` is a regular file (not a FIFO or a device, which a read would block
/// on or never finish) that resolves inside `dir` (a symlinked shard may not lead out of
/// the model directory).
fn inside_regular_file(dir: &Path, path: &Path) -> Result<(), ModelError> {
    // A file that cannot be looked at is left to the read, whose error says more (which
    // index listed the shard).
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(());
    };
    if !meta.is_file() {
        return Err(file_err(
            path,
            "is not a regular file (a directory, FIFO or device); a model directory holds plain files",
        ));
    }
    let (Ok(d), Ok(p)) = (dir.canonicalize(), path.canonicalize()) else {
        return Ok(());
    };
    if !p.starts_with(&d) {
        return Err(file_err(
            path,
            format!(
                "resolves to {}, outside the model directory {}; copy the file into it instead of linking",
                p.display(),
                d.display()
            ),
        ));
    }
    Ok(())
}

/// Why a safetensors file could not be parsed, in words that say what was expected.
fn describe_safetensors_error(bytes: &[u8], e: &SafeTensorError) -> String {
    let len = bytes.len();
    let Some(head) = bytes.get(..8) else {
        return format!(
            "is {len} bytes long, shorter than the 8-byte header size that starts every safetensors file (truncated or empty)"
        );
    };
    let mut n8 = [0u8; 8];
    n8.copy_from_slice(head);
    let n = u64::from_le_bytes(n8);
    if n.saturating_add(8) > len as u64 {
        return format!(
            "is truncated or not a safetensors file: its first 8 bytes announce a {n}-byte JSON header, but the file has only {} bytes after them",
            len - 8
        );
    }
    if let SafeTensorError::MetadataIncompleteBuffer = e {
        // The header parsed: compare the data it describes with the bytes present.
        let header: Option<serde_json::Value> = std::str::from_utf8(&bytes[8..8 + n as usize])
            .ok()
            .and_then(|s| serde_json::from_str(s).ok());
        let described = header
            .as_ref()
            .and_then(|h| h.as_object())
            .map(|o| {
                o.values()
                    .filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64())
                    .max()
                    .unwrap_or(0)
            })
            .unwrap_or(0);
        let present = len as u64 - 8 - n;
        return format!(
            "is truncated or padded: its header describes {described} bytes of tensor data, the file holds {present} (expected a file of {} bytes)",
            8 + n + described
        );
    }
    format!("is not a valid safetensors file ({e})")
}

/// The JSON header of a safetensors file's bytes, when its length field fits the file.
fn header_text(bytes: &[u8]) -> Option<&str> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let end = 8usize.checked_add(usize::try_from(n).ok()?)?;
    std::str::from_utf8(bytes.get(8..end)?).ok()
}

/// The first key that a JSON object's top level names twice (serde_json keeps the last,
/// so safetensors sees overlapping offsets and says only "invalid offset").
fn duplicate_key(json: &str) -> Option<String> {
    struct Keys;
    impl<'de> serde::de::Visitor<'de> for Keys {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut dup = None;
            while let Some(k) = map.next_key::<String>()? {
                map.next_value::<serde::de::IgnoredAny>()?;
                if dup.is_none() && !seen.insert(k.clone()) {
                    dup = Some(k);
                }
            }
            Ok(dup)
        }
    }
    use serde::Deserializer;
    serde_json::Deserializer::from_str(json)
        .deserialize_map(Keys)
        .ok()
        .flatten()
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

/// Reads the weights the config needs from `dir` (single file or shards), checks every
/// tensor's shape and dtype, and converts them to `f32` on `device`. Tensors the config
/// does not use are skipped (and not converted).
pub fn load_weights(
    dir: impl AsRef<Path>,
    cfg: &DecoderConfig,
    device: &Device,
) -> Result<HashMap<String, Tensor>, ModelError> {
    let dir = dir.as_ref();
    let (origin, files) = weight_files(dir)?;
    let needed: HashMap<String, Vec<usize>> = param_shapes(cfg)?.into_iter().collect();
    let indexed = origin.ends_with(WEIGHTS_INDEX_FILE);
    if indexed {
        // Every needed tensor must be listed in the index.
        let listed: std::collections::HashSet<&str> = files
            .values()
            .flat_map(|v| v.iter().map(String::as_str))
            .collect();
        let mut missing: Vec<&String> = needed
            .keys()
            .filter(|k| !listed.contains(k.as_str()))
            .collect();
        missing.sort();
        if let Some(name) = missing.first() {
            return Err(ModelError::Tensor {
                path: origin.clone(),
                tensor: name.to_string(),
                problem: format!(
                    "is not in the shard index; the config needs it with shape {:?}{}",
                    needed[name.as_str()],
                    if missing.len() > 1 {
                        format!(" ({} needed tensors are missing in all)", missing.len())
                    } else {
                        String::new()
                    }
                ),
            });
        }
    }
    let mut out = HashMap::new();
    for (path, listed) in &files {
        inside_regular_file(dir, path)?;
        let bytes = std::fs::read(path).map_err(|e| {
            file_err(
                path,
                if indexed {
                    format!(
                        "cannot read this shard, listed in {}: {e}",
                        origin.display()
                    )
                } else {
                    format!("cannot read the weights: {e}")
                },
            )
        })?;
        // A name given twice is ambiguous (the parser keeps one of the two silently).
        if let Some(name) = header_text(&bytes).and_then(duplicate_key) {
            return Err(ModelError::Tensor {
                path: path.clone(),
                tensor: name,
                problem: "appears twice in the header; each tensor must appear once (the file was written wrongly or edited)".into(),
            });
        }
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| file_err(path, describe_safetensors_error(&bytes, &e)))?;
        let names: Vec<String> = if indexed {
            listed.clone()
        } else {
            st.names().into_iter().map(str::to_string).collect()
        };
        for name in names {
            let Some(shape) = needed.get(&name) else {
                continue;
            };
            let view = st.tensor(&name).map_err(|_| ModelError::Tensor {
                path: path.clone(),
                tensor: name.clone(),
                problem: format!("is listed in {} but is not in this file", origin.display()),
            })?;
            if view.shape() != shape.as_slice() {
                return Err(ModelError::Tensor {
                    path: path.clone(),
                    tensor: name.clone(),
                    problem: format!(
                        "has shape {:?}; the config ({}) needs {shape:?}",
                        view.shape(),
                        dir.join(CONFIG_FILE).display()
                    ),
                });
            }
            if !matches!(
                view.dtype(),
                Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64
            ) {
                return Err(ModelError::Tensor {
                    path: path.clone(),
                    tensor: name.clone(),
                    problem: format!(
                        "has dtype {}; expected a floating-point dtype (F32, BF16, F16 or F64), converted to F32",
                        dtype_name(view.dtype())
                    ),
                });
            }
            let t = view
                .load(device)
                .and_then(|t| t.to_dtype(DType::F32))
                .map_err(|e| ModelError::Tensor {
                    path: path.clone(),
                    tensor: name.clone(),
                    problem: format!("cannot be read: {e}"),
                })?;
            if let Some((i, v)) = first_non_finite(&t) {
                return Err(ModelError::Tensor {
                    path: path.clone(),
                    tensor: name.clone(),
                    problem: format!(
                        "has a non-finite value ({v}) at flat index {i}; the checkpoint is damaged or was saved after a diverged step"
                    ),
                });
            }
            out.insert(name, t);
        }
    }
    let mut missing: Vec<&String> = needed.keys().filter(|k| !out.contains_key(*k)).collect();
    missing.sort();
    if let Some(name) = missing.first() {
        let tied = if name.as_str() == "lm_head.weight" {
            "; or set `tie_word_embeddings: true` in config.json if the head shares the embedding matrix"
        } else {
            ""
        };
        return Err(ModelError::Tensor {
            path: origin,
            tensor: name.to_string(),
            problem: format!(
                "is missing; the config needs it with shape {:?}{tied}{}",
                needed[name.as_str()],
                if missing.len() > 1 {
                    format!(" ({} needed tensors are missing in all)", missing.len())
                } else {
                    String::new()
                }
            ),
        });
    }
    Ok(out)
}

/// The first model file `dir` holds (`config.json`, `model.safetensors`, its shard index,
/// `tokenizer.json`), if any: what an export into `dir` would replace.
pub fn model_files_in(dir: &Path) -> Option<&'static str> {
    [
        CONFIG_FILE,
        WEIGHTS_FILE,
        WEIGHTS_INDEX_FILE,
        TOKENIZER_FILE,
    ]
    .into_iter()
    .find(|f| dir.join(f).exists())
}

/// Writes `model` as a model directory `dir` (created if needed): `config.json` (`cfg`,
/// with the fields it kept from the original file, `torch_dtype: "float32"`) and
/// `model.safetensors` with every parameter in `f32` under its Hugging Face name. Loading
/// it back with [`load`] gives bit-identical parameters; candle-transformers and
/// `transformers` load it as they load the original.
pub fn export(
    model: &Decoder,
    cfg: &DecoderConfig,
    dir: impl AsRef<Path>,
) -> Result<(), ModelError> {
    export_with(model, cfg, None, dir, DType::F32)
}

/// [`export`], also writing `tokenizer` (as read, byte for byte) and storing the weights
/// as `dtype` (`F32` for a bit-identical round trip; `BF16` or `F16` halve the files and
/// round each weight to nearest).
pub fn export_with(
    model: &Decoder,
    cfg: &DecoderConfig,
    tokenizer: Option<&Tokenizer>,
    dir: impl AsRef<Path>,
    dtype: DType,
) -> Result<(), ModelError> {
    let dir = dir.as_ref();
    let torch_dtype = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        other => {
            return Err(file_err(
                dir,
                format!("cannot export weights as {other:?}: expected F32, BF16 or F16"),
            ))
        }
    };
    // The config may differ from the model's in what it does not model (token ids, ...),
    // not in the parameters it implies.
    let params = model.named_params();
    let shapes = param_shapes(cfg)?;
    let same = shapes.len() == params.len()
        && shapes
            .iter()
            .zip(&params)
            .all(|((n, s), (m, v))| n == m && v.dims() == s.as_slice());
    if !same {
        return Err(file_err(
            dir,
            "export was given a config whose parameters (names and shapes) are not the model's: pass model.config() or a config of the same architecture",
        ));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| file_err(dir, format!("cannot create the output directory: {e}")))?;
    let mut tensors: BTreeMap<String, Tensor> = BTreeMap::new();
    for (name, var) in params {
        let t = var.tensor().to_dtype(dtype)?.contiguous()?;
        tensors.insert(name, t);
    }
    let weights = dir.join(WEIGHTS_FILE);
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    // Every file is written to a temporary beside it first; only when all are whole are
    // they renamed into place, so a write that fails (a full disk, a file-size limit)
    // leaves the directory's old model as it was, loadable.
    let mut staged = crate::atomic::Staged::default();
    staged
        .write_with(&weights, |tmp| {
            safetensors::serialize_to_file(tensors.iter(), Some(meta), tmp)
                .map_err(std::io::Error::other)
        })
        .map_err(|e| file_err(&weights, format!("cannot write the weights: {e}")))?;
    let mut out = cfg.clone();
    out.extra
        .insert("torch_dtype".into(), serde_json::Value::from(torch_dtype));
    if out.extra.contains_key("dtype") {
        out.extra
            .insert("dtype".into(), serde_json::Value::from(torch_dtype));
    }
    if let (false, Some(arch)) = (out.extra.contains_key("architectures"), out.architecture()) {
        out.extra
            .insert("architectures".into(), serde_json::json!([arch]));
    }
    let config = dir.join(CONFIG_FILE);
    let config_json = candle_compatible_json(&out) + "\n";
    staged
        .write(&config, |w| {
            std::io::Write::write_all(w, config_json.as_bytes())
        })
        .map_err(|e| file_err(&config, format!("cannot write the config: {e}")))?;
    if let Some(tok) = tokenizer {
        let path = dir.join(TOKENIZER_FILE);
        staged
            .write(&path, |w| {
                std::io::Write::write_all(w, tok.json().as_bytes())
            })
            .map_err(|e| file_err(&path, format!("cannot write the tokenizer: {e}")))?;
    }
    staged
        .commit()
        .map_err(|e| file_err(dir, format!("cannot move the new files into place: {e}")))?;
    // A stale shard index next to the new single file would be ignored by loaders that
    // follow Hugging Face's order, but is confusing: remove it.
    let stale = dir.join(WEIGHTS_INDEX_FILE);
    if stale.exists() {
        std::fs::remove_file(&stale)
            .map_err(|e| file_err(&stale, format!("cannot remove the old shard index: {e}")))?;
    }
    Ok(())
}

/// The config as JSON, with the fields candle-transformers' config structs require
/// (`qwen2::Config` and `qwen3::Config` need `sliding_window`, `max_window_layers` and
/// `use_sliding_window`) filled with values that leave the math unchanged when the config
/// does not set them.
fn candle_compatible_json(cfg: &DecoderConfig) -> String {
    let mut v: serde_json::Value = cfg.clone().into();
    if let (Some(obj), Some("qwen2" | "qwen3")) = (v.as_object_mut(), cfg.model_type.as_deref()) {
        obj.entry("use_sliding_window")
            .or_insert(serde_json::Value::Bool(false));
        obj.entry("max_window_layers")
            .or_insert(cfg.num_hidden_layers.into());
        if cfg.model_type.as_deref() == Some("qwen2") {
            obj.entry("sliding_window")
                .or_insert(cfg.max_position_embeddings.into());
        }
    }
    serde_json::to_string_pretty(&v).unwrap_or_else(|_| "{}".into())
}
