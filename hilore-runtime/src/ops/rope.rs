//! Rotary position embeddings (the rotate-half convention of Llama / Hugging Face).

use super::util::grad_if;
use super::{cpu, Op, Saved};
use crate::error::shape_err;
use crate::{Cx, Error, Packing, Result, Var};
use candle_core::{DType, Device, Tensor};

/// The cosines and sines of every token's rotation angles, `[N, D/2]` each.
///
/// Built once per packed batch and shared by every layer; cloning is cheap (the tensors
/// are reference-counted).
#[derive(Clone, Debug)]
pub struct RopeTables {
    cos: Tensor,
    sin: Tensor,
}

impl RopeTables {
    /// Tables for every token of `packing` (its position within its own sequence) and heads
    /// of size `head_dim` (even): `inv_freq[i] = theta^(-2i/head_dim)`,
    /// `angle[n, i] = position[n] * inv_freq[i]`, computed in f64 and then cast to `dtype`.
    pub fn new(
        packing: &Packing,
        head_dim: usize,
        theta: f64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let positions = packing.positions().to_vec1::<u32>()?;
        Self::from_positions(&positions, head_dim, theta, dtype, device)
    }

    /// Tables for explicit positions (e.g. the next token of each sequence during
    /// generation); see [`RopeTables::new`].
    pub fn from_positions(
        positions: &[u32],
        head_dim: usize,
        theta: f64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(Error::Tape(format!(
                "RopeTables: head_dim must be even and positive, got {head_dim}"
            )));
        }
        if theta.is_nan() || theta <= 0.0 {
            return Err(Error::Tape(format!(
                "RopeTables: theta must be positive, got {theta}"
            )));
        }
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64))
            .collect();
        Self::from_inv_freq(positions, &inv_freq, dtype, device)
    }

    /// Tables for explicit positions and explicit inverse frequencies (`head_dim / 2` of
    /// them): `angle[n, i] = position[n] * inv_freq[i]` in f64, then cast to `dtype`. For
    /// scaled RoPE variants (linear, Llama 3), whose frequencies are not `theta^(-2i/D)`.
    pub fn from_inv_freq(
        positions: &[u32],
        inv_freq: &[f64],
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if inv_freq.is_empty() || inv_freq.iter().any(|f| !f.is_finite()) {
            return Err(Error::Tape(format!(
                "RopeTables: need at least one finite inverse frequency, got {inv_freq:?}"
            )));
        }
        let half = inv_freq.len();
        let n = positions.len();
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for &p in positions {
            for &f in inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (n, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (n, half), device)?.to_dtype(dtype)?;
        Ok(RopeTables { cos, sin })
    }

    /// `cos(angle)`, `[N, D/2]`.
    pub fn cos(&self) -> &Tensor {
        &self.cos
    }

    /// `sin(angle)`, `[N, D/2]`.
    pub fn sin(&self) -> &Tensor {
        &self.sin
    }

    /// The tables of rows `start..start + len`, as views of these tables' storage (so a
    /// tape counts the two once): the tables of one part of a packing, such as the
    /// prompts' rows of a shared-prefix layout ([`crate::Packing::shared_prefix_rows`]).
    pub fn rows(&self, start: usize, len: usize) -> Result<Self> {
        let n = self.num_tokens();
        if start + len > n {
            return Err(Error::Tape(format!(
                "RopeTables::rows: rows {start}..{} of tables for {n} tokens",
                start + len
            )));
        }
        Ok(RopeTables {
            cos: self.cos.narrow(0, start, len)?,
            sin: self.sin.narrow(0, start, len)?,
        })
    }

    /// Number of tokens the tables cover.
    pub fn num_tokens(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The head size the tables were built for.
    pub fn head_dim(&self) -> usize {
        2 * self.cos.dims()[1]
    }
}

/// `[a1 * c - a2 * s, a2 * c + a1 * s]` along the last dim, with `c`, `s` of shape `[N, D/2]`
/// broadcast over the heads of `a: [N, H, D]`. With `s` negated this is the inverse
/// rotation, which is the backward.
fn rotate(a: &Tensor, cos: &Tensor, sin: &Tensor, h: usize) -> Result<Tensor> {
    rotate_signed(a, cos, sin, h, false)
}

/// [`rotate`] by `+angle`, or by `-angle` with `inverse` (the backward). Host `f32` tensors
/// take the fused kernel ([`cpu::rows::rope`]): one pass over `a`'s rows in its
/// `[N, H, D]` layout, instead of slicing it into halves and concatenating.
fn rotate_signed(
    a: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    h: usize,
    inverse: bool,
) -> Result<Tensor> {
    if cpu::all_host_f32(&[a, cos, sin]) {
        let (at, ct, st) = (cpu::dense(a)?, cpu::dense(cos)?, cpu::dense(sin)?);
        let (av, cv, sv) = (cpu::values(&at)?, cpu::values(&ct)?, cpu::values(&st)?);
        let heads = a.dim(1)?;
        let y = cpu::rows::rope(av.get(), cv.get(), sv.get(), heads, 2 * h, inverse);
        return cpu::tensor(y, a.shape().clone());
    }
    let sin = if inverse { sin.neg()? } else { sin.clone() };
    let c = cos.unsqueeze(1)?;
    let s = sin.unsqueeze(1)?;
    let a1 = a.narrow(2, 0, h)?;
    let a2 = a.narrow(2, h, h)?;
    let y1 = (a1.broadcast_mul(&c)? - a2.broadcast_mul(&s)?)?;
    let y2 = (a2.broadcast_mul(&c)? + a1.broadcast_mul(&s)?)?;
    Ok(Tensor::cat(&[y1, y2], 2)?)
}

struct Rope {
    half: usize,
}

impl Op for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        // dx1 = dy1 cos + dy2 sin; dx2 = -dy1 sin + dy2 cos: the rotation by -angle.
        let dx = grad_if(need[0], || rotate_signed(g, &s[0], &s[1], self.half, true))?;
        Ok(vec![dx])
    }
}

