//! The tape's CPU kernels: its hot ops on contiguous `f32` host storage, parallel over
//! rows, heads and blocks with rayon.
//!
//! candle's CPU backend runs its elementwise, copy and reduction kernels on one thread and
//! allocates a buffer per op; only its GEMM is parallel. The ops whose time dominates a
//! decoder's forward and backward (attention, RMSNorm, SwiGLU, RoPE, residual adds and the
//! log-prob head) therefore have kernels of their own here, each fused into one pass
//! where candle needs several. An op takes its kernel when every tensor it reads is a
//! host `f32` tensor ([`host`]); anything else (a GPU tensor, another dtype) takes the
//! op's candle path, which computes the same function.
//!
//! **Determinism.** Work is cut into pieces of a fixed size (rows, heads, blocks) that
//! never depends on the number of threads, each piece is computed by one thread in a fixed
//! order, and every reduction that crosses pieces adds the pieces' partial results in
//! their index order. So a result does not depend on the thread count or on timing:
//! a recompute replays its forward bit for bit, and runs are reproducible. The GEMMs go
//! through the `gemm` crate (the one candle's CPU matmul uses), which splits only the
//! output's rows and columns between threads, never the inner dimension.
//!
//! **Vectorisation.** The loops are written over fixed-width lanes (`LANES` independent
//! accumulators, a polynomial [`exp`] without branches) so that the compiler vectorises
//! them; the hottest (the exponentials of attention and the head, the elementwise maps)
//! also have AVX2 variants chosen at run time (`wide_fn!`), so no `target-cpu` flag is
//! needed. None of them uses fused multiply-add and no order depends on the vector width,
//! so every variant gives the same bits (a test checks it on the machine it runs on).

pub(crate) mod attention;
pub(crate) mod head;
pub(crate) mod rows;

use crate::{Error, Result};
use candle_core::{CpuStorage, DType, Device, Shape, Storage, Tensor};
use std::ops::Range;
use std::sync::RwLockReadGuard;

/// Independent accumulators of the row reductions: wide enough for 8-lane vectors, and a
/// fixed order of summation (lane `l` sums elements `l, l + LANES, ...`, then the lanes are
/// added in order).
pub(crate) const LANES: usize = 8;

/// A host `f32` tensor's values in row-major order, borrowed from its storage (the
/// storage's read lock is held while this lives).
pub(crate) struct Host<'a> {
    guard: RwLockReadGuard<'a, Storage>,
    range: Range<usize>,
}

impl Host<'_> {
    /// The values.
    pub(crate) fn get(&self) -> &[f32] {
        match &*self.guard {
            Storage::Cpu(CpuStorage::F32(v)) => &v[self.range.clone()],
            // `host` only builds a `Host` over f32 CPU storage.
            _ => &[],
        }
    }
}

/// The values of `t` when it is a contiguous `f32` tensor on the CPU.
pub(crate) fn host(t: &Tensor) -> Option<Host<'_>> {
    if t.dtype() != DType::F32 || !t.device().is_cpu() {
        return None;
    }
    let (guard, layout) = t.storage_and_layout();
    let (start, end) = layout.contiguous_offsets()?;
    if !matches!(&*guard, Storage::Cpu(CpuStorage::F32(_))) {
        return None;
    }
    Some(Host {
        guard,
        range: start..end,
    })
}

/// Whether every tensor is an `f32` tensor on the CPU: the ops take their kernel then
/// (a non-contiguous one is made contiguous first, see [`dense`]).
pub(crate) fn all_host_f32(ts: &[&Tensor]) -> bool {
    ts.iter()
        .all(|t| t.dtype() == DType::F32 && t.device().is_cpu())
}

/// `t` itself when it is contiguous, else a contiguous copy.
pub(crate) fn dense(t: &Tensor) -> Result<Tensor> {
    Ok(t.contiguous()?)
}

