//! HiLoRe: activation-memory management for the GRPO actor update, as a library under
//! the `hilore` command line.
//!
//! The binary (`src/main.rs`) only parses arguments and calls these modules: the GRPO
//! trainer ([`train`]: rollouts, the actor update under the allocator, AdamW,
//! checkpoints), its tasks and rewards ([`tasks`], [`tokenizer`]), the comparison and
//! benchmark harnesses ([`compare`], [`bench`], [`bench_tape`], [`check`], [`codecs`]),
//! TRL's GRPO numbers ([`coefficients`]), zoo scoring and export ([`score`],
//! [`export`]). It is a library of the same package (not a crate of its own) so the
//! binary, its end-to-end tests and a user's program share one build of it.
//!
//! The runtime (tape, recovery units, fidelities, allocator, GRPO math) is
//! `hilore_runtime`; the models are `hilore_models`.

pub mod alloc;
pub mod bench;
pub mod bench_tape;
pub mod check;
pub mod codecs;
pub mod coefficients;
pub mod common;
pub mod compare;
pub mod export;
pub mod plot;
pub mod score;
pub mod stats;
pub mod tasks;
pub mod tokenizer;
pub mod train;
pub mod units;
