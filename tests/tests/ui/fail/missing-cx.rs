use hilore_runtime::{recovery_unit, Result, Var};

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn identity(x: &Var) -> Result<Var> {
    Ok(x.clone())
}

fn main() {}
