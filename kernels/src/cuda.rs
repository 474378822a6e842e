//! The codecs on an NVIDIA GPU (cargo feature `cuda`).
//!
//! The kernels (`kernels/cuda/codecs.cu`) are compiled at run time by NVRTC for the GPU at
//! hand, and libcuda and libnvrtc are loaded dynamically, so a binary built on a machine
//! without CUDA runs wherever those libraries exist and reports a clear error where they
//! do not. Each kernel follows its format's spec step by step with correctly rounded IEEE
//! operations, so GPU encodings are byte-identical to the CPU's and decodes bit-identical.
//!
//! ```no_run
//! # fn main() -> Result<(), hilore_kernels::DeviceError> {
//! use hilore_kernels::{codec_by_name, cuda::CudaCodecs, Encoded};
//! let gpu = CudaCodecs::new(0)?;
//! let codec = codec_by_name("fp8-e4m3-b32")?;
//! let x = vec![0.5f32; 1000];
//! let mut enc = Encoded::default();
//! gpu.encode_host(codec, &x, &mut enc)?; // same bytes as codec.encode(&x, &mut enc)
//! # Ok(()) }
//! ```

use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DriverError, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::{Codec, CodecError, DeviceError, Encoded};

/// The CUDA source of every codec kernel.
pub const SOURCE: &str = include_str!("../cuda/codecs.cu");

/// Threads per CUDA block of every launch.
const THREADS: u32 = 256;

/// Where a codec's kernels differ: bf16 has no scales; the scaled formats have a block
/// length, a number of data bytes per value pair, and a largest code magnitude.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    Bf16,
    Scaled { block: usize, pair_bytes: usize },
}

impl Layout {
    fn data_len(self, n: usize) -> usize {
        match self {
            Layout::Bf16 => n.saturating_mul(2),
            Layout::Scaled { pair_bytes: 1, .. } => n.div_ceil(2),
            Layout::Scaled { .. } => n,
        }
    }

    fn scales_len(self, n: usize) -> usize {
        match self {
            Layout::Bf16 => 0,
            Layout::Scaled { block, .. } => n.div_ceil(block).saturating_mul(4),
        }
    }

