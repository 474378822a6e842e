use hilore_runtime::{recovery_unit, Cx, Result, Var};

mod rand {
    pub fn rng() -> f64 {
        4.0
    }
}

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn shaken(cx: &mut Cx, x: &Var) -> Result<Var> {
    use crate::rand::rng as my_rng;
    cx.scale(x, my_rng())
}

fn main() {}
