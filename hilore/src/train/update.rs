//! The actor update: microbatches packed by a token budget, each run under a fidelity
//! plan, seeded with the GRPO coefficients, gradients accumulated over the optimizer step.

use super::optimizer::AdamW;
use super::rollout::Rollout;
use anyhow::Context;
use candle_core::Tensor;
use hilore_models::{Decoder, TokenBatch};
use hilore_runtime::grpo::{
    aggregation_weights, known_before_forward, pack_by_token_budget, CoefficientStats,
    Coefficients, GrpoConfig, Sequences, TokenLogprobs,
};
use hilore_runtime::{Cx, Grads, Plan};
use std::time::Instant;

/// How the update runs.
#[derive(Debug, Clone)]
pub struct UpdateSettings {
    pub grpo: GrpoConfig,
    /// Most rows (tokens) a microbatch's forward may hold.
    pub token_budget: usize,
    /// The fidelity plan every microbatch runs under.
    pub plan: Plan,
    /// Skip the forward and backward of sequences whose exposure is exactly zero
    /// (advantage 0 with `beta = 0`: their gradient is exactly zero in every epoch).
    pub skip_zero_exposure: bool,
}

/// What an update did.
#[derive(Debug, Clone, Default)]
pub struct UpdateReport {
    /// Coefficient statistics over every epoch's tokens.
    pub stats: CoefficientStats,
    /// Gradient norm of the last epoch's step (before clipping).
    pub grad_norm: f64,
    /// Rows through forward and backward, all epochs.
    pub update_tokens: usize,
    /// Sequences (and their rows) not run because their exposure is zero.
    pub skipped_sequences: usize,
    pub skipped_tokens: usize,
    /// Sequences with zero exposure (run or skipped).
    pub zero_exposure_sequences: usize,
    /// Sequences with no response token (nothing to train).
    pub empty_sequences: usize,
    /// Microbatches per epoch.
    pub microbatches: usize,
    /// Highest activation bytes the tape held in any microbatch.
    pub peak_activation_bytes: usize,
    /// Sum of every sequence's exposure in the first epoch, and the largest microbatch's.
    pub exposure_total: f64,
    pub exposure_max_microbatch: f64,
    /// Largest |training-forward log-prob - log-prob recorded while sampling| (first
    /// epoch): the rollout and the update compute the same policy.
    pub logp_mismatch_max: f64,
    /// Wall time of forwards, backwards and optimizer steps.
    pub seconds: f64,
    /// Wall time of the reference model's forwards (for KL), not in `seconds`.
    pub reference_seconds: f64,
}

/// One microbatch: its sequences packed, and where each sequence's target rows are.
pub(crate) struct Micro {
    pub batch: TokenBatch,
    /// `(first row, rows)` of each sequence's trained targets.
    pub targets: Vec<(usize, usize)>,
}

impl Micro {
    /// Packs `seqs[i]` for `i` in `members`, training the targets after the first
    /// `prompt_lens[i]` tokens.
    pub fn new(
        model: &Decoder,
        seqs: &[Vec<u32>],
        prompt_lens: &[usize],
        members: &[usize],
    ) -> anyhow::Result<Self> {
        let picked: Vec<Vec<u32>> = members.iter().map(|&i| seqs[i].clone()).collect();
        let batch =
            TokenBatch::from_sequences(&picked, model.config(), model.head_weight().device())?;
        let mut targets = Vec::with_capacity(members.len());
        let mut row = 0;
        for &i in members {
            let rows = seqs[i].len() - 1;
            targets.push((row + prompt_lens[i] - 1, seqs[i].len() - prompt_lens[i]));
            row += rows;
        }
        Ok(Micro { batch, targets })
    }

    /// The trained targets' values of a per-row vector, sequence after sequence.
    pub fn gather(&self, rows: &[f32]) -> Vec<f32> {
        let mut out = Vec::new();
        for &(s, n) in &self.targets {
            out.extend_from_slice(&rows[s..s + n]);
        }
        out
    }

    /// A per-row seed: `per_target` at the trained targets, 0 elsewhere (prompt rows).
    pub fn seed(&self, per_target: &[f32]) -> anyhow::Result<Tensor> {
        let n = self.batch.num_tokens();
        let mut v = vec![0f32; n];
        let mut k = 0;
        for &(s, len) in &self.targets {
            v[s..s + len].copy_from_slice(&per_target[k..k + len]);
            k += len;
        }
        Ok(Tensor::from_vec(v, n, self.batch.inputs.device())?)
    }
}

