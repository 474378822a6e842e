//! The ops a model beyond the built-in decoder needs: subtraction, `exp`, `tanh`,
//! `sigmoid`, GELU (erf and tanh forms), softmax, sums, means and maxima over a dim,
//! LayerNorm with a bias, zero padding, and a causal depthwise 1-d convolution. Each saves
//! what its backward reads (inputs, not outputs, so a unit's saved state is its inputs'
//! activations) and runs on every candle dtype and device; `tests/ops_fd.rs` checks each
//! backward against finite differences.

use super::elementwise::reduce_to_shape;
use super::util::{any_grad, grad_if};
use super::{shape_of, Op, Saved};
use crate::error::shape_err;
use crate::{Cx, Result, Var};
use candle_core::{DType, Shape, Tensor, D};

struct Sub {
    a: Shape,
    b: Shape,
}

impl Op for Sub {
    fn name(&self) -> &'static str {
        "sub"
    }
    fn backward(&self, _: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![
            grad_if(need[0], || reduce_to_shape(g, &self.a))?,
            grad_if(need[1], || reduce_to_shape(&g.neg()?, &self.b))?,
        ])
    }
}

/// An elementwise function of one input whose derivative is a function of the input.
#[derive(Clone, Copy)]
enum Unary {
    Exp,
    Tanh,
    Sigmoid,
    GeluErf,
    GeluTanh,
}

/// `sqrt(2 / pi)`, GELU's tanh form.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of GELU's tanh form.
const GELU_CUBIC: f64 = 0.044_715;

use super::activation::sigmoid;

/// GELU's tanh argument, `sqrt(2/pi) (x + 0.044715 x^3)`.
fn gelu_tanh_arg(x: &Tensor) -> Result<Tensor> {
    Ok((x + x.powf(3.0)?.affine(GELU_CUBIC, 0.0)?)?.affine(SQRT_2_OVER_PI, 0.0)?)
}

/// The standard normal CDF `(1 + erf(x / sqrt 2)) / 2`.
fn normal_cdf(x: &Tensor) -> Result<Tensor> {
    Ok(x.affine(std::f64::consts::FRAC_1_SQRT_2, 0.0)?
        .erf()?
        .affine(0.5, 0.5)?)
}

impl Unary {
    fn forward(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Unary::Exp => x.exp()?,
            Unary::Tanh => x.tanh()?,
            Unary::Sigmoid => sigmoid(x)?,
            Unary::GeluErf => (x * normal_cdf(x)?)?,
            Unary::GeluTanh => (x * gelu_tanh_arg(x)?.tanh()?.affine(0.5, 0.5)?)?,
        })
    }

    /// `f'(x)`.
    fn derivative(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Unary::Exp => x.exp()?,
            Unary::Tanh => x.tanh()?.sqr()?.affine(-1.0, 1.0)?,
            Unary::Sigmoid => {
                let s = sigmoid(x)?;
                (&s * s.affine(-1.0, 1.0)?)?
            }
            // d/dx x Phi(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
            Unary::GeluErf => {
                let pdf = x
                    .sqr()?
                    .affine(-0.5, 0.0)?
                    .exp()?
                    .affine(1.0 / (2.0 * std::f64::consts::PI).sqrt(), 0.0)?;
                (normal_cdf(x)? + (x * pdf)?)?
            }
            // 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u', u' = sqrt(2/pi) (1 + 3 c x^2).
            Unary::GeluTanh => {
                let t = gelu_tanh_arg(x)?.tanh()?;
                let du = x
                    .sqr()?
                    .affine(3.0 * GELU_CUBIC * SQRT_2_OVER_PI, SQRT_2_OVER_PI)?;
                let left = t.affine(0.5, 0.5)?;
                let right = ((x * t.sqr()?.affine(-0.5, 0.5)?)? * du)?;
                (left + right)?
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            Unary::Exp => "exp",
            Unary::Tanh => "tanh",
            Unary::Sigmoid => "sigmoid",
            Unary::GeluErf => "gelu_erf",
            Unary::GeluTanh => "gelu_tanh",
        }
    }
}

impl Op for Unary {
    fn name(&self) -> &'static str {
        Unary::name(*self)
    }
    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grad_if(need[0], || {
            Ok((g * self.derivative(&s[0])?)?)
        })?])
    }
}

