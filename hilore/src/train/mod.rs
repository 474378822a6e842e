//! `hilore train`: warm start, then GRPO with rollouts, rewards, pre-backward
//! coefficients and a microbatched actor update under a fidelity policy.
//!
//! The run: build the task and its tokenizer; build a decoder (random init, seeded, or a
//! zoo model directory with `--model`, whose tokenizer.json and `eos_token_id` then replace
//! the built-in tokenizer); warm-start it by supervised fine-tuning on the task's reference
//! solutions (off by default for `--model`); evaluate it on
//! a held-out set that training never draws from; then for every GRPO step sample `G`
//! responses to each of `P` prompts with the KV cache, score them, turn rewards into
//! group-relative advantages, and run `mu` update epochs over the sequences (microbatches
//! packed by a token budget, each under the `--policy` fidelity plan, backward seeded with
//! the per-token coefficients `dL/dlogp`, AdamW with gradient clipping); finally evaluate
//! again, write the summary and, with `--out`, export the trained weights as a model
//! directory.
//!
//! Every random choice is a pure function of `--seed` and the step (counter-based streams),
//! so a checkpoint's RNG state is the seed and the next step; with the weights, the
//! reference weights, the optimizer moments and (`--policy hilore`, the default) the
//! allocator's calibrated state it fixes the rest of the run, and `--resume` continues
//! bit for bit. The allocator's plans depend on measured times only through its one
//! calibration (on the first step with exposure; that step is always checkpointed):
//! `--refresh-costs` folds later measurements in as well, which adapts to drift but gives
//! up bit-exact resume.

mod args;
pub mod checkpoint;
mod eval;
mod metrics;
pub mod optimizer;
pub mod rollout;
mod run;
mod settings;
mod sft;
pub mod update;

pub use args::{explicit_ids, parse_args, TrainArgs};
pub use run::run;
pub(crate) use run::HILORE_CODECS;
pub(crate) use settings::policy_plan;

use hilore_models::Decoder;

/// What the actor update ([`update::actor_update`]) and the optimizer
/// ([`optimizer::AdamW`]) need from a policy: its batches, the token log-probs of a batch
/// on the tape, and its parameters by name. The built-in decoder and every zoo model
/// implement it; a model of one's own does by giving these four.
pub trait ActorModel {
    /// The packed batch of `seqs` (prompt and response tokens each; the targets are the
    /// next tokens), with whatever per-row tables the model reads (positions, RoPE).
    fn batch(&self, seqs: &[Vec<u32>]) -> anyhow::Result<hilore_models::TokenBatch>;

    /// The packed batch of prompt groups with each prompt held once
    /// ([`hilore_models::TokenBatch::from_shared_prefixes`]), for the shared-prefix actor
    /// update ([`update::UpdateSettings::shared_prefix`]). A model that does not take such
    /// batches keeps this default, an error saying so.
    fn shared_batch(
        &self,
        _groups: &[hilore_models::PromptGroup],
    ) -> anyhow::Result<hilore_models::TokenBatch> {
        anyhow::bail!(
            "this model does not pack shared prefixes: implement ActorModel::shared_batch (TokenBatch::from_shared_prefixes or pack_shared_prefixes, and read batch.logprob_rows in token_logprobs), or train with --no-shared-prefix"
        )
    }

    /// The log-prob of every target of `batch` (`[M]`: one per row, or with shared
    /// prefixes [`hilore_models::TokenBatch::num_logprobs`]), recorded on `cx` so its
    /// recovery units take the plan's fidelities.
    fn token_logprobs<'m>(
        &'m self,
        cx: &mut hilore_runtime::Cx<'m>,
        batch: &hilore_models::TokenBatch,
    ) -> hilore_runtime::Result<hilore_runtime::Var>;

    /// Every trainable parameter with its name, in a fixed order.
    fn named_params(&self) -> Vec<(String, hilore_runtime::Var)>;

    /// The same parameters, mutably, in the same order (the optimizer's step).
    fn named_params_mut(&mut self) -> Vec<(String, &mut hilore_runtime::Var)>;
}

impl ActorModel for Decoder {
    fn batch(&self, seqs: &[Vec<u32>]) -> anyhow::Result<hilore_models::TokenBatch> {
        Ok(hilore_models::TokenBatch::from_sequences(
            seqs,
            self.config(),
            self.head_weight().device(),
        )?)
    }

    fn shared_batch(
        &self,
        groups: &[hilore_models::PromptGroup],
    ) -> anyhow::Result<hilore_models::TokenBatch> {
        Ok(hilore_models::TokenBatch::from_shared_prefixes(
            groups,
            self.config(),
            self.head_weight().device(),
        )?)
    }

    fn token_logprobs<'m>(
        &'m self,
        cx: &mut hilore_runtime::Cx<'m>,
        batch: &hilore_models::TokenBatch,
    ) -> hilore_runtime::Result<hilore_runtime::Var> {
        Decoder::token_logprobs(self, cx, batch)
    }

    /// The trainable parameters: every weight, or with LoRA ([`Decoder::add_lora`]) the
    /// adapters alone (the frozen weights get no gradient and no optimizer state).
    fn named_params(&self) -> Vec<(String, hilore_runtime::Var)> {
        Decoder::named_params(self)
            .into_iter()
            .filter(|(_, v)| v.requires_grad())
            .collect()
    }

    fn named_params_mut(&mut self) -> Vec<(String, &mut hilore_runtime::Var)> {
        Decoder::named_params_mut(self)
            .into_iter()
            .filter(|(_, v)| v.requires_grad())
            .collect()
    }
}
