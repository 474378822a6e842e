use hilore_runtime::{recovery_unit, Cx, Result, Var};

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn weighted(cx: &mut Cx, x: &Var, weights: Vec<f32>) -> Result<Var> {
    cx.scale(x, weights[0] as f64)
}

fn main() {}
