//! Tensor helpers shared by the ops.

use crate::{Result, Var};
use candle_core::{DType, Device, Tensor};

/// Whether any of `inputs` wants a gradient. An op none of whose inputs does saves nothing:
/// its backward never runs.
pub fn any_grad(inputs: &[&Var]) -> bool {
    inputs.iter().any(|v| v.requires_grad())
}

/// Whether the last two dimensions of `t` are dense in row-major or column-major order,
/// which is what every backend's gemm accepts without a copy (cuBLAS rejects anything else).
fn gemm_layout_ok(t: &Tensor) -> bool {
    let dims = t.dims();
    let st = t.stride();
    let r = dims.len();
    let (rows, cols) = (dims[r - 2], dims[r - 1]);
    let (rs, cs) = (st[r - 2], st[r - 1]);
    let row_major = (cs == 1 || cols == 1) && (rs == cols || rows == 1);
    let col_major = (rs == 1 || rows == 1) && (cs == rows || cols == 1);
    row_major || col_major
}

fn gemm_ready(t: &Tensor) -> Result<Tensor> {
    if gemm_layout_ok(t) {
        Ok(t.clone())
    } else {
        Ok(t.contiguous()?)
    }
}

/// `a @ b` for `[..., M, K] x [..., K, N]` with equal batch dimensions (rank 2 or more).
///
/// Operands whose last two dimensions are dense (contiguous or transposed views) are used
/// as they are; anything else is made contiguous first. More than one batch dimension is
/// flattened into one (a free reshape for contiguous operands), since the backends' strided
/// batch handling stops at two.
pub(crate) fn mm(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let r = a.rank();
    if r <= 3 {
        return Ok(gemm_ready(a)?.matmul(&gemm_ready(b)?)?);
    }
    let ad = a.dims();
    let bd = b.dims();
    let batch: usize = ad[..r - 2].iter().product();
    let (m, k) = (ad[r - 2], ad[r - 1]);
    let n = bd[bd.len() - 1];
    let a3 = gemm_ready(&a.reshape((batch, m, k))?)?;
    let b3 = gemm_ready(&b.reshape((batch, bd[bd.len() - 2], n))?)?;
    let mut out_dims = ad[..r - 2].to_vec();
    out_dims.extend([m, n]);
    Ok(a3.matmul(&b3)?.reshape(out_dims)?)
}

/// An additive causal mask `[t, t]` of `dtype`: 0 on and below the diagonal, `-inf` above.
/// Row `i` of a score matrix plus this mask keeps keys `0..=i`; since the diagonal is always
/// kept, every row's maximum is finite and `exp(-inf - finite) = 0` exactly (no NaN).
pub(crate) fn causal_mask(t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let mut m = vec![0f32; t * t];
    for i in 0..t {
        for v in &mut m[i * t + i + 1..(i + 1) * t] {
            *v = f32::NEG_INFINITY;
        }
    }
    Ok(Tensor::from_vec(m, (t, t), device)?.to_dtype(dtype)?)
}

/// Writes `src` into `dst` at `offset` along `dim`, in place. `dst` must be contiguous and
/// not yet shared with anyone (a buffer the op just allocated); `src` is made contiguous if
/// it is a view.
pub(crate) fn write_at(dst: &Tensor, src: &Tensor, dim: usize, offset: usize) -> Result<()> {
    Ok(dst.slice_set(&src.contiguous()?, dim, offset)?)
}

/// Output gradient slot helper: `Some(f()?)` when the input wants a gradient.
pub fn grad_if(need: bool, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
    if need {
        f().map(Some)
    } else {
        Ok(None)
    }
}