/// Borrows the values of a host `f32` tensor made dense by [`dense`].
pub(crate) fn values(t: &Tensor) -> Result<Host<'_>> {
    host(t).ok_or_else(|| {
        Error::Tape(format!(
            "CPU kernel: expected a contiguous f32 host tensor, got {:?} {:?} on {:?}",
            t.dims(),
            t.dtype(),
            t.device()
        ))
    })
}

/// A host tensor of `shape` that takes ownership of `data` (no copy).
pub(crate) fn tensor(data: Vec<f32>, shape: impl Into<Shape>) -> Result<Tensor> {
    Ok(Tensor::from_vec(data, shape.into(), &Device::Cpu)?)
}

/// A pointer to an `f32` buffer that parallel tasks write to at disjoint places.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: a `SharedMut` is only handed to tasks that write disjoint index sets of one
// buffer which outlives them (each use says which set), so no two threads touch the same
// element and no task outlives the buffer (rayon's scoped iterators join before return).
unsafe impl Send for SharedMut {}
// SAFETY: as above.
unsafe impl Sync for SharedMut {}

impl SharedMut {
    pub(crate) fn new(buf: &mut [f32]) -> Self {
        SharedMut {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    /// `len` elements from `start`.
    ///
    /// # Safety
    /// No other live slice of the same buffer may overlap `start..start + len`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(
            start + len <= self.len,
            "SharedMut: {start}+{len} > {}",
            self.len
        );
        // SAFETY: in bounds (checked above); the caller guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }

    /// The raw pointer at `start`, for a strided GEMM destination.
    pub(crate) fn at(&self, start: usize) -> *mut f32 {
        assert!(start <= self.len, "SharedMut: {start} > {}", self.len);
        // SAFETY: in bounds of the allocation (checked above).
        unsafe { self.ptr.add(start) }
    }
}

/// A strided matrix operand of [`gemm`]: element `(i, j)` is at `rs * i + cs * j` of the
/// slice (non-negative strides).
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// Row-major with `rs` elements between rows.
    pub(crate) fn rows(data: &'a [f32], rs: usize) -> Self {
        MatRef { data, rs, cs: 1 }
    }

    /// The transpose of a row-major matrix with `rs` elements between rows.
    pub(crate) fn rows_t(data: &'a [f32], rs: usize) -> Self {
        MatRef {
            data,
            rs: 1,
            cs: rs,
        }
    }

    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// Whether a GEMM may split its output between the threads of the current pool (outside
/// parallel tasks) or must run on the calling thread (inside them).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Threads {
    One,
    Pool,
}

/// `dst = acc * dst + beta * a b` for `a: m x k`, `b: k x n`, `dst: m x n` (row stride
/// `dst_rs`, column stride 1) with `acc` 0 (overwrite) or 1 (accumulate).
///
/// # Safety
/// `dst` must be valid for writes at `i * dst_rs + j` for `i < m`, `j < n`, and no other
/// thread may touch those elements during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    threads: Threads,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        a.fits(m, k) && b.fits(k, n),
        "cpu gemm: operand out of bounds (m {m}, n {n}, k {k})"
    );
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                // SAFETY: the caller guarantees `dst` covers row `i`.
                unsafe { std::slice::from_raw_parts_mut(dst.add(i * dst_rs), n) }.fill(0.0);
            }
        }
        return;
    }
    let par = match threads {
        Threads::One => gemm::Parallelism::None,
        Threads::Pool => match rayon::current_num_threads() {
            0 | 1 => gemm::Parallelism::None,
            t => gemm::Parallelism::Rayon(t),
        },
    };
    // SAFETY: the operands are in bounds (checked above), `dst` is the caller's promise.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            par,
        )
    }
}

/// [`gemm`] into a row-major slice `dst` (`m x n`, row stride `n`), on the pool.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_into(
    dst: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
) {
    assert!(dst.len() >= m * n, "cpu gemm: destination too small");
    // SAFETY: `dst` is an exclusive slice of at least `m * n` elements.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            n,
            accumulate,
            a,
            b,
            beta,
            Threads::Pool,
        )
    }
}

