//! The same decoder on candle's own autograd, as an independent reference.
//!
//! Written the way a plain candle implementation would be (the Hugging Face formulation):
//! full `[N, vocab]` logits and `log_softmax` + gather, attention as a masked softmax per
//! sequence with the key/value heads repeated for their query group, RoPE as
//! `x * cos + rotate_half(x) * sin` with the `[N, D]` tables `cat(cos, cos)` and
//! `cat(sin, sin)`. It shares no code with the tape's ops: it is what tests and the tape
//! benchmark compare the tape's log-probs, gradients, time and memory against.

use crate::{Decoder, DecoderConfig, ModelError, TokenBatch};
use candle_core::{DType, Tensor, Var, D};
use std::collections::HashMap;

/// A copy of a [`Decoder`]'s parameters as candle `Var`s, and its forward on candle's graph.
#[derive(Debug)]
pub struct CandleDecoder {
    cfg: DecoderConfig,
    names: Vec<String>,
    vars: HashMap<String, Var>,
}

impl CandleDecoder {
    /// Copies every parameter of `model` (same values, new storage).
    /// Refuses configs with features this reference does not model (per-head q/k norm,
    /// an `o_proj` bias, sliding windows, RoPE scaling), rather than silently comparing
    /// against a different model.
    pub fn from_decoder(model: &Decoder) -> Result<Self, ModelError> {
        let cfg = model.config();
        let unsupported = [
            (cfg.qk_norm(), "per-head q/k RMSNorm (qwen3)"),
            (cfg.o_proj_bias(), "an o_proj bias"),
            (
                (0..cfg.num_hidden_layers).any(|l| cfg.layer_window(l).is_some()),
                "sliding-window attention",
            ),
            (cfg.rope_scaling.is_some(), "RoPE scaling"),
        ];
        if let Some((_, what)) = unsupported.iter().find(|(on, _)| *on) {
            return Err(ModelError::Batch(format!(
                "the candle-autograd reference models plain Llama/Qwen2 decoders, not {what}; \
                 compare such models against candle-transformers instead"
            )));
        }
        let mut names = Vec::new();
        let mut vars = HashMap::new();
        for (name, v) in model.named_params() {
            let t = v.tensor().copy()?;
            vars.insert(name.clone(), Var::from_tensor(&t)?);
            names.push(name);
        }
        Ok(CandleDecoder {
            cfg: model.config().clone(),
            names,
            vars,
        })
    }

    fn p(&self, name: &str) -> Result<&Tensor, ModelError> {
        self.vars
            .get(name)
            .map(|v| v.as_tensor())
            .ok_or_else(|| ModelError::Param {
                name: name.to_string(),
                problem: "missing from the reference copy".into(),
            })
    }

    fn linear(&self, x: &Tensor, prefix: &str, bias: bool) -> Result<Tensor, ModelError> {
        let y = x.matmul(&self.p(&format!("{prefix}.weight"))?.t()?)?;
        Ok(if bias {
            y.broadcast_add(self.p(&format!("{prefix}.bias"))?)?
        } else {
            y
        })
    }

