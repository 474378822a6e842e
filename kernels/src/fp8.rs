//! `fp8-e4m3-b32` and `fp8-e4m3-b128`: OCP FP8 E4M3 ("E4M3FN") codes with one f32 scale
//! per block of 32 or 128 values.
//!
//! # Element format
//!
//! OCP 8-bit floating point, E4M3 variant: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa
//! bits. No infinities; `S.1111.111` (0x7f, 0xff) is NaN; the largest finite magnitude is
//! `S.1111.110` = 448. Exponent field 0 holds the subnormals `m * 2^-9` (m = 1..7), so the
//! smallest positive value is 2^-9 and the smallest normal 2^-6. ±0 are 0x00 and 0x80.
//! [`e4m3_to_f32`] decodes a code exactly; [`f32_to_e4m3`] encodes any f32:
//!
//! * rounding: to nearest, ties to even, in one step from the f32 value (including into and
//!   within the subnormal range);
//! * saturation: every finite value whose magnitude exceeds 448 (even one that would round
//!   to 480) becomes ±448, and so do ±Inf (the OCP "saturating" conversion);
//! * NaN becomes 0x7f with the sign of the input.
//!
//! # Codec
//!
//! * Block: `B` = 32 (`fp8-e4m3-b32`) or 128 (`fp8-e4m3-b128`) consecutive values; the last
//!   block may be shorter and is handled as if padded with zeros.
//! * Scale: one f32 per block. `absmax` is the largest |x| of the block;
//!   `scale = absmax / 448` and `inv = 448 / absmax`, each a correctly rounded f32 division.
//!   If `scale` would be zero or subnormal (absmax < 448 * 2^-126 ≈ 5.3e-36, including all-zero
//!   blocks) the block gets `scale = 0`, `inv = 0`, and every value encodes as ±0. If
//!   `scale * 448` would overflow (absmax within ulps of f32::MAX) `scale` is lowered one ulp at
//!   a time until it does not.
//! * Code of value x: `f32_to_e4m3(fl(x * inv))`, where `fl(x * inv)` is the f32 product,
//!   rounded to nearest even. The product can exceed 448 by an ulp or so (inv is rounded);
//!   saturation maps it to 448, so the largest value of a block always gets code ±0x7e.
//! * Decode: `y = fl(e4m3_to_f32(code) * scale)` (one rounding).
//! * Layout: `data` holds one code per value in value order (`n` bytes); `scales` holds one
//!   little-endian f32 per started block (`4 * ceil(n / B)` bytes).
//! * Zeros: ±0 encode as ±0 and decode as ±0.
//! * Subnormals: f32 subnormals are scaled like any value and round to the nearest E4M3 code
//!   (usually zero). Values that land below 2^-6 after scaling use E4M3's subnormal codes.
//! * NaN and ±Inf: `encode` fails with
//!   [`CodecError::NonFinite`](crate::CodecError::NonFinite) naming the first offending
//!   index, and leaves `out` empty.
//! * Decode rejects NaN codes (0x7f, 0xff) and scales an encoder cannot write (negative,
//!   NaN, Inf, subnormal, or with `scale * 448` overflowing).
//!
//! # Error bound
//!
//! With `t = x * inv`: for |t| >= 2^-6 the code is within 2^-4 |t| of t (3 mantissa bits,
//! half an ulp); below, within 2^-10 (half the subnormal spacing 2^-9). So
//! `|y - x| <= 2^-4 |x| + 2^-10 * scale`, plus a few f32 ulps of |x| from rounding `inv`,
//! `t` and `y`.

use crate::scaled::{self, BlockFormat};

/// Bits of f32 2^-6, the smallest normal E4M3 magnitude.
const MIN_NORMAL_BITS: u32 = 0x3c80_0000;
/// 2^14: adding it rounds a value below 2^-6 to a multiple of 2^-9 (its ulp is 2^-9).
const SUBNORMAL_MAGIC: f32 = 16384.0;
/// Bias difference between f32 (127) and E4M3 (7), pre-shifted to the 3-bit mantissa.
const REBIAS: u32 = (127 - 7) << 3;

/// Converts an f32 to an E4M3FN code: round to nearest even, saturate to ±448 (±Inf too),
/// NaN to 0x7f/0xff. Branch-free, so loops over it vectorise.
#[inline(always)]
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7fff_ffff;
    // Subnormal range: the sum's low mantissa bits are the count of 2^-9 steps (0..=8; 8 is
    // code 0x08, the smallest normal, which is exactly where the subnormals carry into).
    let sub = (f32::from_bits(abs) + SUBNORMAL_MAGIC)
        .to_bits()
        .wrapping_sub(SUBNORMAL_MAGIC.to_bits());
    // Normal range: round the 23-bit mantissa to 3 bits, ties to even (a carry moves into
    // the exponent as it should), then rebias; anything past 448 saturates to 0x7e.
    let rounded = abs + 0x7_ffff + ((abs >> 20) & 1);
    let norm = ((rounded >> 20).wrapping_sub(REBIAS)).min(0x7e);
    let mag = if abs < MIN_NORMAL_BITS { sub } else { norm };
    let mag = if abs > 0x7f80_0000 { 0x7f } else { mag };
    sign | mag as u8
}