/// Softmax over the last dim; saves its input.
struct Softmax;

impl Op for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }
    // dx = y (g - sum(g y)), y recomputed from the saved input.
    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grad_if(need[0], || {
            let y = softmax_last(&s[0])?;
            let dot = (g * &y)?.sum_keepdim(D::Minus1)?;
            Ok((y * g.broadcast_sub(&dot)?)?)
        })?])
    }
}

fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&sum)?)
}

/// A sum or mean over `dim` (the dim removed).
struct Reduce {
    shape: Shape,
    dim: usize,
    mean: bool,
}

impl Op for Reduce {
    fn name(&self) -> &'static str {
        if self.mean {
            "mean"
        } else {
            "sum"
        }
    }
    fn backward(&self, _: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grad_if(need[0], || {
            let n = self.shape.dims()[self.dim] as f64;
            let g = if self.mean {
                g.affine(1.0 / n, 0.0)?
            } else {
                g.clone()
            };
            Ok(g.unsqueeze(self.dim)?
                .broadcast_as(&self.shape)?
                .contiguous()?)
        })?])
    }
}

/// The maximum over `dim` (the dim removed); saves the argmax (exact), so the gradient goes
/// to one position per slice (the first of ties).
struct MaxOver {
    shape: Shape,
    dim: usize,
}

impl Op for MaxOver {
    fn name(&self) -> &'static str {
        "max"
    }
    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grad_if(need[0], || {
            let zeros = Tensor::zeros(&self.shape, g.dtype(), g.device())?;
            let g = g.unsqueeze(self.dim)?.contiguous()?;
            Ok(zeros.scatter_add(&s[0], &g, self.dim)?)
        })?])
    }
}

/// LayerNorm over the last dim, `(x - mean) / sqrt(var + eps) * w (+ b)`, biased variance.
struct LayerNorm {
    eps: f64,
    bias: bool,
}

impl Op for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
    }
    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (x, w) = (&s[0], &s[1]);
        let (xhat, inv) = normalize(x, self.eps)?;
        let rows = |t: &Tensor| -> Result<Tensor> {
            let c = t.dim(D::Minus1)?;
            Ok(t.reshape(((), c))?.sum(0)?)
        };
        // dx = inv (gx - mean(gx) - xhat mean(gx xhat)), gx = g w.
        let dx = grad_if(need[0], || {
            let gx = g.broadcast_mul(w)?;
            let m1 = gx.mean_keepdim(D::Minus1)?;
            let m2 = (&gx * &xhat)?.mean_keepdim(D::Minus1)?;
            let inner = (gx.broadcast_sub(&m1)? - xhat.broadcast_mul(&m2)?)?;
            Ok(inner.broadcast_mul(&inv)?)
        })?;
        let dw = grad_if(need[1], || rows(&(g * &xhat)?))?;
        let mut out = vec![dx, dw];
        if self.bias {
            out.push(grad_if(need[2], || rows(g))?);
        }
        Ok(out)
    }
}

/// `(x - mean) * inv` and `inv = 1 / sqrt(var + eps)` (keepdim) over the last dim.
fn normalize(x: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = var.affine(1.0, eps)?.sqrt()?.recip()?;
    Ok((centred.broadcast_mul(&inv)?, inv))
}

/// Zero padding of `dim`: `before` zeros in front, `after` behind.
struct Pad {
    dim: usize,
    before: usize,
    len: usize,
}

impl Op for Pad {
    fn name(&self) -> &'static str {
        "pad"
    }
    fn backward(&self, _: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grad_if(need[0], || {
            Ok(g.narrow(self.dim, self.before, self.len)?.contiguous()?)
        })?])
    }
}

/// Causal depthwise convolution of rows `x: [T, C]` with `w: [C, K]`:
/// `y[t, c] = sum_k w[c, k] x[t - (K - 1) + k, c]`, rows before the first taken as 0.
struct CausalConv {
    k: usize,
}

