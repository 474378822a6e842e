//! The actor update: microbatches packed by a token budget, each run under a fidelity
//! plan, seeded with the GRPO coefficients, gradients accumulated over the optimizer step.

use super::optimizer::AdamW;
use super::rollout::Rollout;
use super::ActorModel;
use anyhow::Context;
use candle_core::Tensor;
use hilore_models::{PromptGroup, TokenBatch};
use hilore_runtime::allocator::{
    MicrobatchInput, MicrobatchShape, OnlineAllocator, PassResult, Workload,
};
use hilore_runtime::grpo::{
    aggregation_weights_layout, known_before_forward, pack_by_token_budget, CoefficientStats,
    Coefficients, GrpoConfig, Sequences, StepLayout, TokenLogprobs,
};
use hilore_runtime::{Cx, Fidelity, Grads, Plan};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

/// Microbatches planned by the allocator are padded to a multiple of this many rows, so
/// that a few sizes (each profiled once) cover every microbatch and the planned peaks are
/// exact.
const PAD_QUANTUM: usize = 128;

/// How the update runs.
#[derive(Debug, Clone)]
pub struct UpdateSettings {
    pub grpo: GrpoConfig,
    /// How the rollout's sequences make loss microbatches and optimizer steps (TRL's
    /// `gradient_accumulation_steps`, `steps_per_generation`): each epoch runs
    /// `layout.steps()` optimizer steps over consecutive slices of the rollout.
    pub layout: StepLayout,
    /// Most rows (tokens) a microbatch's forward may hold.
    pub token_budget: usize,
    /// The fidelity plan every microbatch runs under.
    pub plan: Plan,
    /// Skip the forward and backward of sequences whose exposure is exactly zero
    /// (advantage 0 with `beta = 0`: their gradient is exactly zero in every epoch).
    pub skip_zero_exposure: bool,
    /// HiLoRe (`--policy hilore`): plans every microbatch of a step from measured costs
    /// and the step's exposures, under the memory budget, whenever the coefficients are
    /// known before the forward; `plan` is used otherwise.
    pub allocator: Option<Rc<RefCell<OnlineAllocator>>>,
    /// Shared prefixes (`--shared-prefix`): a microbatch holds each prompt once with the
    /// responses of it that it packs ([`Micro::shared`]); the model must implement
    /// [`ActorModel::shared_batch`].
    pub shared_prefix: bool,
}

/// What an update did.
#[derive(Debug, Clone, Default)]
pub struct UpdateReport {
    /// Coefficient statistics over every epoch's tokens.
    pub stats: CoefficientStats,
    /// Gradient norm of the last optimizer step (before clipping).
    pub grad_norm: f64,
    /// Optimizer steps taken (epochs x steps per rollout).
    pub optimizer_steps: usize,
    /// Microbatches the allocator planned before their forward (`--policy hilore`, where
    /// the coefficients are known then: the rollout's first optimizer step, no KL); the
    /// others ran under the fallback plan.
    pub planned_microbatches: usize,
    /// The trained sequences' rows through forward and backward, all epochs, counted as
    /// if unshared and without padding, so that throughputs compare across layouts.
    pub update_tokens: usize,
    /// Sequences (and their rows) not run because their exposure is zero.
    pub skipped_sequences: usize,
    pub skipped_tokens: usize,
    /// Sequences with zero exposure (run or skipped).
    pub zero_exposure_sequences: usize,
    /// Sequences with no response token (nothing to train).
    pub empty_sequences: usize,
    /// Memory microbatches per epoch (over all its optimizer steps).
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
    /// Unit instances run under each fidelity, over every microbatch and epoch.
    pub fidelities: FidelityCounts,
}

/// How many unit instances ran under each fidelity. An instance inside a recomputed one
/// counts as recomputed (its saved state is dropped with its parent's); otherwise its own
/// fidelity counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FidelityCounts {
    pub store: usize,
    pub compress: usize,
    pub recompute: usize,
}

impl FidelityCounts {
    /// The counts of one forward's unit instances ([`Cx::unit_instances`]).
    pub fn of(instances: &[hilore_runtime::UnitInstanceInfo]) -> Self {
        let mut recomputed = vec![false; instances.len()];
        let mut c = FidelityCounts::default();
        for (i, u) in instances.iter().enumerate() {
            // Parents open before their children, so `recomputed[p]` is already known.
            recomputed[i] =
                u.fidelity == Fidelity::Recompute || u.parent.is_some_and(|p| recomputed[p]);
            if recomputed[i] {
                c.recompute += 1;
            } else if u.fidelity.is_compress() {
                c.compress += 1;
            } else {
                c.store += 1;
            }
        }
        c
    }

    fn add(&mut self, o: FidelityCounts) {
        self.store += o.store;
        self.compress += o.compress;
        self.recompute += o.recompute;
    }
}

/// Prompt rows of a shared-prefix microbatch are padded to a multiple of this many rows
/// where its padding allows: the allocator's byte figures are exact per profile key (rows,
/// prompt rows and log-probs, [`MicrobatchShape::profile_key`]), so a few keys, each profiled once,
/// then cover the microbatches of a run, and a step's plans share their allocators'
/// simulations.
pub const PROMPT_ROW_QUANTUM: usize = 64;

/// The log-probs of a padded shared-prefix microbatch are padded to a multiple of this
/// many (by one-token responses of the padding prompt, which add a log-prob and no row):
/// the head saves what it computes per log-prob, so the count is part of the profile key
/// too.
pub const LOGPROB_QUANTUM: usize = 16;

