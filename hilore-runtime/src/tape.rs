//! The tape: records ops, keeps their saved tensors in slots owned by recovery units,
//! applies each unit's fidelity when its scope closes, and runs backward.

use crate::encoding::{self, Encoding};
use crate::fidelity::{Fidelity, Plan};
use crate::memory::{storage_of, EventKind, Ledger, MemClass, StorageKey};
use crate::ops::{Op, Saved};
use crate::simulate::{
    FwdEvent, NodeProf, ProfKind, ProfRec, Profile, SlotProf, StepProf, UnitProf,
};
use crate::unit::{Recompute, UnitDescriptor};
use crate::{Error, Grads, Result, Var, VarId, VarKind};
use candle_core::{DType, Device, Shape, Tensor, TensorId};
use std::collections::HashMap;
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

/// What a slot holds.
enum Slot {
    /// A parameter reference: not counted, never encoded.
    Param(Tensor),
    /// A tensor in the compute dtype, counted in the ledger under `key`.
    Held { tensor: Tensor, key: StorageKey },
    /// A codec encoding, counted under `key`.
    Encoded { enc: Rc<Encoding>, key: StorageKey },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotKind {
    Act,
    Exact,
    Param,
}

struct SlotMeta {
    kind: SlotKind,
    shape: Shape,
    dtype: DType,
    device: candle_core::Device,
}

struct Node {
    op: Box<dyn Op>,
    name: &'static str,
    inputs: Vec<(VarId, VarKind)>,
    output: VarId,
    needs_grad: bool,
    meta: Vec<SlotMeta>,
    slots: Vec<Slot>,
    unit: Option<usize>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum UnitState {
    /// Scope still open in the forward.
    Open,
    /// Slots hold tensors in the compute dtype.
    Live,
    /// Directly owned activation slots hold encodings.
    Encoded,
    /// Everything dropped; inputs and the recompute closure kept.
    Dropped,
    /// Backward has finished with the unit.
    Done,
}

struct UnitInst<'m> {
    desc: &'static UnitDescriptor,
    call: usize,
    parent: Option<usize>,
    fidelity: Fidelity,
    cost: f64,
    first_node: usize,
    end_node: usize,
    state: UnitState,
    inputs: Vec<Var>,
    held_inputs: Vec<StorageKey>,
    recompute: Option<Recompute<'m>>,
    fingerprint: Option<u64>,
}

/// Which pass the tape is in.
enum Mode {
    /// Nothing is recorded (rollouts, scoring).
    Inference,
    /// Ops append nodes.
    Forward,
    /// A Recompute unit is re-running: ops refill the recorded nodes.
    Replay {
        root: usize,
        cursor: usize,
        end: usize,
        unit_cursor: usize,
    },
    /// Backward is running (between replays).
    Backward,
}

/// The outcome of a recompute check: whether a deterministic unit's re-run reproduced its
/// forward output bit for bit.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RecomputeCheck {
    /// The unit.
    pub unit: String,
    /// Its call index.
    pub call: usize,
    /// Whether the recomputed output equals the forward output bit for bit.
    pub bit_identical: bool,
}

/// Time spent by the tape, split by kind of work. On a GPU the device's queue is drained
/// before every reading of the clock, so these are GPU times, not kernel-launch times.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct TapeTimes {
    /// Encoding Compress units' slots (forward).
    pub encode: Duration,
    /// Decoding them (backward).
    pub decode: Duration,
    /// Re-running Recompute units (backward).
    pub recompute: Duration,
    /// The whole backward pass, recompute and decode included.
    pub backward: Duration,
}

/// What a backward pass did.
#[derive(Debug, Clone, Default)]
pub struct BackwardReport {
    /// Units re-run.
    pub recomputed_units: usize,
    /// Units decoded.
    pub decoded_units: usize,
    /// Ops whose backward ran.
    pub ops: usize,
    /// Recompute checks (filled when [`Cx::verify_recompute`] or
    /// [`Cx::report_recompute_checks`] is on).
    pub checks: Vec<RecomputeCheck>,
}

/// One unit instance as the tape saw it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct UnitInstanceInfo {
    /// The unit's name.
    pub unit: &'static str,
    /// Its call index in the forward.
    pub call: usize,
    /// The enclosing unit instance (index into [`Cx::unit_instances`]).
    pub parent: Option<usize>,
    /// The fidelity it was given.
    pub fidelity: Fidelity,
    /// The value of its cost expression.
    pub cost: f64,
    /// Whether the unit is declared `deterministic` (may be recomputed).
    pub deterministic: bool,
    /// The codecs it allows under Compress (`None`: every codec).
    #[serde(skip)]
    pub codecs: Option<&'static [&'static str]>,
    /// Ops it recorded (nested units' included).
    pub ops: usize,
}

