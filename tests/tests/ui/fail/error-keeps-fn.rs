//! The only error is the macro's: the function is still emitted, so its callers and the
//! rest of the crate type-check and report nothing more.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Plan, Result, Var};

struct Mlp {
    w: Var,
}

impl Mlp {
    #[recovery_unit(deterministic)]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        cx.linear(x, &self.w, None)
    }
}

#[recovery_unit(cost = x.elem_count(), deterministic = yes)]
fn double(cx: &mut Cx, x: &Var) -> Result<Var> {
    cx.scale(x, 2.0)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let mlp = Mlp {
        w: Var::param(Tensor::zeros((2, 2), candle_core::DType::F32, &dev)?),
    };
    let x = Var::constant(Tensor::zeros((1, 2), candle_core::DType::F32, &dev)?);
    let mut cx = Cx::new(Plan::store_all());
    let y = mlp.forward(&mut cx, &x)?;
    let _z: Var = double(&mut cx, &y)?;
    Ok(())
}
