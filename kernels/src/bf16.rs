//! `bf16`: the upper 16 bits of an IEEE f32, rounded to nearest, ties to even.
//!
//! Spec: no block, no scale. Each value becomes 2 little-endian bytes. Rounding is
//! round-to-nearest-even on the 16 discarded mantissa bits; values whose magnitude rounds
//! past bf16's largest finite value become +-Inf exactly as IEEE rounding prescribes.
//! Zeros and subnormals keep their sign and round like any other value. NaN stays NaN (a
//! quiet NaN with the sign kept); +-Inf stays +-Inf. Relative error of a finite normal
//! value is at most 2^-8 (8 significant bits).

use crate::{Codec, CodecError, Encoded};

/// The bf16 codec (2 bytes per value, no scales).
#[derive(Debug, Clone, Copy, Default)]
pub struct Bf16;

const NAME: &str = "bf16";

impl Codec for Bf16 {
    fn name(&self) -> &'static str {
        NAME
    }

    fn encoded_len(&self, n: usize) -> usize {
        2 * n
    }

    fn encode(&self, src: &[f32], out: &mut Encoded) -> Result<(), CodecError> {
        out.codec = NAME;
        out.len = src.len();
        out.scales.clear();
        out.data.clear();
        out.data.reserve(2 * src.len());
        out.data.extend(
            src.iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()),
        );
        Ok(())
    }

    fn decode(&self, enc: &Encoded, dst: &mut [f32]) -> Result<(), CodecError> {
        if enc.codec != NAME {
            return Err(CodecError::WrongCodec {
                expected: NAME,
                found: enc.codec,
            });
        }
        if enc.data.len() != 2 * enc.len {
            return Err(CodecError::Corrupted {
                codec: NAME,
                len: enc.len,
                what: "data",
                found: enc.data.len(),
                expected: 2 * enc.len,
            });
        }
        if dst.len() != enc.len {
            return Err(CodecError::LengthMismatch {
                codec: NAME,
                expected: enc.len,
                found: dst.len(),
            });
        }
        for (d, b) in dst.iter_mut().zip(enc.data.chunks_exact(2)) {
            *d = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        }
        Ok(())
    }
}
