//! HiLoRe's GRPO numbers against TRL's own: the committed cases in `fixtures/trl` were
//! written by `scripts/trl-golden.sh` from TRL's real trainer code (advantages from
//! `_generate_and_score_completions`, `dL/dlogp` by autograd through `_compute_loss` per
//! loss microbatch, every iteration). Each case's TRL config is read as a user's file
//! would be ([`TrlSettings::from_value`]) and every update's batch goes through
//! [`grpo::trl::compute`], the code behind `hilore coefficients`.
//!
//! ## The float32 bound
//!
//! TRL computes in float32, HiLoRe in float64 from the same float32 inputs and rounds
//! once. With `u = 2^-24`:
//!
//! - Advantages: TRL's group mean sums `G` rewards (relative error `G u`), its deviations
//!   and variance add `~4 u`, the square root and the division `2 u`, all relative to the
//!   rewards' scale over the standard deviation: `|dA| <= (G + 8) u (1 + |A|) max(1,
//!   max|R| / std)`. (Batch scaling sums the whole batch: `G` becomes the batch size.)
//! - Coefficients: `c = w (g(A, rho) + beta kl')`. TRL rounds the weight's factors
//!   (`1 / |o|`, `/ B`, `/ GA`, the normaliser: `4 u`), the log-ratio and its exp (`3 u`
//!   per token; a sequence's mean log-ratio sums `|o|` of them: `(|o| + 2) u`), the
//!   surrogate's and KL's few products (`8 u`), so relative to the token's scale
//!   `s = w (|A| max(rho, 1) + beta rho (1 + e^(ref - logp) + 2 max|k3|))` the error is at
//!   most `(|o|_max + 16) u s`, plus the advantage's error carried through,
//!   `w max(rho, 1) |dA|`.
//!
//! The cases keep every ratio 1e-3 (relative) away from the clip boundaries, so both
//! sides take the same branch.
//!
//! Kept different from TRL on purpose: a group whose rewards are all equal gets advantage
//! exactly 0 here; TRL's float32 mean leaves a residue `(R - mean) / (0 + 1e-4)`, at most
//! `G u max|R| / 1e-4` (7.4e-5 on the committed case of rewards 0.1), and gradients that
//! small. Those sequences are checked against that bound instead.

use hilore_runtime::grpo::trl::{compute, Batch, Completion, Group, TrlSettings};
use hilore_runtime::grpo::AdvantageNorm;
use serde_json::Value;
use std::path::Path;

const U: f64 = 1.0 / (1u64 << 24) as f64;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn nested(v: &Value) -> Vec<Vec<f32>> {
    v.as_array().unwrap().iter().map(floats).collect()
}

struct Case {
    name: String,
    settings: TrlSettings,
    g: usize,
    lengths: Vec<usize>,
    truncated: Vec<bool>,
    rewards: Vec<Vec<f32>>,
    old: Vec<Vec<f32>>,
    reference: Option<Vec<Vec<f32>>>,
    logps: Vec<(usize, Vec<Vec<f32>>)>,
    advantages: Vec<f32>,
    /// (update, sequence, coefficients)
    coefficients: Vec<(usize, usize, Vec<f32>)>,
}

fn load(path: &Path) -> Case {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let name = v["name"].as_str().unwrap().to_string();
    let settings = TrlSettings::from_value(&v["config"], &name).unwrap();
    let mut logps: Vec<(usize, Vec<Vec<f32>>)> = v["logps"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, x)| (k.parse().unwrap(), nested(x)))
        .collect();
    logps.sort_by_key(|x| x.0);
    Case {
        name,
        settings,
        g: v["num_generations"].as_u64().unwrap() as usize,
        lengths: v["lengths"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect(),
        truncated: v["truncated"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_bool().unwrap())
            .collect(),
        rewards: nested(&v["rewards"]),
        old: nested(&v["old_logps"]),
        reference: (!v["ref_logps"].is_null()).then(|| nested(&v["ref_logps"])),
        logps,
        advantages: floats(&v["advantages"]),
        coefficients: v["coefficients"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| {
                (
                    u["update"].as_u64().unwrap() as usize,
                    u["sequence"].as_u64().unwrap() as usize,
                    floats(&u["coefficients"]),
                )
            })
            .collect(),
    }
}