/// The padding groups of `pad` rows for a shared-prefix microbatch whose prompts hold
/// `prompts` rows and which computes `logprobs` log-probs, none longer than `longest` rows
/// (the longest member's, so each fits the model's positions as it does; a token of 0
/// each). Where the padding allows, the first group's prompt takes the prompt rows to a
/// multiple of [`PROMPT_ROW_QUANTUM`] and its responses (each continuing it) hold the rest
/// of `pad`; otherwise every padding row is a prompt's ([`pad_pieces`], each with a
/// one-token response: no rows of its own). The last group then gets one-token responses
/// until the log-probs are a multiple of [`LOGPROB_QUANTUM`].
pub fn padding_groups(
    pad: usize,
    prompts: usize,
    logprobs: usize,
    longest: usize,
) -> Vec<PromptGroup> {
    if pad == 0 {
        return Vec::new();
    }
    let mut groups = padding_rows(pad, prompts, longest);
    let added: usize = groups.iter().map(PromptGroup::num_logprobs).sum();
    let extra = (LOGPROB_QUANTUM - (logprobs + added) % LOGPROB_QUANTUM) % LOGPROB_QUANTUM;
    if let Some(last) = groups.last_mut() {
        last.responses.extend(std::iter::repeat_n(vec![0], extra));
    }
    groups
}

/// [`padding_groups`]' rows.
fn padding_rows(pad: usize, prompts: usize, longest: usize) -> Vec<PromptGroup> {
    let c = PROMPT_ROW_QUANTUM - prompts % PROMPT_ROW_QUANTUM;
    if c <= pad && c < longest {
        // Responses of at most `longest - c` rows: positions up to `longest - 1`.
        let per = longest - c;
        let rest = pad - c;
        let mut responses: Vec<Vec<u32>> = vec![vec![0; per + 1]; rest / per];
        if rest % per > 0 || rest == 0 {
            responses.push(vec![0; rest % per + 1]);
        }
        return vec![PromptGroup {
            prompt: vec![0; c],
            responses,
        }];
    }
    pad_pieces(pad, std::iter::once(longest))
        .into_iter()
        .map(|c| PromptGroup {
            prompt: vec![0; c],
            responses: vec![vec![0]],
        })
        .collect()
}

/// `pad` rows of padding as pieces of at most the longest member's rows (`member_rows`):
/// each piece then fits the model's positions as that member does (one piece of `pad`
/// could exceed them, a quantum being larger than a model's context).
fn pad_pieces(pad: usize, member_rows: impl Iterator<Item = usize>) -> Vec<usize> {
    let most = member_rows.max().unwrap_or(pad).max(1);
    let mut out = vec![most; pad / most];
    if pad % most > 0 {
        out.push(pad % most);
    }
    out
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
    pub fn new<M: ActorModel>(
        model: &M,
        seqs: &[Vec<u32>],
        prompt_lens: &[usize],
        members: &[usize],
    ) -> anyhow::Result<Self> {
        let picked: Vec<Vec<u32>> = members.iter().map(|&i| seqs[i].clone()).collect();
        let batch = model.batch(&picked)?;
        let mut targets = Vec::with_capacity(members.len());
        let mut row = 0;
        for &i in members {
            let rows = seqs[i].len() - 1;
            targets.push((row + prompt_lens[i] - 1, seqs[i].len() - prompt_lens[i]));
            row += rows;
        }
        Ok(Micro { batch, targets })
    }

    /// [`Micro::new`], padded with untrained sequences to a multiple of `quantum` rows
    /// (its rows get coefficient 0, so the gradient is unchanged).
    pub fn padded<M: ActorModel>(
        model: &M,
        seqs: &[Vec<u32>],
        prompt_lens: &[usize],
        members: &[usize],
        quantum: usize,
    ) -> anyhow::Result<Self> {
        let rows: usize = members.iter().map(|&i| seqs[i].len() - 1).sum();
        let pad = rows.div_ceil(quantum) * quantum - rows;
        if pad == 0 {
            return Self::new(model, seqs, prompt_lens, members);
        }
        let mut picked: Vec<Vec<u32>> = members.iter().map(|&i| seqs[i].clone()).collect();
        for rows in pad_pieces(pad, members.iter().map(|&i| seqs[i].len() - 1)) {
            picked.push(vec![0; rows + 1]);
        }
        let batch = model.batch(&picked)?;
        let mut targets = Vec::with_capacity(members.len());
        let mut row = 0;
        for &i in members {
            targets.push((row + prompt_lens[i] - 1, seqs[i].len() - prompt_lens[i]));
            row += seqs[i].len() - 1;
        }
        Ok(Micro { batch, targets })
    }

    /// Packs `seqs[i]` for `i` in `members` with shared prefixes: consecutive members with
    /// the same prompt make one [`PromptGroup`] (the prompt's rows once, each response
    /// continuing it), trained on each response's tokens; with `quantum`, padded by
    /// untrained groups to a multiple of `quantum` rows. A prompt whose responses the
    /// packer spread over several microbatches is held once in each of them.
    pub fn shared<M: ActorModel>(
        model: &M,
        seqs: &[Vec<u32>],
        prompt_lens: &[usize],
        members: &[usize],
        quantum: Option<usize>,
    ) -> anyhow::Result<Self> {
        let mut groups: Vec<PromptGroup> = Vec::new();
        let mut targets = Vec::with_capacity(members.len());
        // The next log-prob's index and the rows so far.
        let (mut at, mut rows) = (0, 0);
        for &i in members {
            let p = prompt_lens[i];
            anyhow::ensure!(
                p >= 1 && p < seqs[i].len(),
                "sequence {i}: a prompt of {p} tokens in a sequence of {}; a shared-prefix microbatch needs a prompt and a response of at least 1 token each",
                seqs[i].len()
            );
            let (prompt, response) = seqs[i].split_at(p);
            match groups.last_mut() {
                Some(g) if g.prompt == prompt => g.responses.push(response.to_vec()),
                _ => {
                    groups.push(PromptGroup {
                        prompt: prompt.to_vec(),
                        responses: vec![response.to_vec()],
                    });
                    at += p - 1;
                    rows += p;
                }
            }
            targets.push((at, response.len()));
            at += response.len();
            rows += response.len() - 1;
        }
        if let Some(q) = quantum {
            let pad = rows.div_ceil(q) * q - rows;
            let longest = members
                .iter()
                .map(|&i| seqs[i].len() - 1)
                .max()
                .unwrap_or(pad);
            let prompts: usize = groups.iter().map(|g| g.prompt.len()).sum();
            groups.extend(padding_groups(pad, prompts, at, longest.max(1)));
        }
        let batch = model.shared_batch(&groups)?;
        Ok(Micro { batch, targets })
    }

    /// The microbatch of `members` in the update's layout: [`Micro::shared`] with shared
    /// prefixes, else [`Micro::padded`] with a `quantum`, [`Micro::new`] without.
    pub fn of<M: ActorModel>(
        model: &M,
        r: &Rollout,
        members: &[usize],
        shared_prefix: bool,
        quantum: Option<usize>,
    ) -> anyhow::Result<Self> {
        let (seqs, prompt_lens) = (&r.seqs, &r.prompt_lens);
        match (shared_prefix, quantum) {
            (true, q) => Self::shared(model, seqs, prompt_lens, members, q),
            (false, Some(q)) => Self::padded(model, seqs, prompt_lens, members, q),
            (false, None) => Self::new(model, seqs, prompt_lens, members),
        }
    }

    /// The trained targets' values of a per-row vector, sequence after sequence.
    pub fn gather(&self, rows: &[f32]) -> Vec<f32> {
        let mut out = Vec::new();
        for &(s, n) in &self.targets {
            out.extend_from_slice(&rows[s..s + n]);
        }
        out
    }

    /// A per-log-prob seed: `per_target` at the trained targets, 0 elsewhere (prompt
    /// tokens, padding).
    pub fn seed(&self, per_target: &[f32]) -> anyhow::Result<Tensor> {
        let n = self.batch.num_logprobs();
        let mut v = vec![0f32; n];
        let mut k = 0;
        for &(s, len) in &self.targets {
            v[s..s + len].copy_from_slice(&per_target[k..k + len]);
            k += len;
        }
        Ok(Tensor::from_vec(v, n, self.batch.inputs.device())?)
    }
}

