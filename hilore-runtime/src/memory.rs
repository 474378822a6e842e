//! Exact accounting of the saved state the tape holds, and of the activation gradients
//! alive during backward.
//!
//! Every tensor a slot holds is counted by the storage it keeps alive (a view of a larger
//! buffer keeps the whole buffer), once however many slots share it. Encoded slots count
//! their data plus scales. Parameters referenced by slots are not activation memory and are
//! not counted. The ledger is the ground truth that plans are made against: its figures
//! are the real sizes of the buffers the tape keeps alive.

use candle_core::{CpuStorage, Storage, Tensor};
use serde::Serialize;
use std::collections::HashMap;

/// What a counted buffer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemClass {
    /// Saved tensors in the compute dtype (Store units, and exact slots of others).
    Stored,
    /// Codec encodings (Compress units), data plus scales.
    Compressed,
    /// Inputs kept by Recompute units.
    Inputs,
    /// Compressed slots decoded for backward (transient).
    Decoded,
    /// Slots rebuilt by a recompute during backward (transient).
    Recomputed,
    /// Gradients of activations alive during backward (transient).
    Gradients,
}

impl MemClass {
    /// Every class, in report order.
    pub const ALL: [MemClass; 6] = [
        MemClass::Stored,
        MemClass::Compressed,
        MemClass::Inputs,
        MemClass::Decoded,
        MemClass::Recomputed,
        MemClass::Gradients,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// Identity of a counted buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum StorageKey {
    /// A host buffer, by address.
    Host(usize),
    /// A GPU buffer, by the address of the storage that owns it while it is alive.
    #[cfg_attr(not(feature = "gpu"), allow(dead_code))]
    Device(usize),
    /// A buffer known by the tensor that owns it (other devices).
    Tensor(candle_core::TensorId),
    /// An encoding owned by a slot.
    Encoded(u64),
}

/// The key and the exact byte size of the storage behind `t`.
pub(crate) fn storage_of(t: &Tensor) -> (StorageKey, usize) {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(c) => {
            let (ptr, bytes) = match c {
                CpuStorage::U8(v) => (v.as_ptr() as usize, v.len()),
                CpuStorage::U32(v) => (v.as_ptr() as usize, 4 * v.len()),
                CpuStorage::I16(v) => (v.as_ptr() as usize, 2 * v.len()),
                CpuStorage::I32(v) => (v.as_ptr() as usize, 4 * v.len()),
                CpuStorage::I64(v) => (v.as_ptr() as usize, 8 * v.len()),
                CpuStorage::BF16(v) => (v.as_ptr() as usize, 2 * v.len()),
                CpuStorage::F16(v) => (v.as_ptr() as usize, 2 * v.len()),
                CpuStorage::F32(v) => (v.as_ptr() as usize, 4 * v.len()),
                CpuStorage::F64(v) => (v.as_ptr() as usize, 8 * v.len()),
                CpuStorage::F8E4M3(v) => (v.as_ptr() as usize, v.len()),
                CpuStorage::F6E2M3(v)
                | CpuStorage::F6E3M2(v)
                | CpuStorage::F4(v)
                | CpuStorage::F8E8M0(v) => (v.as_ptr() as usize, v.len()),
            };
            (StorageKey::Host(ptr), bytes)
        }
        // A CUDA buffer, by the storage that owns it (views share it), at its full size.
        #[cfg(feature = "gpu")]
        Storage::Cuda(c) => {
            use candle_core::cuda_backend::CudaStorageSlice as S;
            let bytes = match &c.slice {
                S::U8(v) | S::F6E2M3(v) | S::F6E3M2(v) | S::F4(v) | S::F8E8M0(v) => v.len(),
                S::U32(v) => 4 * v.len(),
                S::I16(v) => 2 * v.len(),
                S::I32(v) => 4 * v.len(),
                S::I64(v) => 8 * v.len(),
                S::BF16(v) => 2 * v.len(),
                S::F16(v) => 2 * v.len(),
                S::F32(v) => 4 * v.len(),
                S::F64(v) => 8 * v.len(),
                S::F8E4M3(v) => v.len(),
            };
            (
                StorageKey::Device(&*storage as *const Storage as usize),
                bytes,
            )
        }
        _ => (
            StorageKey::Tensor(t.id()),
            t.elem_count() * t.dtype().size_in_bytes(),
        ),
    }
}

