//! The same GPT-2 on candle's own autograd, written as plain candle code would be (full
//! `[N, V]` logits, `log_softmax` + gather, attention as a masked softmax per sequence,
//! LayerNorm from mean and variance, GELU's tanh form op by op). It shares no code with
//! the tape's ops: the tests compare the tape's gradients against it.

use crate::{Gpt2, Gpt2Config};
use candle_core::{Tensor, Var, D};
use hilore::train::ActorModel;
use hilore_models::TokenBatch;

/// A copy of a [`Gpt2`]'s parameters as candle `Var`s.
#[derive(Debug)]
pub struct CandleGpt2 {
    cfg: Gpt2Config,
    names: Vec<String>,
    vars: Vec<Var>,
}

impl CandleGpt2 {
    /// Copies every parameter (same values, new storage).
    pub fn new(model: &Gpt2) -> anyhow::Result<Self> {
        let mut names = Vec::new();
        let mut vars = Vec::new();
        for (name, v) in model.named_params() {
            vars.push(Var::from_tensor(&v.tensor().copy()?)?);
            names.push(name);
        }
        Ok(CandleGpt2 {
            cfg: model.cfg,
            names,
            vars,
        })
    }

    fn p(&self, name: &str) -> anyhow::Result<&Tensor> {
        let i = self
            .names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| anyhow::anyhow!("no parameter {name}"))?;
        Ok(self.vars[i].as_tensor())
    }

    fn layer_norm(&self, x: &Tensor, name: &str) -> anyhow::Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let y = xc.broadcast_div(&(var + self.cfg.layer_norm_epsilon)?.sqrt()?)?;
        Ok(y.broadcast_mul(self.p(&format!("{name}.weight"))?)?
            .broadcast_add(self.p(&format!("{name}.bias"))?)?)
    }

    fn linear(&self, x: &Tensor, name: &str) -> anyhow::Result<Tensor> {
        let w = self.p(&format!("{name}.weight"))?;
        Ok(x.matmul(&w.t()?)?
            .broadcast_add(self.p(&format!("{name}.bias"))?)?)
    }

    /// Per-token log-probs of the batch's targets, `[N]`.
    pub fn logprobs(&self, batch: &TokenBatch) -> anyhow::Result<Tensor> {
        let cfg = self.cfg;
        let (n, c, h) = (batch.num_tokens(), cfg.n_embd, cfg.n_head);
        let d = c / h;
        let offsets = batch.packing.offsets().to_vec();
        let mut x = (self.p("wte")?.index_select(&batch.inputs, 0)?
            + self.p("wpe")?.index_select(batch.packing.positions(), 0)?)?;
        for l in 0..cfg.n_layer {
            let p = format!("h.{l}");
            let a = self.layer_norm(&x, &format!("{p}.ln_1"))?;
            let qkv = self.linear(&a, &format!("{p}.attn.c_attn"))?;
            let head = |i: usize| qkv.narrow(1, i * c, c)?.reshape((n, h, d));
            let (q, k, v) = (head(0)?, head(1)?, head(2)?);
            let mut outs = Vec::new();
            for w in offsets.windows(2) {
                let (s, t) = (w[0], w[1] - w[0]);
                let per = |x: &Tensor| x.narrow(0, s, t)?.transpose(0, 1)?.contiguous();
                let (qs, ks, vs) = (per(&q)?, per(&k)?, per(&v)?);
                let mut mask = vec![0f32; t * t];
                for i in 0..t {
                    for m in &mut mask[i * t + i + 1..(i + 1) * t] {
                        *m = f32::NEG_INFINITY;
                    }
                }
                let mask = Tensor::from_vec(mask, (t, t), x.device())?;
                let scores =
                    (qs.matmul(&ks.t()?)? * (1.0 / (d as f64).sqrt()))?.broadcast_add(&mask)?;
                let m = scores.max_keepdim(D::Minus1)?.detach();
                let e = scores.broadcast_sub(&m)?.exp()?;
                let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
                outs.push(probs.matmul(&vs)?.transpose(0, 1)?);
            }
            let o = Tensor::cat(&outs, 0)?.reshape((n, c))?;
            x = (&x + self.linear(&o, &format!("{p}.attn.c_proj"))?)?;
            let a = self.layer_norm(&x, &format!("{p}.ln_2"))?;
            let f = self.linear(&a, &format!("{p}.mlp.c_fc"))?;
            // GELU, tanh form: 0.5 f (1 + tanh(sqrt(2/pi) (f + 0.044715 f^3))).
            let inner = ((&f + (f.powf(3.0)? * 0.044715)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
            let g = ((f.clone() * 0.5)? * (inner.tanh()? + 1.0)?)?;
            x = (&x + self.linear(&g, &format!("{p}.mlp.c_proj"))?)?;
        }
        let hdn = self.layer_norm(&x, "ln_f")?;
        let logits = hdn.matmul(&self.p("wte")?.t()?)?;
        let m = logits.max_keepdim(D::Minus1)?.detach();
        let z = logits.broadcast_sub(&m)?;
        let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
        let logp = z.broadcast_sub(&lse)?;
        Ok(logp.gather(&batch.targets.unsqueeze(1)?, 1)?.squeeze(1)?)
    }

    /// The gradient of `sum(seed * logp)` for every parameter, in
    /// [`ActorModel::named_params`] order.
    pub fn gradients(&self, batch: &TokenBatch, seed: &Tensor) -> anyhow::Result<Vec<Tensor>> {
        let logp = self.logprobs(batch)?;
        let loss = (logp * seed)?.sum_all()?;
        let g = loss.backward()?;
        self.vars
            .iter()
            .zip(&self.names)
            .map(|(v, name)| {
                g.get(v.as_tensor())
                    .cloned()
                    .ok_or_else(|| anyhow::anyhow!("candle gave no gradient for {name}"))
            })
            .collect()
    }
}
