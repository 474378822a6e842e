use hilore_runtime::{recovery_unit, Cx, Result, Var};
use std::collections::HashMap;

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn summed(cx: &mut Cx, x: &Var, a: f64, b: f64) -> Result<Var> {
    let mut weights = HashMap::new();
    weights.insert("a", a);
    weights.insert("b", b);
    let mut y = x.clone();
    for (_, w) in &weights {
        y = cx.scale(&y, *w)?;
    }
    Ok(y)
}

fn main() {}
