//! The memory budget of the actor update: the whole per-device peak, not activations
//! alone.
//!
//! Peak = parameters + parameter gradients + optimizer state + the ledger's peak (saved
//! activations, decoded / recomputed transients and activation gradients). With AdamW in
//! `f32` the fixed part is `4 + 4 + 8 = 16` bytes per parameter. The default budget is
//! 1.10 x the peak under full recompute (gradient checkpointing), the setting HiLoRe is
//! evaluated in; it can be given as a factor of that peak or in bytes.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The default budget factor over gradient checkpointing's total peak.
pub const DEFAULT_BUDGET_FACTOR: f64 = 1.10;

/// Bytes of the state that lives through the whole update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateBytes {
    /// Parameters.
    pub params: usize,
    /// Parameter gradients (accumulated over the step's microbatches).
    pub grads: usize,
    /// Optimizer state.
    pub optimizer: usize,
}

impl StateBytes {
    /// `f32` parameters and gradients, AdamW's two `f32` moments.
    pub fn adamw_f32(num_params: usize) -> Self {
        StateBytes {
            params: 4 * num_params,
            grads: 4 * num_params,
            optimizer: 8 * num_params,
        }
    }

    /// Their sum.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
}

/// A memory budget on the total actor-update peak.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryBudget {
    /// A factor of gradient checkpointing's total peak.
    Factor(f64),
    /// Absolute bytes.
    Bytes(usize),
}

impl Default for MemoryBudget {
    fn default() -> Self {
        MemoryBudget::Factor(DEFAULT_BUDGET_FACTOR)
    }
}

impl MemoryBudget {
    /// The budget in bytes, given gradient checkpointing's total peak.
    pub fn bytes(&self, gc_total_peak: usize) -> usize {
        match *self {
            MemoryBudget::Factor(f) => (f * gc_total_peak as f64).floor() as usize,
            MemoryBudget::Bytes(b) => b,
        }
    }

    /// The factor of gradient checkpointing's peak this budget is.
    pub fn factor(&self, gc_total_peak: usize) -> f64 {
        self.bytes(gc_total_peak) as f64 / gc_total_peak.max(1) as f64
    }
}

impl fmt::Display for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryBudget::Factor(x) => write!(f, "{x}x"),
            MemoryBudget::Bytes(b) => write!(f, "{b}B"),
        }
    }
}

impl FromStr for MemoryBudget {
    type Err = Error;

    /// `1.1` or `1.1x`: a factor of gradient checkpointing's peak; `512MiB`, `2GB`,
    /// `123456B`: bytes (KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000).
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        let bad = || {
            Error::Tape(format!(
                "`{s}` is not a memory budget; give a factor of gradient checkpointing's peak (`1.1` or `1.1x`) or bytes (`512MiB`, `2GB`, `123456B`)"
            ))
        };
        let lower = t.to_ascii_lowercase();
        for (suffix, mult) in [
            ("gib", 1u64 << 30),
            ("mib", 1 << 20),
            ("kib", 1 << 10),
            ("gb", 1_000_000_000),
            ("mb", 1_000_000),
            ("kb", 1_000),
            ("b", 1),
        ] {
            if let Some(num) = lower.strip_suffix(suffix) {
                let v: f64 = num.trim().parse().map_err(|_| bad())?;
                if !(v.is_finite() && v > 0.0) {
                    return Err(bad());
                }
                return Ok(MemoryBudget::Bytes((v * mult as f64).round() as usize));
            }
        }
        let num = lower.strip_suffix('x').unwrap_or(&lower);
        let v: f64 = num.trim().parse().map_err(|_| bad())?;
        if !(v.is_finite() && v > 0.0) {
            return Err(bad());
        }
        Ok(MemoryBudget::Factor(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_factors_and_bytes() {
        assert_eq!(
            "1.1".parse::<MemoryBudget>().unwrap(),
            MemoryBudget::Factor(1.1)
        );
        assert_eq!(
            "1.25x".parse::<MemoryBudget>().unwrap(),
            MemoryBudget::Factor(1.25)
        );
        assert_eq!(
            "2MiB".parse::<MemoryBudget>().unwrap(),
            MemoryBudget::Bytes(2 << 20)
        );
        assert_eq!(
            "1.5GB".parse::<MemoryBudget>().unwrap(),
            MemoryBudget::Bytes(1_500_000_000)
        );
        assert_eq!(
            "77B".parse::<MemoryBudget>().unwrap(),
            MemoryBudget::Bytes(77)
        );
        let e = "lots".parse::<MemoryBudget>().unwrap_err().to_string();
        assert!(e.contains("1.1x"), "{e}");
        assert!("-1".parse::<MemoryBudget>().is_err());
    }

    #[test]
    fn adamw_is_sixteen_bytes_per_param() {
        assert_eq!(StateBytes::adamw_f32(10).total(), 160);
        assert_eq!(MemoryBudget::Factor(1.1).bytes(1000), 1100);
    }
}
