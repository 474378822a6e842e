use hilore_runtime::{recovery_unit, Cx, Result, Var};

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn identity(cx: &Cx, x: &Var) -> Result<Var> {
    let _ = cx.num_ops();
    Ok(x.clone())
}

fn main() {}
