use hilore_runtime::{recovery_unit, Var};

#[recovery_unit(cost = 1, deterministic)]
struct Mlp {
    w: Var,
}

fn main() {
    let _ = |m: Mlp| m.w;
}
