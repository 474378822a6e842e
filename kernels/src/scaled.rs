//! The machinery shared by the scaled block formats (FP8, INT8, INT4): per-block absmax and
//! scale, the NaN/Inf check, block tails, validation on decode, and the split of large
//! tensors over threads.
//!
//! Blocks are handled, 16 at a time, by `#[inline(always)]` functions over a fixed block length, so
//! each format's element loop is a plain loop of known trip count that the compiler
//! vectorises. On x86-64 the same code is also compiled with AVX2 enabled and chosen at run
//! time; this changes speed only, never results (only correctly rounded IEEE operations are
//! used, and Rust never fuses multiply and add).

use rayon::prelude::*;

use crate::{CodecError, Encoded};

/// Tensors with fewer values than this are encoded on the calling thread only.
pub(crate) const PAR_MIN: usize = 1 << 18;
/// Values per parallel task (a multiple of every block size).
pub(crate) const CHUNK: usize = 1 << 16;
/// Largest block size of any format (sizes the stack buffers for block tails).
const MAX_BLOCK: usize = 128;

/// One scaled block format. `quantize` and `dequantize` see exactly one full block.
pub(crate) trait BlockFormat: 'static {
    const NAME: &'static str;
    /// Values per block (a power of two, at most [`MAX_BLOCK`]).
    const BLOCK: usize;
    /// The largest code magnitude; the block's absmax maps onto it.
    const QMAX: f32;
    /// Data bytes for `n` values.
    fn data_len(n: usize) -> usize;
    /// Writes the codes of one block: `x` holds `BLOCK` values, `inv` is the block's
    /// multiplier (`QMAX / absmax`, or 0), `out` holds `data_len(BLOCK)` bytes.
    fn quantize(x: &[f32], inv: f32, out: &mut [u8]);
    /// Decodes one block; returns false if any code is one no encoder writes.
    fn dequantize(codes: &[u8], scale: f32, out: &mut [f32]) -> bool;
    /// The first code of one block that no encoder writes, as (value index, code).
    fn find_invalid(codes: &[u8]) -> Option<(usize, u8)>;
    /// For a final block of `r < BLOCK` values whose `data_len(r)` bytes are `tail`: the
    /// padding code if the padding is not what an encoder writes.
    fn bad_padding(_tail: &[u8], _r: usize) -> Option<u8> {
        None
    }
}

/// Implements [`Codec`](crate::Codec) for the codec type `$codec` by the scaled block
/// format `$format`: its name is the format's [`BlockFormat::NAME`], and sizes, encoding
/// and decoding are this module's generic functions.
macro_rules! block_format_codec {
    ($codec:ty, $format:ty) => {
        impl $crate::Codec for $codec {
            fn name(&self) -> &'static str {
                <$format as $crate::scaled::BlockFormat>::NAME
            }

            fn encoded_len(&self, n: usize) -> usize {
                $crate::scaled::encoded_len::<$format>(n)
            }

            fn encode(
                &self,
                src: &[f32],
                out: &mut $crate::Encoded,
            ) -> Result<(), $crate::CodecError> {
                $crate::scaled::encode::<$format>(src, out)
            }

            fn decode(
                &self,
                enc: &$crate::Encoded,
                dst: &mut [f32],
            ) -> Result<(), $crate::CodecError> {
                $crate::scaled::decode::<$format>(enc, dst)
            }
        }
    };
}
pub(crate) use block_format_codec;

/// Exact encoded size of `n` values: data plus one 4-byte scale per started block.
pub(crate) fn encoded_len<F: BlockFormat>(n: usize) -> usize {
    F::data_len(n).saturating_add(n.div_ceil(F::BLOCK).saturating_mul(4))
}

/// The scale written for a block and the multiplier its values are quantized with.
///
/// `scale = absmax / qmax` and `inv = qmax / absmax`, each one correctly rounded f32
/// division. If that scale is zero or subnormal (absmax < qmax * 2^-126, which includes
/// all-zero blocks) the block is stored with scale 0 and multiplier 0, so every code is
/// zero. If `scale * qmax` would overflow to infinity (absmax within a few ulps of f32::MAX)
/// the scale is stepped down by one ulp until it does not, so decoding stays finite.
#[inline(always)]
pub(crate) fn block_scale(absmax: f32, qmax: f32) -> (f32, f32) {
    let mut scale = absmax / qmax;
    // absmax is finite (checked by the caller), so scale is never NaN.
    if scale < f32::MIN_POSITIVE {
        return (0.0, 0.0);
    }
    while (scale * qmax).is_infinite() {
        scale = f32::from_bits(scale.to_bits() - 1);
    }
    (scale, qmax / absmax)
}

