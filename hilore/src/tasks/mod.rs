//! Tasks with verifiable rewards: seeded procedural generators shipped in the binary
//! (multi-digit arithmetic, Countdown) and user datasets in JSONL with a GSM8K-style
//! final-answer reward.
//!
//! Every task gives examples (a prompt, a reference solution used by the warm start, and
//! the answer the reward checks), a tokenizer, and a reward for a response's text. Rewards
//! never fail: a malformed response scores 0.

mod arithmetic;
mod countdown;
mod jsonl;

pub use arithmetic::Arithmetic;
pub use countdown::Countdown;
pub use jsonl::Jsonl;

use crate::tokenizer::Tokenizer;
use anyhow::bail;
use hilore_models::rng::SplitMix64;
use std::path::PathBuf;

/// The built-in task names.
pub const TASK_NAMES: [&str; 3] = ["arithmetic", "countdown", "jsonl"];

/// One problem.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// The prompt text (the model sees BOS + prompt).
    pub prompt: String,
    /// A correct response (what the warm start imitates; EOS is appended).
    pub solution: String,
    /// What the reward checks against.
    pub answer: String,
}

/// What a response earned.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Reward {
    /// The scalar reward: the task's default [`Task::reward_weights`] applied to its
    /// [`Reward::functions`].
    pub value: f32,
    /// Whether the response is fully correct (counts towards accuracy).
    pub correct: bool,
    /// Whether the response has the answer's form (an integer, an equation, a final
    /// number), right or wrong.
    pub well_formed: bool,
}

/// The reward functions every task scores, in order (TRL's `reward_funcs`, weighted by
/// `reward_weights` and summed).
pub const REWARD_FUNCTIONS: [&str; 2] = ["correct", "format"];

impl Reward {
    /// Full marks.
    pub const CORRECT: Reward = Reward {
        value: 1.0,
        correct: true,
        well_formed: true,
    };
    /// Nothing.
    pub const ZERO: Reward = Reward {
        value: 0.0,
        correct: false,
        well_formed: false,
    };

    /// The values of the [`REWARD_FUNCTIONS`]: 1 or 0 each.
    pub fn functions(&self) -> [f32; 2] {
        [self.correct as u8 as f32, self.well_formed as u8 as f32]
    }

    /// The weighted sum of the functions, in float32 in order (as TRL's
    /// `(rewards_per_func * reward_weights).nansum(dim=1)`).
    pub fn weighted(&self, weights: [f32; 2]) -> f32 {
        let f = self.functions();
        f[0] * weights[0] + f[1] * weights[1]
    }
}

/// How to build a task from the command line.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TaskSpec {
    /// `arithmetic`, `countdown` or `jsonl`.
    pub name: String,
    /// Arithmetic: digits per operand.
    pub digits: usize,
    /// Arithmetic: the operators to draw from (`+`, `-`, `*`).
    pub ops: String,
    /// Countdown: how many numbers.
    pub numbers: usize,
    /// Countdown: the numbers are drawn from 1..=max_number.
    pub max_number: u32,
    /// JSONL: the training data.
    pub data: Option<PathBuf>,
    /// JSONL: held-out data (default: the last lines of `data`).
    pub heldout_data: Option<PathBuf>,
}

/// A task.
#[derive(Debug, Clone)]
pub enum Task {
    Arithmetic(Arithmetic),
    Countdown(Countdown),
    Jsonl(Jsonl),
}

impl Task {
    /// Builds the task a spec names; `heldout` is the held-out set's size (JSONL without a
    /// held-out file takes its last `heldout` lines).
    pub fn new(spec: &TaskSpec, heldout: usize) -> anyhow::Result<Task> {
        match spec.name.as_str() {
            "arithmetic" => Ok(Task::Arithmetic(Arithmetic::new(spec.digits, &spec.ops)?)),
            "countdown" => Ok(Task::Countdown(Countdown::new(
                spec.numbers,
                spec.max_number,
            )?)),
            "jsonl" => {
                let Some(data) = &spec.data else {
                    bail!("task `jsonl` needs a dataset: pass --data FILE.jsonl (one {{\"prompt\": ..., \"answer\": ...}} object per line)");
                };
                Ok(Task::Jsonl(Jsonl::load(
                    data,
                    spec.heldout_data.as_deref(),
                    heldout,
                )?))
            }
            other => bail!(
                "unknown task `{other}`; the tasks are {} (jsonl reads --data FILE)",
                TASK_NAMES.join(", ")
            ),
        }
    }

