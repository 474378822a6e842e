//! `hilore train` with TRL's knobs: a TRL GRPOConfig file sets the flags its keys name
//! (command-line flags win); several optimizer steps per rollout; loss microbatches that
//! leave the weights alone leave the run bit for bit alone; the actor update's log-probs
//! at the sampling temperature.

mod support;

use serde_json::Value;
use std::path::Path;

fn tiny(dir: &Path, extra: &[&str]) -> Vec<String> {
    // One-digit sums: after 150 warm-start steps some responses are right, some wrong, so
    // advantages and gradients are not zero.
    let defaults: [(&str, &str); 16] = [
        ("--digits", "1"),
        ("--layers", "1"),
        ("--hidden", "16"),
        ("--heads", "2"),
        ("--kv-heads", "1"),
        ("--intermediate", "32"),
        ("--sft-steps", "150"),
        ("--sft-target-loss", "0"),
        ("--sft-batch", "16"),
        ("--prompts", "4"),
        ("--group-size", "4"),
        ("--heldout", "8"),
        ("--eval-samples", "1"),
        ("--lr", "1e-3"),
        ("--seed", "5"),
        ("--steps", "3"),
    ];
    support::train_args(&defaults, dir, extra)
}

fn metrics(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            v.as_object_mut()
                .unwrap()
                .retain(|k, _| !k.ends_with("_seconds") && !k.ends_with("_per_s"));
            v
        })
        .collect()
}

fn summary(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// Bound on `|recorded - training forward|` of a log-prob: as in models/tests/generate.rs
/// (f64 log-softmax of the cached f32 logits against the chunked f32 head, a few ulps of
/// |logp| ~ 3), 2e-5 with a 10x margin. Without the temperature in the training forward
/// the two differ by O(0.1) at T = 0.7.
const LOGP_BOUND: f64 = 2e-5;

#[test]
fn a_trl_config_sets_the_grpo_flags_and_the_command_line_wins() {
    let dir = support::tmpdir("train-trl", "config");
    let cfg = dir.join("grpo.yaml");
    // Generation batch 4 x 4 = 16 sequences = 4 prompts of 4; 4 loss microbatches, 2 per
    // optimizer step: 2 optimizer steps per rollout, 2 iterations.
    std::fs::write(
        &cfg,
        "loss_type: grpo\nnum_generations: 4\nper_device_train_batch_size: 4\n\
         gradient_accumulation_steps: 2\nsteps_per_generation: 4\nnum_iterations: 2\n\
         beta: 0.04\ntemperature: 0.7\nepsilon_high: 0.28\nlearning_rate: 0.002\n\
         output_dir: runs/x\nlogging_steps: 5\n",
    )
    .unwrap();
    let (code, out, err) = support::hilore(&tiny(
        &dir,
        &[
            "--grpo-config",
            cfg.to_str().unwrap(),
            "--prompts",
            "8",
            "--lr",
            "1e-3",
        ],
    ));
    // --prompts 8 on the command line wins, and then 32 sequences are not the file's
    // generation batch of 16: refused, naming the fix.
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("drop --prompts or make them agree"), "{err}");
    let args = tiny(
        &dir,
        &[
            "--grpo-config",
            cfg.to_str().unwrap(),
            "--lr",
            "1e-3",
            "--prompts",
            "4",
        ],
    );
    let (code, out, err) = support::hilore(&args);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(err.contains("ignored: logging_steps, output_dir"), "{err}");
    assert!(
        err.contains("--loss-type") && err.contains("--beta"),
        "{err}"
    );
    let s = summary(&dir)["settings"].clone();
    assert_eq!(s["grpo"]["aggregation"], "seq-mean-token-mean");
    assert_eq!(s["grpo"]["beta"].as_f64().unwrap() as f32, 0.04);
    assert_eq!(s["grpo"]["eps_high"].as_f64().unwrap() as f32, 0.28);
    assert_eq!(s["grpo"]["epochs"], 2);
    assert_eq!(s["gradient_accumulation_steps"], 2);
    assert_eq!(s["steps_per_generation"], 4);
    assert_eq!(s["temperature"], 0.7);
    // The command line's --lr won over learning_rate.
    assert_eq!(s["adamw"]["lr"], 1e-3);
    for m in metrics(&dir) {
        assert_eq!(m["optimizer_steps"], 4, "{m}");
        let mismatch = m["logp_mismatch_max"].as_f64().unwrap();
        assert!(mismatch <= LOGP_BOUND, "T 0.7: {mismatch}");
    }
}