/// The tape context: every op and recovery unit runs through it.
///
/// `'m` is the lifetime of the model: Recompute units keep closures that borrow it.
pub struct Cx<'m> {
    plan: Plan,
    mode: Mode,
    nodes: Vec<Node>,
    units: Vec<UnitInst<'m>>,
    stack: Vec<usize>,
    calls: HashMap<*const UnitDescriptor, usize>,
    ledger: Ledger,
    times: TapeTimes,
    seed: u64,
    verify: bool,
    /// With `verify`: record a failed check instead of returning the error.
    report_only: bool,
    checks: Vec<RecomputeCheck>,
    poisoned: Option<String>,
    backward_done: bool,
    /// Live encodings by source tensor and codec: two slots saving the same tensor in
    /// Compress units share one encoding.
    encodings: HashMap<(TensorId, &'static str), (Weak<Encoding>, StorageKey)>,
    prof: Option<Box<ProfRec>>,
    /// The device of the first recorded tensor, when it is a GPU: its queue is drained
    /// before the clock is read, so the times are the GPU's, not the launch's.
    gpu: Option<Device>,
}

impl<'m> Cx<'m> {
    /// A tape that records a forward for backward under `plan`.
    pub fn new(plan: Plan) -> Self {
        Cx {
            plan,
            mode: Mode::Forward,
            nodes: Vec::new(),
            units: Vec::new(),
            stack: Vec::new(),
            calls: HashMap::new(),
            ledger: Ledger::default(),
            times: TapeTimes::default(),
            seed: 0,
            verify: false,
            report_only: false,
            checks: Vec::new(),
            poisoned: None,
            backward_done: false,
            encodings: HashMap::new(),
            prof: None,
            gpu: None,
        }
    }

    /// Records a profile of this pass for [`Profile::simulate`] (see
    /// [`crate::simulate`]). Every tensor the tape sees is kept alive until the tape is
    /// dropped, so profile only to plan, not to train.
    pub fn profiling(mut self, on: bool) -> Self {
        self.prof = on.then(Box::default);
        self
    }

    /// The profile of a finished, profiled pass (after backward).
    pub fn profile(&mut self) -> Result<Profile> {
        if !self.backward_done {
            return Err(Error::Tape(
                "the profile is complete only after backward".into(),
            ));
        }
        match self.prof.take() {
            Some(p) => Ok(p.into_profile()),
            None => Err(Error::Tape(
                "this tape was not profiling: create it with `Cx::new(plan).profiling(true)`"
                    .into(),
            )),
        }
    }

    /// A tape that records nothing: ops only compute (rollouts, scoring, evaluation).
    pub fn inference() -> Self {
        let mut cx = Cx::new(Plan::store_all());
        cx.mode = Mode::Inference;
        cx
    }

    /// Seeds the counter-based RNG ([`Cx::counter_uniform`]).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Fingerprints every Recompute unit's output in the forward and compares the
    /// recomputed output in backward: a difference fails the backward with
    /// [`Error::NotBitIdentical`], naming the unit and the op (the checks are also in
    /// [`BackwardReport::checks`]).
    pub fn verify_recompute(mut self, on: bool) -> Self {
        self.verify = on;
        self.report_only = false;
        self
    }