/// `mu` epochs over the rollout's sequences, one optimizer step per epoch.
pub fn actor_update(
    model: &mut Decoder,
    reference: Option<&Decoder>,
    opt: &mut AdamW,
    r: &Rollout,
    advantages: &[f32],
    s: &UpdateSettings,
) -> anyhow::Result<UpdateReport> {
    let n = r.seqs.len();
    let cfg = s.grpo;
    let weights = aggregation_weights(&r.response_lens, cfg.aggregation);
    let mut rep = UpdateReport::default();
    // With beta = 0 the coefficient is proportional to the advantage in every epoch.
    let zero_exposure: Vec<bool> = (0..n)
        .map(|i| r.response_lens[i] == 0 || (cfg.beta == 0.0 && advantages[i] == 0.0))
        .collect();
    let mut members = Vec::with_capacity(n);
    for i in 0..n {
        rep.zero_exposure_sequences += zero_exposure[i] as usize;
        if r.response_lens[i] == 0 {
            rep.empty_sequences += 1;
        } else if s.skip_zero_exposure && zero_exposure[i] {
            rep.skipped_sequences += 1;
            rep.skipped_tokens += r.seqs[i].len() - 1;
        } else {
            members.push(i);
        }
    }
    let rows: Vec<usize> = members.iter().map(|&i| r.seqs[i].len() - 1).collect();
    let packs = pack_by_token_budget(&rows, s.token_budget)
        .context("packing the actor update's microbatches")?;
    let packs: Vec<Vec<usize>> = packs
        .into_iter()
        .map(|p| p.into_iter().map(|k| members[k]).collect())
        .collect();
    rep.microbatches = packs.len();
    let mut old: Vec<Vec<f32>> = vec![Vec::new(); n];
    let mut refl: Vec<Vec<f32>> = vec![Vec::new(); n];
    let t0 = Instant::now();
    for epoch in 0..cfg.epochs {
        let mut grads = Grads::new();
        let m: &Decoder = model;
        for pack in &packs {
            let micro = Micro::new(m, &r.seqs, &r.prompt_lens, pack)?;
            let lengths: Vec<usize> = pack.iter().map(|&i| r.response_lens[i]).collect();
            let adv: Vec<f32> = pack.iter().map(|&i| advantages[i]).collect();
            let w: Vec<f32> = pack.iter().map(|&i| weights[i]).collect();
            let seqs = Sequences {
                lengths: &lengths,
                advantages: &adv,
                weights: &w,
            };
            // Before the forward: the coefficients when they are already known (first
            // epoch, no KL), hence the microbatch's exposure.
            let pre = if known_before_forward(&cfg, epoch) {
                Some(Coefficients::before_forward(&cfg, seqs)?)
            } else {
                None
            };
            let mut cx = Cx::new(s.plan.clone());
            let logp = m.token_logprobs(&mut cx, &micro.batch)?;
            let cur = micro.gather(&logp.tensor().to_vec1::<f32>()?);
            if epoch == 0 {
                let mut k = 0;
                for &i in pack {
                    let l = r.response_lens[i];
                    for (a, b) in cur[k..k + l].iter().zip(&r.sampled_logp[i]) {
                        rep.logp_mismatch_max = rep.logp_mismatch_max.max((a - b).abs() as f64);
                    }
                    if cfg.epochs > 1 {
                        old[i] = cur[k..k + l].to_vec();
                    }
                    k += l;
                }
                if let Some(rm) = reference {
                    let tr = Instant::now();
                    let mut rcx = Cx::inference();
                    let rl = micro.gather(
                        &rm.token_logprobs(&mut rcx, &micro.batch)?
                            .tensor()
                            .to_vec1::<f32>()?,
                    );
                    let mut k = 0;
                    for &i in pack {
                        let l = r.response_lens[i];
                        refl[i] = rl[k..k + l].to_vec();
                        k += l;
                    }
                    rep.reference_seconds += tr.elapsed().as_secs_f64();
                }
            }
            let old_flat: Vec<f32> = pack.iter().flat_map(|&i| old[i].iter().copied()).collect();
            let ref_flat: Vec<f32> = pack.iter().flat_map(|&i| refl[i].iter().copied()).collect();
            // After the forward: the coefficients from the current log-probs (the same
            // numbers as `pre` when that exists; computed anyway for the statistics).
            let post = Coefficients::after_forward(
                &cfg,
                seqs,
                TokenLogprobs {
                    logp: &cur,
                    old: (epoch > 0).then_some(old_flat.as_slice()),
                    reference: reference.map(|_| ref_flat.as_slice()),
                },
            )?;
            rep.stats.merge(&post.stats);
            let coeffs = pre.unwrap_or(post);
            if epoch == 0 {
                let e = coeffs.exposure();
                rep.exposure_total += e;
                rep.exposure_max_microbatch = rep.exposure_max_microbatch.max(e);
            }
            let seed = micro.seed(&coeffs.per_token)?;
            cx.backward(&logp, &seed, &mut grads)?;
            rep.peak_activation_bytes = rep.peak_activation_bytes.max(cx.memory().peak_bytes());
            rep.update_tokens += micro.batch.num_tokens();
        }
        let info = opt.step(model, &grads)?;
        rep.grad_norm = info.grad_norm;
    }
    rep.seconds = t0.elapsed().as_secs_f64() - rep.reference_seconds;
    Ok(rep)
}