/// One step's microbatches of a model as the allocator sees them: a [`Workload`] for
/// [`OnlineAllocator::plan_step`] from any [`ActorModel`], its batches and their seeds
/// (dL/dlogp per row: the GRPO coefficients at trained rows, 0 elsewhere), so a training
/// loop of one's own plans its steps without writing the profiling and calibration
/// passes. The actor update uses it too.
///
/// ```no_run
/// # use hilore::train::{ActorModel, update::TapeWorkload};
/// # use hilore_runtime::allocator::OnlineAllocator;
/// # use hilore_runtime::Grads;
/// # fn f<M: ActorModel>(model: &M, alloc: &mut OnlineAllocator,
/// #     data: Vec<(hilore_models::TokenBatch, candle_core::Tensor)>) -> anyhow::Result<()> {
/// let mut work = TapeWorkload::new(model);
/// for (batch, seed) in data {
///     work.push(batch, seed)?;
/// }
/// let step = alloc.plan_step(&mut work)?;
/// let mut grads = Grads::new();
/// for (i, d) in step.decisions.iter().enumerate() {
///     let peak = work.run_into(i, &d.plan, &mut grads)?;
///     assert_eq!(peak, d.predicted_peak_bytes);
/// }
/// # Ok(()) }
/// ```
pub struct TapeWorkload<'a, M> {
    model: &'a M,
    items: Vec<(TokenBatch, Tensor, MicrobatchInput)>,
}

impl<'a, M: ActorModel> TapeWorkload<'a, M> {
    /// No microbatches yet.
    pub fn new(model: &'a M) -> Self {
        TapeWorkload {
            model,
            items: Vec::new(),
        }
    }

    /// Adds a microbatch: its batch and its seed (`f32 [M]`, dL/dlogp of every log-prob
    /// of the batch, one per row unless it has shared prefixes, 0 where nothing is
    /// trained). Its exposure is the seed's L2 norm.
    pub fn push(&mut self, batch: TokenBatch, seed: Tensor) -> anyhow::Result<()> {
        let rows = batch.num_logprobs();
        anyhow::ensure!(
            seed.dims() == [rows],
            "TapeWorkload::push: the seed is {:?}, the batch has {rows} log-probs; give one dL/dlogp per log-prob ([{rows}], 0 on untrained ones)",
            seed.dims()
        );
        let v = seed.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
        let exposure = v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        self.push_with_exposure(batch, seed, exposure);
        Ok(())
    }

    /// [`TapeWorkload::push`] with the exposure already known (the actor update's, from
    /// its coefficients).
    pub(crate) fn push_with_exposure(&mut self, batch: TokenBatch, seed: Tensor, exposure: f64) {
        let input = MicrobatchInput {
            shape: MicrobatchShape::of(&batch.packing).with_logprobs(batch.num_logprobs()),
            exposure,
        };
        self.items.push((batch, seed, input));
    }

    /// Microbatch `i`'s batch.
    pub fn batch(&self, i: usize) -> &TokenBatch {
        &self.items[i].0
    }

    /// Microbatch `i`'s seed.
    pub fn seed(&self, i: usize) -> &Tensor {
        &self.items[i].1
    }

