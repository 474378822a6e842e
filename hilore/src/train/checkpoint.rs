//! Training checkpoints: one file, written atomically.
//!
//! Layout (format version 2): the 12-byte magic `HILORE-CKPT\0`, a little-endian `u32`
//! format version, a little-endian `u64` header length, the header's CRC-32 (`u32`), the
//! header (JSON: the run's settings, the training state, and the name, shape and CRC-32
//! of every tensor), then every tensor's `f32` values, little-endian, in header order.
//! `f32` bits round-trip exactly, which is what lets a resumed run continue bit for bit.
//! Reading checks, before allocating anything, that the tensors' sizes add up to the
//! file's length, then every checksum and that every value is finite: a corrupt or
//! truncated checkpoint is an error naming the file and the tensor. Version 1 (the same
//! without checksums) is still read.
//!
//! Writing goes to a temporary file in the same directory, flushed to disk, then renamed
//! over the destination: a crash leaves either the old checkpoint or the new one, never a
//! torn file.

use super::ActorModel;
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::Path;

const MAGIC: &[u8; 12] = b"HILORE-CKPT\0";
const VERSION: u32 = 2;

/// Prefix of a JSON string that holds an `f64`'s bits (see [`floats_to_bits`]).
const F64_BITS: &str = "f64:";

/// `v` with every floating-point number replaced by a string of its bits
/// (`"f64:3ff0000000000000"`), so that it survives the JSON text bit for bit (a decimal
/// float is not guaranteed to parse back to the same bits). Integers stay numbers.
pub fn floats_to_bits(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().expect("an f64 number");
            Value::String(format!("{F64_BITS}{:016x}", x.to_bits()))
        }
        Value::Array(a) => Value::Array(a.into_iter().map(floats_to_bits).collect()),
        Value::Object(o) => {
            Value::Object(o.into_iter().map(|(k, v)| (k, floats_to_bits(v))).collect())
        }
        other => other,
    }
}

/// The inverse of [`floats_to_bits`]. A string of bits that is not a finite number is an
/// error (JSON has no NaN or infinity).
pub fn floats_from_bits(v: serde_json::Value) -> anyhow::Result<serde_json::Value> {
    use serde_json::Value;
    Ok(match v {
        Value::String(s) if s.starts_with(F64_BITS) && s.len() == F64_BITS.len() + 16 => {
            let bits = u64::from_str_radix(&s[F64_BITS.len()..], 16)
                .with_context(|| format!("`{s}` is not an f64's bits"))?;
            let x = f64::from_bits(bits);
            Value::Number(
                serde_json::Number::from_f64(x)
                    .with_context(|| format!("`{s}` is {x}, not a finite number"))?,
            )
        }
        Value::Array(a) => Value::Array(
            a.into_iter()
                .map(floats_from_bits)
                .collect::<anyhow::Result<_>>()?,
        ),
        Value::Object(o) => Value::Object(
            o.into_iter()
                .map(|(k, v)| Ok((k, floats_from_bits(v)?)))
                .collect::<anyhow::Result<_>>()?,
        ),
        other => other,
    })
}

/// One named `f32` tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

#[derive(Serialize, Deserialize)]
struct TensorEntry {
    name: String,
    shape: Vec<usize>,
    /// CRC-32 of the tensor's little-endian bytes (absent in version 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    crc32: Option<u32>,
}

/// Hands `data`'s little-endian bytes to `f` in blocks of at most 16 KiB (a stack
/// buffer: no copy of the tensor), for its checksum and for writing it.
fn le_blocks<E>(data: &[f32], mut f: impl FnMut(&[u8]) -> Result<(), E>) -> Result<(), E> {
    let mut buf = [0u8; 16384];
    for chunk in data.chunks(buf.len() / 4) {
        for (b, x) in buf.chunks_exact_mut(4).zip(chunk) {
            b.copy_from_slice(&x.to_le_bytes());
        }
        f(&buf[..chunk.len() * 4])?;
    }
    Ok(())
}

/// CRC-32 of `data`'s little-endian bytes.
fn crc_of(data: &[f32]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    let _ = le_blocks::<()>(data, |b| {
        h.update(b);
        Ok(())
    });
    h.finalize()
}