/// The batch a user would give `hilore coefficients` at `update`: every completion's
/// log-probs under that update's policy, the sampling policy's after the first step.
fn batch_at(c: &Case, update: usize, logps: &[Vec<f32>]) -> Batch {
    let groups = (0..c.lengths.len() / c.g)
        .map(|gi| Group {
            rewards: (0..c.g)
                .map(|j| {
                    let r = &c.rewards[gi * c.g + j];
                    if r.len() == 1 {
                        Value::from(r[0] as f64)
                    } else {
                        Value::from(r.iter().map(|&x| x as f64).collect::<Vec<_>>())
                    }
                })
                .collect(),
            completions: (0..c.g)
                .map(|j| {
                    let i = gi * c.g + j;
                    Completion {
                        logps: Some(logps[i].clone()),
                        old_logps: (update > 0).then(|| c.old[i].clone()),
                        ref_logps: c.reference.as_ref().map(|r| r[i].clone()),
                        length: None,
                        truncated: c.truncated[i],
                    }
                })
                .collect(),
        })
        .collect();
    Batch {
        config: None,
        update,
        groups,
    }
}

#[test]
#[allow(clippy::needless_range_loop)] // sequences index several parallel arrays
fn advantages_and_coefficients_equal_trl_on_every_committed_case() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trl");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    assert!(
        paths.len() >= 20,
        "{} cases in {}",
        paths.len(),
        dir.display()
    );
    let mut loss_types = std::collections::BTreeSet::new();
    let (mut tokens, mut residue_groups, mut multi_update) = (0usize, 0usize, 0usize);
    for path in &paths {
        let c = load(path);
        let cfg = c.settings.grpo;
        loss_types.insert(format!("{} {}", cfg.loss_type(), cfg.importance_sampling));
        let n = c.lengths.len();
        let max_len = *c.lengths.iter().max().unwrap();
        let mut seen = vec![false; c.coefficients.len()];
        let (mut worst, mut cmax, mut worst_a) = (0.0f64, 0.0f64, 0.0f64);
        multi_update += (c.logps.len() > 1) as usize;
        for (update, logps) in &c.logps {
            let out = compute(&c.settings, &batch_at(&c, *update, logps))
                .unwrap_or_else(|e| panic!("{}: update {update}: {e}", c.name));
            // Advantages, per group.
            let rewards: Vec<f32> = out.sequences.iter().map(|s| s.reward).collect();
            let span = |xs: &[f32]| -> (f64, f64) {
                let m = xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len() as f64;
                let v = xs.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>()
                    / (xs.len() as f64 - 1.0);
                (m, v.sqrt())
            };
            let mut da = vec![0.0f64; n];
            for gi in 0..n / c.g {
                let grp = &rewards[gi * c.g..(gi + 1) * c.g];
                let all_equal = grp.iter().all(|&x| x == grp[0]);
                let (sum_n, std) = match cfg.advantage_norm {
                    AdvantageNorm::BatchStd => (n, span(&rewards).1),
                    AdvantageNorm::GroupStd => (c.g, span(grp).1),
                    AdvantageNorm::None => (c.g, 1.0),
                };
                let rmax = grp.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64));
                for i in gi * c.g..(gi + 1) * c.g {
                    let (mine, theirs) =
                        (out.sequences[i].advantage as f64, c.advantages[i] as f64);
                    if all_equal {
                        // Deliberately exact zero; TRL's residue is bounded.
                        assert_eq!(mine, 0.0, "{}: sequence {i}", c.name);
                        let residue = c.g as f64 * U * rmax / cfg.std_eps as f64;
                        assert!(
                            theirs.abs() <= residue,
                            "{}: residue {theirs} > {residue}",
                            c.name
                        );
                        da[i] = theirs.abs();
                        residue_groups += (i % c.g == 0 && theirs != 0.0) as usize;
                        continue;
                    }
                    let bound =
                        (sum_n as f64 + 8.0) * U * (1.0 + theirs.abs()) * (rmax / std).max(1.0);
                    assert!(
                        (mine - theirs).abs() <= bound,
                        "{}: advantage {i}: HiLoRe {mine}, TRL {theirs}, bound {bound}",
                        c.name
                    );
                    da[i] = bound;
                    worst_a = worst_a.max((mine - theirs).abs());
                }
            }
            // Coefficients of the sequences this update trains.
            for (k, (u, i, want)) in c.coefficients.iter().enumerate() {
                if u != update {
                    continue;
                }
                seen[k] = true;
                let got = out.sequences[*i].coefficients.as_ref().unwrap_or_else(|| {
                    panic!(
                        "{}: update {u} gave no coefficients for sequence {i}",
                        c.name
                    )
                });
                assert_eq!(got.len(), want.len(), "{}: sequence {i}", c.name);
                let w = out.sequences[*i].weight as f64;
                let a = c.advantages[*i] as f64;
                let lp = &logps[*i];
                let old = if *update > 0 { &c.old[*i] } else { lp };
                let rho_seq = (lp
                    .iter()
                    .zip(old)
                    .map(|(&x, &o)| x as f64 - o as f64)
                    .sum::<f64>()
                    / lp.len() as f64)
                    .exp();
                let k3: Vec<f64> = match &c.reference {
                    Some(r) => r[*i]
                        .iter()
                        .zip(lp)
                        .map(|(&r, &x)| {
                            let d = r as f64 - x as f64;
                            d.exp() - d - 1.0
                        })
                        .collect(),
                    None => vec![0.0; lp.len()],
                };
                let k3max = k3.iter().fold(0.0f64, |m, &x| m.max(x.abs()));
                for t in 0..want.len() {
                    let rho = match cfg.importance_sampling {
                        hilore_runtime::grpo::ImportanceSampling::Token => {
                            (lp[t] as f64 - old[t] as f64).exp()
                        }
                        hilore_runtime::grpo::ImportanceSampling::Sequence => rho_seq,
                    };
                    let e = c
                        .reference
                        .as_ref()
                        .map_or(0.0, |r| (r[*i][t] as f64 - lp[t] as f64).exp());
                    let scale = w
                        * (a.abs() * rho.max(1.0)
                            + cfg.beta as f64 * rho * (1.0 + e + 2.0 * k3max));
                    let bound = (max_len as f64 + 16.0) * U * scale + w * rho.max(1.0) * da[*i];
                    let (g, h) = (got[t] as f64, want[t] as f64);
                    assert!(
                        (g - h).abs() <= bound,
                        "{}: update {u}, sequence {i}, token {t}: HiLoRe {g}, TRL {h}, bound {bound:e}",
                        c.name
                    );
                    tokens += 1;
                    worst = worst.max((g - h).abs());
                    cmax = cmax.max(h.abs());
                }
            }
        }
        assert!(
            seen.iter().all(|&s| s),
            "{}: a TRL update was not compared",
            c.name
        );
        eprintln!(
            "{:<32} {} updates: max |dA| {worst_a:.1e}, max |dc| / max |c| {:.1e}",
            c.name,
            c.logps.len(),
            worst / cmax
        );
    }
    for lt in ["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo"] {
        assert!(
            loss_types.iter().any(|x| x.starts_with(&format!("{lt} "))),
            "no case of {lt}: {loss_types:?}"
        );
    }
    assert!(loss_types.iter().any(|x| x.ends_with(" sequence")));
    assert!(residue_groups >= 1, "the all-equal residue case is missing");
    assert!(
        multi_update >= 8,
        "{multi_update} cases with several updates"
    );
    assert!(tokens >= 2000, "{tokens} tokens compared");
}
