//! Batched sampling with a KV cache: the rollout half of GRPO.
//!
//! Generation reuses the decoder's own unit methods under [`Cx::inference`] for every piece
//! of the model except the attention core: the embedding, and per layer `attn_norm`, `qkv`
//! (with the config's RoPE tables, scaling included, for the new tokens' positions), `attn_out`,
//! `mlp_norm`, `gate_up` and `down`; then the final norm and the LM head on the last
//! position. So a change to a unit (a per-head norm inside `qkv`, say) applies to
//! generation without touching this file. Only the attention is written here: the new
//! tokens' keys and values are appended to a per-layer cache and the queries attend to the
//! whole cache (grouped-query heads, the same head layout and the same softmax steps as the
//! training op).
//!
//! ## The cache
//!
//! Prompts are left-padded to a common length, so every row's next token goes to the same
//! cache slot: `k, v: [B, Hkv, capacity, D]` per layer, written in place. A prompt given
//! several times (GRPO samples G responses to each) is prefilled once and its cache rows
//! copied to the other rows before they part. Row `b`'s first
//! `pad[b]` slots are padding, masked out as keys (a padding query attends only to itself,
//! so no row is fully masked and nothing non-finite appears). Positions (RoPE) count from
//! each row's first real token. Rows that finish are dropped from the batch (and the cache)
//! at once, so a long straggler does not drag finished rows through every layer.
//!
//! ## Sampling
//!
//! Temperature `T` (0: greedy), nucleus top-p, a maximum number of new tokens and a stop
//! token. Every random draw comes from one [`SplitMix64`] stream seeded by
//! [`SamplingConfig::seed`], consumed row by row in prompt order, so a seed fixes the
//! output bit for bit. The recorded log-prob of each sampled token is that of the
//! tempered distribution, `log_softmax(logits / T)` (temperature 1 when greedy), before
//! top-p: the quantity a training forward at the same temperature computes
//! ([`Decoder::token_logprobs`] after [`Decoder::set_logit_temperature`], as TRL trains
//! on `logits / T`) and GRPO's ratios are taken against; it differs from the sampling
//! distribution when `top_p < 1`.
//!
//! ```
//! use candle_core::Device;
//! use hilore_models::generate::{generate, SamplingConfig};
//! use hilore_models::{Decoder, DecoderConfig};
//!
//! # fn main() -> Result<(), hilore_models::ModelError> {
//! let model = Decoder::random(&DecoderConfig::tiny(), 0, &Device::Cpu)?;
//! let cfg = SamplingConfig { max_new_tokens: 5, seed: 3, ..SamplingConfig::default() };
//! let outs = generate(&model, &[vec![1, 2, 3], vec![4, 5]], &cfg)?;
//! assert_eq!(outs.len(), 2);
//! assert!(outs.iter().all(|g| g.tokens.len() <= 5 && g.logprobs.len() == g.tokens.len()));
//! # Ok(())
//! # }
//! ```

use crate::rng::SplitMix64;
use crate::{Decoder, ModelError};
use candle_core::{DType, Device, Tensor, D};
use hilore_runtime::{Cx, Packing, Var};

/// How to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// At most this many new tokens per prompt (the stop token included).
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 means greedy (argmax, ties to the lower id).
    pub temperature: f64,
    /// Nucleus sampling: keep the most probable tokens whose probabilities reach `top_p`
    /// (at least one token); 1 keeps all.
    pub top_p: f64,
    /// Generation of a row ends after this token (which is kept in the output).
    pub stop_token: Option<u32>,
    /// Seed of the sampling stream.
    pub seed: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            max_new_tokens: 32,
            temperature: 1.0,
            top_p: 1.0,
            stop_token: None,
            seed: 0,
        }
    }
}

impl SamplingConfig {
    /// Checks the settings against a model: `temperature >= 0`, `0 < top_p <= 1`, a stop
    /// token inside the vocabulary.
    pub fn validate(&self, model: &Decoder) -> Result<(), ModelError> {
        let bad = |what: String| Err(ModelError::Batch(format!("sampling: {what}")));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "temperature is {}; it must be >= 0 (0 is greedy)",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p is {}; it must be in (0, 1]", self.top_p));
        }
        if let Some(s) = self.stop_token {
            if s as usize >= model.config().vocab_size {
                return bad(format!(
                    "stop token {s} is outside the vocabulary of {} ids",
                    model.config().vocab_size
                ));
            }
        }
        Ok(())
    }
}

