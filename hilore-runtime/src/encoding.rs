//! Saved tensors under a codec, where the tensor lives: host tensors are encoded by the CPU
//! codecs; with the `gpu` feature, CUDA tensors are encoded and decoded by the codec kernels
//! on candle's own CUDA storage and stream, without a copy to the host. Both produce the
//! same bytes (the kernels follow each format's spec step by step).

use candle_core::{DType, Device, Shape, Tensor};
use hilore_kernels::{Codec, DeviceError, Encoded};

use crate::{Error, Result};

/// A slot's encoding, on the host or on the GPU its tensor came from.
pub(crate) enum Encoding {
    Host(Encoded),
    #[cfg(feature = "gpu")]
    Cuda(hilore_kernels::cuda::DeviceEncoded),
}

impl Encoding {
    /// Exact bytes the encoding occupies: data plus scales.
    pub(crate) fn nbytes(&self) -> usize {
        match self {
            Encoding::Host(e) => e.nbytes(),
            #[cfg(feature = "gpu")]
            Encoding::Cuda(e) => e.nbytes(),
        }
    }
}

/// An error of a codec, named for the unit whose slot it was encoding or decoding.
fn codec_error(unit: &str, e: DeviceError) -> Error {
    match e {
        DeviceError::Codec(source) => Error::Codec {
            unit: unit.to_string(),
            source,
        },
        source => Error::Device {
            unit: unit.to_string(),
            source,
        },
    }
}

/// Encodes the values of `t` (any float dtype, any layout, row-major order) by `codec`.
pub(crate) fn encode(codec: &'static dyn Codec, t: &Tensor, unit: &str) -> Result<Encoding> {
    #[cfg(feature = "gpu")]
    if let (Device::Cuda(dev), true) = (t.device(), t.elem_count() > 0) {
        return cuda::encode(codec, dev, t).map_err(|e| match e {
            cuda::Failure::Candle(e) => Error::Candle(e),
            cuda::Failure::Device(e) => codec_error(unit, e),
        });
    }
    let mut enc = Encoded::default();
    // A contiguous f32 host tensor (the common case) is encoded from its storage, without
    // a copy; anything else is gathered into row-major f32 first.
    let direct = {
        let (storage, layout) = t.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (candle_core::Storage::Cpu(cs), Some((start, end))) if t.dtype() == DType::F32 => {
                let data = cs.as_slice::<f32>()?;
                Some(codec.encode(&data[start..end], &mut enc))
            }
            _ => None,
        }
    };
    let done = match direct {
        Some(r) => r,
        None => {
            let data: Vec<f32> = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
            codec.encode(&data, &mut enc)
        }
    };
    done.map_err(|e| codec_error(unit, e.into()))?;
    Ok(Encoding::Host(enc))
}

/// Decodes `enc` into a tensor of `shape` and `dtype` on `device`.
pub(crate) fn decode(
    enc: &Encoding,
    shape: &Shape,
    dtype: DType,
    device: &Device,
    unit: &str,
) -> Result<Tensor> {
    match enc {
        Encoding::Host(enc) => {
            let codec = hilore_kernels::codec_by_name(enc.codec)?;
            let mut data = vec![0f32; enc.len];
            codec
                .decode(enc, &mut data)
                .map_err(|e| codec_error(unit, e.into()))?;
            Ok(Tensor::from_vec(data, shape.clone(), device)?.to_dtype(dtype)?)
        }
        #[cfg(feature = "gpu")]
        Encoding::Cuda(enc) => {
            let Device::Cuda(dev) = device else {
                return Err(Error::Tape(format!(
                    "unit `{unit}`: a GPU encoding cannot be decoded onto {device:?}"
                )));
            };
            cuda::decode(enc, dev, shape, dtype).map_err(|e| match e {
                cuda::Failure::Candle(e) => Error::Candle(e),
                cuda::Failure::Device(e) => codec_error(unit, e),
            })
        }
    }
}

#[cfg(feature = "gpu")]
mod cuda {
    use std::sync::{Arc, Mutex, OnceLock};

    use candle_core::cuda_backend::{CudaDevice, CudaStorage};
    use candle_core::op::BackpropOp;
    use candle_core::{DType, Shape, Storage, Tensor};
    use hilore_kernels::cuda::{CudaCodecs, DeviceEncoded};
    use hilore_kernels::{Codec, DeviceError};

    use super::Encoding;

    pub(super) enum Failure {
        Candle(candle_core::Error),
        Device(DeviceError),
    }

    impl From<candle_core::Error> for Failure {
        fn from(e: candle_core::Error) -> Self {
            Failure::Candle(e)
        }
    }

    impl From<DeviceError> for Failure {
        fn from(e: DeviceError) -> Self {
            Failure::Device(e)
        }
    }

    /// The codec kernels of `dev`, compiled once per candle device and ordered on its
    /// stream, so an encode reads a tensor after the kernels that wrote it and a decoded
    /// tensor is written before the kernels that read it.
    fn codecs_for(dev: &CudaDevice) -> Result<Arc<CudaCodecs>, DeviceError> {
        type Cache = Mutex<Vec<(CudaDevice, Arc<CudaCodecs>)>>;
        static CACHE: OnceLock<Cache> = OnceLock::new();
        let mut cache = CACHE
            .get_or_init(Cache::default)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, c)) = cache.iter().find(|(d, _)| d.id() == dev.id()) {
            return Ok(c.clone());
        }
        let codecs = Arc::new(CudaCodecs::with_stream(dev.cuda_stream())?);
        cache.push((dev.clone(), codecs.clone()));
        Ok(codecs)
    }

    pub(super) fn encode(
        codec: &'static dyn Codec,
        dev: &CudaDevice,
        t: &Tensor,
    ) -> Result<Encoding, Failure> {
        let codecs = codecs_for(dev)?;
        // A no-op for a contiguous f32 tensor (the common case): it shares the storage.
        let t = t.to_dtype(DType::F32)?.contiguous()?;
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            return Err(candle_core::Error::Msg("expected a CUDA tensor".into()).into());
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::Msg("expected a contiguous tensor".into()).into());
        };
        let src = cs.as_cuda_slice::<f32>()?.slice(start..end);
        let mut out = codecs.alloc_encoded(codec, end - start)?;
        codecs.encode_view(codec, &src, &mut out)?;
        Ok(Encoding::Cuda(out))
    }

    pub(super) fn decode(
        enc: &DeviceEncoded,
        dev: &CudaDevice,
        shape: &Shape,
        dtype: DType,
    ) -> Result<Tensor, Failure> {
        let codecs = codecs_for(dev)?;
        if enc.len != shape.elem_count() {
            return Err(
                DeviceError::Codec(hilore_kernels::CodecError::LengthMismatch {
                    codec: enc.codec,
                    expected: enc.len,
                    found: shape.elem_count(),
                })
                .into(),
            );
        }
        // SAFETY: the decode kernel writes every one of the `enc.len` values before
        // anything reads them (a failed decode returns an error and the buffer is dropped).
        let mut dst = unsafe { dev.alloc::<f32>(enc.len) }?;
        codecs.decode(enc, &mut dst)?;
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(dst, dev.clone()));
        let t = Tensor::from_storage(storage, shape.clone(), BackpropOp::none(), false);
        Ok(t.to_dtype(dtype)?)
    }
}
