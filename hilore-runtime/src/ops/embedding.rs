//! Embedding lookup.

use super::util::grad_if;
use super::{Op, Saved};
use crate::error::shape_err;
use crate::{Cx, Result, Var};
use candle_core::Tensor;

struct Embedding {
    vocab: usize,
    dim: usize,
}

impl Op for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let dt = grad_if(need[0], || {
            let ids = &s[0];
            let n = ids.dim(0)?;
            // Scatter-add the rows of `g` into a zero table in place: one [V, d] buffer (an
            // out-of-place index_add would hold two), plus the [N, d] expanded ids.
            let table = Tensor::zeros((self.vocab, self.dim), g.dtype(), g.device())?;
            let idx = ids
                .unsqueeze(1)?
                .broadcast_as((n, self.dim))?
                .contiguous()?;
            table.scatter_add_set(&idx, &g.contiguous()?, 0)?;
            Ok(table)
        })?;
        Ok(vec![dt])
    }
}

impl<'m> Cx<'m> {
    /// Rows of `table: [V, d]` at `ids: [N]` (an integer tensor, `u32` usually); returns
    /// `[N, d]`.
    ///
    /// Saves `ids` (`Saved::Exact`) when the table wants a gradient, nothing otherwise; the
    /// table itself is not needed by backward (only its shape, kept in the op).
    pub fn embedding(&mut self, table: &Var, ids: &Tensor) -> Result<Var> {
        let (vocab, dim) = match table.dims() {
            [v, d] => (*v, *d),
            d => return shape_err("embedding", format!("table must be [V, d], got {d:?}")),
        };
        if ids.rank() != 1 || !ids.dtype().is_int() {
            return shape_err(
                "embedding",
                format!(
                    "ids must be a 1-d integer tensor, got {:?} {:?}",
                    ids.dims(),
                    ids.dtype()
                ),
            );
        }
        let y = table.tensor.index_select(ids, 0)?;
        let saved = if table.requires_grad() {
            vec![Saved::Exact(ids.clone())]
        } else {
            vec![]
        };
        self.record(Embedding { vocab, dim }, &[table], y, saved)
    }
}