/// Why a row stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Finish {
    /// It sampled the stop token.
    Stop,
    /// It reached `max_new_tokens`.
    Length,
}

/// One prompt's response.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The sampled tokens (the stop token included when sampled).
    pub tokens: Vec<u32>,
    /// The log-prob of each sampled token at the sampling temperature (1 when greedy).
    pub logprobs: Vec<f32>,
    /// Why generation ended.
    pub finish: Finish,
}

/// One layer's cached keys and values, `[B, Hkv, capacity, D]` each.
struct LayerCache {
    k: Tensor,
    v: Tensor,
}

/// A batch of sequences being decoded, with its KV cache.
pub struct Session<'a> {
    model: &'a Decoder,
    norm: Var,
    device: Device,
    layers: Vec<LayerCache>,
    /// Filled slots (the same for every row: prompts are left-padded).
    len: usize,
    capacity: usize,
    /// Padding slots at the start of each row.
    pad: Vec<usize>,
    /// Rows the prefill ran: the distinct prompts.
    prefilled: usize,
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("rows", &self.pad.len())
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl<'a> Session<'a> {
    /// Runs the prompts through the model (left-padded to the longest), filling a cache
    /// with room for `max_new_tokens` more tokens per row; returns the session and the
    /// logits `[B, vocab]` of the next token of every row.
    pub fn prefill(
        model: &'a Decoder,
        prompts: &[Vec<u32>],
        max_new_tokens: usize,
    ) -> Result<(Self, Tensor), ModelError> {
        let cfg = model.config();
        if prompts.is_empty() {
            return Err(ModelError::Batch(
                "generation needs at least one prompt".into(),
            ));
        }
        if let Some(i) = prompts.iter().position(|p| p.is_empty()) {
            return Err(ModelError::Batch(format!(
                "prompt {i} is empty; every prompt needs at least one token (e.g. a BOS token)"
            )));
        }
        for (i, p) in prompts.iter().enumerate() {
            if let Some(&t) = p.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ModelError::Batch(format!(
                    "prompt {i} has token id {t}, outside the vocabulary of {} ids",
                    cfg.vocab_size
                )));
            }
            // The last token fed to the model sits at position len + max_new - 2.
            let positions = p.len() + max_new_tokens.saturating_sub(1);
            if positions > cfg.max_position_embeddings {
                return Err(ModelError::Batch(format!(
                    "prompt {i} has {} tokens; with {max_new_tokens} new tokens that needs {positions} positions, more than max_position_embeddings = {}",
                    p.len(),
                    cfg.max_position_embeddings
                )));
            }
        }
        let norm = model
            .named_params()
            .into_iter()
            .find(|(n, _)| n == "model.norm.weight")
            .map(|(_, v)| v)
            .ok_or_else(|| ModelError::Param {
                name: "model.norm.weight".into(),
                problem: "the decoder has no final norm".into(),
            })?;
        let device = model.head_weight().device().clone();
        // A prompt that repeats (a GRPO group's responses, evaluation's samples) is run
        // once; its other rows get copies of its cache rows and logits.
        let mut distinct: Vec<&[u32]> = Vec::new();
        let mut first_of: std::collections::HashMap<&[u32], u32> = Default::default();
        let row_of: Vec<u32> = prompts
            .iter()
            .map(|p| {
                *first_of.entry(p.as_slice()).or_insert_with(|| {
                    distinct.push(p);
                    (distinct.len() - 1) as u32
                })
            })
            .collect();
        let b = distinct.len();
        let tmax = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let capacity = tmax + max_new_tokens;
        let (hkv, d) = (cfg.num_key_value_heads, cfg.head_dim);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            layers.push(LayerCache {
                k: Tensor::zeros((b, hkv, capacity, d), DType::F32, &device)?,
                v: Tensor::zeros((b, hkv, capacity, d), DType::F32, &device)?,
            });
        }
        let pad: Vec<usize> = distinct.iter().map(|p| tmax - p.len()).collect();
        let mut ids = Vec::with_capacity(b * tmax);
        let mut positions = Vec::with_capacity(b * tmax);
        for (p, &pb) in distinct.iter().zip(&pad) {
            ids.extend(std::iter::repeat_n(0u32, pb));
            ids.extend_from_slice(p);
            positions.extend(std::iter::repeat_n(0u32, pb));
            positions.extend(0..p.len() as u32);
        }
        let mut s = Session {
            model,
            norm,
            device,
            layers,
            len: 0,
            capacity,
            pad,
            prefilled: b,
        };
        let mut logits = s.forward(&ids, tmax, &positions)?;
        if b < prompts.len() {
            s.pad = row_of.iter().map(|&r| s.pad[r as usize]).collect();
            let idx = Tensor::from_vec(row_of, prompts.len(), &s.device)?;
            for l in &mut s.layers {
                l.k = l.k.index_select(&idx, 0)?;
                l.v = l.v.index_select(&idx, 0)?;
            }
            logits = logits.index_select(&idx, 0)?;
        }
        Ok((s, logits))
    }

    /// Rows the prefill ran through the model: the distinct prompts (repeated prompts
    /// share the run and get copies of its cache).
    pub fn prefilled_rows(&self) -> usize {
        self.prefilled
    }

    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.pad.len()
    }

    /// Feeds one token per row; returns the logits `[B, vocab]` of the next token.
    pub fn step(&mut self, tokens: &[u32]) -> Result<Tensor, ModelError> {
        if tokens.len() != self.rows() {
            return Err(ModelError::Batch(format!(
                "step: {} tokens for {} rows",
                tokens.len(),
                self.rows()
            )));
        }
        if self.len >= self.capacity {
            return Err(ModelError::Batch(format!(
                "step: the KV cache is full ({} slots); prefill with a larger max_new_tokens",
                self.capacity
            )));
        }
        let positions: Vec<u32> = self.pad.iter().map(|&p| (self.len - p) as u32).collect();
        self.forward(tokens, 1, &positions)
    }

    /// Keeps only rows `keep` (indices into the current rows, ascending), dropping the
    /// others from the cache.
    pub fn retain(&mut self, keep: &[usize]) -> Result<(), ModelError> {
        if keep.iter().any(|&r| r >= self.rows()) || keep.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ModelError::Batch(format!(
                "retain: rows {keep:?} are not ascending indices below {}",
                self.rows()
            )));
        }
        let idx = Tensor::from_vec(
            keep.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            keep.len(),
            &self.device,
        )?;
        for l in &mut self.layers {
            l.k = l.k.index_select(&idx, 0)?;
            l.v = l.v.index_select(&idx, 0)?;
        }
        self.pad = keep.iter().map(|&r| self.pad[r]).collect();
        Ok(())
    }

    /// Runs `tq` new tokens per row (`ids` row-major `[B, tq]`, at `positions`) through
    /// the model, appending their keys and values; returns the last new token's logits.
    fn forward(&mut self, ids: &[u32], tq: usize, positions: &[u32]) -> Result<Tensor, ModelError> {
        let model = self.model;
        let cfg = model.config();
        let b = self.rows();
        let n = b * tq;
        let mut cx = Cx::inference();
        let ids = Var::constant(Tensor::from_vec(ids.to_vec(), n, &self.device)?);
        // The config's tables: RoPE scaling (llama3, linear) applies here too.
        let rope = cfg.rope_tables(positions, DType::F32, &self.device)?;
        // One mask per distinct sliding window (Mistral, windowed Qwen layers).
        let mut masks: Vec<(Option<usize>, Tensor)> = Vec::new();
        let mut x = model.embed(&mut cx, &ids)?;
        for (l, layer) in model.layers().iter().enumerate() {
            let window = layer.self_attn.window();
            let mask = match masks.iter().find(|(w, _)| *w == window) {
                Some((_, m)) => m.clone(),
                None => {
                    let m = self.mask(tq, window)?;
                    masks.push((window, m.clone()));
                    m
                }
            };
            let h = layer.attn_norm(&mut cx, &x)?;
            let (q, k, v) = layer.self_attn.qkv(&mut cx, &h, &rope)?;
            let o = self.attend(l, &q, &k, &v, tq, &mask)?;
            let x1 = layer.self_attn.out(&mut cx, &o, &x)?;
            let h = layer.mlp_norm(&mut cx, &x1)?;
            let a = layer.mlp.gate_up(&mut cx, &h)?;
            x = layer.mlp.down(&mut cx, &a, &x1)?;
        }
        self.len += tq;
        let last = x
            .tensor()
            .reshape((b, tq, cfg.hidden_size))?
            .narrow(1, tq - 1, 1)?
            .squeeze(1)?;
        logits_of(model, &self.norm, &mut cx, &Var::constant(last))
    }

    /// `[B, 1, tq, len + tq]`: 0 where query `j` (slot `len + j`) may read key slot `s`
    /// (`pad[b] <= s <= len + j`, or `s = len + j` itself; with a sliding window `W`
    /// also `len + j - s < W`, the training op's rule), `-inf` elsewhere.
    fn mask(&self, tq: usize, window: Option<usize>) -> Result<Tensor, ModelError> {
        let t = self.len + tq;
        let mut m = vec![f32::NEG_INFINITY; self.rows() * tq * t];
        for (b, &pad) in self.pad.iter().enumerate() {
            for j in 0..tq {
                let q = self.len + j;
                let row = &mut m[(b * tq + j) * t..(b * tq + j + 1) * t];
                for (s, v) in row.iter_mut().enumerate().take(q + 1) {
                    let in_window = window.is_none_or(|w| q - s < w);
                    if (s >= pad && in_window) || s == q {
                        *v = 0.0;
                    }
                }
            }
        }
        Ok(Tensor::from_vec(m, (self.rows(), 1, tq, t), &self.device)?)
    }

    /// Appends `k, v: [B tq, Hkv, D]` to layer `l`'s cache and attends `q: [B tq, Hq, D]`
    /// to the cache; returns `[B tq, Hq, D]`. Query head `h` reads kv head `h / G` (heads
    /// laid out `h = kv * G + g`, as in the training op), scores scaled by `1 / sqrt(D)`.
    fn attend(
        &mut self,
        l: usize,
        q: &Var,
        k: &Var,
        v: &Var,
        tq: usize,
        mask: &Tensor,
    ) -> Result<Var, ModelError> {
        let cfg = self.model.config();
        let (b, hq, hkv, d) = (
            self.rows(),
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let g = hq / hkv;
        let t = self.len + tq;
        let to_cache = |x: &Tensor| -> candle_core::Result<Tensor> {
            x.reshape((b, tq, hkv, d))?.transpose(1, 2)?.contiguous()
        };
        let cache = &self.layers[l];
        cache.k.slice_set(&to_cache(k.tensor())?, 2, self.len)?;
        cache.v.slice_set(&to_cache(v.tensor())?, 2, self.len)?;
        let keys = cache.k.narrow(2, 0, t)?.contiguous()?;
        let values = cache.v.narrow(2, 0, t)?.contiguous()?;
        let scale = 1.0 / (d as f64).sqrt();
        // [B, Hq, tq, D] scaled, viewed as [B, Hkv, G tq, D].
        let qs = q
            .tensor()
            .reshape((b, tq, hq, d))?
            .transpose(1, 2)?
            .affine(scale, 0.0)?
            .reshape((b, hkv, g * tq, d))?;
        let s = qs
            .matmul(&keys.t()?)?
            .reshape((b, hq, tq, t))?
            .broadcast_add(mask)?;
        let m = s.max_keepdim(D::Minus1)?;
        let e = s.broadcast_sub(&m)?.exp()?;
        let p = e
            .broadcast_div(&e.sum_keepdim(D::Minus1)?)?
            .reshape((b, hkv, g * tq, t))?;
        let o = p
            .matmul(&values)?
            .reshape((b, hq, tq, d))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b * tq, hq, d))?;
        Ok(Var::constant(o))
    }
}