#[test]
fn loss_microbatches_that_keep_the_weights_keep_the_run_bit_for_bit() {
    // dapo's weight is 1 / (N x GA / SPG): with GA = SPG = 2 it is 1 / N as with 1 and 1,
    // so the run is the same bit for bit (one optimizer step per rollout either way).
    // bnpo's token means per microbatch of 8 sequences differ from one over 16: the
    // layout reaches the loss.
    let run = |name: &str, extra: &[&str]| {
        let dir = support::tmpdir("train-trl", name);
        let mut e = vec!["--policy", "recompute", "--beta", "0.02"];
        e.extend_from_slice(extra);
        support::run_ok(&tiny(&dir, &e));
        metrics(&dir)
    };
    let plain = run("dapo-1", &[]);
    let split = run(
        "dapo-2",
        &[
            "--gradient-accumulation-steps",
            "2",
            "--steps-per-generation",
            "2",
        ],
    );
    assert_eq!(plain, split);
    assert!(plain.iter().any(|m| m["grad_norm"].as_f64().unwrap() > 0.0));
    let bnpo = run("bnpo-1", &["--loss-type", "bnpo"]);
    let bnpo_split = run(
        "bnpo-2",
        &[
            "--loss-type",
            "bnpo",
            "--gradient-accumulation-steps",
            "2",
            "--steps-per-generation",
            "2",
        ],
    );
    // One microbatch of the whole rollout: bnpo is dapo.
    assert_eq!(bnpo, plain);
    assert_ne!(bnpo_split, bnpo);
}

#[test]
fn bad_trl_configs_are_refused_naming_the_key() {
    let dir = support::tmpdir("train-trl", "bad");
    for (text, want) in [
        ("loss_type: vespo\n", "not implemented"),
        ("num_generation: 4\n", "did you mean `num_generations`"),
        ("top_entropy_quantile: 0.5\n", "top_entropy_quantile"),
        ("reward_weights: [1.0, 0.5, 0.2]\n", "two reward functions"),
        (
            "per_device_train_batch_size: 3\nnum_generations: 4\n",
            "make them agree",
        ),
    ] {
        let cfg = dir.join("c.yaml");
        std::fs::write(&cfg, text).unwrap();
        let (code, _, err) = support::hilore(&tiny(
            &dir,
            &["--grpo-config", cfg.to_str().unwrap(), "--force"],
        ));
        assert_ne!(code, 0, "{text}");
        assert!(err.contains(want), "{text}: {err}");
    }
}

/// `--policy hilore` plans a microbatch before its forward exactly where the
/// coefficients are known then: the rollout's first optimizer step without a KL term, for
/// every loss type and ratio level. Here each rollout makes 2 optimizer steps over 2
/// epochs (4 updates); only the first update's microbatches are planned, and none with
/// beta > 0.
#[test]
fn the_allocator_plans_before_the_forward_exactly_where_the_coefficients_are_known() {
    for loss in ["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo"] {
        for (level, beta) in [("token", "0"), ("sequence", "0"), ("token", "0.04")] {
            let dir = support::tmpdir("train-trl", &format!("plan-{loss}-{level}-{beta}"));
            support::run_ok(&tiny(
                &dir,
                &[
                    "--loss-type",
                    loss,
                    "--importance-sampling-level",
                    level,
                    "--beta",
                    beta,
                    "--epsilon-high",
                    if loss == "cispo" { "4" } else { "0.28" },
                    "--num-iterations",
                    "2",
                    "--gradient-accumulation-steps",
                    "1",
                    "--steps-per-generation",
                    "2",
                    "--token-budget",
                    "24",
                    "--steps",
                    "2",
                ],
            ));
            let ms = metrics(&dir);
            let mut planned_any = false;
            for m in &ms {
                let planned = m["planned_microbatches"].as_u64().unwrap();
                let total = m["microbatches"].as_u64().unwrap();
                assert_eq!(m["optimizer_steps"], 4, "{loss} {level} {beta}: {m}");
                if beta != "0" {
                    assert_eq!(planned, 0, "{loss} {level} beta {beta}: {m}");
                } else {
                    // The first of two optimizer steps per epoch: some, never all, of the
                    // epoch's microbatches (a step whose sequences all have zero
                    // exposure plans nothing: there is nothing to run).
                    assert!(planned < total, "{loss} {level}: {m}");
                    planned_any |= planned > 0;
                }
            }
            assert!(
                planned_any || beta != "0",
                "{loss} {level}: nothing planned in {ms:?}"
            );
        }
    }
}
