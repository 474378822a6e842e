//! The GRPO coefficients against a numerical derivative of the loss written from its
//! definition ([`grpo::loss`]: the min of the clipped and unclipped surrogates and the k3
//! term, a separate code path from the coefficient formula), over every branch; and the
//! edge cases of advantages, aggregation, exposure and packing.

use hilore_runtime::grpo::{
    self, advantages, aggregation_weights, aggregation_weights_masked, exposure_per_sequence,
    known_before_forward, microbatch_exposure, pack_by_token_budget, AdvantageNorm, Aggregation,
    Coefficients, GrpoConfig, ImportanceSampling, LossType, Sequences, Surrogate, TokenLogprobs,
};

/// splitmix64, so the tests need no RNG crate and are the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next()
    }
}

/// A random batch: `groups` groups of `g` sequences with 0..=8 response tokens, rewards in
/// {0, 0.1, 1} (all 0.1 in the first group), log-probs in [-4, -0.05], old log-probs such that `rho` lands in
/// [0.5, 1.6] (so both clip sides are hit with the default 0.2 / 0.28 clip), reference
/// log-probs within +-1 of the current ones.
struct Batch {
    lengths: Vec<usize>,
    rewards: Vec<f32>,
    logp: Vec<f32>,
    old: Vec<f32>,
    reference: Vec<f32>,
}

const H: f64 = 1e-3;

/// Every loss type (`dr_grpo` with a completion limit of 9 tokens, above the batches'
/// 8) and every reward scaling.
const LOSS_TYPES: [Aggregation; 3] = [
    Aggregation::TokenMean,
    Aggregation::SeqMeanTokenMean,
    Aggregation::DrGrpo {
        max_completion_length: 9,
    },
];
const SCALINGS: [AdvantageNorm; 3] = [
    AdvantageNorm::GroupStd,
    AdvantageNorm::BatchStd,
    AdvantageNorm::None,
];

fn batch(seed: u64, groups: usize, g: usize, cfg: &GrpoConfig) -> Batch {
    let mut r = Rng(seed);
    let n = groups * g;
    let lengths: Vec<usize> = (0..n).map(|_| (r.next() * 9.0) as usize).collect();
    let mut rewards: Vec<f32> = (0..n)
        .map(|_| [0.0, 0.1, 1.0][(r.next() * 3.0) as usize % 3])
        .collect();
    // The first group scores all alike: its advantages are 0.
    rewards[..g].fill(0.1);
    let total: usize = lengths.iter().sum();
    let (lo, hi) = (1.0 - cfg.eps_low as f64, 1.0 + cfg.eps_high as f64);
    let mut logp = Vec::with_capacity(total);
    let mut old = Vec::with_capacity(total);
    let mut reference = Vec::with_capacity(total);
    for _ in 0..total {
        let lp = r.range(-4.0, -0.05) as f32;
        // Keep rho at least 20 h (relative) away from the clip boundaries, so the central
        // difference never straddles a kink.
        let rho = loop {
            let rho = r.range(0.5, 1.6);
            let delta = cfg.delta.map_or(f64::INFINITY, |d| d as f64);
            if (rho - lo).abs() > 20.0 * H * rho
                && (rho - hi).abs() > 20.0 * H * rho
                && (rho - delta).abs() > 20.0 * H * rho
            {
                break rho;
            }
        };
        logp.push(lp);
        old.push((lp as f64 - rho.ln()) as f32);
        reference.push((lp as f64 + r.range(-1.0, 1.0)) as f32);
    }
    Batch {
        lengths,
        rewards,
        logp,
        old,
        reference,
    }
}