/// Final norm and LM head: `[R, hidden] -> [R, vocab]` logits.
fn logits_of(model: &Decoder, norm: &Var, cx: &mut Cx, x: &Var) -> Result<Tensor, ModelError> {
    let h = cx.rms_norm(x, norm, model.config().rms_norm_eps)?;
    let logits = cx.linear(&h, model.head_weight(), None)?;
    Ok(logits.tensor().clone())
}

/// The next-token logits `[B, vocab]` after each of `seqs`, computed without a cache by
/// the decoder's training forward path (the `layer` units with their own attention over the
/// packed sequences) under [`Cx::inference`]: the reference the KV cache is tested against.
pub fn last_token_logits(model: &Decoder, seqs: &[Vec<u32>]) -> Result<Tensor, ModelError> {
    let cfg = model.config();
    let device = model.head_weight().device().clone();
    if seqs.is_empty() || seqs.iter().any(Vec::is_empty) {
        return Err(ModelError::Batch(
            "last_token_logits needs at least one sequence, none of them empty".into(),
        ));
    }
    let lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
    let packing = Packing::new(&lengths, &device)?;
    let positions: Vec<u32> = packing.positions().to_vec1()?;
    let rope = cfg.rope_tables(&positions, DType::F32, &device)?;
    let flat: Vec<u32> = seqs.concat();
    let n = flat.len();
    let mut cx = Cx::inference();
    let ids = Var::constant(Tensor::from_vec(flat, n, &device)?);
    let mut x = model.embed(&mut cx, &ids)?;
    for layer in model.layers() {
        x = layer.forward(&mut cx, &x, &packing, &rope)?;
    }
    let last: Vec<u32> = packing.offsets()[1..]
        .iter()
        .map(|&o| (o - 1) as u32)
        .collect();
    let idx = Tensor::from_vec(last, seqs.len(), &device)?;
    let rows = Var::constant(x.tensor().index_select(&idx, 0)?);
    let norm = model
        .named_params()
        .into_iter()
        .find(|(n, _)| n == "model.norm.weight")
        .map(|(_, v)| v)
        .ok_or_else(|| ModelError::Param {
            name: "model.norm.weight".into(),
            problem: "the decoder has no final norm".into(),
        })?;
    logits_of(model, &norm, &mut cx, &rows)
}