    fn rms_norm(&self, x: &Tensor, w: &str) -> Result<Tensor, ModelError> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let y = x.broadcast_div(&(ms + self.cfg.rms_norm_eps)?.sqrt()?)?;
        Ok(y.broadcast_mul(self.p(w)?)?)
    }

    /// `x * cos + rotate_half(x) * sin` for `x: [N, H, D]`, tables `[N, D]`.
    fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, ModelError> {
        let half = x.dim(2)? / 2;
        let x1 = x.narrow(2, 0, half)?;
        let x2 = x.narrow(2, half, half)?;
        let rot = Tensor::cat(&[&x2.neg()?, &x1], 2)?;
        let (c, s) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
        Ok((x.broadcast_mul(&c)? + rot.broadcast_mul(&s)?)?)
    }

    /// The per-token log-probs `[N]` of `batch.targets`, on candle's graph (the result
    /// tracks the parameters).
    pub fn token_logprobs(&self, batch: &TokenBatch) -> Result<Tensor, ModelError> {
        let cfg = &self.cfg;
        let (hq, hkv, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let group = hq / hkv;
        let n = batch.num_tokens();
        let cos = Tensor::cat(&[batch.rope_tables()?.cos(), batch.rope_tables()?.cos()], 1)?;
        let sin = Tensor::cat(&[batch.rope_tables()?.sin(), batch.rope_tables()?.sin()], 1)?;
        let scale = 1.0 / (d as f64).sqrt();
        let offsets = batch.packing.offsets().to_vec();
        let mut x = self
            .p("model.embed_tokens.weight")?
            .index_select(&batch.inputs, 0)?;
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let h = self.rms_norm(&x, &format!("{p}.input_layernorm.weight"))?;
            let b = cfg.attention_bias;
            let q = self
                .linear(&h, &format!("{p}.self_attn.q_proj"), b)?
                .reshape((n, hq, d))?;
            let k = self
                .linear(&h, &format!("{p}.self_attn.k_proj"), b)?
                .reshape((n, hkv, d))?;
            let v = self
                .linear(&h, &format!("{p}.self_attn.v_proj"), b)?
                .reshape((n, hkv, d))?;
            let q = Self::rope(&q, &cos, &sin)?;
            let k = Self::rope(&k, &cos, &sin)?;
            let mut outs = Vec::new();
            for w in offsets.windows(2) {
                let (s, t) = (w[0], w[1] - w[0]);
                // [H, T, D]; kv heads repeated for their query group (HF's repeat_kv).
                let qs = q.narrow(0, s, t)?.transpose(0, 1)?.contiguous()?;
                let repeat = |x: &Tensor| -> candle_core::Result<Tensor> {
                    x.narrow(0, s, t)?
                        .transpose(0, 1)?
                        .unsqueeze(1)?
                        .broadcast_as((hkv, group, t, d))?
                        .reshape((hq, t, d))
                };
                let ks = repeat(&k)?;
                let vs = repeat(&v)?;
                let mut mask = vec![0f32; t * t];
                for i in 0..t {
                    for m in &mut mask[i * t + i + 1..(i + 1) * t] {
                        *m = f32::NEG_INFINITY;
                    }
                }
                let mask = Tensor::from_vec(mask, (t, t), x.device())?;
                let scores = (qs.matmul(&ks.t()?)? * scale)?.broadcast_add(&mask)?;
                let m = scores.max_keepdim(D::Minus1)?.detach();
                let e = scores.broadcast_sub(&m)?.exp()?;
                let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
                outs.push(probs.matmul(&vs)?.transpose(0, 1)?);
            }
            let o = Tensor::cat(&outs, 0)?.reshape((n, hq * d))?;
            let x1 = (&x + self.linear(&o, &format!("{p}.self_attn.o_proj"), false)?)?;
            let h = self.rms_norm(&x1, &format!("{p}.post_attention_layernorm.weight"))?;
            let gate = self.linear(&h, &format!("{p}.mlp.gate_proj"), false)?;
            let up = self.linear(&h, &format!("{p}.mlp.up_proj"), false)?;
            let a = (gate.silu()? * up)?;
            x = (&x1 + self.linear(&a, &format!("{p}.mlp.down_proj"), false)?)?;
        }
        let h = self.rms_norm(&x, "model.norm.weight")?;
        let head = if cfg.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        let logits = h.matmul(&self.p(head)?.t()?)?;
        // log_softmax; the max shift is a constant for the gradient.
        let m = logits.max_keepdim(D::Minus1)?.detach();
        let z = logits.broadcast_sub(&m)?;
        let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
        let logp = z.broadcast_sub(&lse)?;
        Ok(logp.gather(&batch.targets.unsqueeze(1)?, 1)?.squeeze(1)?)
    }

    /// The log-probs and the gradient of `sum(coeffs * logp)` for every parameter, in
    /// [`Decoder::named_params`] order.
    pub fn logprobs_and_gradients(
        &self,
        batch: &TokenBatch,
        coeffs: &Tensor,
    ) -> Result<(Tensor, Vec<(String, Tensor)>), ModelError> {
        let logp = self.token_logprobs(batch)?;
        let loss = (&logp * coeffs.to_dtype(DType::F32)?)?.sum_all()?;
        let grads = loss.backward()?;
        let mut out = Vec::with_capacity(self.names.len());
        for name in &self.names {
            let v = &self.vars[name];
            let g = grads
                .get(v.as_tensor())
                .cloned()
                .ok_or_else(|| ModelError::Param {
                    name: name.clone(),
                    problem: "no gradient reached it in candle's backward".into(),
                })?;
            out.push((name.clone(), g));
        }
        Ok((logp.detach(), out))
    }

    /// The gradient of `sum(coeffs * logp)` for every parameter, in
    /// [`Decoder::named_params`] order.
    pub fn gradients(
        &self,
        batch: &TokenBatch,
        coeffs: &Tensor,
    ) -> Result<Vec<(String, Tensor)>, ModelError> {
        Ok(self.logprobs_and_gradients(batch, coeffs)?.1)
    }
}
