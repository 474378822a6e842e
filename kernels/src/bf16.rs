//! `bf16`: the upper 16 bits of an IEEE f32, rounded to nearest, ties to even.
//!
//! * Block and scale: none. Each value becomes 2 little-endian bytes (`data` holds `2 * n`
//!   bytes in value order; `scales` is empty).
//! * Rounding: round-to-nearest-even on the 16 discarded mantissa bits ([`f32_to_bf16`]).
//! * Saturation: none; as IEEE rounding prescribes, a finite value whose magnitude rounds
//!   past bf16's largest finite value (about 3.39e38) becomes ±Inf.
//! * Zeros and subnormals keep their sign and round like any other value.
//! * NaN stays NaN: the top 16 bits are kept (sign and payload) and the quiet bit 0x0040 is
//!   set. ±Inf stays ±Inf. `bf16` is the one format that can carry non-finite values, so it
//!   never rejects input.
//! * Decode ([`bf16_to_f32`]) is exact: the 16 bits become the top of an f32. Every 16-bit
//!   pattern is a valid code.
//!
//! Error bound: relative error of a finite normal value at most 2^-8 (8 significant bits).

use rayon::prelude::*;

use crate::scaled::{CHUNK, PAR_MIN};
use crate::{Codec, CodecError, Encoded};

/// The bf16 codec (2 bytes per value, no scales).
#[derive(Debug, Clone, Copy, Default)]
pub struct Bf16;

const NAME: &str = "bf16";

/// Converts an f32 to bf16 bits: round to nearest even; NaN stays a (quiet) NaN.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let nan = (b | 0x0040_0000) >> 16;
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    (if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }) as u16
}

/// Converts bf16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

#[inline(always)]
fn encode_span_generic(src: &[f32], data: &mut [u8]) {
    for (d, &x) in data.chunks_exact_mut(2).zip(src) {
        d.copy_from_slice(&f32_to_bf16(x).to_le_bytes());
    }
}

#[inline(always)]
fn decode_span_generic(data: &[u8], dst: &mut [f32]) {
    for (y, d) in dst.iter_mut().zip(data.chunks_exact(2)) {
        *y = bf16_to_f32(u16::from_le_bytes([d[0], d[1]]));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn encode_span_avx2(src: &[f32], data: &mut [u8]) {
    encode_span_generic(src, data)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn decode_span_avx2(data: &[u8], dst: &mut [f32]) {
    decode_span_generic(data, dst)
}

fn encode_span(src: &[f32], data: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { encode_span_avx2(src, data) };
    }
    encode_span_generic(src, data)
}

fn decode_span(data: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { decode_span_avx2(data, dst) };
    }
    decode_span_generic(data, dst)
}

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
        out.data.resize(2 * src.len(), 0);
        if src.len() < PAR_MIN {
            encode_span(src, &mut out.data);
        } else {
            src.par_chunks(CHUNK)
                .zip(out.data.par_chunks_mut(2 * CHUNK))
                .for_each(|(x, d)| encode_span(x, d));
        }
        Ok(())
    }

    fn decode(&self, enc: &Encoded, dst: &mut [f32]) -> Result<(), CodecError> {
        if enc.codec != NAME {
            return Err(CodecError::WrongCodec {
                expected: NAME,
                found: enc.codec,
            });
        }
        let expected = enc.len.saturating_mul(2);
        if enc.data.len() != expected {
            return Err(CodecError::Corrupted {
                codec: NAME,
                len: enc.len,
                what: "data",
                found: enc.data.len(),
                expected,
            });
        }
        if !enc.scales.is_empty() {
            return Err(CodecError::Corrupted {
                codec: NAME,
                len: enc.len,
                what: "scales",
                found: enc.scales.len(),
                expected: 0,
            });
        }
        if dst.len() != enc.len {
            return Err(CodecError::LengthMismatch {
                codec: NAME,
                expected: enc.len,
                found: dst.len(),
            });
        }
        if dst.len() < PAR_MIN {
            decode_span(&enc.data, dst);
        } else {
            enc.data
                .par_chunks(2 * CHUNK)
                .zip(dst.par_chunks_mut(CHUNK))
                .for_each(|(d, y)| decode_span(d, y));
        }
        Ok(())
    }
}