/// Samples one token from a row of logits; returns it with its log-prob at the sampling
/// temperature, `log_softmax(logits / T)` (at temperature 1 when greedy), before top-p.
pub fn sample_token(logits: &[f32], cfg: &SamplingConfig, rng: &mut SplitMix64) -> (u32, f32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let t = if cfg.temperature > 0.0 {
        cfg.temperature
    } else {
        1.0
    };
    let lse = max / t
        + logits
            .iter()
            .map(|&z| ((z as f64 - max) / t).exp())
            .sum::<f64>()
            .ln();
    let tok = if cfg.temperature == 0.0 {
        let mut best = 0;
        for (i, &z) in logits.iter().enumerate() {
            if z > logits[best] {
                best = i;
            }
        }
        best
    } else {
        let probs: Vec<f64> = logits
            .iter()
            .map(|&z| ((z as f64 - max) / cfg.temperature).exp())
            .collect();
        let mut order: Vec<usize> = (0..probs.len()).collect();
        let mut total: f64 = probs.iter().sum();
        if cfg.top_p < 1.0 {
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
            let (mut kept, mut cum) = (0, 0.0);
            for &i in &order {
                cum += probs[i];
                kept += 1;
                if cum >= cfg.top_p * total {
                    break;
                }
            }
            order.truncate(kept.max(1));
            total = order.iter().map(|&i| probs[i]).sum();
        }
        // uniform() is in (0, 1], so u > 0 and the walk always lands on a kept token.
        let u = rng.uniform() * total;
        let mut acc = 0.0;
        let mut pick = order[order.len() - 1];
        for &i in &order {
            acc += probs[i];
            if u <= acc {
                pick = i;
                break;
            }
        }
        pick
    };
    (tok as u32, (logits[tok] as f64 / t - lse) as f32)
}

