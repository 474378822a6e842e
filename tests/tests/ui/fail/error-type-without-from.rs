use hilore_runtime::{recovery_unit, Cx, Var};

#[derive(Debug)]
struct LayerError(String);

impl std::fmt::Display for LayerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[recovery_unit(cost = x.elem_count(), deterministic)]
fn double(cx: &mut Cx, x: &Var) -> Result<Var, LayerError> {
    cx.scale(x, 2.0).map_err(|e| LayerError(e.to_string()))
}

fn main() {}