    /// Launch shape: 4 values per thread (scaled: `block / 4` threads per started block).
    fn launch(self, n: usize) -> LaunchConfig {
        let threads = match self {
            Layout::Bf16 => n.div_ceil(4),
            Layout::Scaled { block, .. } => n.div_ceil(block) * (block / 4),
        };
        LaunchConfig {
            grid_dim: (threads.div_ceil(THREADS as usize) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// (codec name, kernel suffix, layout) of every codec, in [`crate::codecs`] order.
const TABLE: [(&str, &str, Layout); 7] = [
    ("bf16", "bf16", Layout::Bf16),
    (
        "fp8-e4m3-b32",
        "fp8_e4m3_b32",
        Layout::Scaled {
            block: 32,
            pair_bytes: 2,
        },
    ),
    (
        "fp8-e4m3-b128",
        "fp8_e4m3_b128",
        Layout::Scaled {
            block: 128,
            pair_bytes: 2,
        },
    ),
    (
        "int8-b32",
        "int8_b32",
        Layout::Scaled {
            block: 32,
            pair_bytes: 2,
        },
    ),
    (
        "int4-g32",
        "int4_g32",
        Layout::Scaled {
            block: 32,
            pair_bytes: 1,
        },
    ),
    (
        "int4-g64",
        "int4_g64",
        Layout::Scaled {
            block: 64,
            pair_bytes: 1,
        },
    ),
    (
        "int4-g128",
        "int4_g128",
        Layout::Scaled {
            block: 128,
            pair_bytes: 1,
        },
    ),
];

#[derive(Debug)]
struct Kernels {
    name: &'static str,
    layout: Layout,
    encode: CudaFunction,
    decode: CudaFunction,
}

/// An encoding held in GPU memory; the same bytes as [`Encoded`].
#[derive(Debug)]
pub struct DeviceEncoded {
    /// Name of the codec that wrote this encoding.
    pub codec: &'static str,
    /// Number of encoded values.
    pub len: usize,
    /// Element payload.
    pub data: CudaSlice<u8>,
    /// Per-block scales (little-endian f32; empty for bf16).
    pub scales: CudaSlice<u8>,
}

impl DeviceEncoded {
    /// Exact bytes the encoding occupies: data plus scales.
    pub fn nbytes(&self) -> usize {
        self.data.len() + self.scales.len()
    }
}

/// The codec kernels, compiled and loaded for one GPU, with the stream they run on.
#[derive(Debug)]
pub struct CudaCodecs {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Vec<Kernels>,
    fill: CudaFunction,
    /// Fault word of the checked calls (see the top of `codecs.cu`).
    fault: Mutex<CudaSlice<u64>>,
    /// Fault word the unchecked calls write to and nobody reads.
    scratch_fault: Mutex<CudaSlice<u64>>,
}

const NO_FAULT: u64 = u64::MAX;

fn driver(context: &'static str) -> impl FnOnce(DriverError) -> DeviceError {
    move |e| DeviceError::Driver {
        context,
        message: e.to_string(),
    }
}

/// The file names cudarc tries for a library, without repeats.
#[cfg(not(feature = "cuda-linked"))]
fn candidates(lib: &str) -> String {
    let mut names = cudarc::get_lib_name_candidates(lib);
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names.join(", ")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Checks that libcuda and libnvrtc can be loaded, without panicking when they cannot.
///
/// With the `cuda-linked` feature the libraries are linked, so the loader has found them
/// before the program started, and there is nothing left to probe.
#[cfg(feature = "cuda-linked")]
pub fn probe_libraries() -> Result<(), DeviceError> {
    Ok(())
}

#[cfg(feature = "cuda-linked")]
fn probe_nvrtc() -> Result<(), DeviceError> {
    Ok(())
}

/// Checks that libcuda and libnvrtc can be loaded, without panicking when they cannot.
#[cfg(not(feature = "cuda-linked"))]
pub fn probe_libraries() -> Result<(), DeviceError> {
    // SAFETY: only tries to open the shared library; no CUDA function is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(DeviceError::DriverNotFound(format!(
            "tried {}; is an NVIDIA driver installed and on the library path (LD_LIBRARY_PATH)?",
            candidates("cuda")
        )));
    }
    probe_nvrtc()
}

#[cfg(not(feature = "cuda-linked"))]
fn probe_nvrtc() -> Result<(), DeviceError> {
    // SAFETY: only tries to open the shared library; no NVRTC function is called.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(DeviceError::NvrtcNotFound(format!(
            "tried {}; add the CUDA toolkit's lib64 (or the nvidia-cuda-nvrtc wheel's lib) to LD_LIBRARY_PATH",
            candidates("nvrtc")
        )));
    }
    Ok(())
}