    /// Forward and backward of microbatch `i` under `plan`, its gradients added into
    /// `grads`; returns the activation ledger's measured peak (what the allocator's
    /// decision predicted).
    pub fn run_into(
        &self,
        i: usize,
        plan: &Plan,
        grads: &mut Grads,
    ) -> hilore_runtime::Result<usize> {
        let mut cx = Cx::new(plan.clone());
        self.forward_backward(i, &mut cx, grads)?;
        Ok(cx.memory().peak_bytes())
    }

    /// Forward and backward of microbatch `i` on `cx`, into `grads`; the forward's
    /// seconds.
    fn forward_backward(
        &self,
        i: usize,
        cx: &mut Cx<'a>,
        grads: &mut Grads,
    ) -> hilore_runtime::Result<f64> {
        let (batch, seed, _) = &self.items[i];
        let t0 = Instant::now();
        let logp = self.model.token_logprobs(cx, batch)?;
        let fwd = t0.elapsed().as_secs_f64();
        cx.backward(&logp, seed, grads)?;
        Ok(fwd)
    }

    fn pass(&self, i: usize, cx: &mut Cx<'a>) -> hilore_runtime::Result<(Grads, f64)> {
        let mut g = Grads::new();
        let fwd = self.forward_backward(i, cx, &mut g)?;
        Ok((g, fwd))
    }
}

impl<M: ActorModel> Workload for TapeWorkload<'_, M> {
    fn len(&self) -> usize {
        self.items.len()
    }

    fn input(&self, i: usize) -> MicrobatchInput {
        self.items[i].2
    }

    fn profile(
        &mut self,
        i: usize,
    ) -> hilore_runtime::Result<(
        hilore_runtime::Profile,
        Vec<hilore_runtime::UnitInstanceInfo>,
    )> {
        let mut cx = Cx::new(Plan::store_all()).profiling(true);
        self.pass(i, &mut cx)?;
        Ok((cx.profile()?, cx.unit_instances()))
    }

    fn run(&mut self, i: usize, plan: &Plan) -> hilore_runtime::Result<PassResult> {
        let mut cx = Cx::new(plan.clone());
        let (g, fwd) = self.pass(i, &mut cx)?;
        let mut grads = Vec::new();
        for (_, p) in self.model.named_params() {
            if let Some(t) = g.get(p.id()) {
                grads.extend(t.flatten_all()?.to_vec1::<f32>()?);
            }
        }
        Ok(PassResult {
            grads,
            times: cx.times().clone(),
            forward_seconds: fwd,
        })
    }
}

/// Which sequences the update runs, packed into microbatches (counting the others in
/// `rep`).
fn select_and_pack(
    r: &Rollout,
    advantages: &[f32],
    s: &UpdateSettings,
    sequences: std::ops::Range<usize>,
    rep: &mut UpdateReport,
) -> anyhow::Result<Vec<Vec<usize>>> {
    // With beta = 0 the coefficient is proportional to the advantage in every epoch.
    let beta0 = s.grpo.beta == 0.0;
    let mut members = Vec::with_capacity(sequences.len());
    for i in sequences {
        let (len, a) = (r.response_lens[i], advantages[i]);
        let zero_exposure = len == 0 || (beta0 && a == 0.0);
        rep.zero_exposure_sequences += zero_exposure as usize;
        if len == 0 {
            rep.empty_sequences += 1;
        } else if s.skip_zero_exposure && zero_exposure {
            rep.skipped_sequences += 1;
            rep.skipped_tokens += r.seqs[i].len() - 1;
        } else {
            members.push(i);
        }
    }
    if s.shared_prefix {
        return pack_shared_prefixes(r, &members, s.token_budget)
            .context("packing the actor update's microbatches");
    }
    let rows: Vec<usize> = members.iter().map(|&i| r.seqs[i].len() - 1).collect();
    let packs = pack_by_token_budget(&rows, s.token_budget)
        .context("packing the actor update's microbatches")?;
    Ok(packs
        .into_iter()
        .map(|p| p.into_iter().map(|k| members[k]).collect())
        .collect())
}

/// `members` in order into microbatches of at most `budget` rows, counting a prompt's rows
/// once per microbatch ([`Micro::shared`]): a response that follows another of the same
/// prompt in its microbatch adds its own rows only. A group that does not fit continues in
/// the next microbatch, which holds the prompt again: splitting a group costs one more
/// copy of its prompt, while keeping it whole would leave a microbatch under-filled or
/// exceed the budget.
fn pack_shared_prefixes(
    r: &Rollout,
    members: &[usize],
    budget: usize,
) -> anyhow::Result<Vec<Vec<usize>>> {
    anyhow::ensure!(
        budget > 0,
        "microbatch token budget is 0; it must hold at least one whole sequence"
    );
    let prompt = |i: usize| &r.seqs[i][..r.prompt_lens[i]];
    let (mut out, mut cur, mut used): (Vec<Vec<usize>>, Vec<usize>, usize) =
        (Vec::new(), Vec::new(), 0);
    for &i in members {
        let full = r.seqs[i].len() - 1;
        anyhow::ensure!(
            full <= budget,
            "sequence {i} has {full} tokens, more than the microbatch token budget of {budget}; raise the budget to at least {full} or lower the maximum prompt + response length"
        );
        let continues = cur.last().is_some_and(|&j| prompt(j) == prompt(i));
        let cost = if continues {
            r.response_lens[i] - 1
        } else {
            full
        };
        if used + cost > budget && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
            used = full;
        } else {
            used += cost;
        }
        cur.push(i);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    Ok(out)
}

/// Log-probs an epoch needs from earlier ones: the first epoch's training log-probs (the
/// old policy of later epochs) and the reference policy's, per sequence.
struct EpochMemory {
    old: Vec<Vec<f32>>,
    reference: Vec<Vec<f32>>,
}

