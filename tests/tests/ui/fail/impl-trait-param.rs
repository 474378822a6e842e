use hilore_runtime::{recovery_unit, Cx, Result, Var};

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn scaled(cx: &mut Cx, x: &Var, factor: impl Into<f64>) -> Result<Var> {
    cx.scale(x, factor.into())
}

fn main() {}
