//! Does every fidelity recover a model's gradient? What `hilore check` does for the
//! built-in decoder, for any model: run its forward and backward under store-all (the
//! reference), under Recompute of each deterministic unit alone and of all of them, and
//! under compress-all for every codec, and compare every parameter gradient with the
//! reference's.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use hilore_runtime::{check::check_recovery, recovery_unit, Cx, Result, Var};
//!
//! #[recovery_unit(cost = 2 * x.elem_count() * w.dim(0)?, deterministic)]
//! fn layer(cx: &mut Cx, x: &Var, w: &Var) -> Result<Var> {
//!     let h = cx.linear(x, w, None)?;
//!     cx.silu(&h)
//! }
//!
//! # fn main() -> Result<()> {
//! let dev = Device::Cpu;
//! let w = Var::param(Tensor::randn(0f32, 0.5, (8, 8), &dev)?);
//! let x = Var::constant(Tensor::randn(0f32, 1.0, (4, 8), &dev)?);
//! let seed = Tensor::randn(0f32, 1.0, (4, 8), &dev)?;
//! let report = check_recovery(|cx| layer(cx, &x, &w), &[w.clone()], &seed)?;
//! assert!(report.exact_plans_bit_identical(), "{report:?}");
//! # Ok(())
//! # }
//! ```

use crate::{Cx, Error, Fidelity, Grads, Plan, Result, Var};
use candle_core::{DType, Tensor};

/// One plan's outcome.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CheckRow {
    /// The plan (`store-all`, `recompute <unit>`, `recompute-all`, `compress-all(codec)`).
    pub plan: String,
    /// Whether the plan is exact (Store and Recompute only): its gradients must equal the
    /// reference's bit for bit.
    pub exact: bool,
    /// `||g - g_ref|| / ||g_ref||` over every parameter gradient.
    pub rel_l2: f64,
    /// Whether every gradient equals the reference's bit for bit.
    pub bit_identical: bool,
    /// Peak bytes of the tape's activation memory.
    pub peak_activation_bytes: usize,
    /// Recomputes verified (fingerprinted), and those that were not bit-identical.
    pub recompute_checks: usize,
    pub failed_recompute_checks: usize,
}

/// What [`check_recovery`] found.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CheckReport {
    pub rows: Vec<CheckRow>,
}

impl CheckReport {
    /// Whether every exact plan gave the reference's gradients bit for bit and every
    /// recompute replayed bit-identically.
    pub fn exact_plans_bit_identical(&self) -> bool {
        self.rows
            .iter()
            .all(|r| r.failed_recompute_checks == 0 && (!r.exact || r.bit_identical))
    }
}

/// One plan's run: the parameters' gradients, the activation peak, the recompute checks
/// and the unit instances.
struct Pass {
    grads: Vec<Tensor>,
    peak: usize,
    checks: usize,
    failed: usize,
    units: Vec<crate::UnitInstanceInfo>,
}

/// Runs `forward` and the backward seeded with `seed` under every plan (see the module
/// docs) and compares the gradients of `params` with store-all's. `forward` must build
/// the same graph each time it is called (the model's forward on fixed inputs).
pub fn check_recovery<'m, F>(forward: F, params: &[Var], seed: &Tensor) -> Result<CheckReport>
where
    F: Fn(&mut Cx<'m>) -> Result<Var>,
{
    let run = |plan: Plan| -> Result<Pass> {
        let mut cx = Cx::new(plan).report_recompute_checks(true);
        let y = forward(&mut cx)?;
        let mut grads = Grads::new();
        let report = cx.backward(&y, seed, &mut grads)?;
        let failed = report.checks.iter().filter(|c| !c.bit_identical).count();
        let g = params
            .iter()
            .map(|p| {
                grads.get(p.id()).cloned().ok_or_else(|| {
                    Error::Tape("check_recovery: a parameter got no gradient under store-all; pass only the parameters the forward reads".into())
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Pass {
            grads: g,
            peak: cx.memory().peak_bytes(),
            checks: report.checks.len(),
            failed,
            units: cx.unit_instances(),
        })
    };
    let Pass {
        grads: reference,
        peak,
        units,
        ..
    } = run(Plan::store_all())?;
    let mut rows = vec![CheckRow {
        plan: "store-all".into(),
        exact: true,
        rel_l2: 0.0,
        bit_identical: true,
        peak_activation_bytes: peak,
        recompute_checks: 0,
        failed_recompute_checks: 0,
    }];
    let mut names: Vec<&'static str> = units
        .iter()
        .filter(|u| u.deterministic)
        .map(|u| u.unit)
        .collect();
    names.sort_unstable();
    names.dedup();
    let mut plans: Vec<(String, bool, Plan)> = names
        .iter()
        .map(|&n| {
            (
                format!("recompute {n}"),
                true,
                Plan::store_all().with_unit(n, Fidelity::Recompute),
            )
        })
        .collect();
    if names.len() > 1 {
        let all = names.iter().fold(Plan::store_all(), |p, &n| {
            p.with_unit(n, Fidelity::Recompute)
        });
        plans.push(("recompute-all".into(), true, all));
    }
    for codec in hilore_kernels::codec_names() {
        // Units that restrict their codecs stay stored.
        let mut plan = Plan::compress_all(codec)?;
        for u in &units {
            if u.codecs.is_some_and(|c| !c.contains(&codec)) {
                plan = plan.with_unit(u.unit, Fidelity::Store);
            }
        }
        plans.push((format!("compress-all({codec})"), false, plan));
    }
    for (name, exact, plan) in plans {
        let Pass {
            grads: g,
            peak,
            checks,
            failed,
            ..
        } = run(plan)?;
        let (mut num, mut den, mut same) = (0f64, 0f64, true);
        for (a, b) in g.iter().zip(&reference) {
            let a = a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            let b = b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            for (x, y) in a.iter().zip(&b) {
                num += (x - y) * (x - y);
                den += y * y;
                same &= x.to_bits() == y.to_bits();
            }
        }
        rows.push(CheckRow {
            plan: name,
            exact,
            rel_l2: if den > 0.0 {
                (num / den).sqrt()
            } else {
                num.sqrt()
            },
            bit_identical: same,
            peak_activation_bytes: peak,
            recompute_checks: checks,
            failed_recompute_checks: failed,
        });
    }
    Ok(CheckReport { rows })
}
