//! An exact memory simulator: the ledger peak any plan would measure, from one profiled
//! pass.
//!
//! A profiled pass ([`crate::Cx::profiling`]) records what every op saves (which storage,
//! which tensor, how many elements), which unit owns it, the order of ops and unit closes,
//! each unit's inputs, and the activation-gradient bytes alive at every backward step
//! (those do not depend on the plan). [`Profile::simulate`] then replays the tape's own
//! rules — fidelities applied at scope close, recompute outermost first with inner plans
//! re-applied, decode before use, release after use, shared storages and shared
//! encodings counted once — on that record. The result equals the ledger's measured peak
//! byte for byte: the allocator plans against it without running the plan.

use crate::fidelity::{Fidelity, Plan};
use crate::memory::StorageKey;
use crate::unit::UnitDescriptor;
use crate::Result;
use candle_core::{Tensor, TensorId};
use std::collections::HashMap;

/// The simulator's maps: small integer keys, hashed fast (a simulation is in the
/// planner's inner loop).
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProfKind {
    Act,
    Exact,
}

#[derive(Debug, Clone)]
pub(crate) struct SlotProf {
    pub kind: ProfKind,
    pub buf: usize,
    pub tid: usize,
    pub elems: usize,
    pub decoded_bytes: usize,
}

#[derive(Debug, Clone)]
pub(crate) struct NodeProf {
    pub needs_grad: bool,
    pub unit: Option<usize>,
    pub slots: Vec<SlotProf>,
}

#[derive(Debug, Clone)]
pub(crate) struct UnitProf {
    pub desc: &'static UnitDescriptor,
    pub call: usize,
    pub parent: Option<usize>,
    pub first: usize,
    pub end: usize,
    pub inputs: Vec<(usize, usize)>,
    pub ev_open: usize,
    pub ev_close: usize,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum FwdEvent {
    Node(usize),
    Close(usize),
}

#[derive(Debug, Clone)]
pub(crate) struct StepProf {
    pub idx: usize,
    pub active: bool,
    pub agrad_at_start: usize,
    pub agrad_peak_adds: Option<usize>,
}

/// What a profiling tape records while it runs.
#[derive(Debug, Default)]
pub(crate) struct ProfRec {
    keep: Vec<Tensor>,
    bufs: HashMap<StorageKey, usize>,
    pub buf_bytes: Vec<usize>,
    tids: HashMap<TensorId, usize>,
    pub nodes: Vec<NodeProf>,
    pub units: Vec<UnitProf>,
    pub events: Vec<FwdEvent>,
    pub steps: Vec<StepProf>,
    pub seed_bytes: usize,
}

impl ProfRec {
    /// Canonical ids of `t`'s storage and of `t` itself. The tensor is kept alive for the
    /// rest of the profiled pass, so no address is reused and storage keys stay unique.
    pub(crate) fn ids(&mut self, t: &Tensor) -> (usize, usize) {
        let (key, bytes) = crate::memory::storage_of(t);
        let n = self.buf_bytes.len();
        let buf = *self.bufs.entry(key).or_insert(n);
        if buf == n {
            self.buf_bytes.push(bytes);
        }
        let m = self.tids.len();
        let tid = *self.tids.entry(t.id()).or_insert(m);
        self.keep.push(t.clone());
        (buf, tid)
    }

