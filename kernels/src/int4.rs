//! `int4-g32`, `int4-g64`, `int4-g128`: symmetric 4-bit integers, two per byte, with one f32
//! absmax scale per group of 32, 64 or 128 values.
//!
//! * Group: `G` = 32, 64 or 128 consecutive values; the last group may be shorter and is
//!   handled as if padded with zeros.
//! * Scale: one f32 per group. `absmax` is the largest |x| of the group;
//!   `scale = absmax / 7` and `inv = 7 / absmax`, each a correctly rounded f32 division.
//!   If `scale` would be zero or subnormal (absmax < 7 * 2^-126 ≈ 8.2e-38, including all-zero
//!   groups) the group gets `scale = 0`, `inv = 0`, and every code is 0. If `scale * 7` would
//!   overflow (absmax within ulps of f32::MAX) `scale` is lowered one ulp at a time until it
//!   does not.
//! * Code of value x: `q = clamp(round_half_even(fl(x * inv)), -7, 7)` where `fl(x * inv)` is
//!   the f32 product rounded to nearest even; the clamp (saturation) only catches the ulp or so
//!   by which a rounded `inv` can push the group's largest value past 7. -8 is never written.
//! * Decode: `y = fl(q * scale)` (q converted exactly, one rounding).
//! * Layout: `data` holds `ceil(n / 2)` bytes; byte `j` holds value `2j` in its low nibble and
//!   value `2j + 1` in its high nibble, each a 4-bit two's-complement integer. For odd `n`
//!   the high nibble of the last byte is padding and is 0. `scales` holds one little-endian
//!   f32 per started group (`4 * ceil(n / G)` bytes). Groups start on byte boundaries because
//!   `G` is even.
//! * Zeros: encode as code 0 and decode as +0 (the sign of zero is not kept).
//! * Subnormals: f32 subnormals are scaled like any value and round to the nearest integer,
//!   almost always 0.
//! * NaN and ±Inf: `encode` fails with
//!   [`CodecError::NonFinite`](crate::CodecError::NonFinite) naming the first offending
//!   index, and leaves `out` empty.
//! * Decode rejects the nibble -8 (0x8), a non-zero padding nibble (reported at index `n`),
//!   and scales an encoder cannot write (negative, NaN, Inf, subnormal, or with `scale * 7`
//!   overflowing).
//!
//! Error bound: `|y - x| <= scale / 2` (half a quantization step), plus a few f32 ulps of
//! |x| from rounding `inv`, `x * inv` and `y`.

use crate::scaled::{self, round_clamp, BlockFormat};

/// The INT4 codec with one f32 scale per `GROUP` values (32, 64 or 128).
#[derive(Debug, Clone, Copy, Default)]
pub struct Int4<const GROUP: usize>;

struct Format<const GROUP: usize>;

/// Sign-extends the low nibble of `c`.
#[inline(always)]
fn lo(c: u8) -> i8 {
    ((c << 4) as i8) >> 4
}

/// Sign-extends the high nibble of `c`.
#[inline(always)]
fn hi(c: u8) -> i8 {
    (c as i8) >> 4
}

macro_rules! int4_codec {
    ($group:literal, $name:literal) => {
        impl BlockFormat for Format<$group> {
            const NAME: &'static str = $name;
            const BLOCK: usize = $group;
            const QMAX: f32 = 7.0;

            fn data_len(n: usize) -> usize {
                n.div_ceil(2)
            }

            #[inline(always)]
            fn quantize(x: &[f32], inv: f32, out: &mut [u8]) {
                let x = &x[..$group];
                let out = &mut out[..$group / 2];
                for (o, p) in out.iter_mut().zip(x.chunks_exact(2)) {
                    let a = round_clamp(p[0] * inv, 7);
                    let b = round_clamp(p[1] * inv, 7);
                    *o = ((a & 0xf) | ((b & 0xf) << 4)) as u8;
                }
            }

            #[inline(always)]
            fn dequantize(codes: &[u8], scale: f32, out: &mut [f32]) -> bool {
                let codes = &codes[..$group / 2];
                let out = &mut out[..$group];
                let mut bad = 0u8;
                for (p, &c) in out.chunks_exact_mut(2).zip(codes) {
                    bad |= u8::from(c & 0x0f == 0x08) | u8::from(c & 0xf0 == 0x80);
                    p[0] = f32::from(lo(c)) * scale;
                    p[1] = f32::from(hi(c)) * scale;
                }
                bad == 0
            }

            fn find_invalid(codes: &[u8]) -> Option<(usize, u8)> {
                codes[..$group / 2]
                    .iter()
                    .flat_map(|&c| [c & 0x0f, c >> 4])
                    .position(|nib| nib == 0x08)
                    .map(|i| (i, 0x08))
            }

            fn bad_padding(tail: &[u8], r: usize) -> Option<u8> {
                let pad = if r % 2 == 1 { tail[r / 2] >> 4 } else { 0 };
                (pad != 0).then_some(pad)
            }
        }

        scaled::block_format_codec!(Int4<$group>, Format<$group>);
    };
}

int4_codec!(32, "int4-g32");
int4_codec!(64, "int4-g64");
int4_codec!(128, "int4-g128");
