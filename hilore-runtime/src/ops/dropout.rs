//! Inverted dropout driven by the tape's counter-based RNG.

use super::util::grad_if;
use super::{Op, Saved};
use crate::{Cx, Error, Result, Var};
use candle_core::Tensor;

struct Dropout {
    /// `1 / (1 - p)`.
    scale: f64,
}

impl Op for Dropout {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grad_if(need[0], || {
            let keep = s[0].to_dtype(g.dtype())?;
            Ok((g * keep)?.affine(self.scale, 0.0)?)
        })?])
    }
}

struct Identity;

impl Op for Identity {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn backward(&self, _: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grad_if(need[0], || Ok(g.clone()))?])
    }
}

impl<'m> Cx<'m> {
    /// Inverted dropout: each element of `x` is zeroed with probability `p` (`0 <= p < 1`)
    /// and the survivors are scaled by `1 / (1 - p)`. The draw comes from
    /// [`Cx::counter_uniform`], so a recompute replays the same mask.
    ///
    /// Saves the keep-mask as `Saved::Exact`, a `u8` tensor of `x`'s shape (1 byte per
    /// element, a quarter of an f32 activation), when `x` wants a gradient; with `p == 0` it
    /// draws nothing and saves nothing.
    pub fn dropout(&mut self, x: &Var, p: f64) -> Result<Var> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::Tape(format!(
                "dropout: p must be in [0, 1), got {p}"
            )));
        }
        if p == 0.0 {
            return self.record(Identity, &[x], x.tensor.clone(), vec![]);
        }
        let u = self.counter_uniform(x.shape().clone(), x.dtype(), x.device())?;
        let keep = u.ge(p)?;
        drop(u);
        let scale = 1.0 / (1.0 - p);
        let y = (&x.tensor * keep.to_dtype(x.dtype())?)?.affine(scale, 0.0)?;
        let saved = if x.requires_grad() {
            vec![Saved::Exact(keep)]
        } else {
            vec![]
        };
        self.record(Dropout { scale }, &[x], y, saved)
    }
}
