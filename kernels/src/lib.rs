//! HiLoRe's compression formats ("codecs").
//!
//! A codec turns a slice of `f32` saved activations into a compact byte encoding
//! (data + scales) and back. The runtime's `Compress` fidelity stores a saved tensor as a
//! codec's [`Encoded`] between the forward and the backward pass, so encoding and decoding
//! must cost far less than recomputing: the CPU paths are vectorised and multi-threaded, and
//! with the `cuda` feature the same formats run on the GPU and produce identical bytes.
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
//!
//! # Formats
//!
//! | name | module | bytes per value | scale | max relative error (normal range) |
//! |---|---|---|---|---|
//! | `bf16` | [`bf16`] | 2 | none | 2^-8 |
//! | `fp8-e4m3-b32` | [`fp8`] | 1 + 4/32 | f32 per 32 values | 2^-4 |
//! | `fp8-e4m3-b128` | [`fp8`] | 1 + 4/128 | f32 per 128 values | 2^-4 |
//! | `int8-b32` | [`int8`] | 1 + 4/32 | f32 per 32 values | absolute: scale/2, scale = absmax/127 |
//! | `int4-g32`, `int4-g64`, `int4-g128` | [`int4`] | 1/2 + 4/group | f32 per group | absolute: scale/2, scale = absmax/7 |
//!
//! Each module's documentation is the format's specification: block size, scale type and
//! how it is computed, rounding, saturation, byte layout, and the handling of zeros,
//! subnormals, infinities and NaN. The CPU code and the CUDA kernels (`kernels/cuda/`) follow
//! the same spec step by step with correctly rounded IEEE operations only (no fused
//! multiply-add, no flush-to-zero), which is why their bytes agree.
//!
//! # Non-finite values
//!
//! NaN or an infinity in the input never silently becomes a finite value. `bf16` carries
//! them exactly (it is a truncated IEEE float). The scaled formats cannot, so their `encode`
//! returns [`CodecError::NonFinite`] naming the first offending index; the runtime turns it
//! into an error naming the unit whose saved tensor held it.
//!
//! # Corrupted encodings
//!
//! `decode` checks the codec name, the element count against the destination, the exact
//! sizes of data and scales, every scale and every code against what an encoder can write,
//! and returns a [`CodecError`] instead of panicking or reading out of bounds.

pub mod bench;
pub mod bf16;
pub mod fp8;
pub mod int4;
pub mod int8;
mod scaled;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use crate::bench::{bench_codec, CodecBenchRow};
pub use crate::bf16::Bf16;
pub use crate::fp8::Fp8E4m3;
pub use crate::int4::Int4;
pub use crate::int8::Int8;

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
    /// A block scale that no encoder writes: negative, NaN, infinite, subnormal, or so large
    /// that decoding would overflow.
    #[error("corrupted `{codec}` encoding: the scale of block {block} is invalid (f32 bits {bits:#010x})")]
    InvalidScale {
        codec: &'static str,
        block: usize,
        bits: u32,
    },
    /// A code that no encoder writes (an FP8 NaN, INT8 -128, INT4 -8, or a non-zero INT4
    /// padding nibble; `index` is then the padding position, equal to the value count).
    #[error("corrupted `{codec}` encoding: invalid code {code:#04x} at value {index}")]
    InvalidCode {
        codec: &'static str,
        index: usize,
        code: u8,
    },
}

/// Errors of asking for a GPU to run the codecs on.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum DeviceError {
    /// This build has no GPU code.
    #[error("not compiled with CUDA support (build hilore-kernels with `--features cuda`)")]
    NotCompiled,
    /// libcuda could not be loaded.
    #[error("CUDA driver library not found: {0}")]
    DriverNotFound(String),
    /// libnvrtc could not be loaded.
    #[error("NVRTC library not found: {0}")]
    NvrtcNotFound(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error while {context}: {message}")]
    Driver {
        context: &'static str,
        message: String,
    },
    /// NVRTC rejected the kernels.
    #[error("NVRTC failed to compile the codec kernels: {0}")]
    Compile(String),
    /// The codec refused the input or the encoding.
    #[error(transparent)]
    Codec(#[from] CodecError),
}

/// Whether this build contains the CUDA implementation (cargo feature `cuda`).
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

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
static FP8_E4M3_B32: Fp8E4m3<32> = Fp8E4m3;
static FP8_E4M3_B128: Fp8E4m3<128> = Fp8E4m3;
static INT8_B32: Int8<32> = Int8;
static INT4_G32: Int4<32> = Int4;
static INT4_G64: Int4<64> = Int4;
static INT4_G128: Int4<128> = Int4;

/// Every codec this build knows, in a stable order.
pub fn codecs() -> Vec<&'static dyn Codec> {
    vec![
        &BF16,
        &FP8_E4M3_B32,
        &FP8_E4M3_B128,
        &INT8_B32,
        &INT4_G32,
        &INT4_G64,
        &INT4_G128,
    ]
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