/// Compiles [`SOURCE`] to PTX for a virtual architecture such as `compute_90`. Needs only
/// libnvrtc, no GPU. IEEE-exact options: no FMA contraction, no flush-to-zero, correctly
/// rounded division.
pub fn compile_kernels(arch: &str) -> Result<Ptx, DeviceError> {
    probe_nvrtc()?;
    let opts = CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some("codecs.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(SOURCE, opts).map_err(|e| DeviceError::Compile(e.to_string()))
}

impl CudaCodecs {
    /// Loads CUDA, compiles the kernels for GPU `ordinal` and loads them; calls run on the
    /// context's default stream.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        probe_libraries()?;
        let ctx = CudaContext::new(ordinal).map_err(driver("opening the GPU"))?;
        Self::with_stream(ctx.default_stream())
    }

    /// Compiles and loads the kernels for the GPU of `stream` and orders every call on
    /// `stream`: pass the stream a tensor library computes on (candle's
    /// `CudaDevice::cuda_stream()`) and its buffers can be encoded and decoded in place, in
    /// order with its own kernels.
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<Self, DeviceError> {
        probe_libraries()?;
        let ctx = stream.context().clone();
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let ptx = compile_kernels(&format!("compute_{major}{minor}"))?;
        let module = ctx
            .load_module(ptx)
            .map_err(driver("loading the compiled kernels"))?;
        let mut kernels = Vec::with_capacity(TABLE.len());
        for (name, suffix, layout) in TABLE {
            kernels.push(Kernels {
                name,
                layout,
                encode: module
                    .load_function(&format!("enc_{suffix}"))
                    .map_err(driver("finding an encode kernel"))?,
                decode: module
                    .load_function(&format!("dec_{suffix}"))
                    .map_err(driver("finding a decode kernel"))?,
            });
        }
        let fill = module
            .load_function("fill_heavy_tailed")
            .map_err(driver("finding the fill kernel"))?;
        let fault = stream.alloc_zeros::<u64>(1).map_err(driver("allocating"))?;
        let scratch_fault = stream.alloc_zeros::<u64>(1).map_err(driver("allocating"))?;
        Ok(CudaCodecs {
            ctx,
            stream,
            kernels,
            fill,
            fault: Mutex::new(fault),
            scratch_fault: Mutex::new(scratch_fault),
        })
    }

    /// The GPU's name as the driver reports it.
    pub fn device_name(&self) -> String {
        self.ctx
            .name()
            .unwrap_or_else(|e| format!("unknown GPU ({e})"))
    }

    /// The context the kernels live in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every call is ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn kernels(&self, codec: &str) -> Result<&Kernels, DeviceError> {
        self.kernels
            .iter()
            .find(|k| k.name == codec)
            .ok_or_else(|| DeviceError::Codec(CodecError::Unknown(codec.to_string())))
    }

    fn alloc_bytes(&self, len: usize) -> Result<CudaSlice<u8>, DeviceError> {
        if len == 0 {
            self.stream.null().map_err(driver("allocating"))
        } else {
            // SAFETY: every byte is written by the encode kernel before it is read.
            unsafe { self.stream.alloc::<u8>(len) }.map_err(driver("allocating"))
        }
    }

    /// Allocates GPU buffers sized for the encoding of `n` values by `codec`.
    pub fn alloc_encoded(&self, codec: &dyn Codec, n: usize) -> Result<DeviceEncoded, DeviceError> {
        let k = self.kernels(codec.name())?;
        Ok(DeviceEncoded {
            codec: k.name,
            len: n,
            data: self.alloc_bytes(k.layout.data_len(n))?,
            scales: self.alloc_bytes(k.layout.scales_len(n))?,
        })
    }

    /// Makes `out` an encoding of `n` values by `k`, reallocating only buffers of the wrong size.
    fn shape(&self, k: &Kernels, n: usize, out: &mut DeviceEncoded) -> Result<(), DeviceError> {
        if out.data.len() != k.layout.data_len(n) {
            out.data = self.alloc_bytes(k.layout.data_len(n))?;
        }
        if out.scales.len() != k.layout.scales_len(n) {
            out.scales = self.alloc_bytes(k.layout.scales_len(n))?;
        }
        out.codec = k.name;
        out.len = n;
        Ok(())
    }

    fn launch_encode(
        &self,
        k: &Kernels,
        src: &CudaView<'_, f32>,
        out: &mut DeviceEncoded,
        fault: &mut CudaSlice<u64>,
    ) -> Result<(), DeviceError> {
        let n = src.len();
        self.shape(k, n, out)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut launch = self.stream.launch_builder(&k.encode);
        launch
            .arg(src)
            .arg(&mut out.data)
            .arg(&mut out.scales)
            .arg(&n64)
            .arg(fault);
        // SAFETY: the kernel's parameters are (const float*, u8*, float*, u64, u64*) and the
        // buffers hold n values, data_len(n) and scales_len(n) bytes, and one u64 (shape()
        // sized them); it reads and writes only inside those bounds.
        unsafe { launch.launch(k.layout.launch(n)) }
            .map_err(driver("launching an encode kernel"))?;
        Ok(())
    }

    fn launch_decode(
        &self,
        k: &Kernels,
        enc: &DeviceEncoded,
        dst: &mut CudaSlice<f32>,
        fault: &mut CudaSlice<u64>,
    ) -> Result<(), DeviceError> {
        check_layout(
            k,
            enc.codec,
            enc.len,
            enc.data.len(),
            enc.scales.len(),
            dst.len(),
        )?;
        let n = enc.len;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut launch = self.stream.launch_builder(&k.decode);
        launch
            .arg(&enc.data)
            .arg(&enc.scales)
            .arg(dst)
            .arg(&n64)
            .arg(fault);
        // SAFETY: parameters (const u8*, const float*, float*, u64, u64*); check_layout
        // verified every buffer has exactly the size n values imply.
        unsafe { launch.launch(k.layout.launch(n)) }
            .map_err(driver("launching a decode kernel"))?;
        Ok(())
    }

    fn reset(&self, fault: &mut CudaSlice<u64>) -> Result<(), DeviceError> {
        self.stream
            .memcpy_htod(&[NO_FAULT], fault)
            .map_err(driver("resetting the fault word"))
    }

    fn read(&self, fault: &CudaSlice<u64>) -> Result<u64, DeviceError> {
        let v = self
            .stream
            .clone_dtoh(fault)
            .map_err(driver("reading the fault word"))?;
        Ok(v.first().copied().unwrap_or(NO_FAULT))
    }

    fn byte_at(&self, buf: &CudaSlice<u8>, at: usize) -> Result<u8, DeviceError> {
        let v = self
            .stream
            .clone_dtoh(&buf.slice(at..at + 1))
            .map_err(driver("reading back a byte"))?;
        Ok(v[0])
    }

    /// Encodes `src` into `out` (reallocating its buffers only if their sizes are wrong)
    /// and waits for it. NaN or Inf in `src` gives [`CodecError::NonFinite`] naming the
    /// first index, as on the CPU.
    pub fn encode(
        &self,
        codec: &dyn Codec,
        src: &CudaSlice<f32>,
        out: &mut DeviceEncoded,
    ) -> Result<(), DeviceError> {
        self.encode_view(codec, &src.as_view(), out)
    }

    /// [`Self::encode`] of a range of a buffer (a tensor that starts at an offset of its
    /// storage).
    pub fn encode_view(
        &self,
        codec: &dyn Codec,
        src: &CudaView<'_, f32>,
        out: &mut DeviceEncoded,
    ) -> Result<(), DeviceError> {
        let k = self.kernels(codec.name())?;
        let mut fault = lock(&self.fault);
        self.reset(&mut fault)?;
        self.launch_encode(k, src, out, &mut fault)?;
        let f = self.read(&fault)?;
        if f == NO_FAULT {
            return Ok(());
        }
        let index = f as usize;
        let value = self
            .stream
            .clone_dtoh(&src.slice(index..index + 1))
            .map_err(driver("reading back a value"))?[0];
        Err(CodecError::NonFinite {
            codec: k.name,
            index,
            value,
        }
        .into())
    }

    /// Decodes `enc` into `dst` and waits for it; corrupted encodings give the same
    /// [`CodecError`] as on the CPU.
    pub fn decode(&self, enc: &DeviceEncoded, dst: &mut CudaSlice<f32>) -> Result<(), DeviceError> {
        let k = self.kernels(enc.codec)?;
        let mut fault = lock(&self.fault);
        self.reset(&mut fault)?;
        self.launch_decode(k, enc, dst, &mut fault)?;
        let f = self.read(&fault)?;
        if f == NO_FAULT {
            return Ok(());
        }
        let Layout::Scaled { block, pair_bytes } = k.layout else {
            return Ok(()); // bf16 reports no faults
        };
        let err = if f % 2 == 0 {
            let b = (f / 2) as usize / block;
            let mut bits = [0u8; 4];
            for (i, byte) in bits.iter_mut().enumerate() {
                *byte = self.byte_at(&enc.scales, 4 * b + i)?;
            }
            CodecError::InvalidScale {
                codec: k.name,
                block: b,
                bits: u32::from_le_bytes(bits),
            }
        } else {
            let index = (f / 2) as usize;
            let code = if pair_bytes == 1 {
                let byte = self.byte_at(&enc.data, index / 2)?;
                if index % 2 == 0 {
                    byte & 0x0f
                } else {
                    byte >> 4
                }
            } else {
                self.byte_at(&enc.data, index)?
            };
            CodecError::InvalidCode {
                codec: k.name,
                index,
                code,
            }
        };
        Err(err.into())
    }

    /// Enqueues an encode on [`Self::stream`] without waiting and without fault reporting
    /// (NaN/Inf inputs leave their blocks unspecified); for timing.
    pub fn encode_unchecked(
        &self,
        codec: &dyn Codec,
        src: &CudaSlice<f32>,
        out: &mut DeviceEncoded,
    ) -> Result<(), DeviceError> {
        let k = self.kernels(codec.name())?;
        let mut fault = lock(&self.scratch_fault);
        self.launch_encode(k, &src.as_view(), out, &mut fault)
    }

    /// Enqueues a decode on [`Self::stream`] without waiting and without fault reporting;
    /// for timing. Sizes are still checked.
    pub fn decode_unchecked(
        &self,
        enc: &DeviceEncoded,
        dst: &mut CudaSlice<f32>,
    ) -> Result<(), DeviceError> {
        let k = self.kernels(enc.codec)?;
        let mut fault = lock(&self.scratch_fault);
        self.launch_decode(k, enc, dst, &mut fault)
    }

    /// Copies `src` to the GPU, encodes it there and copies the encoding back into `out`
    /// (reusing its buffers): the GPU's bytes, for comparison with the CPU's.
    pub fn encode_host(
        &self,
        codec: &dyn Codec,
        src: &[f32],
        out: &mut Encoded,
    ) -> Result<(), DeviceError> {
        let k = self.kernels(codec.name())?;
        out.codec = k.name;
        out.len = src.len();
        out.data.resize(k.layout.data_len(src.len()), 0);
        out.scales.resize(k.layout.scales_len(src.len()), 0);
        if src.is_empty() {
            return Ok(());
        }
        let x = self
            .stream
            .clone_htod(src)
            .map_err(driver("copying to the GPU"))?;
        let mut dev = self.alloc_encoded(codec, src.len())?;
        if let Err(e) = self.encode(codec, &x, &mut dev) {
            out.len = 0;
            out.data.clear();
            out.scales.clear();
            return Err(e);
        }
        self.stream
            .memcpy_dtoh(&dev.data, &mut out.data)
            .map_err(driver("copying from the GPU"))?;
        if !out.scales.is_empty() {
            self.stream
                .memcpy_dtoh(&dev.scales, &mut out.scales)
                .map_err(driver("copying from the GPU"))?;
        }
        self.stream.synchronize().map_err(driver("synchronizing"))?;
        Ok(())
    }

    /// Copies `enc` to the GPU, decodes it there and copies the values back into `dst`.
    pub fn decode_host(&self, enc: &Encoded, dst: &mut [f32]) -> Result<(), DeviceError> {
        let k = self.kernels(enc.codec)?;
        check_layout(
            k,
            enc.codec,
            enc.len,
            enc.data.len(),
            enc.scales.len(),
            dst.len(),
        )?;
        if dst.is_empty() {
            return Ok(());
        }
        let data = self
            .stream
            .clone_htod(&enc.data)
            .map_err(driver("copying to the GPU"))?;
        let scales = if enc.scales.is_empty() {
            self.stream.null().map_err(driver("allocating"))?
        } else {
            self.stream
                .clone_htod(&enc.scales)
                .map_err(driver("copying to the GPU"))?
        };
        let dev = DeviceEncoded {
            codec: k.name,
            len: enc.len,
            data,
            scales,
        };
        let mut y = self
            .stream
            .alloc_zeros::<f32>(dst.len())
            .map_err(driver("allocating"))?;
        self.decode(&dev, &mut y)?;
        self.stream
            .memcpy_dtoh(&y, dst)
            .map_err(driver("copying from the GPU"))?;
        self.stream.synchronize().map_err(driver("synchronizing"))?;
        Ok(())
    }

    /// Fills `dst` with activation-like random values (Gaussian, about 1% of them times 100)
    /// chosen by `seed`, on the GPU; for benchmarks that need fresh inputs every run.
    pub fn fill_heavy_tailed(
        &self,
        seed: u64,
        dst: &mut CudaSlice<f32>,
    ) -> Result<(), DeviceError> {
        let n = dst.len();
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut launch = self.stream.launch_builder(&self.fill);
        launch.arg(dst).arg(&n64).arg(&seed);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(THREADS as usize) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: parameters (float*, u64, u64); one thread per value, bounds-checked.
        unsafe { launch.launch(cfg) }.map_err(driver("launching the fill kernel"))?;
        Ok(())
    }
}