    /// A short description.
    pub fn describe(&self) -> String {
        match self {
            Task::Arithmetic(t) => t.describe(),
            Task::Countdown(t) => t.describe(),
            Task::Jsonl(t) => t.describe(),
        }
    }

    /// The tokenizer the task's text needs.
    pub fn tokenizer(&self) -> Tokenizer {
        match self {
            Task::Arithmetic(t) => t.tokenizer(),
            Task::Countdown(t) => t.tokenizer(),
            Task::Jsonl(_) => Tokenizer::Bytes,
        }
    }

    /// A training example drawn with `rng`.
    pub fn sample(&self, rng: &mut SplitMix64) -> Example {
        match self {
            Task::Arithmetic(t) => t.sample(rng),
            Task::Countdown(t) => t.sample(rng),
            Task::Jsonl(t) => t.sample(rng),
        }
    }

    /// The held-out set: `n` examples drawn from their own stream of `seed` (procedural
    /// tasks), or the dataset's held-out lines (JSONL).
    pub fn heldout(&self, n: usize, seed: u64) -> Vec<Example> {
        match self {
            Task::Jsonl(t) => t.heldout().to_vec(),
            _ => {
                let mut rng = SplitMix64::for_stream(seed, "heldout");
                let mut seen = std::collections::HashSet::new();
                let mut out = Vec::with_capacity(n);
                // Distinct prompts; a task space smaller than n gives what it has.
                let mut tries = 0;
                while out.len() < n && tries < 50 * n.max(1) {
                    tries += 1;
                    let ex = self.sample(&mut rng);
                    if seen.insert(ex.prompt.clone()) {
                        out.push(ex);
                    }
                }
                out
            }
        }
    }

    /// Every example of a dataset task (training and held out); `None` for procedural
    /// tasks, whose problems are drawn without end.
    pub fn dataset_examples(&self) -> Option<Vec<&Example>> {
        match self {
            Task::Jsonl(t) => Some(t.examples().collect()),
            _ => None,
        }
    }

    /// Whether training may draw `ex`: procedural tasks redraw prompts that are in the
    /// held-out set.
    pub fn is_procedural(&self) -> bool {
        !matches!(self, Task::Jsonl(_))
    }

    /// The task's weights of the [`REWARD_FUNCTIONS`], which give [`Reward::value`]:
    /// correctness alone for arithmetic and JSONL, correctness 0.9 and format 0.1 for
    /// Countdown (its 1 / 0.1 / 0 levels).
    pub fn reward_weights(&self) -> [f32; 2] {
        match self {
            Task::Countdown(_) => [1.0 - countdown::FORMAT_REWARD, countdown::FORMAT_REWARD],
            Task::Arithmetic(_) | Task::Jsonl(_) => [1.0, 0.0],
        }
    }

    /// The reward of `response` (decoded text, EOS excluded) to `ex`.
    pub fn reward(&self, ex: &Example, response: &str) -> Reward {
        match self {
            Task::Arithmetic(t) => t.reward(ex, response),
            Task::Countdown(t) => t.reward(ex, response),
            Task::Jsonl(t) => t.reward(ex, response),
        }
    }

    /// The longest prompt this task makes, in characters (bytes for JSONL).
    pub fn max_prompt_chars(&self) -> usize {
        match self {
            Task::Arithmetic(t) => t.max_prompt_chars(),
            Task::Countdown(t) => t.max_prompt_chars(),
            Task::Jsonl(t) => t.max_prompt_chars(),
        }
    }

    /// The longest solution this task needs, in characters (for the default maximum
    /// number of new tokens).
    pub fn max_solution_chars(&self) -> usize {
        match self {
            Task::Arithmetic(t) => t.max_solution_chars(),
            Task::Countdown(t) => t.max_solution_chars(),
            Task::Jsonl(t) => t.max_solution_chars(),
        }
    }
}