/// One optimizer step's forwards and backwards over `packs`: the accumulated gradients.
/// `update` counts the optimizer steps since the rollout (epoch x steps per rollout +
/// step); `first_visit` is true in the first epoch, when these sequences' reference
/// log-probs (and, for the rollout's first step, their old log-probs) are recorded.
#[allow(clippy::too_many_arguments)]
fn epoch_grads<M: ActorModel>(
    m: &M,
    reference: Option<&M>,
    r: &Rollout,
    advantages: &[f32],
    weights: &[f32],
    packs: &[Vec<usize>],
    update: usize,
    first_visit: bool,
    s: &UpdateSettings,
    mem: &mut EpochMemory,
    rep: &mut UpdateReport,
) -> anyhow::Result<EpochGrads> {
    let cfg = s.grpo;
    let mut grads = Grads::new();
    // HiLoRe: with the coefficients known before the forward, plan the whole step.
    let planned = match &s.allocator {
        Some(alloc) if known_before_forward(&cfg, update) => {
            let mut wl = TapeWorkload::new(m);
            let mut targets = Vec::with_capacity(packs.len());
            for pack in packs {
                let micro = Micro::of(m, r, pack, s.shared_prefix, Some(PAD_QUANTUM))?;
                let lengths: Vec<usize> = pack.iter().map(|&i| r.response_lens[i]).collect();
                let adv: Vec<f32> = pack.iter().map(|&i| advantages[i]).collect();
                let w: Vec<f32> = pack.iter().map(|&i| weights[i]).collect();
                let c = Coefficients::before_forward(
                    &cfg,
                    Sequences {
                        lengths: &lengths,
                        advantages: &adv,
                        weights: &w,
                    },
                )?;
                let seed = micro.seed(&c.per_token)?;
                wl.push_with_exposure(micro.batch, seed, c.exposure());
                targets.push(micro.targets);
            }
            let step = alloc.borrow_mut().plan_step(&mut wl)?;
            rep.planned_microbatches += packs.len();
            let micros: Vec<(Micro, MicrobatchInput)> = wl
                .items
                .into_iter()
                .zip(targets)
                .map(|((batch, _, input), targets)| (Micro { batch, targets }, input))
                .collect();
            Some((micros, step.decisions))
        }
        _ => None,
    };
    let mut planned_micros = planned.as_ref().map(|(ms, _)| ms.iter());
    for (k, pack) in packs.iter().enumerate() {
        let micro = match planned_micros.as_mut().and_then(|it| it.next()) {
            Some((mi, _)) => Micro {
                batch: mi.batch.clone(),
                targets: mi.targets.clone(),
            },
            None => Micro::of(m, r, pack, s.shared_prefix, None)?,
        };
        let lengths: Vec<usize> = pack.iter().map(|&i| r.response_lens[i]).collect();
        let adv: Vec<f32> = pack.iter().map(|&i| advantages[i]).collect();
        let w: Vec<f32> = pack.iter().map(|&i| weights[i]).collect();
        let seqs = Sequences {
            lengths: &lengths,
            advantages: &adv,
            weights: &w,
        };
        // Before the forward: the coefficients when they are already known (the first
        // optimizer step since the rollout, no KL), hence the microbatch's exposure.
        let pre = if known_before_forward(&cfg, update) {
            Some(Coefficients::before_forward(&cfg, seqs)?)
        } else {
            None
        };
        let plan = match &planned {
            Some((_, decisions)) => decisions[k].plan.clone(),
            None => s.plan.clone(),
        };
        let mut cx = Cx::new(plan);
        let logp = m.token_logprobs(&mut cx, &micro.batch)?;
        rep.fidelities.add(FidelityCounts::of(&cx.unit_instances()));
        let cur = micro.gather(&logp.tensor().to_vec1::<f32>()?);
        let mut at = 0;
        for &i in pack {
            let l = r.response_lens[i];
            if let Some(t) = cur[at..at + l].iter().position(|x| !x.is_finite()) {
                let group = r.seqs.len() / r.examples.len().max(1);
                anyhow::bail!(
                    "response {i} (prompt {}, sample {}): the policy's log-prob of its token {t} is {}; the policy has diverged (lower --lr) or its weights are damaged",
                    i / group.max(1),
                    i % group.max(1),
                    cur[at + t]
                );
            }
            at += l;
        }
        if update == 0 {
            // The policy that sampled: its log-probs are the old ones of later steps.
            let mut k = 0;
            for &i in pack {
                let l = r.response_lens[i];
                for (a, b) in cur[k..k + l].iter().zip(&r.sampled_logp[i]) {
                    rep.logp_mismatch_max = rep.logp_mismatch_max.max((a - b).abs() as f64);
                }
                if cfg.epochs > 1 {
                    mem.old[i] = cur[k..k + l].to_vec();
                }
                k += l;
            }
        }
        if first_visit {
            if let Some(rm) = reference {
                let tr = Instant::now();
                let mut rcx = Cx::inference();
                let rl = rm.token_logprobs(&mut rcx, &micro.batch)?;
                let rl = micro.gather(&rl.tensor().to_vec1::<f32>()?);
                let mut k = 0;
                for &i in pack {
                    let l = r.response_lens[i];
                    mem.reference[i] = rl[k..k + l].to_vec();
                    k += l;
                }
                rep.reference_seconds += tr.elapsed().as_secs_f64();
            }
        }
        let old: Vec<f32> = pack
            .iter()
            .flat_map(|&i| mem.old[i].iter().copied())
            .collect();
        let refl: Vec<f32> = pack
            .iter()
            .flat_map(|&i| mem.reference[i].iter().copied())
            .collect();
        // After the forward: the coefficients from the current log-probs (the same
        // numbers as `pre` when that exists; computed anyway for the statistics).
        let post = Coefficients::after_forward(
            &cfg,
            seqs,
            TokenLogprobs {
                logp: &cur,
                old: (update > 0).then_some(old.as_slice()),
                reference: reference.map(|_| refl.as_slice()),
            },
        )?;
        rep.stats.merge(&post.stats);
        let coeffs = pre.unwrap_or(post);
        if first_visit {
            let e = coeffs.exposure();
            rep.exposure_total += e;
            rep.exposure_max_microbatch = rep.exposure_max_microbatch.max(e);
        }
        let seed = micro.seed(&coeffs.per_token)?;
        cx.backward(&logp, &seed, &mut grads)?;
        if let (Some(alloc), Some((_, decisions))) = (&s.allocator, &planned) {
            alloc.borrow_mut().observe(&decisions[k], cx.times());
        }
        rep.peak_activation_bytes = rep.peak_activation_bytes.max(cx.memory().peak_bytes());
        // The sequences' rows as if unshared, padding excluded: the same count in either
        // layout, so that throughputs compare.
        rep.update_tokens += pack.iter().map(|&i| r.seqs[i].len() - 1).sum::<usize>();
    }
    let planned_exposures = planned
        .as_ref()
        .map(|(micros, _)| micros.iter().map(|(_, i)| i.exposure).collect());
    Ok(EpochGrads {
        grads,
        planned_exposures,
    })
}

