//! A unit implementing a trait method. The trait names the model lifetime itself
//! (`&'m self`, `Cx<'m>`), the impl repeats the signature, and the macro adds nothing to
//! it, so the impl still matches the trait. Modules can then be used as trait objects.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Plan, Result, Var};

trait Module {
    fn forward<'m>(&'m self, cx: &mut Cx<'m>, x: &Var) -> Result<Var>;
    fn weight(&self) -> &Var;
}

struct Linear {
    w: Var,
}

impl Module for Linear {
    #[recovery_unit(cost = 2 * x.elem_count() * self.w.dim(0)?, deterministic)]
    fn forward<'m>(&'m self, cx: &mut Cx<'m>, x: &Var) -> Result<Var> {
        let h = cx.linear(x, &self.w, None)?;
        cx.silu(&h)
    }

    fn weight(&self) -> &Var {
        &self.w
    }
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

fn run(layers: &[Box<dyn Module>], x: &Var, plan: Plan) -> Result<Vec<u32>> {
    let mut cx = Cx::new(plan);
    let mut h = x.clone();
    for l in layers {
        h = l.forward(&mut cx, &h)?;
    }
    let mut grads = Grads::new();
    let seed = Tensor::ones(h.dims(), h.dtype(), h.device())?;
    cx.backward(&h, &seed, &mut grads)?;
    let mut out = Vec::new();
    for l in layers {
        out.extend(bits(grads.get(l.weight().id()).expect("a gradient"))?);
    }
    Ok(out)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let layers: Vec<Box<dyn Module>> = (0..2)
        .map(|_| -> Result<Box<dyn Module>> {
            Ok(Box::new(Linear {
                w: Var::param(Tensor::randn(0f32, 0.5, (4, 4), &dev)?),
            }))
        })
        .collect::<Result<_>>()?;
    let x = Var::constant(Tensor::randn(0f32, 1.0, (3, 4), &dev)?);
    let stored = run(&layers, &x, Plan::store_all())?;
    let recompute = Plan::store_all().with_unit("forward", Fidelity::Recompute);
    assert_eq!(stored, run(&layers, &x, recompute)?);
    Ok(())
}