/// Whether a stored scale is one [`block_scale`] can produce: +0, or a normal positive f32
/// with `scale * qmax` finite.
#[inline(always)]
pub(crate) fn scale_is_valid(scale: f32, qmax: f32) -> bool {
    scale.to_bits() == 0 || (scale >= f32::MIN_POSITIVE && (scale * qmax).is_finite())
}

/// Rounds to the nearest integer, ties to even, for |t| <= 2^22, and clamps to
/// [-qmax, qmax]. Adding 1.5 * 2^23 leaves exactly the rounded integer in the low mantissa
/// bits; this is branch-free and vectorises (the CUDA kernels do the same addition).
#[inline(always)]
pub(crate) fn round_clamp(t: f32, qmax: i32) -> i32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    let r = ((t + MAGIC).to_bits() as i32).wrapping_sub(0x4B40_0000);
    r.clamp(-qmax, qmax)
}

/// Resizes without reallocating when the capacity suffices; kept bytes are overwritten.
fn set_len(v: &mut Vec<u8>, len: usize) {
    v.resize(len, 0);
}

/// Blocks whose scales are computed together before any of them is quantized, so the
/// divisions of one block overlap the work of others instead of stalling each block.
const GROUP: usize = 16;

/// Absmax bit pattern of one full block (|x| as u32). For |x| the f32 order is the integer
/// order, and NaN and Inf (exponent all ones) compare above every finite value, so one
/// reduction gives both the absmax and whether the block holds a non-finite value.
#[inline(always)]
fn absmax_bits(x: &[f32]) -> u32 {
    let mut m = 0u32;
    for &v in x {
        m = m.max(v.to_bits() & 0x7fff_ffff);
    }
    m
}

/// Encodes `nb <= GROUP` full blocks; `Err(i)` names the first non-finite value.
#[inline(always)]
fn encode_group<F: BlockFormat>(
    x: &[f32],
    data: &mut [u8],
    scales: &mut [u8],
    nb: usize,
) -> Result<(), usize> {
    let db = F::data_len(F::BLOCK);
    let mut m = [0u32; GROUP];
    for (mb, xb) in m.iter_mut().zip(x.chunks_exact(F::BLOCK)).take(nb) {
        *mb = absmax_bits(xb);
    }
    if m[..nb].iter().any(|&b| b >= 0x7f80_0000) {
        return Err(x[..nb * F::BLOCK]
            .iter()
            .position(|v| !v.is_finite())
            .unwrap_or(0));
    }
    let mut inv = [0.0f32; GROUP];
    for ((mb, iv), s) in m
        .iter()
        .zip(inv.iter_mut())
        .zip(scales.chunks_exact_mut(4))
        .take(nb)
    {
        let (scale, i) = block_scale(f32::from_bits(*mb), F::QMAX);
        *iv = i;
        s.copy_from_slice(&scale.to_le_bytes());
    }
    for ((xb, d), &iv) in x
        .chunks_exact(F::BLOCK)
        .zip(data.chunks_exact_mut(db))
        .zip(inv.iter())
        .take(nb)
    {
        F::quantize(xb, iv, d);
    }
    Ok(())
}

/// Encodes a span of whole blocks plus, at the end, one partial block.
#[inline(always)]
fn encode_span_generic<F: BlockFormat>(
    src: &[f32],
    data: &mut [u8],
    scales: &mut [u8],
) -> Result<(), usize> {
    let db = F::data_len(F::BLOCK);
    let full = src.len() / F::BLOCK;
    let mut b = 0;
    while b < full {
        let nb = GROUP.min(full - b);
        encode_group::<F>(
            &src[b * F::BLOCK..(b + nb) * F::BLOCK],
            &mut data[b * db..(b + nb) * db],
            &mut scales[4 * b..4 * (b + nb)],
            nb,
        )
        .map_err(|i| b * F::BLOCK + i)?;
        b += nb;
    }
    let r = src.len() - full * F::BLOCK;
    if r > 0 {
        // The tail is padded with zeros, which changes neither the absmax nor the codes of
        // the real values; only the codes of the real values are kept.
        let mut xb = [0.0f32; MAX_BLOCK];
        xb[..r].copy_from_slice(&src[full * F::BLOCK..]);
        let mut db_buf = [0u8; MAX_BLOCK];
        encode_group::<F>(
            &xb[..F::BLOCK],
            &mut db_buf[..db],
            &mut scales[4 * full..4 * full + 4],
            1,
        )
        .map_err(|i| full * F::BLOCK + i)?;
        let dl = F::data_len(r);
        data[full * db..full * db + dl].copy_from_slice(&db_buf[..dl]);
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn encode_span_avx2<F: BlockFormat>(
    src: &[f32],
    data: &mut [u8],
    scales: &mut [u8],
) -> Result<(), usize> {
    encode_span_generic::<F>(src, data, scales)
}

fn encode_span<F: BlockFormat>(
    src: &[f32],
    data: &mut [u8],
    scales: &mut [u8],
) -> Result<(), usize> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { encode_span_avx2::<F>(src, data, scales) };
    }
    encode_span_generic::<F>(src, data, scales)
}