impl Op for CausalConv {
    fn name(&self) -> &'static str {
        "causal_conv1d"
    }
    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (x, w) = (&s[0], &s[1]);
        let t = x.dim(0)?;
        let xp = x.pad_with_zeros(0, self.k - 1, 0)?;
        let dx = grad_if(need[0], || {
            // dxp[t' + k] += g[t'] w[:, k]; then drop the padding rows.
            let mut dxp = Tensor::zeros(xp.shape(), g.dtype(), g.device())?;
            for k in 0..self.k {
                let wk = w.narrow(1, k, 1)?.squeeze(1)?;
                let part = g.broadcast_mul(&wk)?;
                let part = part.pad_with_zeros(0, k, self.k - 1 - k)?;
                dxp = (dxp + part)?;
            }
            Ok(dxp.narrow(0, self.k - 1, t)?.contiguous()?)
        })?;
        let dw = grad_if(need[1], || {
            let cols: Vec<Tensor> = (0..self.k)
                .map(|k| Ok((g * xp.narrow(0, k, t)?)?.sum(0)?))
                .collect::<Result<_>>()?;
            Ok(Tensor::stack(&cols, 1)?)
        })?;
        Ok(vec![dx, dw])
    }
}

impl<'m> Cx<'m> {
    /// `a - b` with broadcasting. Saves nothing.
    pub fn sub(&mut self, a: &Var, b: &Var) -> Result<Var> {
        let out = a.tensor.broadcast_sub(&b.tensor)?;
        let op = Sub {
            a: shape_of(&a.tensor),
            b: shape_of(&b.tensor),
        };
        self.record(op, &[a, b], out, vec![])
    }

    fn unary(&mut self, f: Unary, x: &Var) -> Result<Var> {
        let out = f.forward(&x.tensor)?;
        let saved = if x.requires_grad() {
            vec![Saved::for_var(x)]
        } else {
            vec![]
        };
        self.record(f, &[x], out, saved)
    }

    /// `exp(x)`. Saves `x` when it wants a gradient.
    pub fn exp(&mut self, x: &Var) -> Result<Var> {
        self.unary(Unary::Exp, x)
    }

    /// `tanh(x)`. Saves `x` when it wants a gradient.
    pub fn tanh(&mut self, x: &Var) -> Result<Var> {
        self.unary(Unary::Tanh, x)
    }

    /// `1 / (1 + exp(-x))`. Saves `x` when it wants a gradient.
    pub fn sigmoid(&mut self, x: &Var) -> Result<Var> {
        self.unary(Unary::Sigmoid, x)
    }

    /// GELU, `x Phi(x)` with the normal CDF by `erf` (PyTorch's default, GPT-2's `gelu`
    /// in Hugging Face configs as `gelu`). Saves `x` when it wants a gradient.
    pub fn gelu_erf(&mut self, x: &Var) -> Result<Var> {
        self.unary(Unary::GeluErf, x)
    }

    /// GELU's tanh form, `x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2` (GPT-2's
    /// `gelu_new`). Saves `x` when it wants a gradient.
    pub fn gelu_tanh(&mut self, x: &Var) -> Result<Var> {
        self.unary(Unary::GeluTanh, x)
    }

    /// Softmax over the last dim. Saves `x` (its backward recomputes the probabilities).
    pub fn softmax(&mut self, x: &Var) -> Result<Var> {
        let out = softmax_last(&x.tensor)?;
        let saved = if x.requires_grad() {
            vec![Saved::for_var(x)]
        } else {
            vec![]
        };
        self.record(Softmax, &[x], out, saved)
    }

    fn reduce(&mut self, x: &Var, dim: usize, mean: bool) -> Result<Var> {
        if dim >= x.dims().len() {
            return shape_err(
                if mean { "mean" } else { "sum" },
                format!("dim {dim} of a rank-{} tensor", x.dims().len()),
            );
        }
        let out = if mean {
            x.tensor.mean(dim)?
        } else {
            x.tensor.sum(dim)?
        };
        let op = Reduce {
            shape: shape_of(&x.tensor),
            dim,
            mean,
        };
        self.record(op, &[x], out, vec![])
    }

    /// The sum over `dim`, which is removed. Saves nothing.
    pub fn sum(&mut self, x: &Var, dim: usize) -> Result<Var> {
        self.reduce(x, dim, false)
    }

    /// The mean over `dim`, which is removed. Saves nothing.
    pub fn mean(&mut self, x: &Var, dim: usize) -> Result<Var> {
        self.reduce(x, dim, true)
    }