/// [`f32_to_e4m3`] for finite inputs only (the codec checks every block first): the same
/// result with fewer operations, since it needs no NaN case and the magnitude fits an i32.
#[inline(always)]
fn finite_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let abs = (bits & 0x7fff_ffff) as i32;
    let sub = (f32::from_bits(abs as u32) + SUBNORMAL_MAGIC).to_bits() as i32
        - SUBNORMAL_MAGIC.to_bits() as i32;
    let norm = (((abs + 0x7_ffff + ((abs >> 20) & 1)) >> 20) - REBIAS as i32).min(0x7e);
    let mag = if abs < MIN_NORMAL_BITS as i32 {
        sub
    } else {
        norm
    };
    ((bits >> 24) & 0x80) as u8 | mag as u8
}

/// Decodes an E4M3FN code to f32 exactly (0x7f and 0xff give NaN). Branch-free.
#[inline(always)]
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = ((code & 0x80) as u32) << 24;
    let mag = (code & 0x7f) as u32;
    let normal = f32::from_bits((mag << 20) + (120 << 23));
    let sub = mag as f32 * (1.0 / 512.0);
    let v = if mag < 8 { sub } else { normal };
    let v = if mag == 0x7f { f32::NAN } else { v };
    f32::from_bits(v.to_bits() | sign)
}

/// The FP8 E4M3 codec with one f32 scale per `BLOCK` values (32 or 128).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fp8E4m3<const BLOCK: usize>;

/// The format behind [`Fp8E4m3`], generic over the block length.
struct Format<const BLOCK: usize>;

macro_rules! fp8_codec {
    ($block:literal, $name:literal) => {
        impl BlockFormat for Format<$block> {
            const NAME: &'static str = $name;
            const BLOCK: usize = $block;
            const QMAX: f32 = 448.0;

            fn data_len(n: usize) -> usize {
                n
            }

            #[inline(always)]
            fn quantize(x: &[f32], inv: f32, out: &mut [u8]) {
                let x = &x[..$block];
                let out = &mut out[..$block];
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = finite_to_e4m3(v * inv);
                }
            }

            #[inline(always)]
            fn dequantize(codes: &[u8], scale: f32, out: &mut [f32]) -> bool {
                let codes = &codes[..$block];
                let out = &mut out[..$block];
                let mut nan = 0u8;
                for (o, &c) in out.iter_mut().zip(codes) {
                    nan |= u8::from(c & 0x7f == 0x7f);
                    *o = e4m3_to_f32(c) * scale;
                }
                nan == 0
            }

            fn find_invalid(codes: &[u8]) -> Option<(usize, u8)> {
                codes[..$block]
                    .iter()
                    .position(|&c| c & 0x7f == 0x7f)
                    .map(|i| (i, codes[i]))
            }
        }

        scaled::block_format_codec!(Fp8E4m3<$block>, Format<$block>);
    };
}

fp8_codec!(32, "fp8-e4m3-b32");
fp8_codec!(128, "fp8-e4m3-b128");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_decodes_and_reencodes_to_itself() {
        for c in 0..=255u8 {
            let v = e4m3_to_f32(c);
            if c & 0x7f == 0x7f {
                assert!(v.is_nan());
                assert_eq!(f32_to_e4m3(v), c);
            } else {
                assert_eq!(f32_to_e4m3(v), c, "code {c:#04x} value {v}");
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
    }

    #[test]
    fn finite_fast_path_agrees_with_the_general_conversion() {
        // A stride co-prime with every power of two visits all exponents and mantissa
        // patterns; the full 2^32 sweep is the ignored test below.
        let mut bits = 0u32;
        for _ in 0..(1u32 << 24) {
            let x = f32::from_bits(bits);
            if x.is_finite() {
                assert_eq!(finite_to_e4m3(x), f32_to_e4m3(x), "{x:e} ({bits:#010x})");
            }
            bits = bits.wrapping_add(251);
        }
    }

    #[test]
    #[ignore = "sweeps all 2^32 f32 bit patterns (about a minute)"]
    fn finite_fast_path_agrees_everywhere() {
        for bits in 0..=u32::MAX {
            let x = f32::from_bits(bits);
            if x.is_finite() {
                assert_eq!(finite_to_e4m3(x), f32_to_e4m3(x), "{x:e}");
            }
        }
    }

    #[test]
    fn saturates_instead_of_overflowing() {
        for v in [449.0f32, 464.0, 480.0, 1e30, f32::MAX, f32::INFINITY] {
            assert_eq!(f32_to_e4m3(v), 0x7e);
            assert_eq!(f32_to_e4m3(-v), 0xfe);
        }
    }
}
