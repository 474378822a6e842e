//! What the commands share: the model, the batch, coefficients, one pass, comparisons.

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use hilore_models::{Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::{BackwardReport, Cx, Grads, Plan};
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A device named on the command line: `cpu`, `cuda` (GPU 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceArg {
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "cpu" => Ok(DeviceArg::Cpu),
            "cuda" | "gpu" => Ok(DeviceArg::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map(DeviceArg::Cuda)
                    .map_err(|_| format!("`{n}` is not a GPU number (cuda:0, cuda:1, ...)")),
                None => Err(format!(
                    "unknown device `{other}`; the devices are `cpu`, `cuda` and `cuda:N`"
                )),
            },
        }
    }
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceArg::Cpu => f.write_str("cpu"),
            DeviceArg::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

static DEVICE: OnceLock<Device> = OnceLock::new();

/// Opens the device every command computes on (`--device`); call once, before [`device`].
pub fn select_device(arg: DeviceArg) -> anyhow::Result<()> {
    let dev = match arg {
        DeviceArg::Cpu => Device::Cpu,
        DeviceArg::Cuda(n) => open_cuda(n)?,
    };
    DEVICE
        .set(dev)
        .map_err(|_| anyhow::anyhow!("the device was already selected"))
}

/// The device the commands compute on: the one `--device` selected, else the CPU. Every
/// call returns the same candle device (one CUDA stream), so tensors made by different
/// modules can meet in one op.
pub fn device() -> Device {
    DEVICE.get().cloned().unwrap_or(Device::Cpu)
}

#[cfg(feature = "gpu")]
fn open_cuda(n: usize) -> anyhow::Result<Device> {
    Device::new_cuda(n).with_context(|| format!("opening GPU cuda:{n}"))
}

#[cfg(not(feature = "gpu"))]
fn open_cuda(n: usize) -> anyhow::Result<Device> {
    anyhow::bail!(
        "`--device cuda:{n}`: this hilore was built without GPU support; build the GPU binary \
         with scripts/build-gpu.sh (cargo build --release -p hilore --features gpu, which \
         needs the CUDA toolkit), or use `--device cpu`"
    )
}

/// The clock, read once `device` has finished its queued work (at once on the CPU), so
/// that differences of two readings are the device's time.
pub fn now(device: &Device) -> anyhow::Result<Instant> {
    if !device.is_cpu() {
        device.synchronize()?;
    }
    Ok(Instant::now())
}

/// Loads a config.json, or the built-in default.
pub fn load_config(path: Option<&Path>) -> anyhow::Result<DecoderConfig> {
    match path {
        Some(p) => DecoderConfig::from_json_file(p)
            .with_context(|| format!("loading model config {}", p.display())),
        None => Ok(DecoderConfig::tiny()),
    }
}

/// Sequence lengths given as `48,64,80` on the command line.
#[derive(Debug, Clone)]
pub struct Lengths(pub Vec<usize>);

impl std::str::FromStr for Lengths {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.split(',')
            .map(|p| {
                let l = p
                    .trim()
                    .parse::<usize>()
                    .map_err(|e| format!("`{p}` is not a sequence length: {e}"))?;
                if l < 2 {
                    return Err(format!(
                        "sequence length {l} is below 2 (a sequence needs one input and one target token)"
                    ));
                }
                Ok(l)
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Lengths)
    }
}

/// The cases of a `--lengths` list: either one batch of sequences of the listed token
/// lengths (`256,192,320`: one case of three sequences), or one case per `LxN` group
/// (`128x7,512x4`: seven sequences of 128 tokens, then, separately, four of 512). Each
/// length is in tokens; a sequence of `L` tokens gives `L - 1` rows (log-probs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LengthCases(pub Vec<LengthCase>);

/// One case of [`LengthCases`]: a label (`128x7`, or the plain list itself) and the
/// token length of every sequence of its batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LengthCase {
    pub label: String,
    pub lengths: Vec<usize>,
}