    /// The maximum over `dim`, which is removed. Saves the argmax (exact, `u32`) when `x`
    /// wants a gradient; the gradient goes to the first maximum of each slice.
    pub fn max(&mut self, x: &Var, dim: usize) -> Result<Var> {
        if dim >= x.dims().len() {
            return shape_err(
                "max",
                format!("dim {dim} of a rank-{} tensor", x.dims().len()),
            );
        }
        let out = x.tensor.max(dim)?;
        let saved = if x.requires_grad() {
            vec![Saved::Exact(
                x.tensor.argmax_keepdim(dim)?.to_dtype(DType::U32)?,
            )]
        } else {
            vec![]
        };
        let op = MaxOver {
            shape: shape_of(&x.tensor),
            dim,
        };
        self.record(op, &[x], out, saved)
    }

    /// LayerNorm over the last dim, `(x - mean) / sqrt(var + eps) * w + b` (biased
    /// variance, as `torch.nn.LayerNorm`); `w` and `b` are `[C]`. Saves `x` and `w`.
    pub fn layer_norm(&mut self, x: &Var, w: &Var, b: Option<&Var>, eps: f64) -> Result<Var> {
        let c = x.dim(x.dims().len().saturating_sub(1))?;
        if w.dims() != [c] || b.is_some_and(|b| b.dims() != [c]) {
            return shape_err(
                "layer_norm",
                format!(
                    "x is {:?}, so the weight and bias must be [{c}]; got {:?} and {:?}",
                    x.dims(),
                    w.dims(),
                    b.map(|b| b.dims().to_vec())
                ),
            );
        }
        let (xhat, _) = normalize(&x.tensor, eps)?;
        let mut out = xhat.broadcast_mul(&w.tensor)?;
        if let Some(b) = b {
            out = out.broadcast_add(&b.tensor)?;
        }
        let mut inputs = vec![x, w];
        inputs.extend(b);
        let saved = if any_grad(&inputs) {
            vec![Saved::for_var(x), Saved::for_var(w)]
        } else {
            vec![]
        };
        self.record(
            LayerNorm {
                eps,
                bias: b.is_some(),
            },
            &inputs,
            out,
            saved,
        )
    }

    /// `x` with `before` zeros in front of `dim` and `after` behind. Saves nothing.
    pub fn pad(&mut self, x: &Var, dim: usize, before: usize, after: usize) -> Result<Var> {
        if dim >= x.dims().len() {
            return shape_err(
                "pad",
                format!("dim {dim} of a rank-{} tensor", x.dims().len()),
            );
        }
        let out = x.tensor.pad_with_zeros(dim, before, after)?;
        let op = Pad {
            dim,
            before,
            len: x.dims()[dim],
        };
        self.record(op, &[x], out, vec![])
    }

    /// Causal depthwise 1-d convolution of one sequence's rows `x: [T, C]` with kernels
    /// `w: [C, K]`: `y[t, c] = sum_k w[c, k] x[t - K + 1 + k, c]`, rows before the first
    /// taken as zero (a short-convolution unit, as in Mamba or Hyena). For packed
    /// sequences, apply it per sequence (`narrow`, then `cat`) so none reads another's
    /// rows. Saves `x` and `w`.
    pub fn causal_conv1d(&mut self, x: &Var, w: &Var) -> Result<Var> {
        let (xd, wd) = (x.dims(), w.dims());
        if xd.len() != 2 || wd.len() != 2 || wd[0] != xd[1] || wd[1] == 0 {
            return shape_err(
                "causal_conv1d",
                format!("x must be [T, C] and w [C, K] with K >= 1; got {xd:?} and {wd:?}"),
            );
        }
        let (t, k) = (xd[0], wd[1]);
        let xp = x.tensor.pad_with_zeros(0, k - 1, 0)?;
        let mut out = Tensor::zeros((t, xd[1]), x.dtype(), x.tensor.device())?;
        for j in 0..k {
            let wk = w.tensor.narrow(1, j, 1)?.squeeze(1)?;
            out = (out + xp.narrow(0, j, t)?.broadcast_mul(&wk)?)?;
        }
        let saved = if any_grad(&[x, w]) {
            vec![Saved::for_var(x), Saved::for_var(w)]
        } else {
            vec![]
        };
        self.record(CausalConv { k }, &[x, w], out, saved)
    }
}
