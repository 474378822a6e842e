use hilore_runtime::{recovery_unit, Cx, Result, Var};

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn double_and_count(cx: &mut Cx, x: &Var, calls: &mut usize) -> Result<Var> {
    *calls += 1;
    cx.scale(x, 2.0)
}

fn main() {}
