//! candle's CUDA tensors (feature `cuda`): grng's device on candle's stream, and the
//! `CudaSlice` of a candle `CudaStorage` lent as a matrix (see [`super::view`]).

use super::buffer::{to_candle, Buffer};
use candle_core::cuda::DeviceId;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr};
use candle_core::CudaStorage;
use grng::cuda::CudaDevice;
use grng::error::{Error, Result};
use grng::Matrix;
use std::sync::{Mutex, PoisonError};

/// What grng keeps per candle CUDA device.
struct Entry {
    id: DeviceId,
    /// grng's device on candle's context and stream. That stream is candle's `Arc` itself:
    /// for a device of `Device::new_cuda`, the per-thread default stream, so grng's kernels go
    /// on the stream of the calling thread, where candle's own work of that thread goes.
    grng: CudaDevice,
    /// One-element buffers that hold a lent buffer's place in its storage (never read: the
    /// tensor is locked meanwhile), reused so that a view allocates nothing.
    spare: Vec<CudaSlice<f32>>,
}

/// One entry per candle CUDA device, made on first use, so that every view and optimizer on a
/// candle device shares one grng device: its kernel modules are loaded (the PTX JIT-compiled)
/// once, not per call. Entries last as long as the process, as candle's devices usually do;
/// each keeps its candle device's stream, and so its context, alive.
static DEVICES: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// Runs `f` on the entry of candle device `d`, making it first if needed.
fn with_entry<R>(d: &candle_core::CudaDevice, f: impl FnOnce(&mut Entry) -> R) -> Result<R> {
    let mut devices = DEVICES.lock().unwrap_or_else(PoisonError::into_inner);
    let i = match devices.iter().position(|e| e.id == d.id()) {
        Some(i) => i,
        None => {
            devices.push(Entry {
                id: d.id(),
                grng: CudaDevice::from_stream(d.cuda_stream())?,
                spare: Vec::new(),
            });
            devices.len() - 1
        }
    };
    Ok(f(&mut devices[i]))
}

/// grng's device on candle device `d`'s context and stream (see [`super::grng_device`]).
pub(super) fn grng_device(d: &candle_core::CudaDevice) -> Result<CudaDevice> {
    with_entry(d, |e| e.grng.clone())
}

/// The candle device `cuda` (GPU 0) or `cuda:N` (see [`super::candle_device`]).
pub(super) fn candle_device(name: &str) -> Result<candle_core::Device> {
    let ordinal = match name.strip_prefix("cuda:") {
        Some(n) => n.parse().map_err(|_| {
            Error::DeviceUnavailable(format!("device {name:?}: expected cuda or cuda:N"))
        })?,
        None => 0,
    };
    candle_core::Device::new_cuda(ordinal)
        .map_err(|e| Error::DeviceUnavailable(format!("device {name:?}: {e}")))
}

/// Element count and device address of an f32 CUDA storage's buffer.
pub(super) fn f32_buffer(s: &CudaStorage) -> Option<(usize, u64)> {
    let slice = s.as_cuda_slice::<f32>().ok()?;
    // On the buffer's own stream: orders nothing (the address is only compared).
    let (addr, _record) = slice.device_ptr(slice.stream());
    Some((slice.len(), addr))
}

/// [`InplaceOp1::cuda_fwd`](candle_core::InplaceOp1::cuda_fwd) of a view: `lend` moves the f32
/// buffer of `storage` out and back, a spare buffer of its device standing in meanwhile.
pub(super) fn lend_storage(
    storage: &mut CudaStorage,
    lend: impl FnOnce(&mut CudaSlice<f32>, CudaSlice<f32>) -> candle_core::Result<CudaSlice<f32>>,
) -> candle_core::Result<()> {
    let device = storage.device.clone();
    let spare = with_entry(&device, |e| e.spare.pop())
        .map_err(to_candle)?
        .map_or_else(|| device.alloc_zeros::<f32>(1), Ok)?;
    let spare = lend(storage.as_cuda_slice_mut::<f32>()?, spare)?;
    with_entry(&device, |e| e.spare.push(spare)).map_err(to_candle)
}

impl Buffer for CudaSlice<f32> {
    fn len(&self) -> usize {
        CudaSlice::len(self)
    }
    fn zeros(&self, len: usize) -> Result<Self> {
        Ok(self.stream().alloc_zeros(len)?)
    }
    fn into_matrix(self, rows: usize, cols: usize) -> Result<Matrix> {
        Matrix::from_cuda_slice(rows, cols, self)
    }
    fn from_matrix(m: Matrix) -> Result<Self> {
        m.into_cuda_slice()
    }
}
