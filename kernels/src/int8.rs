//! `int8-b32`: symmetric 8-bit integers with one f32 absmax scale per block of 32 values.
//!
//! * Block: 32 consecutive values; the last block may be shorter and is handled as if
//!   padded with zeros.
//! * Scale: one f32 per block. `absmax` is the largest |x| of the block;
//!   `scale = absmax / 127` and `inv = 127 / absmax`, each a correctly rounded f32 division.
//!   If `scale` would be zero or subnormal (absmax < 127 * 2^-126 ≈ 1.5e-36, including
//!   all-zero blocks) the block gets `scale = 0`, `inv = 0`, and every code is 0. If
//!   `scale * 127` would overflow (absmax within ulps of f32::MAX) `scale` is lowered one ulp at
//!   a time until it does not.
//! * Code of value x: `q = clamp(round_half_even(fl(x * inv)), -127, 127)` where
//!   `fl(x * inv)` is the f32 product rounded to nearest even. The clamp (saturation) only
//!   catches the ulp or so by which a rounded `inv` can push the block's largest value past
//!   127. -128 is never written.
//! * Decode: `y = fl(q * scale)` (q converted exactly, one rounding).
//! * Layout: `data` holds one two's-complement `i8` per value in value order (`n` bytes);
//!   `scales` holds one little-endian f32 per started block (`4 * ceil(n / 32)` bytes).
//! * Zeros: encode as code 0 and decode as +0 (the sign of zero is not kept).
//! * Subnormals: f32 subnormals are scaled like any value and round to the nearest integer,
//!   almost always 0.
//! * NaN and ±Inf: `encode` fails with
//!   [`CodecError::NonFinite`](crate::CodecError::NonFinite) naming the first offending
//!   index, and leaves `out` empty.
//! * Decode rejects code -128 (0x80) and scales an encoder cannot write (negative, NaN, Inf,
//!   subnormal, or with `scale * 127` overflowing).
//!
//! Error bound: `|y - x| <= scale / 2` (half a quantization step), plus a few f32 ulps of
//! |x| from rounding `inv`, `x * inv` and `y`.

use crate::scaled::{self, round_clamp, BlockFormat};

/// The INT8 codec with one f32 scale per `BLOCK` values (32).
#[derive(Debug, Clone, Copy, Default)]
pub struct Int8<const BLOCK: usize>;

struct Format<const BLOCK: usize>;

macro_rules! int8_codec {
    ($block:literal, $name:literal) => {
        impl BlockFormat for Format<$block> {
            const NAME: &'static str = $name;
            const BLOCK: usize = $block;
            const QMAX: f32 = 127.0;

            fn data_len(n: usize) -> usize {
                n
            }

            #[inline(always)]
            fn quantize(x: &[f32], inv: f32, out: &mut [u8]) {
                let x = &x[..$block];
                let out = &mut out[..$block];
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = round_clamp(v * inv, 127) as i8 as u8;
                }
            }

            #[inline(always)]
            fn dequantize(codes: &[u8], scale: f32, out: &mut [f32]) -> bool {
                let codes = &codes[..$block];
                let out = &mut out[..$block];
                let mut bad = 0u8;
                for (o, &c) in out.iter_mut().zip(codes) {
                    bad |= u8::from(c == 0x80);
                    *o = f32::from(c as i8) * scale;
                }
                bad == 0
            }

            fn find_invalid(codes: &[u8]) -> Option<(usize, u8)> {
                codes[..$block]
                    .iter()
                    .position(|&c| c == 0x80)
                    .map(|i| (i, codes[i]))
            }
        }

        scaled::block_format_codec!(Int8<$block>, Format<$block>);
    };
}

int8_codec!(32, "int8-b32");
