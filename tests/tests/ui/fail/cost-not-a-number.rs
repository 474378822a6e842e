use hilore_runtime::{recovery_unit, Cx, Result, Var};

#[recovery_unit(cost = "a lot", deterministic)]
fn double(cx: &mut Cx, x: &Var) -> Result<Var> {
    cx.scale(x, 2.0)
}

fn main() {}