/// Samples a response to every prompt (see the module docs); `out[i]` answers
/// `prompts[i]`.
pub fn generate(
    model: &Decoder,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
) -> Result<Vec<Generation>, ModelError> {
    cfg.validate(model)?;
    let mut out: Vec<Generation> = prompts
        .iter()
        .map(|_| Generation {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish: Finish::Length,
        })
        .collect();
    if prompts.is_empty() || cfg.max_new_tokens == 0 {
        return Ok(out);
    }
    let mut rng = SplitMix64::new(cfg.seed);
    let (mut session, mut logits) = Session::prefill(model, prompts, cfg.max_new_tokens)?;
    let mut active: Vec<usize> = (0..prompts.len()).collect();
    loop {
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        let mut keep = Vec::with_capacity(active.len());
        let mut next = Vec::with_capacity(active.len());
        for (r, &orig) in active.iter().enumerate() {
            let (tok, lp) = sample_token(&rows[r], cfg, &mut rng);
            let g = &mut out[orig];
            g.tokens.push(tok);
            g.logprobs.push(lp);
            if cfg.stop_token == Some(tok) {
                g.finish = Finish::Stop;
            } else if g.tokens.len() < cfg.max_new_tokens {
                keep.push(r);
                next.push(tok);
            }
        }
        if keep.is_empty() {
            break;
        }
        if keep.len() < active.len() {
            session.retain(&keep)?;
            active = keep.iter().map(|&r| active[r]).collect();
        }
        logits = session.step(&next)?;
    }
    Ok(out)
}