// ----- AVX2 variants ---------------------------------------------------------------------

/// Defines `fn $name(args) -> R` whose body runs compiled for AVX2 (8-lane vectors) where
/// the CPU has it, else as built (the baseline's 4 lanes). The kernels' loops use neither
/// fused multiply-add nor a lane-count-dependent order (their sums run over [`LANES`]
/// accumulators either way), so both variants give the same bits; AVX2 only does twice
/// the lanes per instruction. No `target-cpu` flag is needed in the build.
macro_rules! wide_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name($($a: $t),*) $(-> $r)? {
            #[inline(always)]
            fn body($($a: $t),*) $(-> $r)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            unsafe fn avx2($($a: $t),*) $(-> $r)? {
                body($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2 (checked just above).
                return unsafe { avx2($($a),*) };
            }
            body($($a),*)
        }
    };
}

/// `acc[l] += x[i]` for `i = l mod LANES`: the fixed lane order of every sum here.
#[inline(always)]
fn add_lanes(acc: &mut [f32; LANES], x: &[f32]) {
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    for (l, &v) in chunks.remainder().iter().enumerate() {
        acc[l] += v;
    }
}

/// `x = e^(x - m)` in place, one loop the compiler vectorises (the exp has no branches).
#[inline(always)]
fn exp_shift_in_place(x: &mut [f32], m: f32) {
    for v in x.iter_mut() {
        *v = exp(*v - m);
    }
}

wide_fn! {
    /// `x = e^(x - m)` in place; returns the new row's sum in the fixed lane order of
    /// [`LANES`].
    pub(crate) fn exp_shift_sum(x: &mut [f32], m: f32) -> f32 {
        exp_shift_in_place(x, m);
        let mut acc = [0f32; LANES];
        add_lanes(&mut acc, x);
        lanes_sum(acc)
    }
}

wide_fn! {
    /// `x = e^(x - m) * s` in place.
    pub(crate) fn exp_shift_scale(x: &mut [f32], m: f32, s: f32) {
        exp_shift_in_place(x, m);
        for v in x.iter_mut() {
            *v *= s;
        }
    }
}

wide_fn! {
    /// `sum(e^(x - m))` in the fixed lane order of [`LANES`], through a stack buffer (so
    /// that the exponentials are one vectorised loop and the sum another).
    pub(crate) fn sum_exp(x: &[f32], m: f32) -> f32 {
        const BLOCK: usize = 32 * LANES;
        let mut acc = [0f32; LANES];
        let mut buf = [0f32; BLOCK];
        for c in x.chunks(BLOCK) {
            let t = &mut buf[..c.len()];
            t.copy_from_slice(c);
            exp_shift_in_place(t, m);
            add_lanes(&mut acc, t);
        }
        lanes_sum(acc)
    }
}

// ----- vectorisable math -----------------------------------------------------------------

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split in two (Cody-Waite), so `x - n ln 2` is exact in its high part.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// `1.5 * 2^23`: adding and subtracting it rounds a float of magnitude below `2^22` to the
/// nearest integer, and the sum's low mantissa bits are that integer.
const ROUND: f32 = 12_582_912.0;
/// Below this `exp` returns 0: `exp(-87.3)` is about `1.2e-38`, the smallest normal float,
/// so the absolute error of the cut is below `1.2e-38`.
const EXP_LO: f32 = -87.3;
/// The largest argument evaluated exactly (`n = 127`); above `ln(f32::MAX) = 88.72`
/// the result is `inf`, and in between it is `exp(88.37)` (no op here feeds `exp` such
/// arguments: softmax arguments are at most 0, and a sigmoid of them is 1 either way).
const EXP_HI: f32 = 88.37;

