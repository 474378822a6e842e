//! A free function as a unit, run stored and recomputed: gradients are bit-identical.

use candle_core::{DType, Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Plan, Result, Var};

#[recovery_unit(cost = 2 * x.dim(0)? * x.dim(1)? * w.dim(0)?, deterministic)]
fn project(cx: &mut Cx, x: &Var, w: &Var) -> Result<Var> {
    let h = cx.linear(x, w, None)?;
    cx.silu(&h)
}

fn grad_of_w(plan: Plan, x: &Var, w: &Var) -> Result<Vec<u32>> {
    let mut cx = Cx::new(plan);
    let y = project(&mut cx, x, w)?;
    let mut grads = Grads::new();
    let seed = Tensor::ones(y.dims(), DType::F32, &Device::Cpu)?;
    cx.backward(&y, &seed, &mut grads)?;
    assert_eq!(cx.memory().live_bytes(), 0);
    let g = grads.get(w.id()).expect("w has a gradient");
    Ok(g.flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .map(|v| v.to_bits())
        .collect())
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let x = Var::constant(Tensor::randn(0f32, 1.0, (3, 4), &dev)?);
    let w = Var::param(Tensor::randn(0f32, 1.0, (5, 4), &dev)?);
    let stored = grad_of_w(Plan::store_all(), &x, &w)?;
    let recomputed = grad_of_w(
        Plan::store_all().with_unit("project", Fidelity::Recompute),
        &x,
        &w,
    )?;
    assert_eq!(stored, recomputed);
    Ok(())
}
