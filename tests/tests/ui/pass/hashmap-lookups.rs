//! A `deterministic` unit may look values up in a `HashMap` (lookups do not depend on its
//! random iteration order); it recomputes bit for bit.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Plan, Result, Var};
use std::collections::HashMap;

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn looked_up(cx: &mut Cx, x: &Var, which: u32) -> Result<Var> {
    let gains: HashMap<u32, f64> = HashMap::from([(0, 0.5), (1, 2.0)]);
    let g = gains.get(&which).copied().unwrap_or(1.0);
    let h = cx.mul(x, x)?;
    cx.scale(&h, g)
}

fn main() -> Result<()> {
    let x = Var::param(Tensor::randn(0f32, 1.0, (2, 3), &Device::Cpu)?);
    let seed = Tensor::randn(0f32, 1.0, (2, 3), &Device::Cpu)?;
    let mut cx = Cx::new(Plan::store_all().with_unit("looked_up", Fidelity::Recompute))
        .verify_recompute(true);
    let y = looked_up(&mut cx, &x, 1)?;
    cx.backward(&y, &seed, &mut Grads::new())?;
    Ok(())
}