/// One epoch's accumulated gradients, and the microbatches' exposures when the allocator
/// planned the step.
struct EpochGrads {
    grads: Grads,
    planned_exposures: Option<Vec<f64>>,
}

/// `mu` epochs over the rollout's sequences, one optimizer step per epoch.
pub fn actor_update<M: ActorModel>(
    model: &mut M,
    reference: Option<&M>,
    opt: &mut AdamW,
    r: &Rollout,
    advantages: &[f32],
    s: &UpdateSettings,
) -> anyhow::Result<UpdateReport> {
    let n = r.seqs.len();
    let layout = s.layout;
    if layout.batch_size * layout.steps_per_generation != n {
        anyhow::bail!(
            "the rollout has {n} sequences but the step layout expects {} ({} loss microbatches of {})",
            layout.batch_size * layout.steps_per_generation,
            layout.steps_per_generation,
            layout.batch_size
        );
    }
    let weights = aggregation_weights_layout(
        &r.response_lens,
        s.grpo
            .mask_truncated_completions
            .then_some(r.truncated.as_slice()),
        s.grpo.aggregation,
        layout,
    );
    let mut rep = UpdateReport::default();
    let per_step = layout.sequences_per_step();
    let steps = layout.steps();
    let mut packs = Vec::with_capacity(steps);
    for k in 0..steps {
        packs.push(select_and_pack(
            r,
            advantages,
            s,
            k * per_step..(k + 1) * per_step,
            &mut rep,
        )?);
    }
    rep.microbatches = packs.iter().map(|p| p.len()).sum();
    let mut mem = EpochMemory {
        old: vec![Vec::new(); n],
        reference: vec![Vec::new(); n],
    };
    let t0 = Instant::now();
    if steps > 1 {
        // Steps after the first see a moved policy, so their old log-probs (the
        // sampling policy's) are taken now, before the first optimizer step, as TRL
        // takes them at generation.
        for pack in packs.iter().skip(1).flatten() {
            let micro = Micro::of(model, r, pack, s.shared_prefix, None)?;
            let mut cx = Cx::inference();
            let lp = model.token_logprobs(&mut cx, &micro.batch)?;
            let lp = micro.gather(&lp.tensor().to_vec1::<f32>()?);
            let mut k = 0;
            for &i in pack {
                let l = r.response_lens[i];
                mem.old[i] = lp[k..k + l].to_vec();
                k += l;
            }
        }
    }
    for epoch in 0..s.grpo.epochs {
        for (k, step_packs) in packs.iter().enumerate() {
            let e = epoch_grads(
                model,
                reference,
                r,
                advantages,
                &weights,
                step_packs,
                epoch * steps + k,
                epoch == 0,
                s,
                &mut mem,
                &mut rep,
            )?;
            rep.grad_norm = opt.step(model, &e.grads)?.grad_norm;
            rep.optimizer_steps += 1;
            if let (Some(alloc), Some(exposures)) = (&s.allocator, &e.planned_exposures) {
                // The step's gradient norm (before clipping) refines the allocator's
                // gradient-norm scale.
                alloc
                    .borrow_mut()
                    .observe_step_gradient(rep.grad_norm, exposures);
            }
        }
    }
    rep.seconds = t0.elapsed().as_secs_f64() - rep.reference_seconds;
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first epoch's gradients of every sequence of `r` under `s`: its packs and its
    /// report too.
    fn first_epoch(
        model: &Decoder,
        r: &Rollout,
        adv: &[f32],
        weights: &[f32],
        s: &UpdateSettings,
    ) -> (Grads, Vec<Vec<usize>>, UpdateReport) {
        let n = r.seqs.len();
        let mut rep = UpdateReport::default();
        let packs = select_and_pack(r, adv, s, 0..n, &mut rep).unwrap();
        let mut mem = EpochMemory {
            old: vec![Vec::new(); n],
            reference: vec![Vec::new(); n],
        };
        let g = epoch_grads(
            model, None, r, adv, weights, &packs, 0, true, s, &mut mem, &mut rep,
        )
        .unwrap();
        (g.grads, packs, rep)
    }

    /// The padding rounds the prompt rows to the quantum where it can and the log-probs
    /// always, and no padding group is longer than the longest member.
    #[test]
    fn padding_groups_round_the_prompt_rows_and_fit_the_positions() {
        let logprobs =
            |gs: &[PromptGroup]| -> usize { gs.iter().map(PromptGroup::num_logprobs).sum() };
        let rows = |gs: &[PromptGroup]| -> (usize, usize, usize) {
            let p: usize = gs.iter().map(|g| g.prompt.len()).sum();
            let r: usize = gs
                .iter()
                .flat_map(|g| &g.responses)
                .map(|x| x.len() - 1)
                .sum();
            // The longest group: its prompt and its longest response's rows.
            let most = gs
                .iter()
                .map(|g| {
                    g.prompt.len() + g.responses.iter().map(|x| x.len() - 1).max().unwrap_or(0)
                })
                .max()
                .unwrap_or(0);
            (p, r, most)
        };
        // 100 prompt rows and 93 of padding, members of up to 40 rows: 28 prompt rows
        // take the prompts to 128, the other 65 go to responses of at most 12 rows.
        // Every case pads 101 log-probs to a multiple of 16 with one-token responses.
        let g = padding_groups(93, 100, 101, 40);
        assert_eq!(rows(&g), (28, 65, 40));
        assert_eq!((100 + rows(&g).0) % PROMPT_ROW_QUANTUM, 0);
        assert_eq!((101 + logprobs(&g)) % LOGPROB_QUANTUM, 0);
        assert!(g[0].responses.iter().all(|r| r.len() - 1 <= 12));
        // Exactly the rounding: responses of one token (no rows).
        let g = padding_groups(28, 100, 101, 40);
        assert_eq!(rows(&g), (28, 0, 28));
        assert_eq!((101 + logprobs(&g)) % LOGPROB_QUANTUM, 0);
        // Too little padding to round: every padding row in a prompt, as pad_pieces cuts it.
        let g = padding_groups(20, 100, 101, 40);
        assert_eq!(rows(&g), (20, 0, 20));
        assert_eq!((101 + logprobs(&g)) % LOGPROB_QUANTUM, 0);
        // A rounding no shorter than the longest member: pieces of 40 in prompts.
        let g = padding_groups(93, 10, 101, 40);
        assert_eq!(rows(&g), (93, 0, 40));
        assert_eq!((101 + logprobs(&g)) % LOGPROB_QUANTUM, 0);
        assert!(padding_groups(0, 100, 101, 40).is_empty());
    }

    /// Padding comes in pieces no longer than the longest member, so it fits the model's
    /// positions whenever the members do (in one piece, the zoo test's model of 64
    /// positions got a padding prompt of 93 rows).
    #[test]
    fn padding_pieces_fit_the_longest_member() {
        assert_eq!(pad_pieces(93, [40, 20].into_iter()), [40, 40, 13]);
        assert_eq!(pad_pieces(80, [40].into_iter()), [40, 40]);
        assert_eq!(pad_pieces(7, [40].into_iter()), [7]);
        assert!(pad_pieces(0, [40].into_iter()).is_empty());
        assert_eq!(pad_pieces(3, std::iter::empty()), [3]);
    }
    use candle_core::Device;
    use hilore_models::{Decoder, DecoderConfig};
    use hilore_runtime::grpo::advantages as group_advantages;

    /// The shared-prefix update (each prompt once per microbatch) gives the unshared
    /// update's gradient: the same sums in another order, so within `reference.rs`'s
    /// derived f32 bound (1e-5 relative L2 per parameter; a prompt row counted once too
    /// many or too few would be O(1e-1)). A budget of 16 rows splits both groups of 4
    /// responses, so a prompt is held again in the next microbatch; gradient
    /// checkpointing over shared prefixes equals store bit for bit.
    #[test]
    fn shared_prefixes_keep_the_gradient() {
        let cfg = DecoderConfig {
            vocab_size: 17,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 8,
            ..DecoderConfig::tiny()
        };
        let model = Decoder::random(&cfg, 2, &Device::Cpu).unwrap();
        let prompts = [vec![0u32, 3, 4, 5, 6, 2], vec![0, 9, 2, 8, 7, 7]];
        let responses: [&[u32]; 8] = [
            &[5, 1],
            &[6, 7, 8, 9, 10, 11, 1],
            &[12],
            &[5, 5, 5, 5, 1],
            &[13, 14, 1],
            &[15, 16, 3, 4, 5, 6, 7, 8, 1],
            &[2, 1],
            &[3],
        ];
        let seqs: Vec<Vec<u32>> = responses
            .iter()
            .enumerate()
            .map(|(i, r)| [prompts[i / 4].as_slice(), r].concat())
            .collect();
        let rewards = vec![1.0, 0.0, 0.5, 1.0, 0.0, 0.2, 1.0, 0.0];
        let r = Rollout::scored(seqs, vec![6; 8], rewards.clone());
        let adv = group_advantages(&rewards, 4, Default::default(), 1e-4).unwrap();
        let weights =
            hilore_runtime::grpo::aggregation_weights(&r.response_lens, Default::default());
        let grads = |shared: bool, plan: Plan| {
            let s = UpdateSettings {
                grpo: GrpoConfig::default(),
                layout: StepLayout::single(8),
                token_budget: 16,
                plan,
                skip_zero_exposure: false,
                shared_prefix: shared,
                allocator: None,
            };
            first_epoch(&model, &r, &adv, &weights, &s)
        };
        let (plain, plain_packs, plain_rep) = grads(false, hilore_models::plans::store_all());
        let (shared, packs, rep) = grads(true, hilore_models::plans::store_all());
        // Every microbatch within the budget, a prompt's rows counted once in each.
        for p in &packs {
            let mut rows = 0;
            for (k, &i) in p.iter().enumerate() {
                let continues = k > 0 && i / 4 == p[k - 1] / 4;
                rows += if continues {
                    r.response_lens[i] - 1
                } else {
                    r.seqs[i].len() - 1
                };
            }
            assert!(rows <= 16, "{packs:?}: {rows} rows");
        }
        // Group 0 (its prompt's 6 rows, then 1, 6, 0 and 4 of its responses) spreads over
        // two microbatches, each holding its prompt; sharing needs fewer microbatches than
        // copies.
        assert_eq!(packs, [vec![0, 1, 2], vec![3], vec![4, 5], vec![6, 7]]);
        assert_eq!(plain_packs.len(), 6, "{plain_packs:?}");
        // Throughputs count the same rows either way.
        assert_eq!(rep.update_tokens, plain_rep.update_tokens);
        for (name, p) in model.named_params() {
            let (a, b) = (shared.get(p.id()).unwrap(), plain.get(p.id()).unwrap());
            let d = (a - b)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let n = b
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let e = (d as f64 / n as f64).sqrt();
            assert!(e <= 1e-5, "{name}: relative L2 {e:e}");
        }
        let (gc, _, _) = grads(true, hilore_models::plans::gradient_checkpointing());
        for (name, p) in model.named_params() {
            let bits = |t: &Tensor| {
                t.flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                bits(gc.get(p.id()).unwrap()),
                bits(shared.get(p.id()).unwrap()),
                "{name}"
            );
        }
    }

    /// Skipping the zero-exposure sequences leaves the gradient unchanged up to f32
    /// summation order (the microbatches hold other rows, so matmul blocking differs):
    /// each entry is a sum of ~100 products, ~1e-6 relative at worst, and 1e-5 leaves a
    /// 10x margin; a skipped sequence that did contribute would be an O(1e-1) change.
    #[test]
    fn skipping_zero_exposure_sequences_keeps_the_gradient() {
        let cfg = DecoderConfig {
            vocab_size: 17,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 8,
            ..DecoderConfig::tiny()
        };
        let model = Decoder::random(&cfg, 1, &Device::Cpu).unwrap();
        // Two groups of 3: the first all correct (A = 0), the second mixed.
        let seqs: Vec<Vec<u32>> = vec![
            vec![0, 3, 4, 5, 1],
            vec![0, 3, 4, 6, 7, 1],
            vec![0, 3, 4, 5],
            vec![0, 9, 2, 8, 1],
            vec![0, 9, 2, 10, 11, 12, 1],
            vec![0, 9, 2, 13],
        ];
        let prompt_lens = vec![3; 6];
        let response_lens: Vec<usize> = seqs.iter().map(|s| s.len() - 3).collect();
        let rewards = vec![1.0, 1.0, 1.0, 1.0, 0.0, 0.1];
        let r = Rollout {
            examples: Vec::new(),
            sampled_logp: response_lens.iter().map(|&l| vec![0.0; l]).collect(),
            texts: vec![String::new(); 6],
            correct: rewards.iter().map(|&x| x == 1.0).collect(),
            seqs,
            prompt_lens,
            response_lens: response_lens.clone(),
            truncated: vec![false; 6],
            rewards: rewards.clone(),
            seconds: 0.0,
        };
        let adv = group_advantages(&rewards, 3, Default::default(), 1e-4).unwrap();
        assert_eq!(&adv[..3], &[0.0; 3]);
        let weights = hilore_runtime::grpo::aggregation_weights(&response_lens, Default::default());
        let settings = |skip: bool| UpdateSettings {
            grpo: GrpoConfig::default(),
            layout: StepLayout::single(6),
            token_budget: 64,
            plan: hilore_models::plans::store_all(),
            skip_zero_exposure: skip,
            shared_prefix: false,
            allocator: None,
        };
        let grads = |skip: bool| {
            let (g, _, rep) = first_epoch(&model, &r, &adv, &weights, &settings(skip));
            (g, rep)
        };
        let (all, rep_all) = grads(false);
        let (kept, rep_kept) = grads(true);
        assert_eq!(rep_all.skipped_sequences, 0);
        assert_eq!(rep_kept.skipped_sequences, 3);
        assert_eq!(rep_kept.skipped_tokens, 4 + 5 + 3);
        assert_eq!(rep_all.zero_exposure_sequences, 3);
        assert!(rep_kept.update_tokens < rep_all.update_tokens);
        // An empty response (no token to train) is counted and left out of every
        // microbatch; a budget below one sequence is an error naming the fix.
        let mut r2 = r.clone();
        r2.seqs[5].truncate(3);
        r2.response_lens[5] = 0;
        r2.sampled_logp[5].clear();
        let s = settings(false);
        let mut rep = UpdateReport::default();
        let packs = select_and_pack(&r2, &adv, &s, 0..6, &mut rep).unwrap();
        assert_eq!(rep.empty_sequences, 1);
        assert!(packs.iter().all(|p| !p.contains(&5)));
        let mut rep = UpdateReport::default();
        let tight = UpdateSettings {
            token_budget: 5,
            ..s
        };
        let err = format!(
            "{:#}",
            select_and_pack(&r, &adv, &tight, 0..6, &mut rep).unwrap_err()
        );
        assert!(err.contains("raise the budget to at least 6"), "{err}");
        for (name, p) in model.named_params() {
            let a: Vec<f32> = all
                .get(p.id())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let b: Vec<f32> = kept
                .get(p.id())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let num: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
                .sum();
            let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
            assert!(den > 0.0, "{name}: zero gradient");
            assert!(
                (num / den).sqrt() <= 1e-5,
                "{name}: rel L2 {}",
                (num / den).sqrt()
            );
        }
    }
}