    /// [`Cx::verify_recompute`] that only records each check's outcome in
    /// [`BackwardReport::checks`] and lets the backward finish: for tools that compare
    /// many plans and report every failure (`hilore check`).
    pub fn report_recompute_checks(mut self, on: bool) -> Self {
        self.verify = on;
        self.report_only = true;
        self
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Whether ops are recorded (false for [`Cx::inference`]).
    pub fn records(&self) -> bool {
        !matches!(self.mode, Mode::Inference)
    }

    /// The memory ledger.
    pub fn memory(&self) -> &Ledger {
        &self.ledger
    }

    /// Time spent encoding, decoding, recomputing and in backward.
    pub fn times(&self) -> &TapeTimes {
        &self.times
    }

    /// Number of ops recorded.
    pub fn num_ops(&self) -> usize {
        self.nodes.len()
    }

    /// Every unit instance opened, in order.
    pub fn unit_instances(&self) -> Vec<UnitInstanceInfo> {
        self.units
            .iter()
            .map(|u| UnitInstanceInfo {
                unit: u.desc.name,
                call: u.call,
                parent: u.parent,
                fidelity: u.fidelity,
                cost: u.cost,
                deterministic: u.desc.deterministic,
                codecs: u.desc.codecs,
                ops: u.end_node - u.first_node,
            })
            .collect()
    }

    // ----- recording -------------------------------------------------------------------

    /// Records one op: `inputs` produced `output`; backward will read `saved`.
    /// During a recompute, refills the recorded op instead. Called by every op.
    pub fn record<O: Op + 'static>(
        &mut self,
        op: O,
        inputs: &[&Var],
        output: Tensor,
        saved: Vec<Saved>,
    ) -> Result<Var> {
        let needs_grad = inputs.iter().any(|v| v.requires_grad());
        if self.gpu.is_none() && !output.device().is_cpu() {
            self.gpu = Some(output.device().clone());
        }
        match self.mode {
            Mode::Inference => Ok(Var::activation(VarId::fresh(), output, false)),
            Mode::Forward => {
                let id = VarId::fresh();
                let (meta, slots) = if needs_grad {
                    self.hold_all(saved, MemClass::Stored)
                } else {
                    (Vec::new(), Vec::new())
                };
                let unit = self.stack.last().copied();
                if let Some(prof) = self.prof.as_mut() {
                    let mut ps = Vec::new();
                    for (m, slot) in meta.iter().zip(&slots) {
                        if let Slot::Held { tensor, .. } = slot {
                            let (buf, tid) = prof.ids(tensor);
                            ps.push(SlotProf {
                                kind: if m.kind == SlotKind::Act { ProfKind::Act } else { ProfKind::Exact },
                                buf,
                                tid,
                                elems: tensor.elem_count(),
                                decoded_bytes: tensor.elem_count() * tensor.dtype().size_in_bytes(),
                            });
                        }
                    }
                    prof.events.push(FwdEvent::Node(self.nodes.len()));
                    prof.nodes.push(NodeProf {
                        needs_grad,
                        unit,
                        slots: ps,
                    });
                }
                self.nodes.push(Node {
                    name: op.name(),
                    op: Box::new(op),
                    inputs: inputs.iter().map(|v| (v.id, v.kind)).collect(),
                    output: id,
                    needs_grad,
                    meta,
                    slots,
                    unit,
                });
                Ok(Var::activation(id, output, needs_grad))
            }
            Mode::Replay {
                root,
                cursor,
                end,
                ..
            } => {
                let unit = self.units[root].desc.name;
                if cursor >= end {
                    return Err(self.diverged(
                        unit,
                        format!("the recompute ran more ops than the {} recorded", end - self.units[root].first_node),
                    ));
                }
                let node = &self.nodes[cursor];
                if node.name != op.name() {
                    return Err(self.diverged(
                        unit,
                        format!("op {cursor} was `{}` in the forward, `{}` now", node.name, op.name()),
                    ));
                }
                // A constant made inside the unit (`Var::constant` of a mask, a table)
                // gets a new id each time the body runs; it carries no gradient and the
                // replayed op saves the replay's value, so a constant in a constant's place
                // replays. Any other new input means the body read something else.
                let replays = |((id, kind), v): (&(VarId, VarKind), &&Var)| {
                    *id == v.id
                        || (matches!(kind, VarKind::Constant | VarKind::Frozen) && v.kind == *kind)
                };
                let same_inputs = node.inputs.len() == inputs.len()
                    && node.inputs.iter().zip(inputs.iter()).all(replays);
                if !same_inputs {
                    let fresh_param = inputs.iter().any(|v| {
                        v.kind == VarKind::Param && !node.inputs.iter().any(|(id, _)| *id == v.id)
                    });
                    let hint = if fresh_param {
                        "; a `Var::param` made inside the unit gets a new id when it is recomputed: make it once, outside the unit (a field of the model), and pass it in"
                    } else {
                        "; the recompute computed its inputs differently from the forward: the body must be a function of the unit's inputs alone"
                    };
                    return Err(self.diverged(unit, format!("op {cursor} (`{}`) got other inputs than in the forward{hint}", node.name)));
                }
                let output_id = node.output;
                let (meta, slots) = if needs_grad {
                    self.hold_all(saved, MemClass::Recomputed)
                } else {
                    (Vec::new(), Vec::new())
                };
                let node = &mut self.nodes[cursor];
                node.op = Box::new(op);
                node.meta = meta;
                node.slots = slots;
                if let Mode::Replay { cursor, .. } = &mut self.mode {
                    *cursor += 1;
                }
                Ok(Var::activation(output_id, output, needs_grad))
            }
            Mode::Backward => Err(Error::Tape(
                "an op ran during backward outside a recompute; create a new Cx for the next forward".into(),
            )),
        }
    }