/// Checks every coefficient against the central difference of `grpo::loss` in that
/// token's log-prob; returns how many tokens were in each branch
/// `(unclipped A > 0, unclipped A < 0, clipped high, clipped low, A = 0)`.
fn check_against_fd(cfg: &GrpoConfig, b: &Batch, g: usize, with_old: bool) -> [usize; 5] {
    let adv = advantages(&b.rewards, g, cfg.advantage_norm, cfg.std_eps).unwrap();
    let w = aggregation_weights(&b.lengths, cfg.aggregation);
    let seqs = Sequences {
        lengths: &b.lengths,
        advantages: &adv,
        weights: &w,
    };
    // Without old log-probs the policy has not moved since sampling: logp_old is the
    // current log-prob's value, a constant of the loss (the detached copy).
    let old_const: &[f32] = if with_old { &b.old } else { &b.logp };
    let lp = |logp: &[f32]| -> f64 {
        grpo::loss(
            cfg,
            seqs,
            TokenLogprobs {
                logp,
                old: Some(old_const),
                reference: Some(&b.reference),
            },
        )
        .unwrap()
    };
    let c = Coefficients::after_forward(
        cfg,
        seqs,
        TokenLogprobs {
            logp: &b.logp,
            old: with_old.then_some(b.old.as_slice()),
            reference: Some(&b.reference),
        },
    )
    .unwrap();
    assert_eq!(c.per_token.len(), b.logp.len());
    let (lo, hi) = (1.0 - cfg.eps_low as f64, 1.0 + cfg.eps_high as f64);
    let mut branches = [0usize; 5];
    let mut t = 0;
    for (i, &len) in b.lengths.iter().enumerate() {
        let a = adv[i] as f64;
        for _ in 0..len {
            let mut plus = b.logp.clone();
            let mut minus = b.logp.clone();
            plus[t] = (b.logp[t] as f64 + H) as f32;
            minus[t] = (b.logp[t] as f64 - H) as f32;
            // The exact perturbation after rounding the inputs to f32.
            let delta = plus[t] as f64 - minus[t] as f64;
            let fd = (lp(&plus) - lp(&minus)) / delta;
            let rho = if with_old {
                (b.logp[t] as f64 - b.old[t] as f64).exp()
            } else {
                1.0
            };
            let e = (b.reference[t] as f64 - b.logp[t] as f64).exp();
            // Scale of the token's terms: the FD truncation error is about
            // h^2 / 6 * (third derivative) ~ 2e-7 * scale, the f32 rounding of c
            // 6e-8 * scale, the f64 loss's rounding over 2h about 1e-13: 1e-5 * scale
            // leaves a 50x margin; a wrong branch or a missing term is O(scale).
            // The KL part is beta * (1 - e) or, bias-corrected, beta * rho * (1 - e + k3):
            // at most beta * rho * (1 + e + |k3|).
            let k3 = e - (b.reference[t] as f64 - b.logp[t] as f64) - 1.0;
            let scale = w[i] as f64
                * (a.abs() * rho + cfg.beta as f64 * rho * (1.0 + e + k3.abs()))
                + 1e-12;
            let got = c.per_token[t] as f64;
            assert!(
                (got - fd).abs() <= 1e-5 * scale,
                "token {t} of sequence {i}: coefficient {got}, numerical derivative {fd} (A {a}, rho {rho}, scale {scale})"
            );
            let k = if a == 0.0 {
                4
            } else if (a > 0.0 && rho > hi)
                || (a < 0.0 && cfg.delta.is_some_and(|d| rho > d as f64))
            {
                2
            } else if a < 0.0 && rho < lo {
                3
            } else if a > 0.0 {
                0
            } else {
                1
            };
            branches[k] += 1;
            t += 1;
        }
    }
    branches
}

