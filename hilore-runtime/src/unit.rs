//! Recovery units: descriptors, the registry, and what the `#[recovery_unit]` macro
//! expands to.

use crate::fidelity::Fidelity;
use crate::{Cx, Error, Packing, Result, Var};
use candle_core::Tensor;
use std::fmt::Display;
use std::rc::Rc;

/// How a unit parameter is replayed on recompute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamKind {
    /// `&self`: the module, borrowed for the life of the tape.
    Module,
    /// The tape context `&mut Cx`.
    Context,
    /// A tape value (`Var`, `&Var`, `&[Var]`, ...): kept by a Recompute unit.
    Tape,
    /// `Copy` configuration or other replayable metadata, captured by value.
    Config,
}

/// One parameter of a unit's function, as written.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ParamInfo {
    /// The parameter's name.
    pub name: &'static str,
    /// Its type, as written.
    pub ty: &'static str,
    /// How it is replayed.
    pub kind: ParamKind,
}

/// What the macro knows about a unit at compile time. One `'static` descriptor per
/// annotated function, registered with `inventory` so it can be listed before anything
/// runs.
#[derive(Debug, serde::Serialize)]
pub struct UnitDescriptor {
    /// The unit's name (the `name = "..."` argument, or the function's name).
    pub name: &'static str,
    /// `module_path!()` of the function.
    pub module: &'static str,
    /// The function's name.
    pub function: &'static str,
    /// Source file.
    pub file: &'static str,
    /// Source line of the function.
    pub line: u32,
    /// The parameters, in order.
    pub params: &'static [ParamInfo],
    /// Whether the body replays bit-identically (may be recomputed).
    pub deterministic: bool,
    /// The cost expression, as written.
    pub cost: &'static str,
    /// The codecs the unit allows under Compress (`None`: every codec).
    pub codecs: Option<&'static [&'static str]>,
}

impl UnitDescriptor {
    /// Whether the unit may be given `f`.
    pub fn offers(&self, f: Fidelity) -> bool {
        match f {
            Fidelity::Store => true,
            Fidelity::Recompute => self.deterministic,
            Fidelity::Compress(c) => self.codecs.is_none_or(|cs| cs.contains(&c)),
        }
    }

    pub(crate) fn check(&self, f: Fidelity) -> Result<()> {
        if self.offers(f) {
            return Ok(());
        }
        match f {
            Fidelity::Recompute => Err(Error::NotDeterministic {
                unit: self.name.to_string(),
            }),
            Fidelity::Compress(c) => Err(Error::CodecNotAllowed {
                unit: self.name.to_string(),
                codec: c.to_string(),
                allowed: self.codecs.unwrap_or(&[]).join(", "),
            }),
            Fidelity::Store => Ok(()),
        }
    }
}

/// The registration `#[recovery_unit]` submits for each descriptor.
#[derive(Debug)]
pub struct UnitRegistration(pub &'static UnitDescriptor);

inventory::collect!(UnitRegistration);

/// Every unit registered in this binary, sorted by module, file and line.
pub fn registered_units() -> Vec<&'static UnitDescriptor> {
    let mut v: Vec<&'static UnitDescriptor> =
        inventory::iter::<UnitRegistration>().map(|r| r.0).collect();
    v.sort_by(|a, b| (a.module, a.file, a.line, a.name).cmp(&(b.module, b.file, b.line, b.name)));
    v
}

/// A value a recovery unit can take as input: captured at the forward and handed back,
/// unchanged, when the unit is recomputed.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an input of a recovery unit: it cannot be replayed on recompute",
    label = "not replayable",
    note = "unit inputs must be tape values (`Var`, `&Var`, `&[Var]`), `Copy` configuration, or replayable metadata such as `&Packing`",
    note = "move owned or mutable state into the module (`&self`), or pass it as a `Var`",
    note = "a list of tape values is taken as `&[Var]`, not `Vec<Var>`; an optional weight (a bias) is best a field of the module, read through `&self`"
)]
pub trait Replayable {
    /// What the unit keeps to replay this input.
    type Captured: 'static;
    /// Captures the input at the forward.
    fn capture(&self) -> Self::Captured;
    /// The input, by reference, from what was captured.
    fn replay_ref(c: &Self::Captured) -> &Self;
    /// Tape values in the captured input (what a Recompute unit keeps alive).
    fn tape_vars(_c: &Self::Captured, _out: &mut Vec<Var>) {}
}

/// A [`Replayable`] input taken by value.
pub trait ReplayOwned: Replayable + Sized {
    /// The input, by value, from what was captured.
    fn replay(c: &Self::Captured) -> Self;
}

impl<T: Copy + 'static> Replayable for T {
    type Captured = T;
    fn capture(&self) -> T {
        *self
    }
    fn replay_ref(c: &T) -> &T {
        c
    }
}

impl<T: Copy + 'static> ReplayOwned for T {
    fn replay(c: &T) -> T {
        *c
    }
}

impl Replayable for Var {
    type Captured = Var;
    fn capture(&self) -> Var {
        self.clone()
    }
    fn replay_ref(c: &Var) -> &Var {
        c
    }
    fn tape_vars(c: &Var, out: &mut Vec<Var>) {
        out.push(c.clone())
    }
}

impl ReplayOwned for Var {
    fn replay(c: &Var) -> Var {
        c.clone()
    }
}