/// A sequence length of `--lengths`, at least 2 tokens.
fn sequence_length(tok: &str, what: &str) -> Result<usize, String> {
    let l = tok.parse::<usize>().map_err(|_| {
        format!("`{what}` is not a sequence length: expected a whole number of tokens, like `128`")
    })?;
    if l < 2 {
        return Err(format!(
            "`{what}`: sequence length {l} is below 2 (a sequence needs one input and one target token)"
        ));
    }
    Ok(l)
}

impl std::str::FromStr for LengthCases {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let toks: Vec<&str> = s.split(',').map(str::trim).collect();
        if let Some(i) = toks.iter().position(|t| t.is_empty()) {
            return Err(format!(
                "`{s}`: item {} is empty; write lengths like `256,192,320` or cases like `128x7,512x4`",
                i + 1
            ));
        }
        let grouped = toks.iter().filter(|t| t.contains(['x', 'X'])).count();
        if grouped == 0 {
            let lengths = toks
                .iter()
                .map(|t| sequence_length(t, t))
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(LengthCases(vec![LengthCase {
                label: lengths
                    .iter()
                    .map(|l| l.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                lengths,
            }]));
        }
        if grouped < toks.len() {
            let plain = toks.iter().find(|t| !t.contains(['x', 'X'])).unwrap_or(&"");
            let group = toks.iter().find(|t| t.contains(['x', 'X'])).unwrap_or(&"");
            return Err(format!(
                "`{plain}` has no `xN` count while `{group}` has one: write `{plain}x1` for one sequence of {plain} tokens as its own case, or list every length plainly (`128,128,512`) for one batch"
            ));
        }
        toks.iter()
            .map(|t| {
                let (l, n) = t
                    .split_once(['x', 'X'])
                    .ok_or_else(|| format!("`{t}` is not a case"))?;
                let bad = || {
                    format!(
                        "`{t}` is not a case: expected LENGTHxCOUNT, like `128x7` (7 sequences of 128 tokens)"
                    )
                };
                if l.trim().is_empty() || n.trim().is_empty() {
                    return Err(bad());
                }
                let l = sequence_length(l.trim(), t).map_err(|e| {
                    if l.trim().parse::<usize>().is_ok() {
                        e
                    } else {
                        bad()
                    }
                })?;
                let n = n.trim().parse::<usize>().map_err(|_| bad())?;
                if n == 0 {
                    return Err(format!(
                        "`{t}`: a case needs at least one sequence (`{l}x1`)"
                    ));
                }
                Ok(LengthCase {
                    label: format!("{l}x{n}"),
                    lengths: vec![l; n],
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(LengthCases)
    }
}

/// Deterministic standard-normal values (splitmix64 + Box-Muller).
pub fn normal_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed ^ 0x5DEE_CE66_D1CE_4E5B;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (next(), next());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// Per-token coefficients dL/dlogp for a check: random, nonzero.
pub fn coefficients(n: usize, seed: u64, device: &Device) -> anyhow::Result<Tensor> {
    Ok(Tensor::from_vec(normal_vec(n, seed), n, device)?)
}

/// The outcome of one forward+backward.
pub struct Pass {
    pub grads: Vec<(String, Tensor)>,
    pub peak_activation_bytes: usize,
    pub peak_saved_bytes: usize,
    pub report: BackwardReport,
    pub forward: Duration,
    pub backward: Duration,
    pub times: hilore_runtime::TapeTimes,
}

/// Every parameter's gradient, in [`Decoder::named_params`] order; an error names the
/// first parameter that no gradient reached.
pub fn named_grads(model: &Decoder, grads: &Grads) -> anyhow::Result<Vec<(String, Tensor)>> {
    model
        .named_params()
        .into_iter()
        .map(|(name, var)| {
            let g = grads
                .get(var.id())
                .cloned()
                .with_context(|| format!("no gradient reached parameter {name}"))?;
            Ok((name, g))
        })
        .collect()
}
/// One forward+backward of `model` on `batch` under `plan`, seeded with `coeffs`.
pub fn run_pass(
    model: &Decoder,
    batch: &TokenBatch,
    coeffs: &Tensor,
    plan: Plan,
    verify: bool,
) -> anyhow::Result<Pass> {
    let mut cx = Cx::new(plan).report_recompute_checks(verify);
    let dev = coeffs.device();
    let t0 = now(dev)?;
    let logp = model.token_logprobs(&mut cx, batch)?;
    let forward = now(dev)? - t0;
    let mut grads = Grads::new();
    let t1 = now(dev)?;
    let report = cx.backward(&logp, coeffs, &mut grads)?;
    let backward = now(dev)? - t1;
    drop(logp);
    let named = named_grads(model, &grads)?;
    Ok(Pass {
        grads: named,
        peak_activation_bytes: cx.memory().peak_bytes(),
        peak_saved_bytes: cx.memory().peak_saved_bytes(),
        report,
        forward,
        backward,
        times: cx.times().clone(),
    })
}

/// How far `got` is from `want`, over every parameter.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GradDiff {
    /// Largest absolute elementwise difference over all parameters.
    pub max_abs_diff: f64,
    /// ||got - want|| / ||want|| over all parameters together.
    pub rel_l2: f64,
    /// The largest per-parameter relative L2 error, and which parameter.
    pub worst_param: String,
    pub worst_param_rel_l2: f64,
    /// Whether every gradient is equal bit for bit.
    pub bit_identical: bool,
    /// Cosine similarity of the flattened gradients.
    pub cosine: f64,
}

pub fn compare(got: &[(String, Tensor)], want: &[(String, Tensor)]) -> anyhow::Result<GradDiff> {
    let mut max_abs: f64 = 0.0;
    let (mut num, mut den, mut dot, mut gg) = (0f64, 0f64, 0f64, 0f64);
    let mut worst = (String::new(), 0f64);
    let mut bits = true;
    for ((name, g), (_, w)) in got.iter().zip(want) {
        let g: Vec<f32> = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        let w: Vec<f32> = w.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        let (mut n, mut d) = (0f64, 0f64);
        for (&a, &b) in g.iter().zip(&w) {
            bits &= a.to_bits() == b.to_bits();
            let diff = a as f64 - b as f64;
            max_abs = max_abs.max(diff.abs());
            n += diff * diff;
            d += (b as f64) * (b as f64);
            dot += a as f64 * b as f64;
            gg += a as f64 * a as f64;
        }
        let rel = if d > 0.0 { (n / d).sqrt() } else { n.sqrt() };
        if rel >= worst.1 {
            worst = (name.clone(), rel);
        }
        num += n;
        den += d;
    }
    Ok(GradDiff {
        max_abs_diff: max_abs,
        rel_l2: if den > 0.0 {
            (num / den).sqrt()
        } else {
            num.sqrt()
        },
        worst_param: worst.0,
        worst_param_rel_l2: worst.1,
        bit_identical: bits,
        cosine: if gg > 0.0 && den > 0.0 {
            dot / (gg.sqrt() * den.sqrt())
        } else {
            1.0
        },
    })
}

/// `1234567` as `1.18 MiB`.
pub fn human_bytes(b: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceArg;

    #[test]
    fn device_names_parse() {
        assert_eq!("cpu".parse::<DeviceArg>(), Ok(DeviceArg::Cpu));
        assert_eq!("cuda".parse::<DeviceArg>(), Ok(DeviceArg::Cuda(0)));
        assert_eq!("cuda:3".parse::<DeviceArg>(), Ok(DeviceArg::Cuda(3)));
        assert_eq!(DeviceArg::Cuda(3).to_string(), "cuda:3");
        let e = "cuda:x".parse::<DeviceArg>().unwrap_err();
        assert!(e.contains("not a GPU number"), "{e}");
        let e = "tpu".parse::<DeviceArg>().unwrap_err();
        assert!(e.contains("`cpu`, `cuda` and `cuda:N`"), "{e}");
    }

    #[test]
    fn length_cases_parse() {
        use super::{LengthCase, LengthCases};
        let c: LengthCases = "256,192,320".parse().unwrap();
        assert_eq!(
            c.0,
            vec![LengthCase {
                label: "256,192,320".into(),
                lengths: vec![256, 192, 320]
            }]
        );
        let c: LengthCases = "128x7, 512x4".parse().unwrap();
        assert_eq!(c.0.len(), 2);
        assert_eq!(c.0[0].label, "128x7");
        assert_eq!(c.0[0].lengths, vec![128; 7]);
        assert_eq!(c.0[1].lengths, vec![512; 4]);
        for (bad, want) in [
            ("128x7,512", "write `512x1`"),
            ("128xq", "expected LENGTHxCOUNT"),
            ("x4", "expected LENGTHxCOUNT"),
            ("128x0", "at least one sequence"),
            ("1x4", "below 2"),
            ("abc", "`abc` is not a sequence length"),
            ("128,,64", "item 2 is empty"),
        ] {
            let e = bad.parse::<LengthCases>().unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    #[cfg(not(feature = "gpu"))]
    #[test]
    fn cuda_without_the_gpu_feature_is_an_error_that_names_the_fix() {
        let e = super::open_cuda(0).unwrap_err().to_string();
        assert!(e.contains("scripts/build-gpu.sh"), "{e}");
    }
}

/// The ranges a numeric flag may be checked against by [`check_flag`].
#[derive(Debug, Clone, Copy)]
pub enum Range {
    /// `> 0`.
    Positive,
    /// `>= 0`.
    NonNegative,
    /// `(0, 1]`.
    UpToOne,
    /// `[0, 1)`.
    Fraction,
}

/// Checks a numeric flag's value: finite and in `range`, else an error naming the flag,
/// the value, the valid range and `hint` (what the usual values are, what 0 means).
pub fn check_flag(flag: &str, v: f64, range: Range, hint: &str) -> anyhow::Result<()> {
    let (ok, want) = match range {
        Range::Positive => (v > 0.0, "a number > 0"),
        Range::NonNegative => (v >= 0.0, "a number >= 0"),
        Range::UpToOne => (v > 0.0 && v <= 1.0, "a number in (0, 1]"),
        Range::Fraction => ((0.0..1.0).contains(&v), "a number in [0, 1)"),
    };
    if v.is_finite() && ok {
        return Ok(());
    }
    let hint = if hint.is_empty() {
        String::new()
    } else {
        format!(" ({hint})")
    };
    anyhow::bail!("{flag} is {v}; it must be {want}{hint}")
}

/// Checks a count flag: at least `min`, else an error naming the flag and `why`.
pub fn check_count(flag: &str, v: usize, min: usize, why: &str) -> anyhow::Result<()> {
    if v >= min {
        return Ok(());
    }
    anyhow::bail!("{flag} is {v}; it must be at least {min} ({why})")
}

/// Checks that a forward + backward of `tokens` rows on `cfg` can fit this machine's
/// memory before anything is allocated: under store-all every layer keeps about
/// `8 * hidden + 3 * intermediate` values a row (norm outputs, q/k/v, attention output,
/// residuals, gate/up/SwiGLU), and the head a logits chunk; a lower bound, in f32.
pub fn check_activation_size(cfg: &DecoderConfig, tokens: usize, flag: &str) -> anyhow::Result<()> {
    let Some(mem) = hilore_models::machine_memory_bytes() else {
        return Ok(());
    };
    let per_row = (cfg.num_hidden_layers as u128)
        .saturating_mul(8 * cfg.hidden_size as u128 + 3 * cfg.intermediate_size as u128)
        .saturating_mul(4);
    let need = per_row.saturating_mul(tokens as u128);
    if need > mem as u128 {
        anyhow::bail!(
            "{flag}: {tokens} rows need at least {:.1} GiB of activations on this model ({} layers, hidden {}, MLP {}), more than this machine's {:.1} GiB; use fewer or shorter sequences",
            need as f64 / (1u64 << 30) as f64,
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            mem as f64 / (1u64 << 30) as f64
        );
    }
    Ok(())
}

/// A progress bar of `len` items (hidden unless `enabled`), as every long loop shows it:
/// the phase, the bar, the count, a message, elapsed time and the estimate of what is left.
pub fn progress_bar(len: usize, enabled: bool, prefix: &str) -> indicatif::ProgressBar {
    if !enabled {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix:>10} [{bar:30}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_prefix(prefix.to_string());
    pb
}
