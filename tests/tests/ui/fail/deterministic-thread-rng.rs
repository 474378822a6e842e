use hilore_runtime::{recovery_unit, Cx, Result, Var};

/// Stands in for the `rand` crate.
mod rand {
    pub struct ThreadRng;
    pub fn thread_rng() -> ThreadRng {
        ThreadRng
    }
    impl ThreadRng {
        pub fn next_f64(&mut self) -> f64 {
            0.5
        }
    }
}

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn jitter(cx: &mut Cx, x: &Var) -> Result<Var> {
    let s = rand::thread_rng().next_f64();
    cx.scale(x, s)
}

fn main() {}
