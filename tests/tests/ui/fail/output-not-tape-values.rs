use hilore_runtime::{recovery_unit, Cx, Result, Var};

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn norm(cx: &mut Cx, x: &Var) -> Result<f32> {
    let y = cx.mul(x, x)?;
    Ok(y.tensor().sum_all()?.to_scalar::<f32>()?)
}

fn main() {}