/// The CPU's layout checks, in the same order, for an encoding about to be decoded.
fn check_layout(
    k: &Kernels,
    codec: &'static str,
    n: usize,
    data: usize,
    scales: usize,
    dst: usize,
) -> Result<(), CodecError> {
    if codec != k.name {
        return Err(CodecError::WrongCodec {
            expected: k.name,
            found: codec,
        });
    }
    let want = k.layout.data_len(n);
    if data != want {
        return Err(CodecError::Corrupted {
            codec: k.name,
            len: n,
            what: "data",
            found: data,
            expected: want,
        });
    }
    let want = k.layout.scales_len(n);
    if scales != want {
        return Err(CodecError::Corrupted {
            codec: k.name,
            len: n,
            what: "scales",
            found: scales,
            expected: want,
        });
    }
    if dst != n {
        return Err(CodecError::LengthMismatch {
            codec: k.name,
            expected: n,
            found: dst,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_the_cpu_codecs() {
        let cpu = crate::codecs();
        assert_eq!(cpu.len(), TABLE.len());
        for (codec, (name, suffix, layout)) in cpu.iter().zip(TABLE) {
            assert_eq!(codec.name(), name);
            assert!(SOURCE.contains(suffix), "{name}");
            for n in [0usize, 1, 31, 32, 33, 1000, 4097] {
                assert_eq!(
                    layout.data_len(n) + layout.scales_len(n),
                    codec.encoded_len(n),
                    "{name} n {n}"
                );
            }
        }
    }

    #[test]
    fn kernels_compile_with_nvrtc_where_it_is_installed() {
        match compile_kernels("compute_90") {
            Ok(ptx) => {
                let text = ptx.to_src();
                for (_, suffix, _) in TABLE {
                    assert!(text.contains(&format!(".entry enc_{suffix}")), "{suffix}");
                    assert!(text.contains(&format!(".entry dec_{suffix}")), "{suffix}");
                }
                // No codec kernel may contain a fused multiply-add: it would round
                // differently from the CPU. (The benchmark's fill kernel may: its math
                // library uses FMAs, and its values need not match anything.)
                for entry in text.split(".entry ").skip(1) {
                    if !entry.starts_with("fill_") {
                        let name = entry.split('(').next().unwrap_or(entry);
                        assert!(!entry.contains("fma."), "{name} contains an FMA");
                    }
                }
            }
            Err(DeviceError::NvrtcNotFound(m)) => eprintln!("skipped: {m}"),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn missing_libraries_are_an_error_not_a_panic() {
        // On a machine with CUDA this succeeds; elsewhere it must name what is missing.
        match probe_libraries() {
            Ok(()) => {}
            Err(DeviceError::DriverNotFound(m)) | Err(DeviceError::NvrtcNotFound(m)) => {
                assert!(m.contains("tried"), "{m}");
            }
            Err(other) => panic!("unexpected {other:?}"),
        }
        if probe_libraries().is_err() {
            let err = CudaCodecs::new(0).unwrap_err();
            assert!(err.to_string().contains("not found"), "{err}");
        }
    }
}