impl<'m> Cx<'m> {
    /// Rotary embedding of `x: [N, H, D]`: `x * cos + rotate_half(x) * sin` with
    /// `rotate_half(x) = cat(-x2, x1)` (`x1` the first half of `D`).
    ///
    /// Saves the tables' `cos` and `sin` as `Saved::Exact` when `x` wants a gradient (the
    /// same tensors for every layer: the accounting counts a storage once), never `x`.
    pub fn rope(&mut self, x: &Var, tables: &RopeTables) -> Result<Var> {
        let (n, _h, d) = match x.dims() {
            [n, h, d] => (*n, *h, *d),
            dims => return shape_err("rope", format!("x must be [N, H, D], got {dims:?}")),
        };
        if tables.cos.dims() != [n, d / 2] || d % 2 != 0 {
            return shape_err(
                "rope",
                format!(
                    "tables are {:?} but x is {:?}: they need N = {n} rows of D/2 = {} (D even)",
                    tables.cos.dims(),
                    x.dims(),
                    d / 2
                ),
            );
        }
        if tables.cos.dtype() != x.dtype() {
            return shape_err(
                "rope",
                format!(
                    "tables are {:?} but x is {:?}; build the tables in the compute dtype",
                    tables.cos.dtype(),
                    x.dtype()
                ),
            );
        }
        let y = rotate(&x.tensor, &tables.cos, &tables.sin, d / 2)?;
        let saved = if x.requires_grad() {
            vec![
                Saved::Exact(tables.cos.clone()),
                Saved::Exact(tables.sin.clone()),
            ]
        } else {
            vec![]
        };
        self.record(Rope { half: d / 2 }, &[x], y, saved)
    }
}
