//! A unit in a trait impl whose trait leaves the model lifetime elided: the macro ties
//! `&self` and `Cx` to one lifetime, so the impl no longer matches the trait. The error
//! names the fix: write the lifetime in the trait and the impl alike.

use hilore_runtime::{recovery_unit, Cx, Result, Var};

trait Module {
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var>;
}

struct Linear {
    w: Var,
}

impl Module for Linear {
    #[recovery_unit(cost = x.elem_count(), deterministic)]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        cx.linear(x, &self.w, None)
    }
}

fn main() {}
