//! A unit returning two tape values.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Plan, Result, Var};

struct GateUp {
    gate: Var,
    up: Var,
}

impl GateUp {
    #[recovery_unit(cost = 4 * x.elem_count() * self.gate.dim(0)?, deterministic)]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<(Var, Var)> {
        let g = cx.linear(x, &self.gate, None)?;
        let u = cx.linear(x, &self.up, None)?;
        Ok((g, u))
    }
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

fn run(m: &GateUp, x: &Var, plan: Plan) -> Result<Vec<u32>> {
    let mut cx = Cx::new(plan);
    let (g, u) = m.forward(&mut cx, x)?;
    let y = cx.swiglu(&g, &u)?;
    let mut grads = Grads::new();
    let seed = Tensor::ones(y.dims(), y.dtype(), y.device())?;
    cx.backward(&y, &seed, &mut grads)?;
    let mut out = bits(grads.get(m.gate.id()).expect("gate has a gradient"))?;
    out.extend(bits(grads.get(m.up.id()).expect("up has a gradient"))?);
    Ok(out)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let m = GateUp {
        gate: Var::param(Tensor::randn(0f32, 1.0, (6, 4), &dev)?),
        up: Var::param(Tensor::randn(0f32, 1.0, (6, 4), &dev)?),
    };
    let x = Var::constant(Tensor::randn(0f32, 1.0, (3, 4), &dev)?);
    let stored = run(&m, &x, Plan::store_all())?;
    let recomputed = run(
        &m,
        &x,
        Plan::store_all().with_unit("forward", Fidelity::Recompute),
    )?;
    assert_eq!(stored, recomputed);
    Ok(())
}
