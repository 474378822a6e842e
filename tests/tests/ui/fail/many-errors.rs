use hilore_runtime::{recovery_unit, Var};

struct Layer {
    w: Var,
}

impl Layer {
    #[recovery_unit(deterministic, flavour = "fast")]
    async fn forward(&mut self, x: &mut Var) -> Var {
        let _ = std::time::Instant::now();
        x.clone()
    }
}

fn main() {
    let _ = |l: Layer| l.w;
}