    fn diverged(&mut self, unit: &str, detail: String) -> Error {
        let e = Error::ReplayDiverged {
            unit: unit.to_string(),
            detail,
        };
        self.poisoned = Some(e.to_string());
        e
    }

    fn hold_all(&mut self, saved: Vec<Saved>, class: MemClass) -> (Vec<SlotMeta>, Vec<Slot>) {
        saved
            .into_iter()
            .map(|s| {
                let kind = match s {
                    Saved::Act(_) => SlotKind::Act,
                    Saved::Exact(_) => SlotKind::Exact,
                    Saved::Param(_) => SlotKind::Param,
                };
                let t = s.tensor();
                let meta = SlotMeta {
                    kind,
                    shape: t.shape().clone(),
                    dtype: t.dtype(),
                    device: t.device().clone(),
                };
                let slot = match s {
                    Saved::Param(t) => Slot::Param(t),
                    Saved::Act(t) | Saved::Exact(t) => self.hold(t, class),
                };
                (meta, slot)
            })
            .unzip()
    }

    fn hold(&mut self, tensor: Tensor, class: MemClass) -> Slot {
        let (key, bytes) = storage_of(&tensor);
        self.ledger.add(key, bytes, class);
        Slot::Held { tensor, key }
    }

    fn release(&mut self, slot: Slot) {
        match slot {
            Slot::Held { key, .. } | Slot::Encoded { key, .. } => self.ledger.release(key),
            Slot::Param(_) => {}
        }
    }

    fn release_node(&mut self, idx: usize) {
        let slots = std::mem::take(&mut self.nodes[idx].slots);
        for s in slots {
            self.release(s);
        }
    }

    /// Uniform values in `[0, 1)` from a counter-based generator keyed by the tape's seed
    /// and the index of the op about to be recorded, so a recompute draws the same values.
    pub fn counter_uniform(
        &mut self,
        shape: impl Into<Shape>,
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<Tensor> {
        let shape: Shape = shape.into();
        let stream = match self.mode {
            Mode::Replay { cursor, .. } => cursor as u64,
            _ => self.nodes.len() as u64,
        };
        let key = splitmix64(self.seed ^ splitmix64(stream.wrapping_add(0x9E37_79B9)));
        let n = shape.elem_count();
        let v: Vec<f64> = (0..n as u64)
            .map(|i| {
                (splitmix64(key ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03)) >> 11) as f64
                    / (1u64 << 53) as f64
            })
            .collect();
        Ok(Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?)
    }

    // ----- units ------------------------------------------------------------------------

    pub(crate) fn open_unit(
        &mut self,
        desc: &'static UnitDescriptor,
        cost: f64,
        inputs: Vec<Var>,
    ) -> Result<usize> {
        if let Some(p) = &self.poisoned {
            return Err(Error::Tape(format!(
                "the tape is unusable after an earlier error: {p}"
            )));
        }
        match &mut self.mode {
            Mode::Forward => {
                let counter = self.calls.entry(desc as *const _).or_insert(0);
                let call = *counter;
                *counter += 1;
                let fidelity = self.plan.fidelity_for(desc, call);
                desc.check(fidelity)?;
                let idx = self.units.len();
                if let Some(prof) = self.prof.as_mut() {
                    let ins = inputs
                        .iter()
                        .filter(|v| !v.kind.is_weight())
                        .map(|v| prof.ids(&v.tensor))
                        .collect();
                    let ev_open = prof.events.len();
                    prof.units.push(UnitProf {
                        desc,
                        call,
                        parent: self.stack.last().copied(),
                        first: self.nodes.len(),
                        end: self.nodes.len(),
                        inputs: ins,
                        ev_open,
                        ev_close: ev_open,
                    });
                }
                self.units.push(UnitInst {
                    desc,
                    call,
                    parent: self.stack.last().copied(),
                    fidelity,
                    cost,
                    first_node: self.nodes.len(),
                    end_node: self.nodes.len(),
                    state: UnitState::Open,
                    inputs,
                    held_inputs: Vec::new(),
                    recompute: None,
                    fingerprint: None,
                });
                self.stack.push(idx);
                Ok(idx)
            }
            Mode::Replay {
                unit_cursor,
                cursor,
                root,
                ..
            } => {
                let idx = *unit_cursor;
                let (root, cursor) = (*root, *cursor);
                let ok = idx < self.units.len()
                    && std::ptr::eq(self.units[idx].desc, desc)
                    && self.units[idx].first_node == cursor;
                if !ok {
                    let unit = self.units[root].desc.name;
                    return Err(self.diverged(
                        unit,
                        format!(
                            "unit `{}` opened where the forward did not open it",
                            desc.name
                        ),
                    ));
                }
                if let Mode::Replay { unit_cursor, .. } = &mut self.mode {
                    *unit_cursor += 1;
                }
                self.units[idx].inputs = inputs;
                self.stack.push(idx);
                Ok(idx)
            }
            Mode::Inference | Mode::Backward => Err(Error::Tape(
                "a recovery unit opened outside a forward".into(),
            )),
        }
    }