#[derive(Serialize, Deserialize)]
struct Header {
    run: serde_json::Value,
    state: serde_json::Value,
    tensors: Vec<TensorEntry>,
}

/// A checkpoint's contents.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The settings that fix the trajectory (compared on resume).
    pub run: serde_json::Value,
    /// The training state (step, counters, warm-start results).
    pub state: serde_json::Value,
    /// Weights, reference weights and optimizer moments, by name.
    pub tensors: Vec<NamedTensor>,
}

impl Checkpoint {
    /// Writes the checkpoint to `path` atomically (temporary file + rename).
    pub fn save_atomic(&self, path: &Path) -> anyhow::Result<()> {
        let header = Header {
            run: self.run.clone(),
            state: self.state.clone(),
            tensors: self
                .tensors
                .iter()
                .map(|t| TensorEntry {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    crc32: Some(crc_of(&t.data)),
                })
                .collect(),
        };
        let header = serde_json::to_vec(&header)?;
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating checkpoint directory {}", dir.display()))?;
        if path.file_name().is_none() {
            bail!("checkpoint path {} has no file name", path.display());
        }
        // Written to `.NAME.tmp-PID` beside it, flushed, then renamed over it (so a
        // failed or killed write leaves the previous checkpoint whole); temporaries of
        // runs that died mid-write are removed first.
        hilore_models::atomic::write_atomic(path, |w| {
            w.write_all(MAGIC)?;
            w.write_all(&VERSION.to_le_bytes())?;
            w.write_all(&(header.len() as u64).to_le_bytes())?;
            w.write_all(&crc32fast::hash(&header).to_le_bytes())?;
            w.write_all(&header)?;
            for t in &self.tensors {
                le_blocks(&t.data, |b| w.write_all(b))?;
            }
            Ok(())
        })
        .with_context(|| format!("writing checkpoint {}", path.display()))?;
        Ok(())
    }

    /// Reads a checkpoint written by [`Checkpoint::save_atomic`].
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let ctx = || format!("reading checkpoint {}", path.display());
        // Checked before opening: opening a FIFO blocks until something writes to it.
        let meta = std::fs::metadata(path).with_context(ctx)?;
        if !meta.is_file() {
            bail!(
                "checkpoint {} is not a regular file; give the path of a checkpoint file",
                path.display()
            );
        }
        let file = std::fs::File::open(path).with_context(ctx)?;
        let file_len = file.metadata().with_context(ctx)?.len();
        let mut f = std::io::BufReader::new(file);
        let mut magic = [0u8; 12];
        f.read_exact(&mut magic).with_context(ctx)?;
        if &magic != MAGIC {
            bail!("{} is not a hilore training checkpoint", path.display());
        }
        let mut b4 = [0u8; 4];
        f.read_exact(&mut b4).with_context(ctx)?;
        let version = u32::from_le_bytes(b4);
        if version != VERSION && version != 1 {
            bail!(
                "checkpoint {} has format version {version}; this hilore reads versions 1 and {VERSION}",
                path.display()
            );
        }
        let mut b8 = [0u8; 8];
        f.read_exact(&mut b8).with_context(ctx)?;
        let n = u64::from_le_bytes(b8);
        let prefix: u64 = if version == 1 { 24 } else { 28 };
        if n > file_len.saturating_sub(prefix) {
            bail!(
                "checkpoint {} has a corrupt header length ({n} bytes in a file of {file_len})",
                path.display()
            );
        }
        let want_crc = if version == 1 {
            None
        } else {
            f.read_exact(&mut b4).with_context(ctx)?;
            Some(u32::from_le_bytes(b4))
        };
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header).with_context(ctx)?;
        if let Some(c) = want_crc {
            if crc32fast::hash(&header) != c {
                bail!(
                    "checkpoint {} is corrupt: its header does not match its checksum",
                    path.display()
                );
            }
        }
        let header: Header = serde_json::from_slice(&header)
            .with_context(|| format!("checkpoint {} has a corrupt header", path.display()))?;
        // The tensors' sizes against the bytes the file has, before allocating any.
        let mut left = file_len - prefix - n;
        for e in &header.tensors {
            let bytes = e
                .shape
                .iter()
                .try_fold(4u64, |acc, &d| acc.checked_mul(d as u64));
            match bytes {
                Some(b) if b <= left => left -= b,
                _ => bail!(
                    "checkpoint {} is corrupt or truncated: tensor {} of shape {:?} needs more bytes than the file has left ({left})",
                    path.display(),
                    e.name,
                    e.shape
                ),
            }
        }
        if left != 0 {
            bail!(
                "checkpoint {} has {left} trailing bytes after its last tensor",
                path.display()
            );
        }
        let mut tensors = Vec::with_capacity(header.tensors.len());
        for e in header.tensors {
            let len: usize = e.shape.iter().product();
            let mut bytes = vec![0u8; len * 4];
            f.read_exact(&mut bytes).with_context(|| {
                format!(
                    "checkpoint {} is truncated in tensor {}",
                    path.display(),
                    e.name
                )
            })?;
            if version != 1 && e.crc32 != Some(crc32fast::hash(&bytes)) {
                bail!(
                    "checkpoint {} is corrupt: tensor {} does not match its checksum",
                    path.display(),
                    e.name
                );
            }
            let data: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if let Some(i) = data.iter().position(|x| !x.is_finite()) {
                bail!(
                    "checkpoint {}: tensor {} has a non-finite value ({}) at flat index {i}",
                    path.display(),
                    e.name,
                    data[i]
                );
            }
            tensors.push(NamedTensor {
                name: e.name,
                shape: e.shape,
                data,
            });
        }
        Ok(Checkpoint {
            run: header.run,
            state: header.state,
            tensors,
        })
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> anyhow::Result<&NamedTensor> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .with_context(|| format!("checkpoint has no tensor {name}"))
    }
}