/// Encodes `src` with format `F` into `out`, reusing its buffers.
pub(crate) fn encode<F: BlockFormat>(src: &[f32], out: &mut Encoded) -> Result<(), CodecError> {
    let n = src.len();
    out.codec = F::NAME;
    out.len = n;
    set_len(&mut out.data, F::data_len(n));
    set_len(&mut out.scales, 4 * n.div_ceil(F::BLOCK));
    let result = if n < PAR_MIN {
        encode_span::<F>(src, &mut out.data, &mut out.scales)
    } else {
        let dc = F::data_len(CHUNK);
        let sc = 4 * (CHUNK / F::BLOCK);
        src.par_chunks(CHUNK)
            .zip(out.data.par_chunks_mut(dc))
            .zip(out.scales.par_chunks_mut(sc))
            .enumerate()
            .filter_map(|(c, ((x, d), s))| encode_span::<F>(x, d, s).err().map(|i| c * CHUNK + i))
            .min()
            .map_or(Ok(()), Err)
    };
    result.map_err(|index| {
        // Leave no half-written encoding behind that would decode as if valid.
        out.len = 0;
        out.data.clear();
        out.scales.clear();
        CodecError::NonFinite {
            codec: F::NAME,
            index,
            value: src[index],
        }
    })
}

/// A decode failure inside a span, positioned so the first one in value order wins.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Scale { block: usize, bits: u32 },
    Code { index: usize, code: u8 },
}

impl Fault {
    /// Value order; a bad scale comes before a bad code of its own block.
    fn key<F: BlockFormat>(&self) -> usize {
        match *self {
            Fault::Scale { block, .. } => 2 * block * F::BLOCK,
            Fault::Code { index, .. } => 2 * index + 1,
        }
    }

    fn shift<F: BlockFormat>(self, values: usize) -> Fault {
        match self {
            Fault::Scale { block, bits } => Fault::Scale {
                block: block + values / F::BLOCK,
                bits,
            },
            Fault::Code { index, code } => Fault::Code {
                index: index + values,
                code,
            },
        }
    }

    fn into_error<F: BlockFormat>(self) -> CodecError {
        match self {
            Fault::Scale { block, bits } => CodecError::InvalidScale {
                codec: F::NAME,
                block,
                bits,
            },
            Fault::Code { index, code } => CodecError::InvalidCode {
                codec: F::NAME,
                index,
                code,
            },
        }
    }
}

#[inline(always)]
fn read_scale<F: BlockFormat>(bytes: &[u8], block: usize) -> Result<f32, Fault> {
    let bits = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let s = f32::from_bits(bits);
    if scale_is_valid(s, F::QMAX) {
        Ok(s)
    } else {
        Err(Fault::Scale { block, bits })
    }
}

#[inline(always)]
fn decode_block<F: BlockFormat>(
    codes: &[u8],
    scale: &[u8],
    dst: &mut [f32],
    block: usize,
) -> Result<(), Fault> {
    let s = read_scale::<F>(scale, block)?;
    if F::dequantize(codes, s, dst) {
        return Ok(());
    }
    match F::find_invalid(codes) {
        Some((i, code)) => Err(Fault::Code {
            index: block * F::BLOCK + i,
            code,
        }),
        None => Ok(()),
    }
}