    pub(crate) fn abort_unit(&mut self, inst: usize) {
        self.poisoned = Some(format!(
            "unit `{}` failed during the forward",
            self.units[inst].desc.name
        ));
        self.stack.retain(|&u| u != inst);
    }

    pub(crate) fn close_unit(
        &mut self,
        inst: usize,
        outputs: &[Tensor],
        replay: Recompute<'m>,
    ) -> Result<()> {
        let top = self.stack.pop();
        debug_assert_eq!(top, Some(inst));
        let end = match self.mode {
            Mode::Replay { cursor, .. } => cursor,
            _ => self.nodes.len(),
        };
        if matches!(self.mode, Mode::Replay { .. }) && self.units[inst].end_node != end {
            let unit = self.units[inst].desc.name;
            return Err(self.diverged(
                unit,
                "the recompute recorded a different number of ops".into(),
            ));
        }
        self.units[inst].end_node = end;
        if matches!(self.mode, Mode::Forward) {
            if let Some(prof) = self.prof.as_mut() {
                prof.units[inst].end = end;
                prof.units[inst].ev_close = prof.events.len();
                prof.events.push(FwdEvent::Close(inst));
            }
        }
        let fidelity = self.units[inst].fidelity;
        match fidelity {
            Fidelity::Store => self.units[inst].state = UnitState::Live,
            Fidelity::Compress(codec) => self.encode_unit(inst, codec)?,
            Fidelity::Recompute => {
                if self.verify && matches!(self.mode, Mode::Forward) {
                    self.units[inst].fingerprint = Some(fingerprint(outputs)?);
                }
                self.drop_unit(inst, replay);
            }
        }
        let u = &self.units[inst];
        let (name, call) = (u.desc.name, u.call);
        self.ledger
            .event(EventKind::UnitClosed, name, call, fidelity.to_string());
        if matches!(self.mode, Mode::Forward) {
            // The plain forward does not need the inputs of units that are not recomputed.
            if fidelity != Fidelity::Recompute {
                self.units[inst].inputs.clear();
            }
        }
        Ok(())
    }

    /// Drops everything the unit and its nested units hold; keeps the unit's inputs and
    /// its recompute closure.
    fn drop_unit(&mut self, inst: usize, replay: Recompute<'m>) {
        let (first, end) = (self.units[inst].first_node, self.units[inst].end_node);
        for n in first..end {
            self.release_node(n);
        }
        for u in inst + 1..self.units.len() {
            if self.units[u].first_node >= end {
                break;
            }
            self.release_inputs(u);
            self.units[u].recompute = None;
            self.units[u].state = UnitState::Dropped;
        }
        let inputs = std::mem::take(&mut self.units[inst].inputs);
        let mut keys = Vec::with_capacity(inputs.len());
        for v in &inputs {
            if v.kind.is_weight() {
                continue;
            }
            let (key, bytes) = storage_of(&v.tensor);
            self.ledger.add(key, bytes, MemClass::Inputs);
            keys.push(key);
        }
        let u = &mut self.units[inst];
        u.inputs = inputs;
        u.held_inputs = keys;
        u.recompute = Some(replay);
        u.state = UnitState::Dropped;
    }

    fn release_inputs(&mut self, u: usize) {
        let keys = std::mem::take(&mut self.units[u].held_inputs);
        for k in keys {
            self.ledger.release(k);
        }
        self.units[u].inputs.clear();
    }

    /// The clock, read after the GPU's queued work has finished (at once on the CPU).
    fn now(&self) -> Result<Instant> {
        if let Some(dev) = &self.gpu {
            dev.synchronize()?;
        }
        Ok(Instant::now())
    }

    /// Time since `t0`, once the GPU's queued work has finished.
    fn since(&self, t0: Instant) -> Result<Duration> {
        Ok(self.now()?.duration_since(t0))
    }