    pub(crate) fn into_profile(self) -> Profile {
        let mut slot_start = Vec::with_capacity(self.nodes.len() + 1);
        slot_start.push(0);
        for n in &self.nodes {
            slot_start.push(slot_start[slot_start.len() - 1] + n.slots.len());
        }
        Profile {
            slot_start,
            buf_bytes: self.buf_bytes,
            nodes: self.nodes,
            units: self.units,
            events: self.events,
            steps: self.steps,
            seed_bytes: self.seed_bytes,
        }
    }
}

/// The record of one profiled forward+backward; see the module docs.
#[derive(Debug, Clone)]
pub struct Profile {
    /// Where node `i`'s slots start in a simulation's flat slot list (`[nodes]` is the
    /// total).
    slot_start: Vec<usize>,
    buf_bytes: Vec<usize>,
    nodes: Vec<NodeProf>,
    units: Vec<UnitProf>,
    events: Vec<FwdEvent>,
    steps: Vec<StepProf>,
    seed_bytes: usize,
}

/// Exact byte figures of one unit instance, from a profile.
#[derive(Debug, Clone, serde::Serialize)]
pub struct InstanceBytes {
    /// Index of the instance (order of opening in the forward).
    pub index: usize,
    /// The unit.
    pub unit: &'static str,
    /// Call index.
    pub call: usize,
    /// Enclosing instance.
    pub parent: Option<usize>,
    /// Distinct storage bytes its own ops save (nested units excluded).
    pub own_saved_bytes: usize,
    /// Elements of its own activation slots (what Compress encodes).
    pub own_act_elems: Vec<usize>,
    /// Distinct storage bytes of its inputs (what Recompute keeps).
    pub input_bytes: usize,
    /// Ops it recorded, nested units' included.
    pub ops: usize,
}

/// What [`Profile::simulate`] predicts for a plan.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Simulated {
    /// The ledger's peak (saved state plus activation gradients), in bytes.
    pub peak_bytes: usize,
    /// Saved bytes alive when the forward ends.
    pub end_of_forward_bytes: usize,
    /// Units that backward would re-run.
    pub recomputes: usize,
    /// Units that backward would decode.
    pub decodes: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Key {
    Buf(u32, usize),
    Tensor(u32, usize),
    Fresh(usize),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SimSlot {
    Held(Key),
    Enc(Key),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum St {
    Open,
    Live,
    Encoded,
    Dropped,
    Done,
}

struct SimUnit {
    state: St,
    held: Vec<Key>,
    buf_map: FastMap<usize, Key>,
    tid_map: FastMap<usize, Key>,
}

/// Reference counts and bytes of the storages and encodings alive: `(count, bytes)`, a
/// count of 0 meaning absent. The forward's own storages and the fresh keys (encodings,
/// decoded copies) are indexed directly; only storages a recompute re-creates are hashed.
struct Refs {
    buf0: Vec<(usize, usize)>,
    fresh: Vec<(usize, usize)>,
    other: FastMap<Key, (usize, usize)>,
}

impl Refs {
    fn new(bufs: usize) -> Self {
        Refs {
            buf0: vec![(0, 0); bufs],
            fresh: Vec::new(),
            other: FastMap::default(),
        }
    }

    /// The entry of `k`, created absent.
    fn entry(&mut self, k: Key) -> &mut (usize, usize) {
        match k {
            Key::Buf(0, b) => &mut self.buf0[b],
            Key::Fresh(n) => {
                if self.fresh.len() <= n {
                    self.fresh.resize(n + 1, (0, 0));
                }
                &mut self.fresh[n]
            }
            k => self.other.entry(k).or_insert((0, 0)),
        }
    }

    /// Adds a reference to `k` (of `bytes` if absent); the bytes it adds, if it was absent.
    fn add(&mut self, k: Key, bytes: usize) -> Option<usize> {
        let e = self.entry(k);
        if e.0 == 0 {
            e.1 = bytes;
        }
        e.0 += 1;
        (e.0 == 1).then_some(e.1)
    }

    /// The entry of `k`, if it has one (absent ones may have an entry of count 0).
    fn get(&mut self, k: Key) -> Option<&mut (usize, usize)> {
        match k {
            Key::Buf(0, b) => self.buf0.get_mut(b),
            Key::Fresh(n) => self.fresh.get_mut(n),
            k => self.other.get_mut(&k),
        }
    }

    /// Drops a reference to `k`; the bytes it frees, if that was the last one (a hashed
    /// entry is then removed, so the map holds only what is alive).
    fn release(&mut self, k: Key) -> Option<usize> {
        let e = self.get(k).filter(|e| e.0 > 0)?;
        e.0 -= 1;
        if e.0 > 0 {
            return None;
        }
        let bytes = e.1;
        if !matches!(k, Key::Buf(0, _) | Key::Fresh(_)) {
            self.other.remove(&k);
        }
        Some(bytes)
    }

    fn contains(&mut self, k: Key) -> bool {
        self.get(k).is_some_and(|e| e.0 > 0)
    }
}

struct Sim<'p> {
    p: &'p Profile,
    /// Every instance's fidelity under the plan.
    fids: &'p [Fidelity],
    refs: Refs,
    saved: usize,
    agrad: usize,
    peak: usize,
    fresh: usize,
    gen: u32,
    ctx: Vec<(u32, usize)>,
    /// Every node's slots, flat ([`Profile::slot_start`]); meaningful while it is held.
    slots: Vec<SimSlot>,
    /// Whether node `i` holds its slots (saved in the forward, or again by a recompute,
    /// and not yet released).
    held: Vec<bool>,
    units: Vec<SimUnit>,
    encodings: FastMap<(Key, &'static str), Key>,
    recomputes: usize,
    decodes: usize,
}

impl Sim<'_> {
    fn add(&mut self, k: Key, bytes: usize) {
        if let Some(b) = self.refs.add(k, bytes) {
            self.saved += b;
            self.peak = self.peak.max(self.saved + self.agrad);
        }
    }

    fn release(&mut self, k: Key) {
        if let Some(b) = self.refs.release(k) {
            self.saved -= b;
        }
    }

    fn fresh(&mut self) -> Key {
        self.fresh += 1;
        Key::Fresh(self.fresh)
    }

    fn resolve_buf(&self, buf: usize) -> Key {
        match self.ctx.last() {
            None => Key::Buf(0, buf),
            Some(&(g, r)) => self.units[r]
                .buf_map
                .get(&buf)
                .copied()
                .unwrap_or(Key::Buf(g, buf)),
        }
    }

    fn resolve_tid(&self, tid: usize) -> Key {
        match self.ctx.last() {
            None => Key::Tensor(0, tid),
            Some(&(g, r)) => self.units[r]
                .tid_map
                .get(&tid)
                .copied()
                .unwrap_or(Key::Tensor(g, tid)),
        }
    }

    /// Node `i`'s slots in the flat slot list, while it holds them (none otherwise).
    fn node_slots(&self, i: usize) -> std::ops::Range<usize> {
        if self.held[i] {
            self.p.slot_start[i]..self.p.slot_start[i + 1]
        } else {
            0..0
        }
    }

    fn hold_node(&mut self, i: usize) {
        let p = self.p;
        let node = &p.nodes[i];
        if !node.needs_grad {
            return;
        }
        let start = p.slot_start[i];
        for (j, s) in node.slots.iter().enumerate() {
            let k = self.resolve_buf(s.buf);
            self.add(k, p.buf_bytes[s.buf]);
            self.slots[start + j] = SimSlot::Held(k);
        }
        self.held[i] = true;
    }

    fn release_node(&mut self, i: usize) {
        for j in self.node_slots(i) {
            match self.slots[j] {
                SimSlot::Held(k) | SimSlot::Enc(k) => self.release(k),
            }
        }
        self.held[i] = false;
    }

    fn release_inputs(&mut self, u: usize) {
        for k in std::mem::take(&mut self.units[u].held) {
            self.release(k);
        }
    }

    fn close(&mut self, u: usize, root: Option<usize>) -> Result<()> {
        let up = &self.p.units[u];
        if root == Some(u) {
            self.units[u].state = St::Live;
            return Ok(());
        }
        match self.fids[u] {
            Fidelity::Store => self.units[u].state = St::Live,
            Fidelity::Compress(codec) => {
                let codec = hilore_kernels::codec_by_name(codec)?;
                for i in up.first..up.end {
                    if self.p.nodes[i].unit != Some(u) {
                        continue;
                    }
                    let base = self.p.slot_start[i];
                    for j in self.node_slots(i) {
                        let sp = &self.p.nodes[i].slots[j - base];
                        let SimSlot::Held(k) = self.slots[j] else {
                            continue;
                        };
                        if sp.kind != ProfKind::Act {
                            continue;
                        }
                        let t = self.resolve_tid(sp.tid);
                        let enc = match self.encodings.get(&(t, codec.name())) {
                            Some(e) if self.refs.contains(*e) => *e,
                            _ => {
                                let e = self.fresh();
                                self.encodings.insert((t, codec.name()), e);
                                e
                            }
                        };
                        self.add(enc, codec.encoded_len(sp.elems));
                        self.release(k);
                        self.slots[j] = SimSlot::Enc(enc);
                    }
                }
                self.units[u].state = St::Encoded;
            }
            Fidelity::Recompute => {
                for i in up.first..up.end {
                    self.release_node(i);
                }
                for v in u + 1..self.p.units.len() {
                    if self.p.units[v].first >= up.end {
                        break;
                    }
                    self.release_inputs(v);
                    self.units[v].state = St::Dropped;
                }
                let mut held = Vec::new();
                let mut buf_map = FastMap::default();
                let mut tid_map = FastMap::default();
                for &(buf, tid) in &up.inputs {
                    let k = self.resolve_buf(buf);
                    self.add(k, self.p.buf_bytes[buf]);
                    held.push(k);
                    buf_map.insert(buf, k);
                    tid_map.insert(tid, self.resolve_tid(tid));
                }
                let su = &mut self.units[u];
                su.held = held;
                su.buf_map = buf_map;
                su.tid_map = tid_map;
                su.state = St::Dropped;
            }
        }
        Ok(())
    }

    fn run_events(&mut self, from: usize, to: usize, root: Option<usize>) -> Result<()> {
        for e in from..to {
            match self.p.events[e] {
                FwdEvent::Node(i) => self.hold_node(i),
                FwdEvent::Close(u) => self.close(u, root)?,
            }
        }
        Ok(())
    }

    fn replay(&mut self, r: usize) -> Result<()> {
        self.gen += 1;
        self.ctx.push((self.gen, r));
        let (from, to) = (self.p.units[r].ev_open, self.p.units[r].ev_close);
        let res = self.run_events(from, to + 1, Some(r));
        self.ctx.pop();
        self.recomputes += 1;
        res
    }

    fn materialize(&mut self, idx: usize) -> Result<()> {
        let Some(unit) = self.p.nodes[idx].unit else {
            return Ok(());
        };
        loop {
            let mut outermost = None;
            let mut u = Some(unit);
            while let Some(i) = u {
                if self.units[i].state == St::Dropped {
                    outermost = Some(i);
                }
                u = self.p.units[i].parent;
            }
            match outermost {
                Some(i) => self.replay(i)?,
                None => break,
            }
        }
        if self.units[unit].state == St::Encoded {
            let up = &self.p.units[unit];
            for i in up.first..up.end {
                if self.p.nodes[i].unit != Some(unit) {
                    continue;
                }
                let base = self.p.slot_start[i];
                for j in self.node_slots(i) {
                    let SimSlot::Enc(k) = self.slots[j] else {
                        continue;
                    };
                    let d = self.fresh();
                    self.add(d, self.p.nodes[i].slots[j - base].decoded_bytes);
                    self.release(k);
                    self.slots[j] = SimSlot::Held(d);
                }
            }
            self.units[unit].state = St::Live;
            self.decodes += 1;
        }
        Ok(())
    }
}

impl Profile {
    /// Exact byte figures of every unit instance.
    pub fn instances(&self) -> Vec<InstanceBytes> {
        self.units
            .iter()
            .enumerate()
            .map(|(i, u)| {
                let mut seen = std::collections::HashSet::new();
                let mut own = 0;
                let mut elems = Vec::new();
                for n in u.first..u.end {
                    let node = &self.nodes[n];
                    if node.unit != Some(i) || !node.needs_grad {
                        continue;
                    }
                    for s in &node.slots {
                        if seen.insert(s.buf) {
                            own += self.buf_bytes[s.buf];
                        }
                        if s.kind == ProfKind::Act {
                            elems.push(s.elems);
                        }
                    }
                }
                let mut seen = std::collections::HashSet::new();
                let input_bytes = u
                    .inputs
                    .iter()
                    .filter(|(b, _)| seen.insert(*b))
                    .map(|(b, _)| self.buf_bytes[*b])
                    .sum();
                InstanceBytes {
                    index: i,
                    unit: u.desc.name,
                    call: u.call,
                    parent: u.parent,
                    own_saved_bytes: own,
                    own_act_elems: elems,
                    input_bytes,
                    ops: u.end - u.first,
                }
            })
            .collect()
    }

    /// The unit descriptor of instance `i`.
    pub fn descriptor(&self, i: usize) -> &'static UnitDescriptor {
        self.units[i].desc
    }

    /// Number of unit instances.
    pub fn num_instances(&self) -> usize {
        self.units.len()
    }

    /// Number of events a simulation replays: the forward's ops and unit closes and the
    /// backward's steps (what a simulation's time grows with).
    pub fn num_events(&self) -> usize {
        self.events.len() + self.steps.len()
    }

    /// Predicts the ledger peak of `plan` on the profiled forward+backward, exactly.
    pub fn simulate(&self, plan: &Plan) -> Result<Simulated> {
        let fids: Vec<Fidelity> = self
            .units
            .iter()
            .map(|u| plan.fidelity_for(u.desc, u.call))
            .collect();
        self.simulate_fidelities(&fids)
    }

    /// [`Profile::simulate`] with every instance's fidelity given directly (`fids[i]` for
    /// instance `i`, in the order of [`Profile::instances`]).
    pub fn simulate_fidelities(&self, fids: &[Fidelity]) -> Result<Simulated> {
        if fids.len() != self.units.len() {
            return Err(crate::Error::Tape(format!(
                "simulator: {} fidelities given for {} unit instances",
                fids.len(),
                self.units.len()
            )));
        }
        for (u, &f) in self.units.iter().zip(fids) {
            u.desc.check(f)?;
            if let Fidelity::Compress(codec) = f {
                hilore_kernels::codec_by_name(codec)?;
            }
        }
        let mut sim = Sim {
            p: self,
            fids,
            refs: Refs::new(self.buf_bytes.len()),
            saved: 0,
            agrad: 0,
            peak: 0,
            fresh: 0,
            gen: 0,
            ctx: Vec::new(),
            slots: vec![SimSlot::Held(Key::Fresh(0)); self.slot_start[self.nodes.len()]],
            held: vec![false; self.nodes.len()],
            units: (0..self.units.len())
                .map(|_| SimUnit {
                    state: St::Open,
                    held: Vec::new(),
                    buf_map: FastMap::default(),
                    tid_map: FastMap::default(),
                })
                .collect(),
            encodings: FastMap::default(),
            recomputes: 0,
            decodes: 0,
        };
        sim.run_events(0, self.events.len(), None)?;
        let end_of_forward_bytes = sim.saved;
        sim.agrad = self.seed_bytes;
        sim.peak = sim.peak.max(sim.saved + sim.agrad);
        let mut finishing: FastMap<usize, Vec<usize>> = FastMap::default();
        for (i, u) in self.units.iter().enumerate() {
            finishing.entry(u.first).or_default().push(i);
        }
        for step in &self.steps {
            sim.agrad = step.agrad_at_start;
            if step.active {
                sim.materialize(step.idx)?;
                if let Some(p) = step.agrad_peak_adds {
                    sim.peak = sim.peak.max(sim.saved + p);
                }
            }
            sim.release_node(step.idx);
            if let Some(done) = finishing.remove(&step.idx) {
                for u in done.into_iter().rev() {
                    sim.release_inputs(u);
                    sim.units[u].state = St::Done;
                }
            }
        }
        if sim.saved > 0 {
            for u in 0..self.units.len() {
                sim.release_inputs(u);
            }
        }
        Ok(Simulated {
            peak_bytes: sim.peak,
            end_of_forward_bytes,
            recomputes: sim.recomputes,
            decodes: sim.decodes,
        })
    }
}
