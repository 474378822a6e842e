//! Seeded random numbers for weights, token batches and plans.
//!
//! candle's `randn` draws from an unseeded thread RNG, so nothing here uses it: every value
//! comes from splitmix64 (a 64-bit counter through a bijective mixer) and the Box-Muller
//! transform, so the same seed gives the same bits on every machine and run.

use candle_core::{Device, Shape, Tensor};

/// The splitmix64 generator.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
    spare: Option<f64>,
}

impl SplitMix64 {
    /// A generator whose stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 {
            state: seed,
            spare: None,
        }
    }

    /// A generator for the named stream of `seed` (e.g. one parameter's values), so that
    /// adding a stream does not shift the values of the others.
    pub fn for_stream(seed: u64, stream: &str) -> Self {
        // FNV-1a of the name, mixed with the seed.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in stream.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        SplitMix64::new(mix(seed ^ mix(h)))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.state)
    }

    /// Uniform in `(0, 1]` (never 0, so its logarithm is finite).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        // Multiply-shift: unbiased to within 2^-64 * n, which is far below anything observable here.
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// A standard normal value (Box-Muller; the second value of each pair is kept for the
    /// next call).
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let a = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some(r * a.sin());
        r * a.cos()
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` values `mean + std * N(0, 1)` from the stream `seed`.
pub fn normal_vec(n: usize, mean: f64, std: f64, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| (mean + std * rng.normal()) as f32).collect()
}

/// An f32 tensor of `mean + std * N(0, 1)` values from the stream `seed`.
pub fn normal_tensor(
    shape: impl Into<Shape>,
    mean: f64,
    std: f64,
    seed: u64,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let shape: Shape = shape.into();
    Tensor::from_vec(
        normal_vec(shape.elem_count(), mean, std, seed),
        shape,
        device,
    )
}
