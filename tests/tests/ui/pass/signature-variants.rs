//! Signatures the macro keeps intact: doc comments and other attributes, `pub(crate)`,
//! named lifetimes (on `&self`, on `Cx`, on inputs), `mut` parameters, generic and const
//! generic parameters with a `where` clause, and a unit in a nested module.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Plan, Result, Var};

mod layers {
    use hilore_runtime::{recovery_unit, Cx, Result, Var};

    pub struct Proj {
        pub(crate) w: Var,
    }

    impl Proj {
        /// Projects `x` (a doc comment on a unit).
        #[inline]
        #[recovery_unit(cost = x.elem_count() * self.w.dim(0)?, deterministic)]
        #[must_use = "a unit's output is its result"]
        pub(crate) fn forward<'a>(&'a self, cx: &mut Cx<'a>, x: &Var) -> Result<Var> {
            cx.linear(x, &self.w, None)
        }

        /// Halves `x` `times` times.
        #[recovery_unit(cost = x.elem_count() * times, deterministic)]
        pub fn halve<'x>(&self, cx: &mut Cx<'_>, x: &'x Var, mut times: usize) -> Result<Var> {
            let mut y = x.clone();
            while times > 0 {
                y = cx.scale(&y, 0.5)?;
                times -= 1;
            }
            Ok(y)
        }
    }
}

/// Scales `x` by `s`, `N` times.
#[recovery_unit(cost = N * x.elem_count(), deterministic)]
fn repeat_scale<S, const N: usize>(cx: &mut Cx, x: &Var, s: S) -> hilore_runtime::Result<Var>
where
    S: Copy + Into<f64> + 'static,
{
    let mut y = x.clone();
    for _ in 0..N {
        y = cx.scale(&y, s.into())?;
    }
    Ok(y)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

fn run(p: &layers::Proj, x: &Var, plan: Plan) -> Result<Vec<u32>> {
    let mut cx = Cx::new(plan);
    let h = p.forward(&mut cx, x)?;
    let h = p.halve(&mut cx, &h, 2)?;
    let y = repeat_scale::<f32, 3>(&mut cx, &h, 1.5)?;
    let mut grads = Grads::new();
    let seed = Tensor::ones(y.dims(), y.dtype(), y.device())?;
    cx.backward(&y, &seed, &mut grads)?;
    bits(grads.get(p.w.id()).expect("w has a gradient"))
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let p = layers::Proj {
        w: Var::param(Tensor::randn(0f32, 1.0, (5, 4), &dev)?),
    };
    let x = Var::constant(Tensor::randn(0f32, 1.0, (3, 4), &dev)?);
    let stored = run(&p, &x, Plan::store_all())?;
    let recompute_all = Plan::uniform("recompute-all", Fidelity::Recompute);
    assert_eq!(stored, run(&p, &x, recompute_all)?);
    let units = hilore_runtime::registered_units();
    let halve = units
        .iter()
        .find(|u| u.function == "halve")
        .expect("halve is registered");
    assert!(halve.module.ends_with("::layers"), "{}", halve.module);
    Ok(())
}