/// What happened, for the memory timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A unit scope closed in the forward and its fidelity was applied.
    UnitClosed,
    /// A Compress unit's slots were decoded in backward.
    Decoded,
    /// A Recompute unit was re-run in backward.
    Recomputed,
    /// Backward finished a unit and freed what it held.
    Freed,
    /// Backward started.
    BackwardStart,
    /// Backward finished.
    BackwardEnd,
}

/// One point of the memory timeline.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryEvent {
    /// What happened.
    pub kind: EventKind,
    /// The unit it happened to (empty for pass-level events).
    pub unit: String,
    /// The unit's call index.
    pub call: usize,
    /// The fidelity of that unit instance.
    pub fidelity: String,
    /// Live saved bytes right after the event.
    pub live_bytes: usize,
}

#[derive(Debug)]
struct Entry {
    bytes: usize,
    refs: usize,
    class: MemClass,
}

/// Live saved bytes by class, the peak, and the timeline.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: HashMap<StorageKey, Entry>,
    live: [usize; 6],
    peak: usize,
    peak_saved: usize,
    peak_by_class: [usize; 6],
    events: Vec<MemoryEvent>,
}

impl Ledger {
    pub(crate) fn add(&mut self, key: StorageKey, bytes: usize, class: MemClass) {
        let e = self.entries.entry(key).or_insert(Entry {
            bytes,
            refs: 0,
            class,
        });
        e.refs += 1;
        if e.refs == 1 {
            self.live[class.index()] += bytes;
            let total = self.live_bytes();
            if total > self.peak {
                self.peak = total;
                self.peak_by_class = self.live;
            }
            let saved = total - self.live[MemClass::Gradients.index()];
            self.peak_saved = self.peak_saved.max(saved);
        }
    }

    pub(crate) fn release(&mut self, key: StorageKey) {
        if let Some(e) = self.entries.get_mut(&key) {
            e.refs -= 1;
            if e.refs == 0 {
                self.live[e.class.index()] -= e.bytes;
                self.entries.remove(&key);
            }
        }
    }

    pub(crate) fn event(&mut self, kind: EventKind, unit: &str, call: usize, fidelity: String) {
        let live_bytes = self.live_bytes();
        self.events.push(MemoryEvent {
            kind,
            unit: unit.to_string(),
            call,
            fidelity,
            live_bytes,
        });
    }

    /// Saved bytes alive now.
    pub fn live_bytes(&self) -> usize {
        self.live.iter().sum()
    }

    /// Saved bytes of one class alive now.
    pub fn live_bytes_of(&self, class: MemClass) -> usize {
        self.live[class.index()]
    }

    /// The highest `live_bytes` seen: saved state plus transients (decoded and
    /// recomputed slots, activation gradients in backward).
    pub fn peak_bytes(&self) -> usize {
        self.peak
    }

    /// The highest saved-state bytes seen, activation gradients excluded: what a hand
    /// count of the ops' saved tensors gives.
    pub fn peak_saved_bytes(&self) -> usize {
        self.peak_saved
    }

    /// The split by class at the moment of the peak.
    pub fn peak_by_class(&self) -> Vec<(MemClass, usize)> {
        MemClass::ALL
            .iter()
            .map(|&c| (c, self.peak_by_class[c.index()]))
            .collect()
    }

    /// The timeline.
    pub fn events(&self) -> &[MemoryEvent] {
        &self.events
    }

    /// Number of distinct buffers alive now.
    pub fn live_buffers(&self) -> usize {
        self.entries.len()
    }
}
