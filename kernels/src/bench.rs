//! Measuring the codecs on the CPU: round-trip error on activation-like data, compression
//! ratio, and encode/decode bandwidth against a plain copy of the same bytes.
//!
//! The random data is deterministic (a seed picks it) and cheap to make in parallel:
//! value `i` depends only on `(seed, i)` through splitmix64 and Box-Muller, so no random
//! number crate is needed and every thread count gives the same data.

use std::time::Instant;

use rayon::prelude::*;

use crate::scaled::CHUNK;
use crate::{Codec, CodecError, Encoded};

/// One codec's measurements, as `hilore codecs` reports them.
#[derive(Debug, Clone, PartialEq)]
pub struct CodecBenchRow {
    /// Codec name.
    pub codec: &'static str,
    /// Where it ran, e.g. `cpu (2 threads)`.
    pub device: String,
    /// Values per tensor.
    pub n: usize,
    /// Encoded bytes (data + scales) of `n` values.
    pub encoded_bytes: usize,
    /// `4 * n / encoded_bytes`.
    pub compression_ratio: f64,
    /// ||x - decode(encode(x))|| / ||x|| on standard Gaussian data.
    pub rel_l2_gaussian: f64,
    /// max |x - decode(encode(x))| on standard Gaussian data.
    pub max_abs_gaussian: f64,
    /// Relative L2 error on heavy-tailed data (see [`fill_heavy_tailed`]).
    pub rel_l2_heavy_tail: f64,
    /// Max absolute error on heavy-tailed data.
    pub max_abs_heavy_tail: f64,
    /// Encode bandwidth in GB/s (1e9 bytes), counted on the `4 * n` uncompressed bytes;
    /// median over the repetitions.
    pub encode_gbps: f64,
    /// Decode bandwidth in GB/s, counted the same way.
    pub decode_gbps: f64,
    /// Bandwidth of copying the same `4 * n` bytes (the faster of one thread and all
    /// threads), median over the repetitions.
    pub memcpy_gbps: f64,
    /// Timed repetitions (after one warm-up).
    pub reps: usize,
}

/// splitmix64: a full-period 64-bit mixer; good enough to drive Box-Muller.
#[inline]
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform in (0, 1] from the top 53 bits of a hash.
#[inline]
fn unit(h: u64) -> f64 {
    ((h >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The standard normal pair number `pair` of stream `seed` (Box-Muller).
#[inline]
fn gaussian_pair(seed: u64, pair: u64) -> (f64, f64) {
    let key = splitmix64(seed) ^ pair.wrapping_mul(0xd1b5_4a32_d192_ed03);
    let u1 = unit(splitmix64(key));
    let u2 = unit(splitmix64(key ^ 0x6a09_e667_f3bc_c909));
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
    (r * c, r * s)
}

/// Fills `out` with standard Gaussian values; value `i` depends only on `(seed, i)`.
pub fn fill_gaussian(seed: u64, out: &mut [f32]) {
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let base = (c * CHUNK) as u64;
            for (j, v) in chunk.iter_mut().enumerate() {
                let i = base + j as u64;
                let (a, b) = gaussian_pair(seed, i / 2);
                *v = if i % 2 == 0 { a } else { b } as f32;
            }
        });
}

/// Fills `out` with activation-like heavy-tailed values: standard Gaussian, except that
/// about 1% of the values (chosen by the seed) are multiplied by 100.
pub fn fill_heavy_tailed(seed: u64, out: &mut [f32]) {
    fill_gaussian(seed, out);
    let salt = splitmix64(seed ^ 0xa076_1d64_78bd_642f);
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let base = (c * CHUNK) as u64;
            for (j, v) in chunk.iter_mut().enumerate() {
                if splitmix64(salt ^ (base + j as u64)) % 100 == 0 {
                    *v *= 100.0;
                }
            }
        });
}

/// Relative L2 error `||x - y|| / ||x||` and max absolute error, accumulated in f64.
pub fn round_trip_error(x: &[f32], y: &[f32]) -> (f64, f64) {
    let (mut num, mut den, mut max) = (0.0f64, 0.0f64, 0.0f64);
    for (&a, &b) in x.iter().zip(y) {
        let d = f64::from(a) - f64::from(b);
        num += d * d;
        den += f64::from(a) * f64::from(a);
        max = max.max(d.abs());
    }
    let rel = if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    (rel, max)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Runs `f` and returns its result with the wall-clock seconds it took.
fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed().as_secs_f64())
}

/// Measures `codec` on the CPU with tensors of `n` values: errors on Gaussian and
/// heavy-tailed data, compression ratio, and the median over `reps` repetitions (after one
/// warm-up) of encode, decode and copy bandwidth, each repetition on fresh random data.
pub fn bench_codec(codec: &dyn Codec, n: usize, reps: usize) -> Result<CodecBenchRow, CodecError> {
    let reps = reps.max(1);
    let mut x = vec![0.0f32; n];
    let mut y = vec![0.0f32; n];
    let mut copy = vec![0.0f32; n];
    let mut enc = Encoded::default();

    fill_gaussian(1, &mut x);
    codec.encode(&x, &mut enc)?;
    codec.decode(&enc, &mut y)?;
    let (rel_l2_gaussian, max_abs_gaussian) = round_trip_error(&x, &y);
    let encoded_bytes = enc.nbytes();

    fill_heavy_tailed(2, &mut x);
    codec.encode(&x, &mut enc)?;
    codec.decode(&enc, &mut y)?;
    let (rel_l2_heavy_tail, max_abs_heavy_tail) = round_trip_error(&x, &y);

    let bytes = 4.0 * n as f64;
    let (mut te, mut td, mut tc) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..=reps {
        fill_heavy_tailed(1000 + rep as u64, &mut x);
        let (r, e) = timed(|| codec.encode(&x, &mut enc));
        r?;
        let (r, d) = timed(|| codec.decode(&enc, &mut y));
        r?;
        let ((), c1) = timed(|| copy.copy_from_slice(&x));
        let ((), cp) = timed(|| {
            copy.par_chunks_mut(CHUNK)
                .zip(x.par_chunks(CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s))
        });
        if rep > 0 {
            te.push(bytes / e / 1e9);
            td.push(bytes / d / 1e9);
            tc.push(bytes / c1.min(cp) / 1e9);
        }
    }
    std::hint::black_box((&y, &copy));

    Ok(CodecBenchRow {
        codec: codec.name(),
        device: format!("cpu ({} threads)", rayon::current_num_threads()),
        n,
        encoded_bytes,
        compression_ratio: if encoded_bytes > 0 {
            bytes / encoded_bytes as f64
        } else {
            f64::NAN
        },
        rel_l2_gaussian,
        max_abs_gaussian,
        rel_l2_heavy_tail,
        max_abs_heavy_tail,
        encode_gbps: median(&mut te),
        decode_gbps: median(&mut td),
        memcpy_gbps: median(&mut tc),
        reps,
    })
}
