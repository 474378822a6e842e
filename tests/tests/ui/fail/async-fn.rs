use hilore_runtime::{recovery_unit, Cx, Result, Var};

#[recovery_unit(cost = x.elem_count(), deterministic)]
async fn double(cx: &mut Cx<'_>, x: &Var) -> Result<Var> {
    cx.scale(x, 2.0)
}

fn main() {}
