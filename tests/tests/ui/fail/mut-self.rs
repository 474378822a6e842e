use hilore_runtime::{recovery_unit, Cx, Result, Var};

struct Counter {
    calls: usize,
}

impl Counter {
    #[recovery_unit(cost = x.elem_count(), deterministic)]
    fn forward(&mut self, cx: &mut Cx, x: &Var) -> Result<Var> {
        self.calls += 1;
        cx.scale(x, 2.0)
    }
}

fn main() {}
