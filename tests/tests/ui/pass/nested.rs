//! A unit method that calls another unit: the inner unit owns its own ops' slots, the
//! outer one everything else. Every mix of Store and Recompute gives the same gradients.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Plan, Result, Var};

struct Mlp {
    up: Var,
    down: Var,
}

impl Mlp {
    #[recovery_unit(cost = 4 * x.elem_count() * self.up.dim(0)?, deterministic, name = "mlp")]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let h = cx.linear(x, &self.up, None)?;
        let h = cx.silu(&h)?;
        cx.linear(&h, &self.down, None)
    }
}

struct Block {
    norm: Var,
    mlp: Mlp,
}

impl Block {
    #[recovery_unit(cost = 3 * x.elem_count(), deterministic, name = "block")]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let h = cx.rms_norm(x, &self.norm, 1e-6)?;
        let h = self.mlp.forward(cx, &h)?;
        cx.add(x, &h)
    }
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

fn run(block: &Block, x: &Var, plan: Plan) -> Result<(Vec<u32>, usize)> {
    let mut cx = Cx::new(plan);
    let y = block.forward(&mut cx, x)?;
    let mut grads = Grads::new();
    let seed = Tensor::ones(y.dims(), y.dtype(), y.device())?;
    cx.backward(&y, &seed, &mut grads)?;
    assert_eq!(cx.memory().live_bytes(), 0);
    let mut g = Vec::new();
    for w in [&block.norm, &block.mlp.up, &block.mlp.down] {
        g.extend(bits(
            grads.get(w.id()).expect("every weight has a gradient"),
        )?);
    }
    Ok((g, cx.memory().peak_bytes()))
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let block = Block {
        norm: Var::param(Tensor::randn(1f32, 0.1, 8, &dev)?),
        mlp: Mlp {
            up: Var::param(Tensor::randn(0f32, 0.3, (16, 8), &dev)?),
            down: Var::param(Tensor::randn(0f32, 0.3, (8, 16), &dev)?),
        },
    };
    let x = Var::constant(Tensor::randn(0f32, 1.0, (4, 8), &dev)?);
    let (stored, stored_peak) = run(&block, &x, Plan::store_all())?;
    // Both functions are `forward`, so each unit has a name of its own (a plan naming a
    // name two units share is refused).
    let plans = [
        (Fidelity::Recompute, Fidelity::Store),
        (Fidelity::Store, Fidelity::Recompute),
        (Fidelity::Recompute, Fidelity::Recompute),
    ];
    for (outer, inner) in plans {
        let plan = Plan::store_all()
            .with_unit("block", outer)
            .with_unit("mlp", inner);
        let (g, peak) = run(&block, &x, plan)?;
        assert_eq!(
            g, stored,
            "outer {outer}, inner {inner}: bit-identical gradients"
        );
        assert!(
            peak <= stored_peak,
            "outer {outer}, inner {inner}: peak {peak} > {stored_peak}"
        );
    }
    Ok(())
}
