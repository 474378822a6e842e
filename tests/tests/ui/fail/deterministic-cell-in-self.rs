use hilore_runtime::{recovery_unit, Cx, Result, Var};
use std::cell::Cell;

struct Counted {
    calls: Cell<u32>,
}

impl Counted {
    #[recovery_unit(cost = x.elem_count(), deterministic)]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let n = self.calls.get();
        self.calls.set(n + 1);
        cx.scale(x, 1.0 + n as f64)
    }
}

fn main() {}
