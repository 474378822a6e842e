//! HiLoRe's compression formats ("codecs").
//!
//! A codec turns a slice of `f32` saved activations into a compact byte encoding
//! (data + scales) and back. The runtime's `Compress` fidelity stores a saved tensor as a
//! codec's [`Encoded`] between the forward and the backward pass.
//!
//! ```
//! use hilore_kernels::{codec_by_name, Encoded};
//! let codec = codec_by_name("bf16").unwrap();
//! let x = vec![1.0f32, -2.5, 3.140625];
//! let mut enc = Encoded::default();
//! codec.encode(&x, &mut enc).unwrap();
//! assert_eq!(enc.nbytes(), codec.encoded_len(x.len()));
//! let mut y = vec![0.0; x.len()];
//! codec.decode(&enc, &mut y).unwrap();
//! assert_eq!(x, y); // these three values are exactly representable in bf16
//! ```

mod bf16;

pub use crate::bf16::Bf16;

/// Errors of encoding and decoding.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CodecError {
    /// The encoding was produced by another codec.
    #[error("encoding was made by codec `{found}`, cannot decode it with `{expected}`")]
    WrongCodec {
        expected: &'static str,
        found: &'static str,
    },
    /// The buffers do not have the sizes the element count implies (truncated or corrupted).
    #[error("corrupted `{codec}` encoding of {len} values: {what} holds {found} bytes, expected {expected}")]
    Corrupted {
        codec: &'static str,
        len: usize,
        what: &'static str,
        found: usize,
        expected: usize,
    },
    /// The destination slice does not hold as many values as were encoded.
    #[error("destination holds {found} values but the `{codec}` encoding has {expected}")]
    LengthMismatch {
        codec: &'static str,
        expected: usize,
        found: usize,
    },
    /// A codec name that no codec answers to.
    #[error("unknown codec `{0}`; the codecs are {list}", list = codec_names().join(", "))]
    Unknown(String),
    /// The input holds NaN or an infinity, which the format cannot carry faithfully.
    #[error("`{codec}` cannot encode a non-finite value (found {value} at index {index})")]
    NonFinite {
        codec: &'static str,
        index: usize,
        value: f32,
    },
}

/// A codec's encoding of `len` values: `data` and `scales` bytes, both counted by
/// [`Encoded::nbytes`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Encoded {
    /// Name of the codec that wrote this encoding.
    pub codec: &'static str,
    /// Number of encoded values.
    pub len: usize,
    /// Element payload.
    pub data: Vec<u8>,
    /// Per-block scales (empty for codecs without scales).
    pub scales: Vec<u8>,
}

impl Encoded {
    /// Exact bytes the encoding occupies: data plus scales.
    pub fn nbytes(&self) -> usize {
        self.data.len() + self.scales.len()
    }
}

/// A lossy or lossless compression format for saved activations.
pub trait Codec: Send + Sync + std::fmt::Debug {
    /// Stable name (`bf16`, ...), used in plans, reports and JSON.
    fn name(&self) -> &'static str;
    /// Exact size in bytes (data + scales) of the encoding of `n` values.
    fn encoded_len(&self, n: usize) -> usize;
    /// Encodes `src` into `out`, reusing `out`'s buffers.
    fn encode(&self, src: &[f32], out: &mut Encoded) -> Result<(), CodecError>;
    /// Decodes `enc` into `dst`, which must hold exactly `enc.len` values.
    fn decode(&self, enc: &Encoded, dst: &mut [f32]) -> Result<(), CodecError>;
}

static BF16: Bf16 = Bf16;

/// Every codec this build knows, in a stable order.
pub fn codecs() -> Vec<&'static dyn Codec> {
    vec![&BF16]
}

/// The names of [`codecs`].
pub fn codec_names() -> Vec<&'static str> {
    codecs().iter().map(|c| c.name()).collect()
}

/// Looks a codec up by name.
pub fn codec_by_name(name: &str) -> Result<&'static dyn Codec, CodecError> {
    codecs()
        .into_iter()
        .find(|c| c.name() == name)
        .ok_or_else(|| CodecError::Unknown(name.to_string()))
}