    fn encode_unit(&mut self, inst: usize, codec_name: &'static str) -> Result<()> {
        let t0 = self.now()?;
        let codec = hilore_kernels::codec_by_name(codec_name)?;
        let (first, end) = (self.units[inst].first_node, self.units[inst].end_node);
        for n in first..end {
            if self.nodes[n].unit != Some(inst) {
                continue;
            }
            for s in 0..self.nodes[n].slots.len() {
                if self.nodes[n].meta[s].kind != SlotKind::Act {
                    continue;
                }
                let Slot::Held { tensor, .. } = &self.nodes[n].slots[s] else {
                    continue;
                };
                let share = (tensor.id(), codec.name());
                let shared = self
                    .encodings
                    .get(&share)
                    .and_then(|(w, key)| w.upgrade().map(|e| (e, *key)));
                let (enc, key) = match shared {
                    Some(found) => found,
                    None => {
                        let enc =
                            Rc::new(encoding::encode(codec, tensor, self.units[inst].desc.name)?);
                        let key = StorageKey::Encoded(next_encoding_id());
                        self.encodings.insert(share, (Rc::downgrade(&enc), key));
                        (enc, key)
                    }
                };
                self.ledger.add(key, enc.nbytes(), MemClass::Compressed);
                let old =
                    std::mem::replace(&mut self.nodes[n].slots[s], Slot::Encoded { enc, key });
                self.release(old);
            }
        }
        self.units[inst].state = UnitState::Encoded;
        self.times.encode += self.since(t0)?;
        Ok(())
    }

    fn decode_unit(&mut self, inst: usize) -> Result<()> {
        let t0 = self.now()?;
        let (first, end) = (self.units[inst].first_node, self.units[inst].end_node);
        for n in first..end {
            if self.nodes[n].unit != Some(inst) {
                continue;
            }
            for s in 0..self.nodes[n].slots.len() {
                let Slot::Encoded { enc, .. } = &self.nodes[n].slots[s] else {
                    continue;
                };
                let meta = &self.nodes[n].meta[s];
                let unit = self.units[inst].desc.name;
                let t = encoding::decode(enc, &meta.shape, meta.dtype, &meta.device, unit)?;
                let held = self.hold(t, MemClass::Decoded);
                let old = std::mem::replace(&mut self.nodes[n].slots[s], held);
                self.release(old);
            }
        }
        self.units[inst].state = UnitState::Live;
        let u = &self.units[inst];
        let (name, call, fid) = (u.desc.name, u.call, u.fidelity.to_string());
        self.ledger.event(EventKind::Decoded, name, call, fid);
        self.times.decode += self.since(t0)?;
        Ok(())
    }

    fn replay_unit(&mut self, inst: usize) -> Result<()> {
        let t0 = self.now()?;
        let Some(body) = self.units[inst].recompute.clone() else {
            return Err(Error::Tape(format!(
                "unit `{}` was dropped but keeps no recompute closure",
                self.units[inst].desc.name
            )));
        };
        self.mode = Mode::Replay {
            root: inst,
            cursor: self.units[inst].first_node,
            end: self.units[inst].end_node,
            unit_cursor: inst + 1,
        };
        self.stack.push(inst);
        let result = body(self);
        self.stack.pop();
        let cursor = match self.mode {
            Mode::Replay { cursor, .. } => cursor,
            _ => 0,
        };
        self.mode = Mode::Backward;
        let outputs = result?;
        let end = self.units[inst].end_node;
        if cursor != end {
            let unit = self.units[inst].desc.name;
            return Err(self.diverged(
                unit,
                format!(
                    "the recompute ran {} ops, the forward {}",
                    cursor - self.units[inst].first_node,
                    end - self.units[inst].first_node
                ),
            ));
        }
        if let Some(fp) = self.units[inst].fingerprint {
            let same = fingerprint(&outputs)? == fp;
            self.checks.push(RecomputeCheck {
                unit: self.units[inst].desc.name.to_string(),
                call: self.units[inst].call,
                bit_identical: same,
            });
            if !same && !self.report_only {
                let op_index = end.saturating_sub(1);
                let e = Error::NotBitIdentical {
                    unit: self.units[inst].desc.name.to_string(),
                    call: self.units[inst].call,
                    op: self.nodes.get(op_index).map_or("?", |n| n.name),
                    op_index,
                };
                self.poisoned = Some(e.to_string());
                return Err(e);
            }
        }
        self.units[inst].state = UnitState::Live;
        let u = &self.units[inst];
        let (name, call, fid) = (u.desc.name, u.call, u.fidelity.to_string());
        self.ledger.event(EventKind::Recomputed, name, call, fid);
        self.times.recompute += self.since(t0)?;
        Ok(())
    }

