//! A method as a unit: `&self` is borrowed for the life of the tape, so the recompute
//! closure can read the module's weights in backward.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Plan, Result, Var};

struct Mlp {
    w1: Var,
    w2: Var,
    hidden: usize,
}

impl Mlp {
    #[recovery_unit(cost = 4 * x.dim(0)? * x.dim(1)? * self.hidden, deterministic)]
    pub fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let h = cx.linear(x, &self.w1, None)?;
        let h = cx.silu(&h)?;
        cx.linear(&h, &self.w2, None)
    }
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

/// Gradients of both weights, and the peak of saved bytes.
fn run(mlp: &Mlp, x: &Var, seed: &Tensor, plan: Plan) -> Result<(Vec<u32>, usize)> {
    let mut cx = Cx::new(plan);
    let y = mlp.forward(&mut cx, x)?;
    let mut grads = Grads::new();
    cx.backward(&y, seed, &mut grads)?;
    assert_eq!(
        cx.memory().live_bytes(),
        0,
        "everything saved is freed by backward"
    );
    let mut g = bits(grads.get(mlp.w1.id()).expect("w1 has a gradient"))?;
    g.extend(bits(grads.get(mlp.w2.id()).expect("w2 has a gradient"))?);
    Ok((g, cx.memory().peak_bytes()))
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let mlp = Mlp {
        w1: Var::param(Tensor::randn(0f32, 1.0, (16, 8), &dev)?),
        w2: Var::param(Tensor::randn(0f32, 1.0, (8, 16), &dev)?),
        hidden: 16,
    };
    let x = Var::constant(Tensor::randn(0f32, 1.0, (4, 8), &dev)?);
    let seed = Tensor::randn(0f32, 1.0, (4, 8), &dev)?;
    let (stored, stored_peak) = run(&mlp, &x, &seed, Plan::store_all())?;
    let recompute = Plan::store_all().with_unit("forward", Fidelity::Recompute);
    let (recomputed, recomputed_peak) = run(&mlp, &x, &seed, recompute)?;
    assert_eq!(
        stored, recomputed,
        "recompute reproduces the stored gradients bit for bit"
    );
    assert!(stored_peak > 0 && recomputed_peak > 0);
    Ok(())
}