/// The parameters of `model` as checkpoint tensors named `{prefix}/{name}`, in the
/// model's order (for any [`ActorModel`]: the policy, the reference policy).
pub fn model_tensors<M: ActorModel>(prefix: &str, model: &M) -> anyhow::Result<Vec<NamedTensor>> {
    model
        .named_params()
        .into_iter()
        .map(|(name, v)| {
            Ok(NamedTensor {
                name: format!("{prefix}/{name}"),
                shape: v.dims().to_vec(),
                data: v.tensor().flatten_all()?.to_vec1::<f32>()?,
            })
        })
        .collect()
}

/// Sets every parameter of `model` from the tensor `{prefix}/{name}` of `ck`, bit for
/// bit; a missing tensor, or one of another shape, is an error naming it (and nothing of
/// the model is changed then).
pub fn restore_model<M: ActorModel>(
    ck: &Checkpoint,
    prefix: &str,
    model: &mut M,
) -> anyhow::Result<()> {
    let mut values = Vec::new();
    for (name, v) in model.named_params() {
        let t = ck.tensor(&format!("{prefix}/{name}"))?;
        if t.shape != v.dims() {
            bail!(
                "checkpoint tensor {prefix}/{name} has shape {:?}, the model's parameter {:?}: the checkpoint is of another model",
                t.shape,
                v.dims()
            );
        }
        let device = v.tensor().device().clone();
        values.push(
            candle_core::Tensor::from_vec(t.data.clone(), t.shape.clone(), &device)?
                .to_dtype(v.tensor().dtype())?,
        );
    }
    for ((_, p), t) in model.named_params_mut().into_iter().zip(values) {
        p.set_tensor(t)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Floats whose shortest decimal form needs 17 digits and a far exponent (where a
    /// fast decimal parser may round to a neighbour) come back with the same bits through
    /// the JSON text; integers stay integers.
    #[test]
    fn floats_survive_the_json_text_bit_for_bit() {
        let xs: Vec<f64> = vec![
            3.718_281_828_459_045e-9,
            0.1 + 0.2,
            f64::MIN_POSITIVE,
            5e-324,
            -1.797_693_134_862_315_7e308,
            2.225_073_858_507_201e-308,
            1.0 / 3.0 * 1e-7,
        ];
        let v = serde_json::json!({"xs": xs, "n": 7u64, "name": "f64:not-bits"});
        let text = serde_json::to_string(&floats_to_bits(v)).unwrap();
        let back = floats_from_bits(serde_json::from_str(&text).unwrap()).unwrap();
        let got: Vec<f64> = serde_json::from_value(back["xs"].clone()).unwrap();
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&xs));
        assert_eq!(back["n"], 7);
        assert_eq!(back["name"], "f64:not-bits");
        // Bits of a NaN are an error, not a panic.
        let nan = serde_json::json!(format!("f64:{:016x}", f64::NAN.to_bits()));
        assert!(floats_from_bits(nan).is_err());
    }

    #[test]
    fn round_trip_is_bit_exact_and_atomic() {
        let dir = std::env::temp_dir().join(format!("hilore-ckpt-test-{}", std::process::id()));
        let path = dir.join("a.ckpt");
        let ck = Checkpoint {
            run: serde_json::json!({"seed": 3}),
            state: serde_json::json!({"step": 7}),
            tensors: vec![
                NamedTensor {
                    name: "w".into(),
                    shape: vec![2, 3],
                    data: vec![1.0, -0.0, f32::MIN_POSITIVE, 1e-45, 3.5, -7.25],
                },
                NamedTensor {
                    name: "b".into(),
                    shape: vec![1],
                    data: vec![0.1],
                },
            ],
        };
        ck.save_atomic(&path).unwrap();
        let back = Checkpoint::load(&path).unwrap();
        assert_eq!(back.run, ck.run);
        assert_eq!(back.state, ck.state);
        for (a, b) in back.tensors.iter().zip(&ck.tensors) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.data), bits(&b.data));
        }
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1);
        let bytes = std::fs::read(&path).unwrap();
        let err = |b: &[u8]| {
            std::fs::write(&path, b).unwrap();
            let e = format!("{:#}", Checkpoint::load(&path).unwrap_err());
            assert!(e.contains("a.ckpt"), "the file is named: {e}");
            e
        };
        // A truncated file is an error naming the tensor that does not fit.
        let e = err(&bytes[..bytes.len() - 3]);
        assert!(e.contains("tensor b"), "{e}");
        // Every flipped bit is found: in the header (by its checksum, or the length
        // field) or in a tensor (named).
        let n = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
        for byte in 16..bytes.len() {
            let mut b = bytes.clone();
            b[byte] ^= 0x10;
            let e = err(&b);
            if byte >= 28 + n {
                let t = if byte < 28 + n + 24 {
                    "tensor w"
                } else {
                    "tensor b"
                };
                assert!(e.contains(t), "byte {byte}: {e}");
            }
        }
        // A tensor shape of 2^40 elements is an error before anything is allocated.
        let mut h: serde_json::Value = serde_json::from_slice(&bytes[28..28 + n]).unwrap();
        h["tensors"][0]["shape"] = serde_json::json!([1u64 << 40]);
        let hb = serde_json::to_vec(&h).unwrap();
        let mut b = bytes[..16].to_vec();
        b.extend_from_slice(&(hb.len() as u64).to_le_bytes());
        b.extend_from_slice(&crc32fast::hash(&hb).to_le_bytes());
        b.extend_from_slice(&hb);
        b.extend_from_slice(&bytes[28 + n..]);
        let e = err(&b);
        assert!(e.contains("tensor w") && e.contains("1099511627776"), "{e}");
        // A non-finite value is named with its tensor and index.
        let bad = Checkpoint {
            tensors: vec![NamedTensor {
                name: "w".into(),
                shape: vec![3],
                data: vec![0.0, f32::NAN, 1.0],
            }],
            ..ck.clone()
        };
        bad.save_atomic(&path).unwrap();
        let e = format!("{:#}", Checkpoint::load(&path).unwrap_err());
        assert!(e.contains("tensor w") && e.contains("index 1"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// A checkpoint damaged anywhere (a byte flipped, cut short, bytes inserted) or
        /// replaced by random bytes is an error naming the file, or (for damage that
        /// changes nothing it reads) the same checkpoint: never a panic or an allocation
        /// the file cannot back.
        #[test]
        fn damaged_checkpoints_are_errors_or_identical(
            kind in 0u8..4,
            at in any::<usize>(),
            x in 1u8..=255,
            junk in prop::collection::vec(any::<u8>(), 0..200),
            case in any::<u32>(),
        ) {
            let dir = std::env::temp_dir()
                .join(format!("hilore-ckpt-fuzz-{}-{case}", std::process::id()));
            let path = dir.join("f.ckpt");
            let ck = Checkpoint {
                run: serde_json::json!({"seed": 3, "lr": 0.5}),
                state: serde_json::json!({"step": 7, "name": "x"}),
                tensors: vec![
                    NamedTensor { name: "w".into(), shape: vec![2, 3], data: vec![1.0, -2.0, 0.5, 3.0, 0.0, 7.0] },
                    NamedTensor { name: "b".into(), shape: vec![2], data: vec![0.1, 0.2] },
                ],
            };
            ck.save_atomic(&path).unwrap();
            let mut b = std::fs::read(&path).unwrap();
            let i = at % b.len();
            match kind {
                0 => b[i] ^= x,
                1 => b.truncate(i),
                2 => { b.splice(i..i, junk.iter().copied()); }
                _ => b = junk.clone(),
            }
            std::fs::write(&path, &b).unwrap();
            match Checkpoint::load(&path) {
                Ok(back) => prop_assert_eq!(back, ck),
                Err(e) => {
                    let msg = format!("{e:#}");
                    prop_assert!(msg.contains("f.ckpt"), "no path named: {}", msg);
                }
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// Any model's parameters and AdamW's moments round-trip through a checkpoint file bit
    /// for bit; a checkpoint of another model is refused naming the tensor, leaving the
    /// model as it was.
    #[test]
    fn model_and_moments_restore_bit_for_bit() {
        use crate::train::optimizer::{AdamW, AdamWConfig};
        use hilore_models::{Decoder, DecoderConfig};
        let dev = candle_core::Device::Cpu;
        let cfg = DecoderConfig::tiny();
        let a = Decoder::random(&cfg, 1, &dev).unwrap();
        let adamw = AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
        };
        let mut opt = AdamW::new(adamw, &a);
        for (i, (_, m, v)) in opt.state.iter_mut().enumerate() {
            m.iter_mut().for_each(|x| *x = i as f32 * 0.25 - 1e-7);
            v.iter_mut().for_each(|x| *x = (i as f32 + 0.5) * 3e-9);
        }
        let mut tensors = model_tensors("model", &a).unwrap();
        tensors.extend(opt.moment_tensors());
        let ck = Checkpoint {
            run: serde_json::json!({}),
            state: serde_json::json!({}),
            tensors,
        };
        let dir = std::env::temp_dir().join(format!("hilore-ckpt-model-{}", std::process::id()));
        let path = dir.join("m.ckpt");
        ck.save_atomic(&path).unwrap();
        let back = Checkpoint::load(&path).unwrap();
        std::fs::remove_dir_all(&dir).ok();

        let mut b = Decoder::random(&cfg, 2, &dev).unwrap();
        restore_model(&back, "model", &mut b).unwrap();
        let bits = |m: &Decoder| -> Vec<u32> {
            m.named_params()
                .iter()
                .flat_map(|(_, v)| v.tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .map(f32::to_bits)
                .collect()
        };
        assert_eq!(bits(&a), bits(&b));
        let mut opt_b = AdamW::new(adamw, &b);
        opt_b.restore_moments(&back).unwrap();
        assert_eq!(opt_b.state, opt.state);

        // Another model's checkpoint: an error naming the tensor, the model unchanged.
        let wide = DecoderConfig {
            intermediate_size: cfg.intermediate_size * 2,
            ..cfg.clone()
        };
        let mut c = Decoder::random(&wide, 3, &dev).unwrap();
        let before = bits(&c);
        let e = restore_model(&back, "model", &mut c)
            .unwrap_err()
            .to_string();
        assert!(e.contains("model/") && e.contains("another model"), "{e}");
        assert_eq!(bits(&c), before);
        let e = restore_model(&back, "reference", &mut b)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no tensor reference/"), "{e}");
    }
}