#[test]
fn coefficients_equal_numerical_derivative_of_the_loss_on_every_branch() {
    let mut seen = [0usize; 5];
    let mut cases = 0;
    for aggregation in LOSS_TYPES {
        for advantage_norm in SCALINGS {
            for beta in [0.0, 0.04, 0.5] {
                for (kl_bias_correction, delta) in [(true, None), (false, None), (true, Some(1.4))]
                {
                    for with_old in [true, false] {
                        let cfg = GrpoConfig {
                            beta,
                            aggregation,
                            advantage_norm,
                            kl_bias_correction,
                            delta,
                            // DAPO's clip-higher, so both ranges are exercised.
                            eps_high: 0.28,
                            ..GrpoConfig::default()
                        };
                        let b = batch(11 + cases as u64, 4, 5, &cfg);
                        let br = check_against_fd(&cfg, &b, 5, with_old);
                        for k in 0..5 {
                            seen[k] += br[k];
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    // Every branch was exercised, many times.
    for (k, name) in [
        "unclipped A > 0",
        "unclipped A < 0",
        "clipped high (A > 0, rho > 1 + eps_high; or A < 0, rho > delta)",
        "clipped low (A < 0, rho < 1 - eps_low)",
        "A = 0",
    ]
    .iter()
    .enumerate()
    {
        assert!(seen[k] >= 20, "branch {name} was hit {} times", seen[k]);
    }
}

#[test]
fn symmetric_and_asymmetric_clip_ranges() {
    for (lo, hi) in [(0.2, 0.2), (0.1, 0.4), (0.3, 0.05)] {
        let cfg = GrpoConfig {
            eps_low: lo,
            eps_high: hi,
            beta: 0.1,
            ..GrpoConfig::default()
        };
        let b = batch(99, 3, 4, &cfg);
        check_against_fd(&cfg, &b, 4, true);
    }
}

#[test]
fn clipped_tokens_have_zero_policy_coefficient_and_are_counted() {
    let cfg = GrpoConfig::default();
    // One sequence with A > 0 (reward 1 vs 0): rho 1.5 is clipped high, rho 1.1 is not.
    let rewards = [1.0, 0.0];
    let adv = advantages(&rewards, 2, cfg.advantage_norm, cfg.std_eps).unwrap();
    let lengths = [2, 2];
    let w = aggregation_weights(&lengths, cfg.aggregation);
    let logp = [-1.0f32, -1.0, -1.0, -1.0];
    let old = [
        (-1.0f64 - 1.5f64.ln()) as f32,
        (-1.0f64 - 1.1f64.ln()) as f32,
        (-1.0f64 - 0.5f64.ln()) as f32,
        (-1.0f64 - 0.9f64.ln()) as f32,
    ];
    let c = Coefficients::after_forward(
        &cfg,
        Sequences {
            lengths: &lengths,
            advantages: &adv,
            weights: &w,
        },
        TokenLogprobs {
            logp: &logp,
            old: Some(&old),
            reference: None,
        },
    )
    .unwrap();
    assert_eq!(c.per_token[0], 0.0, "A > 0, rho 1.5 > 1.28: clipped");
    assert!(c.per_token[1] < 0.0, "A > 0, rho 1.1: pushes logp up");
    assert_eq!(c.per_token[2], 0.0, "A < 0, rho 0.5 < 0.8: clipped");
    assert!(c.per_token[3] > 0.0, "A < 0, rho 0.9: pushes logp down");
    assert_eq!(c.stats.clipped_high, 1);
    assert_eq!(c.stats.clipped_low, 1);
    assert_eq!(c.stats.clip_fraction(), 0.5);
}

#[test]
fn before_forward_is_minus_a_w_and_matches_after_forward_in_the_first_epoch() {
    // Every loss type, importance sampling level, reward scaling, two-sided clip and
    // truncation mask: with beta = 0 and the first optimizer step the coefficients are
    // known before the forward, and equal the after-forward ones bit for bit, with no old
    // log-probs or with the current ones as old (TRL's `old = logp.detach()`).
    let truncated: Vec<bool> = (0..12).map(|i| i % 5 == 2).collect();
    for name in LossType::NAMES {
        for importance_sampling in [ImportanceSampling::Token, ImportanceSampling::Sequence] {
            for advantage_norm in SCALINGS {
                for (delta, masked) in [(None, false), (Some(1.5), true)] {
                    let t = LossType::parse(name, 9).unwrap();
                    let cfg = GrpoConfig {
                        advantage_norm,
                        delta: delta.filter(|_| t.surrogate == Surrogate::Clip),
                        mask_truncated_completions: masked,
                        importance_sampling,
                        ..GrpoConfig::default()
                    }
                    .with_loss_type(t);
                    cfg.validate().unwrap();
                    assert!(known_before_forward(&cfg, 0), "{cfg:?}");
                    assert!(!known_before_forward(&cfg, 1), "{cfg:?}");
                    let b = batch(5, 3, 4, &cfg);
                    let adv = advantages(&b.rewards, 4, cfg.advantage_norm, cfg.std_eps).unwrap();
                    let w = aggregation_weights_masked(
                        &b.lengths,
                        masked.then_some(truncated.as_slice()),
                        cfg.aggregation,
                    );
                    let seqs = Sequences {
                        lengths: &b.lengths,
                        advantages: &adv,
                        weights: &w,
                    };
                    let pre = Coefficients::before_forward(&cfg, seqs).unwrap();
                    for old in [None, Some(b.logp.as_slice())] {
                        let lp = TokenLogprobs {
                            logp: &b.logp,
                            old,
                            reference: None,
                        };
                        let post = Coefficients::after_forward(&cfg, seqs, lp).unwrap();
                        assert_eq!(pre.per_token, post.per_token, "{cfg:?}");
                    }
                    // Not vacuous: some tokens carry a coefficient.
                    assert!(pre.per_token.iter().any(|&c| c != 0.0), "{cfg:?}");
                }
            }
        }
    }
    let cfg = GrpoConfig::default();
    assert!(known_before_forward(&cfg, 0));
    assert!(!known_before_forward(&cfg, 1), "epoch 2: rho != 1");
    let kl = GrpoConfig { beta: 0.1, ..cfg };
    assert!(!known_before_forward(&kl, 0), "KL needs the current logp");
    let b = batch(5, 3, 4, &cfg);
    let adv = advantages(&b.rewards, 4, cfg.advantage_norm, cfg.std_eps).unwrap();
    let w = aggregation_weights(&b.lengths, cfg.aggregation);
    let seqs = Sequences {
        lengths: &b.lengths,
        advantages: &adv,
        weights: &w,
    };
    let pre = Coefficients::before_forward(&cfg, seqs).unwrap();
    let post = Coefficients::after_forward(
        &cfg,
        seqs,
        TokenLogprobs {
            logp: &b.logp,
            old: None,
            reference: None,
        },
    )
    .unwrap();
    // Bit for bit: the same product rounded once.
    assert_eq!(pre.per_token, post.per_token);
    assert_eq!(pre.offsets, post.offsets);
    for i in 0..b.lengths.len() {
        for &c in pre.sequence(i) {
            assert_eq!(c, (-(adv[i] as f64) * w[i] as f64) as f32);
        }
    }
    // The loss agrees too (rho = 1: l = -A per token).
    let l = grpo::loss(
        &cfg,
        seqs,
        TokenLogprobs {
            logp: &b.logp,
            old: None,
            reference: None,
        },
    )
    .unwrap();
    assert!((pre.stats.loss - l).abs() <= 1e-12 * l.abs().max(1.0));
    // With a KL term the coefficients are not known before the forward.
    let err = Coefficients::before_forward(&kl, seqs)
        .unwrap_err()
        .to_string();
    assert!(err.contains("after_forward"), "{err}");
}

#[test]
fn advantages_edge_cases() {
    let eps = 1e-4;
    // All-equal groups: exactly 0, for both normalisations.
    for norm in [
        AdvantageNorm::GroupStd,
        AdvantageNorm::BatchStd,
        AdvantageNorm::None,
    ] {
        let a = advantages(&[0.1, 0.1, 0.1, 1.0, 1.0, 1.0], 3, norm, eps).unwrap();
        assert!(a.iter().all(|&x| x == 0.0), "{a:?}");
    }
    // G = 1: every advantage is 0.
    let a = advantages(&[0.3, 1.0, 0.0], 1, AdvantageNorm::GroupStd, eps).unwrap();
    assert_eq!(a, vec![0.0; 3]);
    // GroupStd: zero mean, unit sample std (divided by G - 1, as TRL's torch.std; up to
    // eps) within each group.
    let r = [0.0, 1.0, 1.0, 0.1, 0.0, 0.0, 0.0, 1.0];
    let a = advantages(&r, 4, AdvantageNorm::GroupStd, eps).unwrap();
    for g in a.chunks(4) {
        let m: f64 = g.iter().map(|&x| x as f64).sum::<f64>() / 4.0;
        let v: f64 = g.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / 3.0;
        assert!(m.abs() < 1e-6, "mean {m}");
        // std / (std + eps) with std >= 0.4 here: within 3e-4 of 1.
        assert!((v.sqrt() - 1.0).abs() < 3e-4, "std {}", v.sqrt());
    }
    // Two responses, rewards 0 and 1: mean 0.5, sample std sqrt(0.5), so
    // A = +-0.5 / (sqrt(0.5) + 1e-4) = +-0.707007 (TRL's number; the population std 0.5
    // would give +-0.9998).
    let a = advantages(&[0.0, 1.0], 2, AdvantageNorm::GroupStd, eps).unwrap();
    let want = 0.5 / (0.5f64.sqrt() + 1e-4);
    for (got, sign) in a.iter().zip([-1.0, 1.0]) {
        // f32 rounding of the result: 6e-8 relative.
        assert!(
            (*got as f64 - sign * want).abs() <= 1e-7,
            "{got} vs {}",
            sign * want
        );
    }
    // BatchStd: the group's mean, the whole batch's sample std. Rewards (0, 1 | 1, 1):
    // batch mean 0.75, sample std sqrt(0.75 / 3) = 0.5; the first group's advantages
    // are -+0.5 / (0.5 + 1e-4), the second group (all equal) exactly 0.
    let a = advantages(&[0.0, 1.0, 1.0, 1.0], 2, AdvantageNorm::BatchStd, eps).unwrap();
    let want = 0.5 / (0.5 + 1e-4);
    assert!(
        (a[0] as f64 + want).abs() <= 1e-7 && (a[1] as f64 - want).abs() <= 1e-7,
        "{a:?}"
    );
    assert_eq!(&a[2..], &[0.0, 0.0]);
    // Dr. GRPO: R - mean.
    let a = advantages(&[0.0, 1.0], 2, AdvantageNorm::None, eps).unwrap();
    assert_eq!(a, vec![-0.5, 0.5]);
    // Bad input.
    assert!(advantages(&[1.0, 0.0, 1.0], 2, AdvantageNorm::GroupStd, eps).is_err());
    assert!(advantages(&[1.0], 0, AdvantageNorm::GroupStd, eps).is_err());
    let err = advantages(&[1.0, f32::NAN], 2, AdvantageNorm::GroupStd, eps)
        .unwrap_err()
        .to_string();
    assert!(err.contains("finite"), "{err}");
}

#[test]
fn aggregation_weights_and_empty_or_long_responses() {
    let lengths = [0, 3, 5, 64];
    let w = aggregation_weights(&lengths, Aggregation::TokenMean);
    let total: f64 = lengths
        .iter()
        .zip(&w)
        .map(|(&l, &w)| l as f64 * w as f64)
        .sum();
    assert!(
        (total - 1.0).abs() < 1e-6,
        "token-mean weights sum to 1 over tokens"
    );
    assert_eq!(w[0], 0.0);
    // TRL's `grpo`: the mean over every sequence of the batch, the empty one counted, so
    // each non-empty sequence weighs 1/4 (not 1/3). f32 rounding of w: 6e-8 relative.
    let w = aggregation_weights(&lengths, Aggregation::SeqMeanTokenMean);
    for (i, &l) in lengths.iter().enumerate().skip(1) {
        assert!(
            (l as f64 * w[i] as f64 - 1.0 / 4.0).abs() < 1e-7,
            "each non-empty sequence of 4 weighs 1/4"
        );
    }
    assert_eq!(w[0], 0.0);
    // dr_grpo: one constant, 1 / (S * max_completion_length) = 1 / (4 * 64).
    let w = aggregation_weights(
        &lengths,
        Aggregation::DrGrpo {
            max_completion_length: 64,
        },
    );
    assert_eq!(w, vec![0.0, 1.0 / 256.0, 1.0 / 256.0, 1.0 / 256.0]);
    // mask_truncated_completions: a masked sequence weighs 0 and leaves dapo's token
    // count (1 / (3 + 64), not 1 / 72), but grpo's mean and dr_grpo's normaliser still
    // count it (1/4 per kept sequence; 1 / (4 * 64)). Sequence 2 (5 tokens) is masked.
    let masked = [false, false, true, false];
    let w = aggregation_weights_masked(&lengths, Some(&masked), Aggregation::TokenMean);
    assert_eq!(w, vec![0.0, 1.0 / 67.0, 0.0, 1.0 / 67.0]);
    let w = aggregation_weights_masked(&lengths, Some(&masked), Aggregation::SeqMeanTokenMean);
    assert_eq!(
        w,
        vec![0.0, (1.0 / 12.0f64) as f32, 0.0, (1.0 / 256.0f64) as f32]
    );
    let dr = Aggregation::DrGrpo {
        max_completion_length: 64,
    };
    let w = aggregation_weights_masked(&lengths, Some(&masked), dr);
    assert_eq!(w, vec![0.0, 1.0 / 256.0, 0.0, 1.0 / 256.0]);
    // Nothing masked: the plain weights.
    for agg in [Aggregation::TokenMean, Aggregation::SeqMeanTokenMean, dr] {
        assert_eq!(
            aggregation_weights_masked(&lengths, Some(&[false; 4]), agg),
            aggregation_weights(&lengths, agg)
        );
    }
    // No tokens at all: weights 0, no coefficients, zero loss.
    let w = aggregation_weights(&[0, 0], Aggregation::TokenMean);
    assert_eq!(w, vec![0.0, 0.0]);
    let cfg = GrpoConfig::default();
    let c = Coefficients::before_forward(
        &cfg,
        Sequences {
            lengths: &[0, 0],
            advantages: &[1.0, -1.0],
            weights: &w,
        },
    )
    .unwrap();
    assert!(c.per_token.is_empty());
    assert_eq!(c.offsets, vec![0, 0, 0]);
    assert_eq!(c.exposure_per_sequence(), vec![0.0, 0.0]);
}

#[test]
fn exposure_is_zero_exactly_for_zero_advantage_sequences() {
    let cfg = GrpoConfig::default();
    // Group 0 all equal (A = 0), group 1 mixed.
    let rewards = [1.0, 1.0, 0.0, 1.0];
    let adv = advantages(&rewards, 2, cfg.advantage_norm, cfg.std_eps).unwrap();
    let lengths = [4, 2, 3, 5];
    let w = aggregation_weights(&lengths, cfg.aggregation);
    let seqs = Sequences {
        lengths: &lengths,
        advantages: &adv,
        weights: &w,
    };
    let c = Coefficients::before_forward(&cfg, seqs).unwrap();
    let e = c.exposure_per_sequence();
    assert_eq!(e[0], 0.0);
    assert_eq!(e[1], 0.0);
    assert!(e[2] > 0.0 && e[3] > 0.0);
    // sqrt(sum c^2) = |A| w sqrt(len) per sequence (c = -A w on every token); the f32
    // coefficients carry a relative rounding of 2^-24, far inside 1e-6.
    for i in 2..4 {
        let want = adv[i].abs() as f64 * w[i] as f64 * (lengths[i] as f64).sqrt();
        assert!((e[i] - want).abs() <= 1e-6 * want);
    }
    assert_eq!(exposure_per_sequence(&c.per_token, &c.offsets), e);
    assert_eq!(microbatch_exposure(&e, &[0, 1]), 0.0);
    // Sequences add in quadrature (f64 sums of a few terms: 1e-15 relative).
    let both = (e[2] * e[2] + e[3] * e[3]).sqrt();
    assert!((microbatch_exposure(&e, &[1, 2, 3]) - both).abs() < 1e-15 * both.max(1.0));
    assert!((c.exposure() - both).abs() < 1e-12);
    // Later epochs too (beta = 0): A = 0 keeps the coefficient 0 whatever rho is.
    let logp = vec![-1.0f32; 14];
    let old = vec![-1.3f32; 14];
    let post = Coefficients::after_forward(
        &cfg,
        seqs,
        TokenLogprobs {
            logp: &logp,
            old: Some(&old),
            reference: None,
        },
    )
    .unwrap();
    assert!(post
        .sequence(0)
        .iter()
        .chain(post.sequence(1))
        .all(|&c| c == 0.0));
}

#[test]
fn packing_by_token_budget() {
    let rows = [5, 3, 4, 8, 1, 1];
    let packs = pack_by_token_budget(&rows, 8).unwrap();
    assert_eq!(packs, vec![vec![0, 1], vec![2], vec![3], vec![4, 5]]);
    for p in &packs {
        assert!(p.iter().map(|&i| rows[i]).sum::<usize>() <= 8);
    }
    // Every sequence exactly once, in order.
    let flat: Vec<usize> = packs.concat();
    assert_eq!(flat, (0..rows.len()).collect::<Vec<_>>());
    // One sequence longer than the budget: a clear error naming it and the fix.
    let err = pack_by_token_budget(&rows, 7).unwrap_err().to_string();
    assert!(err.contains("sequence 3 has 8 tokens"), "{err}");
    assert!(err.contains("at least 8"), "{err}");
    assert!(pack_by_token_budget(&rows, 0).is_err());
    assert!(pack_by_token_budget(&[], 4).unwrap().is_empty());
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let cfg = GrpoConfig {
        beta: 0.1,
        ..GrpoConfig::default()
    };
    let seqs = Sequences {
        lengths: &[2],
        advantages: &[1.0],
        weights: &[0.5],
    };
    let lp = [-1.0f32, -2.0];
    // beta > 0 without reference log-probs.
    let err = Coefficients::after_forward(
        &cfg,
        seqs,
        TokenLogprobs {
            logp: &lp,
            old: None,
            reference: None,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("reference"), "{err}");
    // Wrong lengths.
    let short = [-1.0f32];
    assert!(Coefficients::after_forward(
        &cfg,
        seqs,
        TokenLogprobs {
            logp: &short,
            old: None,
            reference: Some(&short),
        },
    )
    .is_err());
    // Mismatched per-sequence arrays.
    assert!(Coefficients::before_forward(
        &GrpoConfig::default(),
        Sequences {
            lengths: &[2, 3],
            advantages: &[1.0],
            weights: &[0.5, 0.5],
        },
    )
    .is_err());
    // Non-finite log-probs.
    let nan = [f32::NAN, -1.0];
    assert!(grpo::loss(
        &GrpoConfig::default(),
        seqs,
        TokenLogprobs {
            logp: &nan,
            old: None,
            reference: None,
        },
    )
    .is_err());
    // Invalid settings, each naming its field.
    for (bad, field) in [
        (
            GrpoConfig {
                eps_low: 1.0,
                ..GrpoConfig::default()
            },
            "eps_low",
        ),
        (
            GrpoConfig {
                eps_high: -0.1,
                ..GrpoConfig::default()
            },
            "eps_high",
        ),
        (
            GrpoConfig {
                beta: f32::NAN,
                ..GrpoConfig::default()
            },
            "beta",
        ),
        (
            GrpoConfig {
                epochs: 0,
                ..GrpoConfig::default()
            },
            "epochs",
        ),
        (
            GrpoConfig {
                std_eps: 0.0,
                ..GrpoConfig::default()
            },
            "std_eps",
        ),
    ] {
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains(field), "{err}");
    }
    assert!(GrpoConfig::default().validate().is_ok());
    assert!(AdvantageNorm::parse("zscore").is_err());
    assert!(LossType::parse("sum", 8).is_err());
    assert!(LossType::parse("luspo", 8)
        .unwrap_err()
        .to_string()
        .contains("not implemented"));
    for name in LossType::NAMES {
        assert_eq!(LossType::parse(name, 8).unwrap().name(), Some(name));
    }
    for (name, want) in [
        ("seq-mean-token-mean", Aggregation::SeqMeanTokenMean),
        ("grpo", Aggregation::SeqMeanTokenMean),
        ("dapo", Aggregation::TokenMean),
        (
            "dr_grpo",
            Aggregation::DrGrpo {
                max_completion_length: 8,
            },
        ),
    ] {
        assert_eq!(
            LossType::parse(name, 8).unwrap().aggregation,
            want,
            "{name}"
        );
    }
}

#[test]
fn two_sided_clipping_zeroes_negative_advantage_tokens_above_delta() {
    // One sequence with A = -0.707 (rewards 0 and 1 over G = 2, sample std sqrt(0.5)),
    // three tokens with rho = 1.1, 1.5, 3.0 against delta = 2 (eps_high 0.2).
    let cfg = GrpoConfig {
        delta: Some(2.0),
        ..GrpoConfig::default()
    };
    let adv = advantages(&[0.0, 1.0], 2, cfg.advantage_norm, cfg.std_eps).unwrap();
    let lengths = [3, 0];
    let w = aggregation_weights(&lengths, cfg.aggregation);
    let logp = [-1.0f32, -1.0, -1.0];
    let old: Vec<f32> = [1.1f64, 1.5, 3.0]
        .iter()
        .map(|r| (-1.0 - r.ln()) as f32)
        .collect();
    let seqs = Sequences {
        lengths: &lengths,
        advantages: &adv,
        weights: &w,
    };
    let lp = TokenLogprobs {
        logp: &logp,
        old: Some(&old),
        reference: None,
    };
    let c = Coefficients::after_forward(&cfg, seqs, lp).unwrap();
    let a = adv[0] as f64;
    assert!(a < 0.0);
    // Below delta (A < 0 is never clipped high): c = -A rho w, rho from the f32 inputs
    // (relative error of the f32 result 6e-8).
    for t in 0..2 {
        let rho = (logp[t] as f64 - old[t] as f64).exp();
        let want = -a * rho * w[0] as f64;
        assert!(
            (c.per_token[t] as f64 - want).abs() <= 1e-7 * want.abs(),
            "token {t}"
        );
    }
    // Above delta: no gradient, counted as clipped; without delta it would have one.
    assert_eq!(c.per_token[2], 0.0);
    assert_eq!(c.stats.clipped_high, 1);
    let plain = Coefficients::after_forward(&GrpoConfig::default(), seqs, lp).unwrap();
    assert!(plain.per_token[2] > 0.0);
    // A delta inside the clip range is refused, naming the field.
    let bad = GrpoConfig {
        delta: Some(1.1),
        ..GrpoConfig::default()
    };
    assert!(bad.validate().unwrap_err().to_string().contains("delta"));
    assert!(cfg.validate().is_ok());
}

/// The loss types beyond the clip (CISPO, SAPO, `bnpo`'s weights) and sequence-level
/// importance ratios (GSPO), each with and without old log-probs, KL and its bias
/// correction: every coefficient against the central difference of `grpo::loss` (CISPO's
/// weight held at the unperturbed log-probs, as autograd's detach does).
///
/// Bound as in the clip test: FD truncation ~h^2/6 x third derivative ~2e-7 x scale, f32
/// rounding of c 6e-8 x scale, so 1e-5 x scale is a 50x margin; a missing or wrong term is
/// O(scale). A sequence whose ratio lies within 20 h of a clip boundary (a kink the
/// central difference would straddle: one token moves the mean log-ratio by h / |o|) is
/// left out and counted.
#[test]
fn every_loss_type_and_sequence_level_ratios_equal_numerical_derivative() {
    let mut checked = 0usize;
    let mut skipped = 0usize;
    let mut seed = 500;
    for name in LossType::NAMES {
        for importance_sampling in [ImportanceSampling::Token, ImportanceSampling::Sequence] {
            for beta in [0.0f32, 0.3] {
                for kl_bias_correction in [true, false] {
                    for with_old in [true, false] {
                        let t = LossType::parse(name, 9).unwrap();
                        let cfg = GrpoConfig {
                            beta,
                            kl_bias_correction,
                            importance_sampling,
                            // CISPO's cap inside the batches' ratio range [0.5, 1.6].
                            eps_high: if t.surrogate == Surrogate::Cispo {
                                1.3
                            } else {
                                0.28
                            },
                            ..GrpoConfig::default()
                        }
                        .with_loss_type(t);
                        cfg.validate().unwrap();
                        seed += 1;
                        let b = batch(seed, 4, 5, &cfg);
                        let (c, s) = check_general_fd(&cfg, &b, 5, with_old);
                        checked += c;
                        skipped += s;
                    }
                }
            }
        }
    }
    assert!(checked >= 6 * 2 * 8 * 40, "only {checked} tokens checked");
    assert!(
        skipped * 20 <= checked,
        "{skipped} of {checked} tokens skipped at kinks"
    );
}

/// `bnpo`'s token means per loss microbatch, `dapo`'s over a generation of several
/// optimizer steps, and `grpo`'s and `dr_grpo`'s per-step sequence counts, from their
/// definitions on a small layout.
#[test]
fn aggregation_weights_follow_the_step_layout() {
    use hilore_runtime::grpo::{aggregation_weights_layout, StepLayout};
    // 8 sequences, microbatches of 2, accumulation 2, 4 microbatches per generation: 2
    // optimizer steps.
    let lengths = [3usize, 5, 0, 4, 2, 2, 7, 1];
    let layout = StepLayout::new(8, 2, 4).unwrap();
    assert_eq!(
        (
            layout.batch_size,
            layout.steps(),
            layout.sequences_per_step()
        ),
        (2, 2, 4)
    );
    let w = |a| aggregation_weights_layout(&lengths, None, a, layout);
    let bnpo = w(Aggregation::Bnpo);
    let mb_tokens = [8.0f64, 4.0, 4.0, 8.0];
    for (i, &l) in lengths.iter().enumerate() {
        let want = if l == 0 {
            0.0
        } else {
            1.0 / (2.0 * mb_tokens[i / 2])
        };
        assert_eq!(bnpo[i], want as f32, "bnpo {i}");
    }
    // dapo: N = 24 tokens over the generation, normaliser N x GA / SPG = 12.
    for (i, &x) in w(Aggregation::TokenMean).iter().enumerate() {
        assert_eq!(
            x,
            if lengths[i] == 0 { 0.0 } else { 1.0 / 12.0 },
            "dapo {i}"
        );
    }
    for (i, &x) in w(Aggregation::SeqMeanTokenMean).iter().enumerate() {
        let want = if lengths[i] == 0 {
            0.0
        } else {
            1.0 / (4.0 * lengths[i] as f64)
        };
        assert_eq!(x, want as f32, "grpo {i}");
    }
    let dr = w(Aggregation::DrGrpo {
        max_completion_length: 10,
    });
    assert_eq!(dr[0], (1.0f64 / 40.0) as f32);
    // A masked sequence leaves bnpo's token count of its microbatch.
    let masked = [false, true, false, false, false, false, false, false];
    let m = aggregation_weights_layout(&lengths, Some(&masked), Aggregation::Bnpo, layout);
    assert_eq!((m[0], m[1]), ((1.0f64 / 6.0) as f32, 0.0));
    // Layouts that do not divide are refused, naming the fix.
    for (n, ga, spg, what) in [
        (8, 3, 4, "multiple of gradient_accumulation_steps"),
        (9, 1, 2, "multiple of 2"),
        (8, 0, 4, "at least 1"),
    ] {
        let e = StepLayout::new(n, ga, spg).unwrap_err().to_string();
        assert!(e.contains(what), "{e}");
    }
}

/// Returns (tokens checked, tokens skipped at a sequence-level kink).
fn check_general_fd(cfg: &GrpoConfig, b: &Batch, g: usize, with_old: bool) -> (usize, usize) {
    let adv = advantages(&b.rewards, g, cfg.advantage_norm, cfg.std_eps).unwrap();
    let w = aggregation_weights(&b.lengths, cfg.aggregation);
    let seqs = Sequences {
        lengths: &b.lengths,
        advantages: &adv,
        weights: &w,
    };
    let old_const: &[f32] = if with_old { &b.old } else { &b.logp };
    let lp = |logp: &[f32]| -> f64 {
        grpo::loss_with_detached(
            cfg,
            seqs,
            TokenLogprobs {
                logp,
                old: Some(old_const),
                reference: Some(&b.reference),
            },
            Some(&b.logp),
        )
        .unwrap()
    };
    let c = Coefficients::after_forward(
        cfg,
        seqs,
        TokenLogprobs {
            logp: &b.logp,
            old: with_old.then_some(b.old.as_slice()),
            reference: Some(&b.reference),
        },
    )
    .unwrap();
    let mut kinks = vec![cfg.eps_high as f64 + 1.0, 1.0 - cfg.eps_low as f64];
    if cfg.surrogate == Surrogate::Cispo {
        kinks.clear();
    }
    let (mut checked, mut skipped) = (0, 0);
    let mut t = 0;
    for (i, &len) in b.lengths.iter().enumerate() {
        let a = adv[i] as f64;
        let span = t..t + len;
        t += len;
        let log_ratio = |k: usize| b.logp[k] as f64 - old_const[k] as f64;
        let seq_rho = (span.clone().map(log_ratio).sum::<f64>() / len.max(1) as f64).exp();
        if cfg.importance_sampling == ImportanceSampling::Sequence
            && kinks
                .iter()
                .any(|&k| (seq_rho - k).abs() <= 20.0 * H * seq_rho)
        {
            skipped += len;
            continue;
        }
        let k3s: Vec<f64> = span
            .clone()
            .map(|k| {
                let d = b.reference[k] as f64 - b.logp[k] as f64;
                d.exp() - d - 1.0
            })
            .collect();
        let k3_max = k3s.iter().fold(0.0f64, |m, &x| m.max(x.abs()));
        for k in span {
            let mut plus = b.logp.clone();
            let mut minus = b.logp.clone();
            plus[k] = (b.logp[k] as f64 + H) as f32;
            minus[k] = (b.logp[k] as f64 - H) as f32;
            let fd = (lp(&plus) - lp(&minus)) / (plus[k] as f64 - minus[k] as f64);
            let rho = match cfg.importance_sampling {
                ImportanceSampling::Token => log_ratio(k).exp(),
                ImportanceSampling::Sequence => seq_rho,
            };
            let e = (b.reference[k] as f64 - b.logp[k] as f64).exp();
            let scale = w[i] as f64
                * (a.abs() * rho.max(1.0) + cfg.beta as f64 * rho * (1.0 + e + 2.0 * k3_max))
                + 1e-12;
            let got = c.per_token[k] as f64;
            assert!(
                (got - fd).abs() <= 1e-5 * scale,
                "{} {}: token {k} of sequence {i}: coefficient {got}, numerical derivative {fd} (A {a}, rho {rho}, scale {scale})",
                cfg.loss_type(),
                cfg.importance_sampling
            );
            checked += 1;
        }
    }
    (checked, skipped)
}