impl Replayable for [Var] {
    type Captured = Vec<Var>;
    fn capture(&self) -> Vec<Var> {
        self.to_vec()
    }
    fn replay_ref(c: &Vec<Var>) -> &[Var] {
        c
    }
    fn tape_vars(c: &Vec<Var>, out: &mut Vec<Var>) {
        out.extend(c.iter().cloned())
    }
}

impl Replayable for Packing {
    type Captured = Packing;
    fn capture(&self) -> Packing {
        self.clone()
    }
    fn replay_ref(c: &Packing) -> &Packing {
        c
    }
    fn tape_vars(c: &Packing, out: &mut Vec<Var>) {
        out.push(Var::constant(c.positions().clone()))
    }
}

impl ReplayOwned for Packing {
    fn replay(c: &Packing) -> Packing {
        c.clone()
    }
}

impl Replayable for crate::ops::RopeTables {
    type Captured = crate::ops::RopeTables;
    fn capture(&self) -> Self {
        self.clone()
    }
    fn replay_ref(c: &Self) -> &Self {
        c
    }
    fn tape_vars(c: &Self, out: &mut Vec<Var>) {
        out.push(Var::constant(c.cos().clone()));
        out.push(Var::constant(c.sin().clone()));
    }
}

impl ReplayOwned for crate::ops::RopeTables {
    fn replay(c: &Self) -> Self {
        c.clone()
    }
}

/// What a unit returns: the tape values it produced.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the output of a recovery unit",
    label = "not tape values",
    note = "return `Result<T>` with `T` a `Var`, a `Vec<Var>` or a tuple of them: recompute checks that the re-run reproduces them bit for bit"
)]
pub trait UnitOutput {
    /// The output tensors (fingerprinted to check that a recompute is bit-identical).
    fn output_tensors(&self, out: &mut Vec<Tensor>);
}

impl UnitOutput for Var {
    fn output_tensors(&self, out: &mut Vec<Tensor>) {
        out.push(self.tensor.clone())
    }
}

impl UnitOutput for Vec<Var> {
    fn output_tensors(&self, out: &mut Vec<Tensor>) {
        out.extend(self.iter().map(|v| v.tensor.clone()))
    }
}

impl<A: UnitOutput, B: UnitOutput> UnitOutput for (A, B) {
    fn output_tensors(&self, out: &mut Vec<Tensor>) {
        self.0.output_tensors(out);
        self.1.output_tensors(out);
    }
}

impl<A: UnitOutput, B: UnitOutput, C: UnitOutput> UnitOutput for (A, B, C) {
    fn output_tensors(&self, out: &mut Vec<Tensor>) {
        self.0.output_tensors(out);
        self.1.output_tensors(out);
        self.2.output_tensors(out);
    }
}

/// A unit's cost expression value (any number type).
#[diagnostic::on_unimplemented(
    message = "the `cost` of a recovery unit must be a number, not `{Self}`",
    label = "the cost expression's value",
    note = "`#[recovery_unit(cost = <expr>)]` takes usize, u64, u32, i64, i32, f64 or f32: an estimate of the unit's work (e.g. FLOPs), read by the allocator's cost model",
    note = "`?` works inside it (`cost = 2 * x.dim(0)? * w.dim(1)?`); convert other types with `as f64`"
)]
pub trait IntoCost {
    /// As `f64`.
    fn into_cost(self) -> f64;
}

macro_rules! into_cost {
    ($($t:ty),*) => {$(
        impl IntoCost for $t {
            fn into_cost(self) -> f64 {
                self as f64
            }
        }
    )*};
}
into_cost!(usize, u64, u32, i64, i32, f64, f32);

/// The recompute closure a Recompute unit keeps: re-runs the body on the captured inputs.
pub(crate) type Recompute<'m> = Rc<dyn Fn(&mut Cx<'m>) -> Result<Vec<Tensor>> + 'm>;

/// A unit's body, as `run_unit` takes it: re-runnable on the tape it is given.
#[doc(hidden)]
pub type UnitBody<'m, T, E> = Rc<dyn Fn(&mut Cx<'m>) -> std::result::Result<T, E> + 'm>;

/// Runs one recovery unit: opens its scope, runs the body, closes the scope (applying the
/// plan's fidelity). What `#[recovery_unit]` expands to; not for direct use.
#[doc(hidden)]
pub fn run_unit<'m, T, E>(
    cx: &mut Cx<'m>,
    desc: &'static UnitDescriptor,
    cost: Result<f64>,
    inputs: Vec<Var>,
    body: UnitBody<'m, T, E>,
) -> std::result::Result<T, E>
where
    T: UnitOutput + 'm,
    E: From<Error> + Display + 'm,
{
    if !cx.records() {
        return body(cx);
    }
    let cost = cost?;
    let inst = cx.open_unit(desc, cost, inputs)?;
    let out = match body(cx) {
        Ok(out) => out,
        Err(e) => {
            cx.abort_unit(inst);
            return Err(e);
        }
    };
    let mut outs = Vec::new();
    out.output_tensors(&mut outs);
    let replay: Recompute<'m> = {
        let body = body.clone();
        Rc::new(move |cx: &mut Cx<'m>| {
            let out = body(cx).map_err(|e| Error::Recompute {
                unit: desc.name.to_string(),
                message: e.to_string(),
            })?;
            let mut outs = Vec::new();
            out.output_tensors(&mut outs);
            Ok(outs)
        })
    };
    cx.close_unit(inst, &outs, replay)?;
    Ok(out)
}
