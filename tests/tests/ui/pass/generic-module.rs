//! A unit on a generic module: `impl<A: Activation> Mlp<A>`, with the activation itself an
//! ordinary trait method called inside the unit.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Plan, Result, Var};

trait Activation {
    fn apply(&self, cx: &mut Cx, x: &Var) -> Result<Var>;
}

struct Silu;

impl Activation for Silu {
    fn apply(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        cx.silu(x)
    }
}

struct Gain(f64);

impl Activation for Gain {
    fn apply(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        cx.scale(x, self.0)
    }
}

struct Mlp<A: Activation> {
    w: Var,
    act: A,
}

impl<A: Activation> Mlp<A> {
    #[recovery_unit(cost = 2 * x.elem_count() * self.w.dim(0)?, deterministic)]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let h = cx.linear(x, &self.w, None)?;
        self.act.apply(cx, &h)
    }
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

fn grad<A: Activation>(mlp: &Mlp<A>, x: &Var, plan: Plan) -> Result<Vec<u32>> {
    let mut cx = Cx::new(plan);
    let y = mlp.forward(&mut cx, x)?;
    let mut grads = Grads::new();
    let seed = Tensor::ones(y.dims(), y.dtype(), y.device())?;
    cx.backward(&y, &seed, &mut grads)?;
    bits(grads.get(mlp.w.id()).expect("w has a gradient"))
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let x = Var::constant(Tensor::randn(0f32, 1.0, (3, 4), &dev)?);
    let silu = Mlp {
        w: Var::param(Tensor::randn(0f32, 1.0, (5, 4), &dev)?),
        act: Silu,
    };
    let gain = Mlp {
        w: Var::param(Tensor::randn(0f32, 1.0, (5, 4), &dev)?),
        act: Gain(0.5),
    };
    let recompute = || Plan::store_all().with_unit("forward", Fidelity::Recompute);
    assert_eq!(
        grad(&silu, &x, Plan::store_all())?,
        grad(&silu, &x, recompute())?
    );
    assert_eq!(
        grad(&gain, &x, Plan::store_all())?,
        grad(&gain, &x, recompute())?
    );
    // Both instantiations share one descriptor: the unit is the function, not the type.
    let n = hilore_runtime::registered_units()
        .iter()
        .filter(|u| u.function == "forward" && u.module == module_path!())
        .count();
    assert_eq!(n, 1);
    Ok(())
}