#[inline(always)]
fn decode_span_generic<F: BlockFormat>(
    data: &[u8],
    scales: &[u8],
    dst: &mut [f32],
) -> Result<(), Fault> {
    let db = F::data_len(F::BLOCK);
    let full = dst.len() / F::BLOCK;
    for (b, ((d, s), y)) in data
        .chunks_exact(db)
        .zip(scales.chunks_exact(4))
        .zip(dst.chunks_exact_mut(F::BLOCK))
        .enumerate()
    {
        decode_block::<F>(d, s, y, b)?;
    }
    let r = dst.len() - full * F::BLOCK;
    if r > 0 {
        let dl = F::data_len(r);
        let tail = &data[full * db..full * db + dl];
        let mut cb = [0u8; MAX_BLOCK];
        cb[..dl].copy_from_slice(tail);
        let mut yb = [0.0f32; MAX_BLOCK];
        decode_block::<F>(
            &cb[..db],
            &scales[4 * full..4 * full + 4],
            &mut yb[..F::BLOCK],
            full,
        )?;
        if let Some(code) = F::bad_padding(tail, r) {
            return Err(Fault::Code {
                index: full * F::BLOCK + r,
                code,
            });
        }
        dst[full * F::BLOCK..].copy_from_slice(&yb[..r]);
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn decode_span_avx2<F: BlockFormat>(
    data: &[u8],
    scales: &[u8],
    dst: &mut [f32],
) -> Result<(), Fault> {
    decode_span_generic::<F>(data, scales, dst)
}

fn decode_span<F: BlockFormat>(data: &[u8], scales: &[u8], dst: &mut [f32]) -> Result<(), Fault> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { decode_span_avx2::<F>(data, scales, dst) };
    }
    decode_span_generic::<F>(data, scales, dst)
}

/// Checks that `enc` is a well-formed encoding of `dst.len()` values by format `F`.
pub(crate) fn check_layout<F: BlockFormat>(
    enc: &Encoded,
    dst_len: usize,
) -> Result<(), CodecError> {
    if enc.codec != F::NAME {
        return Err(CodecError::WrongCodec {
            expected: F::NAME,
            found: enc.codec,
        });
    }
    let n = enc.len;
    let expected_data = F::data_len(n);
    if enc.data.len() != expected_data {
        return Err(CodecError::Corrupted {
            codec: F::NAME,
            len: n,
            what: "data",
            found: enc.data.len(),
            expected: expected_data,
        });
    }
    let expected_scales = n.div_ceil(F::BLOCK).saturating_mul(4);
    if enc.scales.len() != expected_scales {
        return Err(CodecError::Corrupted {
            codec: F::NAME,
            len: n,
            what: "scales",
            found: enc.scales.len(),
            expected: expected_scales,
        });
    }
    if dst_len != n {
        return Err(CodecError::LengthMismatch {
            codec: F::NAME,
            expected: n,
            found: dst_len,
        });
    }
    Ok(())
}

/// Decodes `enc` (format `F`) into `dst`.
pub(crate) fn decode<F: BlockFormat>(enc: &Encoded, dst: &mut [f32]) -> Result<(), CodecError> {
    check_layout::<F>(enc, dst.len())?;
    let n = dst.len();
    let result = if n < PAR_MIN {
        decode_span::<F>(&enc.data, &enc.scales, dst)
    } else {
        let dc = F::data_len(CHUNK);
        let sc = 4 * (CHUNK / F::BLOCK);
        enc.data
            .par_chunks(dc)
            .zip(enc.scales.par_chunks(sc))
            .zip(dst.par_chunks_mut(CHUNK))
            .enumerate()
            .filter_map(|(c, ((d, s), y))| {
                decode_span::<F>(d, s, y)
                    .err()
                    .map(|f| f.shift::<F>(c * CHUNK))
            })
            .min_by_key(|f| f.key::<F>())
            .map_or(Ok(()), Err)
    };
    result.map_err(Fault::into_error::<F>)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_clamp_is_ties_to_even() {
        for (t, q) in [
            (0.5f32, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (-2.5, -2),
            (126.5, 126),
            (127.49, 127),
            (200.0, 127),
            (-200.0, -127),
            (0.49999997, 0),
        ] {
            assert_eq!(round_clamp(t, 127), q, "t = {t}");
            assert_eq!(
                t.round_ties_even().clamp(-127.0, 127.0) as i32,
                q,
                "t = {t}"
            );
        }
    }

    #[test]
    fn block_scale_keeps_decoding_finite_near_f32_max() {
        for qmax in [448.0f32, 127.0, 7.0] {
            for k in 0..64u32 {
                let absmax = f32::from_bits(f32::MAX.to_bits() - k);
                let (s, inv) = block_scale(absmax, qmax);
                assert!((s * qmax).is_finite(), "absmax {absmax:e} qmax {qmax}");
                assert!(scale_is_valid(s, qmax));
                assert!(inv.is_finite() && inv > 0.0);
            }
            // Below the smallest normal scale the block is stored as zero.
            let tiny = qmax * f32::MIN_POSITIVE * 0.5;
            assert_eq!(block_scale(tiny, qmax), (0.0, 0.0));
            assert_eq!(block_scale(0.0, qmax), (0.0, 0.0));
            let (s, _) = block_scale(qmax * f32::MIN_POSITIVE, qmax);
            assert!(s >= f32::MIN_POSITIVE);
        }
    }
}