/// `e^x` for `f32`, to about 2 ulp on `[-87.3, 88.37]`: Cephes' `expf` (range reduction by
/// `ln 2`, a degree-6 polynomial, the exponent set through the bits), written without
/// branches so that loops over it vectorise. `exp(-inf) = 0`, `exp(NaN) = NaN`.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let xc = x.clamp(EXP_LO, EXP_HI);
    let t = xc * LOG2E + ROUND;
    let n = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let fx = t - ROUND;
    let r = xc - fx * LN2_HI - fx * LN2_LO;
    let r2 = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = (p * r2 + r + 1.0) * f32::from_bits(((n + 127) as u32) << 23);
    if x < EXP_LO {
        0.0
    } else if x > 88.722_84 {
        f32::INFINITY
    } else {
        y
    }
}

/// `1 / (1 + e^-x)`: 0 for very negative `x` (not NaN), 1 for very positive.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `sum(x)` in the fixed lane order of [`LANES`] (the order [`exp_shift_sum`] sums in).
#[cfg(test)]
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    add_lanes(&mut acc, x);
    lanes_sum(acc)
}

/// `sum(a * b)` in the fixed lane order of [`LANES`].
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (&x, &y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += x * y;
    }
    lanes_sum(acc)
}

/// `max(x)` (`-inf` for an empty slice) in lanes.
#[inline]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    for (l, &v) in chunks.remainder().iter().enumerate() {
        acc[l] = if v > acc[l] { v } else { acc[l] };
    }
    // A NaN never wins a `>`, so it does not reach the maximum; the callers feed the
    // row itself on (into `exp(x - max)` and a sum), where a NaN does propagate.
    acc.iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

#[inline(always)]
fn lanes_sum(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

/// Rows per parallel piece for rows of `row_len` elements: about 16 Ki elements a piece
/// (enough work to amortise a task), at least one row. Depends only on the shape.
pub(crate) fn rows_per_piece(row_len: usize) -> usize {
    (16 * 1024 / row_len.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The polynomial `exp` against the library's `f64` exp: Cephes' bound for `expf` is
    /// below 2 ulp on the reduced range; 4 ulp of slack (relative 4 * 2^-23 = 4.8e-7)
    /// covers the final scaling's rounding.
    #[test]
    fn exp_matches_libm() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            assert!(
                ((got - want) / want).abs() < 4.8e-7,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.0137;
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(1000.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(sigmoid(-1000.0), 0.0);
        assert_eq!(sigmoid(1000.0), 1.0);
    }

    /// The AVX2 variants (taken where this CPU has AVX2) give bit for bit what the same
    /// math compiled for the baseline gives: no lane-width-dependent order, no FMA.
    #[test]
    fn wide_variants_match_the_baseline_bit_for_bit() {
        let x: Vec<f32> = (0..1037)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.013 - 9.0)
            .collect();
        let m = 2.5f32;
        let plain: Vec<f32> = x.iter().map(|&v| exp(v - m)).collect();
        let mut acc = [0f32; LANES];
        for (i, &v) in plain.iter().enumerate() {
            acc[i % LANES] += v;
        }
        let plain_sum = lanes_sum(acc);
        let mut y = x.clone();
        let s = exp_shift_sum(&mut y, m);
        assert_eq!(s.to_bits(), plain_sum.to_bits());
        assert!(y
            .iter()
            .zip(&plain)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_eq!(sum_exp(&x, m).to_bits(), plain_sum.to_bits());
        let mut z = x.clone();
        exp_shift_scale(&mut z, m, -0.75);
        assert!(z
            .iter()
            .zip(&plain)
            .all(|(a, b)| a.to_bits() == (b * -0.75).to_bits()));
    }

    #[test]
    fn reductions() {
        let x: Vec<f32> = (0..37).map(|i| i as f32 - 10.0).collect();
        assert_eq!(sum(&x), x.iter().sum::<f32>());
        assert_eq!(max(&x), 26.0);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        assert_eq!(dot(&x, &x), x.iter().map(|v| v * v).sum::<f32>());
    }
}
