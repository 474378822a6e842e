use hilore_runtime::{recovery_unit, Cx, Result, Var};

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn biased(cx: &mut Cx, x: &Var, w: &Var, b: Option<&Var>) -> Result<Var> {
    cx.linear(x, w, b)
}

fn main() {}
