//! `name = "..."` renames the unit in plans and reports; `codecs = [...]` restricts what
//! Compress may use.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Error, Fidelity, Grads, Plan, Result, Var};

struct Proj {
    w: Var,
}

impl Proj {
    #[recovery_unit(cost = 2 * x.elem_count() * self.w.dim(0)?, deterministic, name = "mlp.up", codecs = ["bf16"])]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let h = cx.linear(x, &self.w, None)?;
        cx.silu(&h)
    }
}

fn grad(p: &Proj, x: &Var, plan: Plan) -> Result<Vec<f32>> {
    let mut cx = Cx::new(plan);
    let y = p.forward(&mut cx, x)?;
    let mut grads = Grads::new();
    let seed = Tensor::ones(y.dims(), y.dtype(), y.device())?;
    cx.backward(&y, &seed, &mut grads)?;
    Ok(grads
        .get(p.w.id())
        .expect("w has a gradient")
        .flatten_all()?
        .to_vec1()?)
}

fn main() -> Result<()> {
    let unit = hilore_runtime::registered_units()
        .into_iter()
        .find(|u| u.name == "mlp.up")
        .expect("the unit is registered under its name");
    assert_eq!(unit.function, "forward");
    assert_eq!(unit.codecs, Some(&["bf16"][..]));

    let dev = Device::Cpu;
    let p = Proj {
        w: Var::param(Tensor::randn(0f32, 1.0, (6, 4), &dev)?),
    };
    let x = Var::constant(Tensor::randn(0f32, 1.0, (3, 4), &dev)?);
    let stored = grad(&p, &x, Plan::store_all())?;
    let recomputed = grad(
        &p,
        &x,
        Plan::store_all().with_unit("mlp.up", Fidelity::Recompute),
    )?;
    assert_eq!(stored, recomputed);
    let compressed = grad(
        &p,
        &x,
        Plan::store_all().with_unit("mlp.up", Fidelity::Compress("bf16")),
    )?;
    // bf16 keeps 8 significant bits: relative error per saved element <= 2^-8.
    let num: f32 = stored
        .iter()
        .zip(&compressed)
        .map(|(a, b)| (a - b) * (a - b))
        .sum();
    let den: f32 = stored.iter().map(|a| a * a).sum();
    assert!(
        (num / den).sqrt() < 2e-2,
        "bf16 relative error {}",
        (num / den).sqrt()
    );

    // The plan names the unit by its `name`, not its function.
    let err = grad(
        &p,
        &x,
        Plan::store_all().with_unit("mlp.up", Fidelity::Compress("fp8")),
    );
    assert!(matches!(err, Err(Error::CodecNotAllowed { .. })), "{err:?}");
    Ok(())
}
