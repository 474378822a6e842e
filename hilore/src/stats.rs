//! Statistics of paired differences (one per seed): mean, standard error, a 95% interval
//! from Student's t, and an exact two-sided sign test.

use serde::{Deserialize, Serialize};

/// A summary of paired differences `d_i` (e.g. HiLoRe minus exact, per seed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Paired {
    /// Number of pairs.
    pub n: usize,
    pub mean: f64,
    /// Sample standard deviation (divides by `n - 1`; 0 for one pair).
    pub sd: f64,
    /// Standard error of the mean, `sd / sqrt(n)`.
    pub se: f64,
    /// The 95% confidence interval of the mean, `mean +- t(0.975, n - 1) se`
    /// (unbounded for one pair).
    pub ci95_low: f64,
    pub ci95_high: f64,
    /// Pairs above, below and at zero.
    pub positive: usize,
    pub negative: usize,
    pub zero: usize,
    /// Two-sided exact sign test: the probability, with each nonzero difference equally
    /// likely positive or negative, of a split at least as uneven as the one seen
    /// (ties left out; 1 when all are ties).
    pub sign_test_p: f64,
}

impl Paired {
    /// The summary of `diffs`. Errors on no pairs or a non-finite difference.
    pub fn of(diffs: &[f64]) -> anyhow::Result<Self> {
        anyhow::ensure!(!diffs.is_empty(), "no paired differences to summarise");
        if let Some(i) = diffs.iter().position(|d| !d.is_finite()) {
            anyhow::bail!(
                "paired difference {i} is {}; every run must report a finite accuracy",
                diffs[i]
            );
        }
        let n = diffs.len();
        let mean = diffs.iter().sum::<f64>() / n as f64;
        let sd = if n > 1 {
            (diffs.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        let se = sd / (n as f64).sqrt();
        let half = if n > 1 {
            t_975(n - 1) * se
        } else {
            f64::INFINITY
        };
        let positive = diffs.iter().filter(|&&d| d > 0.0).count();
        let negative = diffs.iter().filter(|&&d| d < 0.0).count();
        Ok(Paired {
            n,
            mean,
            sd,
            se,
            ci95_low: mean - half,
            ci95_high: mean + half,
            positive,
            negative,
            zero: n - positive - negative,
            sign_test_p: sign_test(positive, negative),
        })
    }
}

/// The 0.975 quantile of Student's t with `df` degrees of freedom: the table for
/// `df <= 30` (to 3 decimals), beyond it the Cornish-Fisher expansion around the normal
/// quantile, whose error there is below 1e-4.
pub fn t_975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    if (1..=30).contains(&df) {
        return TABLE[df - 1];
    }
    let z = 1.959_963_984_540_054f64;
    let v = df.max(1) as f64;
    z + (z.powi(3) + z) / (4.0 * v)
        + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * v * v)
}

/// Two-sided exact sign test of `pos` against `neg` (ties already left out).
pub fn sign_test(pos: usize, neg: usize) -> f64 {
    let m = pos + neg;
    if m == 0 {
        return 1.0;
    }
    let k = pos.min(neg);
    // P(X <= k) for X ~ Binomial(m, 1/2), by log-binomial terms.
    let ln_half_m = m as f64 * 0.5f64.ln();
    let mut ln_c = 0.0; // ln C(m, 0)
    let mut tail = 0.0;
    for i in 0..=k {
        if i > 0 {
            ln_c += ((m - i + 1) as f64).ln() - (i as f64).ln();
        }
        tail += (ln_c + ln_half_m).exp();
    }
    (2.0 * tail).min(1.0)
}

/// The least-squares slope of `ys` on `xs` (same length, at least two distinct `xs`):
/// `sum (x - mean x)(y - mean y) / sum (x - mean x)^2`. A trend test over paired runs
/// takes one slope per seed and summarises the slopes with [`Paired::of`]: the seeds are
/// independent, the levels within a seed are not.
pub fn slope(xs: &[f64], ys: &[f64]) -> anyhow::Result<f64> {
    anyhow::ensure!(
        xs.len() == ys.len() && xs.len() >= 2,
        "a slope needs two or more (x, y) points of equal count ({} x, {} y)",
        xs.len(),
        ys.len()
    );
    let n = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    anyhow::ensure!(sxx > 0.0, "a slope needs two distinct x values");
    let sxy: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    Ok(sxy / sxx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_summary_from_its_definitions() {
        let d = [1.0, -2.0, 3.0, 4.0, 0.0];
        let p = Paired::of(&d).unwrap();
        assert_eq!(p.n, 5);
        assert!((p.mean - 1.2).abs() < 1e-12);
        // sd = sqrt(((-0.2)^2 + 3.2^2 + 1.8^2 + 2.8^2 + 1.2^2) / 4) = sqrt(22.8 / 4)
        assert!((p.sd - (22.8f64 / 4.0).sqrt()).abs() < 1e-12);
        assert!((p.se - p.sd / 5f64.sqrt()).abs() < 1e-12);
        assert!((p.ci95_high - p.mean - 2.776 * p.se).abs() < 1e-12);
        assert_eq!((p.positive, p.negative, p.zero), (3, 1, 1));
        // 3 of 4 nonzero positive: 2 x P(X <= 1), X ~ Bin(4, 1/2) = 2 x 5/16.
        assert!((p.sign_test_p - 0.625).abs() < 1e-12);
        assert!(Paired::of(&[]).is_err());
        assert!(Paired::of(&[1.0, f64::NAN]).is_err());
        let one = Paired::of(&[0.5]).unwrap();
        assert!(one.ci95_low.is_infinite() && one.ci95_high.is_infinite());
    }

    #[test]
    fn slope_of_a_line_and_of_noise() {
        // y = 2 - 0.5 x exactly.
        let xs = [-2.5, -2.0, -1.5];
        let ys: Vec<f64> = xs.iter().map(|x| 2.0 - 0.5 * x).collect();
        assert!((slope(&xs, &ys).unwrap() + 0.5).abs() < 1e-12);
        // (0,1), (1,0), (2,2): means 1, 1; sxy = (-1)(0) + 0 + (1)(1) = 1; sxx = 2.
        assert!((slope(&[0.0, 1.0, 2.0], &[1.0, 0.0, 2.0]).unwrap() - 0.5).abs() < 1e-12);
        assert!(slope(&[1.0, 1.0], &[0.0, 1.0]).is_err());
        assert!(slope(&[1.0], &[0.0]).is_err());
    }

    #[test]
    fn sign_test_and_t_quantiles_match_tables() {
        // 8 of 10: 2 x (1 + 10 + 45) / 1024 = 0.109375; 10 of 10: 2 / 1024.
        assert!((sign_test(8, 2) - 0.109_375).abs() < 1e-12);
        assert!((sign_test(0, 10) - 2.0 / 1024.0).abs() < 1e-12);
        assert_eq!(sign_test(5, 5), 1.0);
        assert_eq!(sign_test(0, 0), 1.0);
        // Published quantiles: df 40: 2.0211, 60: 2.0003, 120: 1.9799, 1000: 1.9623.
        for (df, want) in [(40, 2.0211), (60, 2.0003), (120, 1.9799), (1000, 1.9623)] {
            assert!((t_975(df) - want).abs() < 2e-4, "df {df}: {}", t_975(df));
        }
        assert_eq!(t_975(9), 2.262);
    }
}
