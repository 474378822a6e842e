use hilore_runtime::{recovery_unit, Cx, Result, Var};

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn labelled(cx: &mut Cx, x: &Var, label: String) -> Result<Var> {
    let _ = label.len();
    cx.scale(x, 2.0)
}

fn main() {}