    /// Makes node `idx`'s saved tensors available: re-runs dropped enclosing units
    /// (outermost first) and decodes its unit if compressed.
    fn materialize(&mut self, idx: usize, report: &mut BackwardReport) -> Result<()> {
        let Some(unit) = self.nodes[idx].unit else {
            return Ok(());
        };
        loop {
            let mut outermost = None;
            let mut u = Some(unit);
            while let Some(i) = u {
                if self.units[i].state == UnitState::Dropped {
                    outermost = Some(i);
                }
                u = self.units[i].parent;
            }
            match outermost {
                Some(i) => {
                    self.replay_unit(i)?;
                    report.recomputed_units += 1;
                }
                None => break,
            }
        }
        if self.units[unit].state == UnitState::Encoded {
            self.decode_unit(unit)?;
            report.decoded_units += 1;
        }
        Ok(())
    }

    /// Backward from `output`, seeded with `seed` (the gradient of `output`, e.g. the
    /// per-token coefficients dL/dlogp). Parameter gradients are added into `grads`.
    /// A tape runs backward once.
    pub fn backward(
        &mut self,
        output: &Var,
        seed: &Tensor,
        grads: &mut Grads,
    ) -> Result<BackwardReport> {
        if let Some(p) = &self.poisoned {
            return Err(Error::Tape(format!(
                "the tape is unusable after an earlier error: {p}"
            )));
        }
        if !matches!(self.mode, Mode::Forward) || self.backward_done {
            return Err(Error::Tape(
                "backward runs once, after a recorded forward; create a new Cx per microbatch"
                    .into(),
            ));
        }
        if !self.stack.is_empty() {
            return Err(Error::Tape(
                "backward called while a recovery unit is still open".into(),
            ));
        }
        // A plan that names a unit this forward never ran would otherwise be ignored
        // without a word (a misspelt name, a unit of another model, units whose crate
        // was not linked).
        let ran: std::collections::BTreeSet<&str> =
            self.units.iter().map(|u| u.desc.name).collect();
        // Two units of one name (every unnamed `fn forward` is `forward`) would share
        // the plan's fidelity and call counts without a word: a plan naming such a name
        // is refused, naming where each is defined.
        for name in self.plan.unit_names() {
            let mut sites: Vec<(&str, u32)> = self
                .units
                .iter()
                .filter(|u| u.desc.name == name)
                .map(|u| (u.desc.file, u.desc.line))
                .collect();
            sites.sort_unstable();
            sites.dedup();
            if sites.len() > 1 {
                return Err(Error::Tape(format!(
                    "plan `{}` names unit `{name}`, but {} different units ran under that name ({}); give each its own `#[recovery_unit(name = \"...\")]`",
                    self.plan.name(),
                    sites.len(),
                    sites
                        .iter()
                        .map(|(f, l)| format!("{f}:{l}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        let unknown: Vec<&str> = self
            .plan
            .unit_names()
            .into_iter()
            .filter(|n| !ran.contains(n))
            .collect();
        if !unknown.is_empty() {
            return Err(Error::Tape(format!(
                "plan `{}` names unit{} {} that this forward never ran; the units it ran are {}",
                self.plan.name(),
                if unknown.len() > 1 { "s" } else { "" },
                unknown
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", "),
                if ran.is_empty() {
                    "none (no recovery unit ran: the model calls none, or the crate that defines them is not linked into this binary)".to_string()
                } else {
                    ran.iter()
                        .map(|n| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            )));
        }
        if seed.shape() != output.tensor.shape() {
            return Err(Error::Tape(format!(
                "backward seed has shape {:?}, the output {:?}",
                seed.dims(),
                output.tensor.dims()
            )));
        }
        if self.gpu.is_none() && !seed.device().is_cpu() {
            self.gpu = Some(seed.device().clone());
        }
        let t0 = self.now()?;
        self.backward_done = true;
        self.mode = Mode::Backward;
        self.ledger
            .event(EventKind::BackwardStart, "", 0, String::new());
        let mut report = BackwardReport::default();
        // Gradients of activations, counted in the ledger while alive.
        let mut agrads: HashMap<VarId, (Tensor, StorageKey)> = HashMap::new();
        if output.kind == VarKind::Param {
            grads.accumulate(output.id, seed.clone())?;
        } else {
            let (key, bytes) = storage_of(seed);
            self.ledger.add(key, bytes, MemClass::Gradients);
            agrads.insert(output.id, (seed.clone(), key));
        }
        if let Some(prof) = self.prof.as_mut() {
            prof.seed_bytes = self.ledger.live_bytes_of(MemClass::Gradients);
        }
        // Units finish, in backward, at their first node.
        let mut finishing: HashMap<usize, Vec<usize>> = HashMap::new();
        for (i, u) in self.units.iter().enumerate() {
            finishing.entry(u.first_node).or_default().push(i);
        }
        for idx in (0..self.nodes.len()).rev() {
            let g = agrads.remove(&self.nodes[idx].output);
            let active = g.is_some() && self.nodes[idx].needs_grad;
            let agrad_at_start = self.ledger.live_bytes_of(MemClass::Gradients);
            let mut agrad_peak_adds: Option<usize> = None;
            if let (Some((g, _)), true) = (&g, active) {
                self.materialize(idx, &mut report)?;
                let node = &self.nodes[idx];
                let mut saved = Vec::with_capacity(node.slots.len());
                for (s, slot) in node.slots.iter().enumerate() {
                    match slot {
                        Slot::Held { tensor, .. } | Slot::Param(tensor) => {
                            saved.push(tensor.clone())
                        }
                        _ => {
                            return Err(Error::Tape(format!(
                                "op {idx} (`{}`) slot {s} is not materialized in backward",
                                node.name
                            )))
                        }
                    }
                }
                let needs: Vec<bool> = node
                    .inputs
                    .iter()
                    .map(|(_, k)| !matches!(k, VarKind::Constant | VarKind::Frozen))
                    .collect();
                let gin = node.op.backward(&saved, g, &needs)?;
                drop(saved);
                report.ops += 1;
                let inputs = self.nodes[idx].inputs.clone();
                for ((id, kind), gi) in inputs.into_iter().zip(gin) {
                    let Some(gi) = gi else { continue };
                    match kind {
                        VarKind::Constant | VarKind::Frozen => {}
                        VarKind::Param => grads.accumulate(id, gi)?,
                        VarKind::Activation => {
                            let (key, bytes) = storage_of(&gi);
                            self.ledger.add(key, bytes, MemClass::Gradients);
                            let mut now = self.ledger.live_bytes_of(MemClass::Gradients);
                            let entry = match agrads.remove(&id) {
                                Some((prev, prev_key)) => {
                                    let sum = crate::ops::add_same(&prev, &gi)?;
                                    let (skey, sbytes) = storage_of(&sum);
                                    self.ledger.add(skey, sbytes, MemClass::Gradients);
                                    now = now.max(self.ledger.live_bytes_of(MemClass::Gradients));
                                    self.ledger.release(prev_key);
                                    self.ledger.release(key);
                                    (sum, skey)
                                }
                                None => (gi, key),
                            };
                            agrad_peak_adds = Some(agrad_peak_adds.map_or(now, |p| p.max(now)));
                            agrads.insert(id, entry);
                        }
                    }
                }
            }
            if let Some((_, key)) = g {
                self.ledger.release(key);
            }
            if let Some(prof) = self.prof.as_mut() {
                prof.steps.push(StepProf {
                    idx,
                    active,
                    agrad_at_start,
                    agrad_peak_adds,
                });
            }
            self.release_node(idx);
            if let Some(done) = finishing.remove(&idx) {
                for u in done.into_iter().rev() {
                    self.release_inputs(u);
                    self.units[u].recompute = None;
                    self.units[u].state = UnitState::Done;
                    let info = &self.units[u];
                    let (name, call, fid) = (info.desc.name, info.call, info.fidelity.to_string());
                    self.ledger.event(EventKind::Freed, name, call, fid);
                }
            }
        }
        for u in 0..self.units.len() {
            self.release_inputs(u);
            self.units[u].recompute = None;
        }
        for (_, (_, key)) in agrads.drain() {
            self.ledger.release(key);
        }
        self.ledger
            .event(EventKind::BackwardEnd, "", 0, String::new());
        report.checks = std::mem::take(&mut self.checks);
        self.times.backward += self.since(t0)?;
        Ok(report)
    }
}

impl std::fmt::Debug for Cx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cx")
            .field("plan", &self.plan.name())
            .field("ops", &self.nodes.len())
            .field("units", &self.units.len())
            .field("live_bytes", &self.ledger.live_bytes())
            .finish()
    }
}

fn next_encoding_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

pub(crate) fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A hash of the exact bits of `tensors` (FNV-1a over the raw element bytes).
fn fingerprint(tensors: &[Tensor]) -> Result<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for t in tensors {
        let t = t.flatten_all()?;
        eat(&(t.dims()[0] as u64).to_le_bytes());
        match t.dtype() {
            DType::F64 => t
                .to_vec1::<f64>()?
                .iter()
                .for_each(|v| eat(&v.to_bits().to_le_bytes())),
            DType::U32 => t
                .to_vec1::<u32>()?
                .iter()
                .for_each(|v| eat(&v.to_le_bytes())),
            _ => t
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?
                .iter()
                .for_each(|v| eat(&v.to_bits().to_le_bytes())),
        }
    }
    Ok(h)
}
