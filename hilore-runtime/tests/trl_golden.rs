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

use hilore_runtime::grpo::trl::{compute, Batch, TrlSettings};
use hilore_runtime::grpo::{AdvantageNorm, ImportanceSampling};
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

/// The committed cases, in name order.
fn cases() -> Vec<Value> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trl");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
        .collect()
}

#[test]
#[allow(clippy::needless_range_loop)] // sequences index several parallel arrays
fn advantages_and_coefficients_equal_trl_on_every_committed_case() {
    let cases = cases();
    assert!(cases.len() >= 20, "{} cases", cases.len());
    let mut loss_types = std::collections::BTreeSet::new();
    let (mut tokens, mut residue_groups, mut multi_update) = (0usize, 0usize, 0usize);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let settings = TrlSettings::from_value(&case["config"], name).unwrap();
        let cfg = settings.grpo;
        let g = settings.num_generations;
        loss_types.insert(format!("{} {}", cfg.loss_type(), cfg.importance_sampling));
        let trl_adv = floats(&case["trl"]["advantages"]);
        let trl_c: Vec<(usize, usize, Vec<f32>)> = case["trl"]["coefficients"]
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
            .collect();
        let batches = case["batches"].as_array().unwrap();
        multi_update += (batches.len() > 1) as usize;
        let mut seen = vec![false; trl_c.len()];
        let (mut worst, mut cmax, mut worst_a) = (0.0f64, 0.0f64, 0.0f64);
        for b in batches {
            let batch: Batch = serde_json::from_value(b.clone()).unwrap();
            let update = batch.update;
            let out = compute(&settings, &batch)
                .unwrap_or_else(|e| panic!("{name}: update {update}: {e}"));
            let comps: Vec<_> = batch.groups.iter().flat_map(|g| &g.completions).collect();
            let n = comps.len();
            let max_len = comps
                .iter()
                .map(|c| c.logps.as_ref().unwrap().len())
                .max()
                .unwrap();
            // Advantages, per group.
            let rewards: Vec<f32> = out.sequences.iter().map(|s| s.reward).collect();
            let std_of = |xs: &[f32]| -> f64 {
                let m = xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len() as f64;
                (xs.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / (xs.len() as f64 - 1.0))
                    .sqrt()
            };
            let mut da = vec![0.0f64; n];
            for gi in 0..n / g {
                let grp = &rewards[gi * g..(gi + 1) * g];
                let all_equal = grp.iter().all(|&x| x == grp[0]);
                let (summed, std) = match cfg.advantage_norm {
                    AdvantageNorm::BatchStd => (n, std_of(&rewards)),
                    AdvantageNorm::GroupStd => (g, std_of(grp)),
                    AdvantageNorm::None => (g, 1.0),
                };
                let rmax = grp.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64));
                for i in gi * g..(gi + 1) * g {
                    let (mine, theirs) = (out.sequences[i].advantage as f64, trl_adv[i] as f64);
                    if all_equal {
                        // Deliberately exactly zero; TRL's residue is bounded.
                        assert_eq!(mine, 0.0, "{name}: sequence {i}");
                        let residue = g as f64 * U * rmax / cfg.std_eps as f64;
                        assert!(
                            theirs.abs() <= residue,
                            "{name}: residue {theirs} > {residue}"
                        );
                        da[i] = theirs.abs();
                        residue_groups += (i % g == 0 && theirs != 0.0) as usize;
                        continue;
                    }
                    let bound =
                        (summed as f64 + 8.0) * U * (1.0 + theirs.abs()) * (rmax / std).max(1.0);
                    assert!(
                        (mine - theirs).abs() <= bound,
                        "{name}: advantage {i}: HiLoRe {mine}, TRL {theirs}, bound {bound}"
                    );
                    da[i] = bound;
                    worst_a = worst_a.max((mine - theirs).abs());
                }
            }
            // Coefficients of the sequences this update trains.
            for (k, (u, i, want)) in trl_c.iter().enumerate() {
                if *u != update {
                    continue;
                }
                seen[k] = true;
                let got = out.sequences[*i].coefficients.as_ref().unwrap_or_else(|| {
                    panic!("{name}: update {u} gave no coefficients for sequence {i}")
                });
                assert_eq!(got.len(), want.len(), "{name}: sequence {i}");
                let w = out.sequences[*i].weight as f64;
                let a = trl_adv[*i] as f64;
                let lp = comps[*i].logps.as_ref().unwrap();
                let old = comps[*i].old_logps.as_ref().unwrap_or(lp);
                let rho_seq = (lp
                    .iter()
                    .zip(old)
                    .map(|(&x, &o)| x as f64 - o as f64)
                    .sum::<f64>()
                    / lp.len() as f64)
                    .exp();
                let reference = comps[*i].ref_logps.as_ref();
                let k3max = reference.map_or(0.0, |r| {
                    r.iter().zip(lp).fold(0.0f64, |m, (&r, &x)| {
                        let d = r as f64 - x as f64;
                        m.max((d.exp() - d - 1.0).abs())
                    })
                });
                for t in 0..want.len() {
                    let rho = match cfg.importance_sampling {
                        ImportanceSampling::Token => (lp[t] as f64 - old[t] as f64).exp(),
                        ImportanceSampling::Sequence => rho_seq,
                    };
                    let e = reference.map_or(0.0, |r| (r[t] as f64 - lp[t] as f64).exp());
                    let scale = w
                        * (a.abs() * rho.max(1.0)
                            + cfg.beta as f64 * rho * (1.0 + e + 2.0 * k3max));
                    let bound = (max_len as f64 + 16.0) * U * scale + w * rho.max(1.0) * da[*i];
                    let (mine, theirs) = (got[t] as f64, want[t] as f64);
                    assert!(
                        (mine - theirs).abs() <= bound,
                        "{name}: update {u}, sequence {i}, token {t}: HiLoRe {mine}, TRL {theirs}, bound {bound:e}"
                    );
                    tokens += 1;
                    worst = worst.max((mine - theirs).abs());
                    cmax = cmax.max(theirs.abs());
                }
            }
        }
        assert!(
            seen.iter().all(|&s| s),
            "{name}: a TRL update was not compared"
        );
        eprintln!(
            "{name:<32} {} updates: max |dA| {worst_a:.1e}, max |dc| / max |c| {:.1e}",
            batches.len(),
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
