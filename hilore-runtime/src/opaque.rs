//! Opaque recovery units: unmodified candle closures and zoo modules managed as units.
//!
//! A model may contain layers HiLoRe did not write: a `candle_transformers` block, a
//! closure of candle ops. [`OpaqueUnit`] makes any [`candle_core::Module`] (candle `Tensor`
//! in, `Tensor` out, parameters held as [`candle_core::Var`]s) one recovery unit on the
//! tape, with the **Store** and **Recompute** fidelities, without rewriting it: inside the
//! unit the module runs on candle's own autograd (the custom-op pattern), and the tape sees
//! one op, `opaque`, whose backward asks candle for the gradients.
//!
//! - **Forward.** The unit's input is copied into a fresh candle `Var` (so candle tracks
//!   it), the module runs, and the tape records one op whose inputs are the unit input and
//!   the module's parameters (as tape parameters sharing the candle `Var`s' storage). The
//!   output goes on the tape detached from candle's graph.
//! - **Backward.** With the incoming gradient `g`, candle differentiates `sum(y * g)` from
//!   the module's output `y` ([`candle_core::Tensor::backward`]): the gradient of the input
//!   copy is the input gradient, those of the parameter `Var`s go into [`crate::Grads`]
//!   under the parameters' tape ids.
//!
//! What each fidelity keeps between forward and backward:
//!
//! - **Store** keeps candle's graph of the unit: the output `y` with every tensor candle's
//!   backward will visit, which are the nodes [`candle_core::Tensor::sorted_nodes`]
//!   returns (each intermediate that depends on the input or a parameter, and the input
//!   copy). They sit in the op's slots as [`crate::Saved::Exact`], so the [`crate::Ledger`]
//!   counts each distinct storage once, under [`crate::MemClass::Stored`], like any other
//!   saved tensor. The parameters, and views of them such as a transposed weight, are not
//!   counted (they are model memory). Not counted
//!   either, because no public candle API reaches them: tensors the graph holds that
//!   depend on neither the input nor a parameter (a mask or a table built inside the
//!   closure); they are constants of the sequence length, usually small or cached by the
//!   module itself.
//! - **Recompute** keeps only the unit's input (the tape's rule for every Recompute unit,
//!   counted under [`crate::MemClass::Inputs`]). The graph built in the forward is released
//!   when the unit closes; in backward the module re-runs on the kept input with its
//!   parameters tracked, and candle's backward runs on the fresh graph. Candle's CPU ops
//!   are deterministic, so Store and Recompute give bit-identical gradients.
//!
//! **Compress is not offered.** What backward needs lives inside candle's graph, as the
//! inputs each candle op keeps alive (`Arc` clones held by the op, out of reach:
//! `Tensor::op()` is private to candle). The tape can count those tensors but cannot
//! replace them with an encoding and hand candle a decoded copy: candle's backward would
//! still read the originals, so a "compressed" opaque unit would keep the full-precision
//! graph and the encoding both. Descriptors made with [`opaque_unit!`] therefore allow no
//! codec, and a plan asking for one fails when the unit opens.
//!
//! Parameters: the module reads its candle `Var`s, the tape its own views of the same
//! storage. Update them in place ([`OpaqueUnit::set_param`], or candle's `Var::set`), so
//! both see the new values; replacing a tape parameter's tensor
//! ([`crate::Var::set_tensor`]) would leave the module on the old values.
//!
//! # Example: a candle-transformers MLP block as a unit
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use candle_transformers::models::with_tracing::{linear_no_bias, RmsNorm};
//! use hilore_runtime::{opaque_unit, Cx, Fidelity, Grads, OpaqueUnit, Plan, Var};
//!
//! // The descriptor: listed by `hilore units`, referred to by plans as "zoo_mlp".
//! opaque_unit!(static ZOO_MLP = "zoo_mlp", deterministic);
//!
//! # fn main() -> hilore_runtime::Result<()> {
//! let dev = Device::Cpu;
//! let (hidden, inter) = (16, 32);
//! // Unmodified zoo layers, built the zoo's way (VarBuilder over a VarMap of candle Vars).
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! let norm = RmsNorm::new(hidden, 1e-6, vb.pp("norm"))?;
//! let gate = linear_no_bias(hidden, inter, vb.pp("gate_proj"))?;
//! let up = linear_no_bias(hidden, inter, vb.pp("up_proj"))?;
//! let down = linear_no_bias(inter, hidden, vb.pp("down_proj"))?;
//! // The block: x + down(silu(gate(norm(x))) * up(norm(x))), on candle's autograd.
//! // (`forward_diff` is the zoo RmsNorm's differentiable path.)
//! let block = move |x: &Tensor| -> candle_core::Result<Tensor> {
//!     let h = norm.forward_diff(x)?;
//!     let a = (gate.forward(&h)?.silu()? * up.forward(&h)?)?;
//!     x + down.forward(&a)?
//! };
//! let unit = OpaqueUnit::new(&ZOO_MLP, block, varmap.all_vars())?;
//!
//! let x = Var::param(Tensor::randn(0f32, 1.0, (5, hidden), &dev)?);
//! for fidelity in [Fidelity::Store, Fidelity::Recompute] {
//!     let mut cx = Cx::new(Plan::store_all().with_unit("zoo_mlp", fidelity));
//!     let y = unit.forward(&mut cx, &x)?;
//!     let mut grads = Grads::new();
//!     cx.backward(&y, &Tensor::ones((5, hidden), DType::F32, &dev)?, &mut grads)?;
//!     assert!(grads.get(x.id()).is_some());
//!     assert!(unit.params().all(|p| grads.get(p.id()).is_some()));
//! }
//! // Compress is refused.
//! let mut cx = Cx::new(Plan::store_all().with_unit("zoo_mlp", Fidelity::Compress("bf16")));
//! assert!(unit.forward(&mut cx, &x).is_err());
//! # Ok(())
//! # }
//! ```

