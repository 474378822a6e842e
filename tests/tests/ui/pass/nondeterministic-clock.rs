//! A unit without `deterministic` may read the clock: it is stored or compressed, never
//! recomputed, and a plan asking for Recompute is refused.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Error, Fidelity, Grads, Plan, Result, Var};
use std::time::Instant;

#[recovery_unit(cost = x.elem_count())]
fn jitter(cx: &mut Cx, x: &Var) -> Result<Var> {
    let started = Instant::now();
    let y = cx.mul(x, x)?;
    // Nondeterministic, on purpose: the scale depends on the clock (always in (0, 1]).
    let s = 1.0 / (1.0 + started.elapsed().as_secs_f64());
    cx.scale(&y, s)
}

fn run(x: &Var, plan: Plan) -> Result<()> {
    let mut cx = Cx::new(plan);
    let y = jitter(&mut cx, x)?;
    let mut grads = Grads::new();
    let seed = Tensor::ones(y.dims(), y.dtype(), y.device())?;
    cx.backward(&y, &seed, &mut grads)?;
    assert!(grads.get(x.id()).is_some());
    assert_eq!(cx.memory().live_bytes(), 0);
    Ok(())
}

fn main() -> Result<()> {
    let x = Var::param(Tensor::randn(0f32, 1.0, (3, 4), &Device::Cpu)?);
    run(&x, Plan::store_all())?;
    run(
        &x,
        Plan::store_all().with_unit("jitter", Fidelity::Compress("bf16")),
    )?;
    match run(
        &x,
        Plan::store_all().with_unit("jitter", Fidelity::Recompute),
    ) {
        Err(e @ Error::NotDeterministic { .. }) => assert!(e.to_string().contains("`jitter`")),
        other => panic!("Recompute of a non-deterministic unit must be refused, got {other:?}"),
    }
    Ok(())
}
