//! Fidelities and plans.

use crate::unit::UnitDescriptor;
use crate::{Error, Result};
use std::collections::HashMap;
use std::fmt;

/// What a recovery unit's saved state is between the forward and the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fidelity {
    /// The saved tensors in the compute dtype. Exact, costs their full bytes.
    #[default]
    Store,
    /// Every activation the unit saves, encoded by the named codec (data + scales);
    /// decoded when backward reaches the unit. Lossy, with a bound set by the codec.
    Compress(&'static str),
    /// Nothing but the unit's inputs; the unit body is re-run when backward reaches it.
    /// Bit-identical; only offered to `deterministic` units.
    Recompute,
}

impl Fidelity {
    /// Parses `store`, `recompute` or `compress-<codec>` (e.g. `compress-bf16`).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "store" => Ok(Fidelity::Store),
            "recompute" => Ok(Fidelity::Recompute),
            _ => match s.strip_prefix("compress-") {
                Some(codec) => Ok(Fidelity::Compress(
                    hilore_kernels::codec_by_name(codec)?.name(),
                )),
                None => Err(Error::Tape(format!(
                    "unknown fidelity `{s}`; the fidelities are `store`, `recompute` and `compress-<codec>` with codec one of {}",
                    hilore_kernels::codec_names().join(", ")
                ))),
            },
        }
    }
}

impl fmt::Display for Fidelity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fidelity::Store => f.write_str("store"),
            Fidelity::Recompute => f.write_str("recompute"),
            Fidelity::Compress(c) => write!(f, "compress-{c}"),
        }
    }
}

impl serde::Serialize for Fidelity {
    /// As its name (`store`, `recompute`, `compress-<codec>`), the form
    /// [`Fidelity::parse`] reads.
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl Fidelity {
    /// Whether this fidelity compresses (with any codec).
    pub fn is_compress(&self) -> bool {
        matches!(self, Fidelity::Compress(_))
    }
}

/// A fidelity for every unit instance (a unit's descriptor x its call index in the
/// forward). Lookup order: the instance, then the unit, then the default.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    name: String,
    default: Fidelity,
    by_unit: HashMap<String, Fidelity>,
    /// Unit name -> call -> fidelity (looked up by `&str`, without an allocation).
    by_instance: HashMap<String, HashMap<usize, Fidelity>>,
}

impl Plan {
    /// Every unit stored: the exact, most memory-hungry plan.
    pub fn store_all() -> Self {
        Plan {
            name: "store-all".into(),
            ..Plan::default()
        }
    }

    /// Every unit compressed with `codec`.
    pub fn compress_all(codec: &str) -> Result<Self> {
        let codec = hilore_kernels::codec_by_name(codec)?.name();
        Ok(Plan {
            name: format!("compress-all({codec})"),
            default: Fidelity::Compress(codec),
            ..Plan::default()
        })
    }

    /// A plan with the given default fidelity.
    pub fn uniform(name: impl Into<String>, default: Fidelity) -> Self {
        Plan {
            name: name.into(),
            default,
            ..Plan::default()
        }
    }

    /// Renames the plan (for reports).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The unit names this plan gives a fidelity to (by unit or by instance), sorted.
    pub fn unit_names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self
            .by_unit
            .keys()
            .chain(self.by_instance.keys())
            .map(String::as_str)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Every instance of the unit named `unit` gets `fidelity`.
    pub fn with_unit(mut self, unit: impl Into<String>, fidelity: Fidelity) -> Self {
        self.by_unit.insert(unit.into(), fidelity);
        self
    }

    /// Call `call` of the unit named `unit` gets `fidelity`.
    pub fn with_instance(
        mut self,
        unit: impl Into<String>,
        call: usize,
        fidelity: Fidelity,
    ) -> Self {
        self.by_instance
            .entry(unit.into())
            .or_default()
            .insert(call, fidelity);
        self
    }

    /// Sets one instance in place.
    pub fn set_instance(&mut self, unit: &str, call: usize, fidelity: Fidelity) {
        match self.by_instance.get_mut(unit) {
            Some(calls) => {
                calls.insert(call, fidelity);
            }
            None => {
                self.by_instance
                    .insert(unit.to_string(), HashMap::from([(call, fidelity)]));
            }
        }
    }

    /// The plan's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fidelity of call `call` of `unit`.
    pub fn fidelity_for(&self, unit: &UnitDescriptor, call: usize) -> Fidelity {
        if let Some(f) = self.by_instance.get(unit.name).and_then(|c| c.get(&call)) {
            return *f;
        }
        if let Some(f) = self.by_unit.get(unit.name) {
            return *f;
        }
        self.default
    }
}