use crate::memory::{storage_of, StorageKey};
use crate::ops::{Op, Saved};
use crate::unit::{run_unit, UnitDescriptor};
use crate::{Cx, Error, Result, Var};
use candle_core::{Module, Tensor, TensorId};
use std::collections::HashSet;
use std::rc::Rc;

/// Declares the `'static` descriptor of an opaque unit and registers it, so the unit is
/// listed by `hilore units` before anything runs and plans can name it.
///
/// `opaque_unit!(static NAME = "unit_name", deterministic);` declares a unit that may be
/// recomputed (its module replays bit-identically: no randomness, no state); without
/// `deterministic` it is offered Store only. No codec is ever offered (see the module
/// docs for why).
#[macro_export]
macro_rules! opaque_unit {
    (@def $(#[$a:meta])* [$($vis:tt)*] $id:ident $name:literal $det:literal) => {
        $(#[$a])*
        $($vis)* static $id: $crate::UnitDescriptor = $crate::UnitDescriptor {
            name: $name,
            module: ::core::module_path!(),
            function: "<opaque candle module>",
            file: ::core::file!(),
            line: ::core::line!(),
            params: &[$crate::ParamInfo {
                name: "x",
                ty: "&Var",
                kind: $crate::ParamKind::Tape,
            }],
            deterministic: $det,
            cost: "2 * parameter elements * rows of x (opaque unit default)",
            codecs: ::core::option::Option::Some(&[]),
        };
        $crate::__private::inventory::submit! {
            $crate::__private::UnitRegistration(&$id)
        }
    };
    ($(#[$a:meta])* $vis:vis static $id:ident = $name:literal, deterministic $(,)?) => {
        $crate::opaque_unit!(@def $(#[$a])* [$vis] $id $name true);
    };
    ($(#[$a:meta])* $vis:vis static $id:ident = $name:literal $(,)?) => {
        $crate::opaque_unit!(@def $(#[$a])* [$vis] $id $name false);
    };
}

/// The unit body handed to the tape (re-run on recompute).
type Body<'m> = Rc<dyn Fn(&mut Cx<'m>) -> Result<Var> + 'm>;

/// An unmodified candle module (or closure) managed as one recovery unit. See the
/// [module docs](self) for what each fidelity keeps and how it is counted.
pub struct OpaqueUnit<M> {
    desc: &'static UnitDescriptor,
    module: M,
    /// The module's candle `Var`s and the tape parameters sharing their storage.
    params: Vec<(candle_core::Var, Var)>,
    cost: Option<fn(&Tensor) -> f64>,
}

impl<M> std::fmt::Debug for OpaqueUnit<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpaqueUnit")
            .field("unit", &self.desc.name)
            .field("params", &self.params.len())
            .finish()
    }
}

impl<M: Module> OpaqueUnit<M> {
    /// Manages `module`, whose trainable parameters are `params` (the candle `Var`s it
    /// reads), as the unit `desc` (declared with [`opaque_unit!`]).
    pub fn new(
        desc: &'static UnitDescriptor,
        module: M,
        params: Vec<candle_core::Var>,
    ) -> Result<Self> {
        if desc.codecs.is_none_or(|c| !c.is_empty()) {
            return Err(Error::Tape(format!(
                "opaque unit `{}`: its descriptor offers codecs, but an opaque unit's saved state \
                 lives in candle's graph and cannot be compressed; declare it with opaque_unit!",
                desc.name
            )));
        }
        let mut seen = HashSet::new();
        for p in &params {
            if !seen.insert(p.as_tensor().id()) {
                return Err(Error::Tape(format!(
                    "opaque unit `{}`: a parameter is listed twice",
                    desc.name
                )));
            }
        }
        let params = params
            .into_iter()
            .map(|v| {
                let tape = Var::param(v.as_tensor().clone());
                (v, tape)
            })
            .collect();
        Ok(OpaqueUnit {
            desc,
            module,
            params,
            cost: None,
        })
    }

    /// Sets the unit's cost expression (evaluated on the unit's input at each call; the
    /// default is `2 * parameter elements * rows`, rows being the input's elements over
    /// its last dimension: the multiply-adds of a stack of linear layers).
    pub fn with_cost(mut self, cost: fn(&Tensor) -> f64) -> Self {
        self.cost = Some(cost);
        self
    }

    /// The unit's descriptor.
    pub fn descriptor(&self) -> &'static UnitDescriptor {
        self.desc
    }

    /// The module.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The parameters as tape values: their ids key the gradients in [`crate::Grads`].
    pub fn params(&self) -> impl Iterator<Item = &Var> {
        self.params.iter().map(|(_, t)| t)
    }

    /// The parameters as the module's candle `Var`s, in the order given to
    /// [`OpaqueUnit::new`].
    pub fn candle_params(&self) -> impl Iterator<Item = &candle_core::Var> {
        self.params.iter().map(|(c, _)| c)
    }

    /// Writes `value` into parameter `i` in place (after an optimizer step): the module
    /// and the tape see it.
    pub fn set_param(&self, i: usize, value: &Tensor) -> Result<()> {
        let (c, _) = self.params.get(i).ok_or_else(|| {
            Error::Tape(format!(
                "opaque unit `{}` has {} parameters, no parameter {i}",
                self.desc.name,
                self.params.len()
            ))
        })?;
        Ok(c.set(value)?)
    }

    fn cost_of(&self, x: &Tensor) -> f64 {
        if let Some(f) = self.cost {
            return f(x);
        }
        let last = x.dims().last().copied().unwrap_or(1).max(1);
        let rows = x.elem_count() / last;
        let n: usize = self.params.iter().map(|(c, _)| c.elem_count()).sum();
        2.0 * n as f64 * rows as f64
    }

    /// Runs the module on `x` as the unit: its fidelity comes from `cx`'s plan (Store or
    /// Recompute), its parameters' gradients go into the `Grads` of `cx`'s backward.
    pub fn forward<'m>(&'m self, cx: &mut Cx<'m>, x: &Var) -> Result<Var> {
        let cost = Ok(self.cost_of(x.tensor()));
        let input = x.clone();
        let body: Body<'m> = Rc::new(move |cx: &mut Cx<'m>| self.run(cx, &input));
        run_unit(cx, self.desc, cost, vec![x.clone()], body)
    }

    /// The body: one `opaque` op on the tape.
    fn run(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let mut inputs: Vec<&Var> = Vec::with_capacity(1 + self.params.len());
        inputs.push(x);
        inputs.extend(self.params.iter().map(|(_, t)| t));
        if !cx.records() {
            // Inference: nothing to keep; the graph candle builds around the parameter
            // Vars is dropped with the output.
            let y = self.module.forward(x.tensor())?.detach();
            return cx.record(self.op(None), &inputs, y, Vec::new());
        }
        // The input as a candle Var (a copy: candle tracks only variables it made).
        let xin = if x.requires_grad() {
            candle_core::Var::from_tensor(x.tensor())?.into_inner()
        } else {
            x.tensor().clone()
        };
        let y = self.module.forward(&xin)?;
        let x_id = x.requires_grad().then(|| xin.id());
        // What candle's backward will visit, minus the parameters and views of them
        // (same storage, e.g. a transposed weight): counted as saved.
        let params: HashSet<StorageKey> = self
            .params
            .iter()
            .map(|(c, _)| storage_of(c.as_tensor()).0)
            .collect();
        let mut saved = vec![Saved::Exact(y.clone())];
        for node in y.sorted_nodes() {
            if node.id() != y.id() && !params.contains(&storage_of(node).0) {
                saved.push(Saved::Exact(node.clone()));
            }
        }
        let out = y.detach();
        cx.record(self.op(x_id), &inputs, out, saved)
    }

    fn op(&self, x_id: Option<TensorId>) -> OpaqueOp {
        OpaqueOp {
            unit: self.desc.name,
            x_id,
            param_ids: self
                .params
                .iter()
                .map(|(c, _)| c.as_tensor().id())
                .collect(),
        }
    }
}

/// The tape op of an opaque unit: backward is candle's.
struct OpaqueOp {
    unit: &'static str,
    /// Candle's id of the input copy, when the input wants a gradient.
    x_id: Option<TensorId>,
    param_ids: Vec<TensorId>,
}

impl Op for OpaqueOp {
    fn name(&self) -> &'static str {
        "opaque"
    }

    fn backward(&self, s: &[Tensor], g: &Tensor, need: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let y = s.first().ok_or_else(|| {
            Error::Tape(format!(
                "opaque unit `{}`: backward found no saved graph",
                self.unit
            ))
        })?;
        if g.shape() != y.shape() {
            return Err(Error::Tape(format!(
                "opaque unit `{}`: gradient of shape {:?} for an output of shape {:?}",
                self.unit,
                g.dims(),
                y.dims()
            )));
        }
        // d/dtheta sum(y * g) = g^T dy/dtheta: candle seeds its backward with ones, and the
        // product's backward turns them into exactly g.
        let grads = (y * g.to_dtype(y.dtype())?)?.sum_all()?.backward()?;
        let mut out = Vec::with_capacity(need.len());
        out.push(if need.first().copied().unwrap_or(false) {
            let g = self.x_id.and_then(|id| grads.get_id(id)).ok_or_else(|| {
                Error::Tape(format!(
                    "opaque unit `{}`: candle's backward gave the input no gradient; the module's \
                     output does not depend on its input through differentiable candle ops (a \
                     custom op without backward, such as candle-nn's fused RmsNorm, stops \
                     gradients: use its differentiable path, e.g. `forward_diff`)",
                    self.unit
                ))
            })?;
            Some(g.clone())
        } else {
            None
        });
        for (i, id) in self.param_ids.iter().enumerate() {
            if !need.get(i + 1).copied().unwrap_or(false) {
                out.push(None);
                continue;
            }
            // A parameter that gets no gradient is a silent training bug (most often a
            // candle op without backward on its path): say so.
            let g = grads.get_id(*id).ok_or_else(|| {
                Error::Tape(format!(
                    "opaque unit `{}`: candle's backward gave parameter {i} no gradient; the \
                     module does not use it through differentiable candle ops (candle-nn's fused \
                     RmsNorm, for one, has no backward: use `forward_diff`)",
                    self.unit
                ))
            })?;
            out.push(Some(g.clone()));
        }
        Ok(out)
    }
}
