//! Devices and device-resident matrices: the one device-agnostic entry point.
//!
//! Every numerical operation is a method on [`Device`] (see [`crate::ops`]) taking
//! [`Matrix`] operands that live on that device. The optimizers are written once against
//! these methods; which backend runs is decided by the `Device` value alone:
//!
//! - [`Device::Cpu`]: the rayon backend in [`crate::cpu`] — the fallback and the test oracle;
//! - [`Device::Cuda`]: the hand-written kernels of `kernels/*.cu` on a GPU through cudarc;
//! - [`Device::Emulated`]: the *same* kernels compiled for the CPU and run by the emulator in
//!   `kernels/emu/` through the same launch code — slow, for tests on machines without a GPU.

pub use crate::element::Element;
use crate::error::{Error, Result};

/// Where numbers live and kernels run.
#[derive(Clone, Debug)]
pub enum Device {
    /// The rayon CPU backend (reference and fallback).
    Cpu,
    /// The CUDA kernels executed on the CPU by the emulator (tests; slow).
    Emulated,
    /// A CUDA GPU.
    Cuda(crate::driver::CudaDevice),
}

impl Device {
    /// Short name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Emulated => "emulated",
            Device::Cuda(_) => "cuda",
        }
    }

    /// Copies a row-major `rows x cols` host array onto this device.
    pub fn upload<T: Element>(&self, rows: usize, cols: usize, host: &[T]) -> Result<Matrix<T>> {
        let len = self.alloc_len::<T>(rows, cols)?;
        crate::error::check_len("Device::upload", "host", host.len(), len)?;
        if !matches!(self, Device::Cpu) {
            crate::hooks::count(crate::hooks::Queued::Upload);
        }
        let storage = match self {
            Device::Cpu | Device::Emulated => {
                let mut v = crate::error::try_with_capacity(self.name(), rows, cols)?;
                v.extend_from_slice(host);
                Storage::Host(v)
            }
            Device::Cuda(d) => Storage::Cuda(
                d.upload(host)
                    .map_err(|e| self.driver_alloc_error::<T>(rows, cols, e))?,
            ),
        };
        Ok(Matrix {
            rows,
            cols,
            storage,
        })
    }

    /// The elements of every matrix of `ms` (row-major, in order) by one read-back: on a GPU
    /// the matrices are gathered into one buffer by queued device-to-device copies and that
    /// buffer is copied to the host, one wait for the stream where [`Matrix::to_vec`] of each
    /// would wait once per matrix. An empty `ms` reads nothing.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for a matrix of another device, [`Error::OutOfMemory`] for the
    /// gathering buffer, driver errors.
    pub fn download_all<T: Element>(&self, ms: &[&Matrix<T>]) -> Result<Vec<Vec<T>>> {
        const OP: &str = "Device::download_all";
        for m in ms {
            self.check_on(OP, m)?;
        }
        if ms.is_empty() {
            return Ok(Vec::new());
        }
        crate::hooks::count(crate::hooks::Queued::ReadBack);
        let Device::Cuda(d) = self else {
            return ms.iter().map(|m| m.elements()).collect();
        };
        let total = ms.iter().map(|m| m.len()).sum::<usize>();
        let stream = d.stream();
        // SAFETY: the copies below write every element (the matrices' lengths add up to
        // `total`) before the one read; `T` is plain data (`Element: Pod`).
        let mut all = unsafe { stream.alloc::<T>(total) }
            .map_err(|e| self.driver_alloc_error::<T>(total, 1, e))?;
        let mut at = 0;
        for m in ms {
            if let Storage::Cuda(s) = &m.storage {
                stream.memcpy_dtod(s, &mut all.slice_mut(at..at + s.len()))?;
                at += s.len();
            }
        }
        let flat = stream.clone_dtoh(&all)?;
        let mut rest = &flat[..];
        ms.iter()
            .map(|m| {
                let (head, tail) = rest.split_at(m.len());
                rest = tail;
                crate::error::try_to_vec(head)
            })
            .collect()
    }

    /// A `rows x cols` matrix of zeros on this device.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when `rows * cols` overflows or the memory cannot be had (the host
    /// allocator's refusal is returned, not an abort); the device stays usable.
    pub fn zeros<T: Element>(&self, rows: usize, cols: usize) -> Result<Matrix<T>> {
        let m = self.allocate(rows, cols, true)?;
        if !matches!(self, Device::Cpu) {
            crate::hooks::count(crate::hooks::Queued::ZeroFill);
        }
        Ok(m)
    }

    /// A `rows x cols` matrix for a kernel that writes each element before anything reads it
    /// (a product's result, a reduction's per-block partials): on CUDA the memory as
    /// allocated, without the memset [`Device::zeros`] queues (an operation on the stream, as a
    /// launch is); on the host NaN, so that an element read before it was written poisons what
    /// it fed (as the emulator poisons dynamic shared memory), and the tests see it.
    pub(crate) fn scratch<T: Element>(&self, rows: usize, cols: usize) -> Result<Matrix<T>> {
        self.allocate(rows, cols, false)
    }

    /// [`Device::zeros`] (`zeroed`) or [`Device::scratch`].
    fn allocate<T: Element>(&self, rows: usize, cols: usize, zeroed: bool) -> Result<Matrix<T>> {
        let len = self.alloc_len::<T>(rows, cols)?;
        let storage = match self {
            Device::Cpu | Device::Emulated => {
                let mut v = crate::error::try_with_capacity(self.name(), rows, cols)?;
                let fill = match zeroed {
                    true => T::default(),
                    false => T::from_f32(f32::NAN),
                };
                v.resize(len, fill);
                Storage::Host(v)
            }
            Device::Cuda(d) => {
                let slice = match zeroed {
                    true => d.zeros(len),
                    false => d.scratch(len),
                };
                Storage::Cuda(slice.map_err(|e| self.driver_alloc_error::<T>(rows, cols, e))?)
            }
        };
        Ok(Matrix {
            rows,
            cols,
            storage,
        })
    }

    /// `rows * cols`, or [`Error::OutOfMemory`] when it (or its size in bytes) overflows.
    fn alloc_len<T: Element>(&self, rows: usize, cols: usize) -> Result<usize> {
        rows.checked_mul(cols)
            .filter(|n| n.checked_mul(std::mem::size_of::<T>()).is_some())
            .ok_or_else(|| self.out_of_memory::<T>(rows, cols, "size overflows usize".into()))
    }

    /// The driver's out-of-memory refusal as [`Error::OutOfMemory`]; any other error as is.
    fn driver_alloc_error<T: Element>(
        &self,
        rows: usize,
        cols: usize,
        e: cudarc::driver::DriverError,
    ) -> Error {
        if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            self.out_of_memory::<T>(rows, cols, e.to_string())
        } else {
            e.into()
        }
    }

    fn out_of_memory<T: Element>(&self, rows: usize, cols: usize, reason: String) -> Error {
        crate::error::out_of_memory::<T>(self.name(), rows, cols, reason)
    }

    /// The size by which a step on this device decides whether to run on the rayon pool
    /// (`cpu::on_pool`): `work` on the CPU backend, whose loops gain from it; 0 on the kernel
    /// devices, whose host work is launches and would pay the hop (~20–40 µs) for nothing —
    /// and whose per-thread state (the deferred-check ledger, `cuda::hooks::read_backs`)
    /// then stays on the caller's thread.
    pub(crate) fn pool_work(&self, work: usize) -> usize {
        match self {
            Device::Cpu => work,
            Device::Emulated | Device::Cuda(_) => 0,
        }
    }

    /// Checks that `m` lives on this device (host storage for Cpu/Emulated).
    pub(crate) fn check_on<T: Element>(&self, op: &'static str, m: &Matrix<T>) -> Result<()> {
        let ok = matches!(
            (self, &m.storage),
            (Device::Cpu | Device::Emulated, Storage::Host(_))
                | (Device::Cuda(_), Storage::Cuda(_))
        );
        if ok {
            Ok(())
        } else {
            Err(Error::DeviceMismatch {
                op,
                a: self.name(),
                b: m.storage_name(),
            })
        }
    }
}

/// Where a [`Matrix`]'s elements are stored.
#[derive(Debug)]
pub(crate) enum Storage<T: Element> {
    /// Host memory (Cpu and Emulated devices).
    Host(Vec<T>),
    /// GPU memory.
    Cuda(cudarc::driver::CudaSlice<T>),
}

/// A dense row-major `rows x cols` matrix resident on a [`Device`].
///
/// Vectors are `n x 1` matrices. Element `(i, j)` is at flat index `i * cols + j`.
#[derive(Debug)]
pub struct Matrix<T: Element = f32> {
    rows: usize,
    cols: usize,
    pub(crate) storage: Storage<T>,
}

impl<T: Element> crate::shape::Shaped for Matrix<T> {
    fn stored_shape(&self) -> (usize, usize) {
        self.shape()
    }
}

impl<T: Element> Matrix<T> {
    crate::mat::shape_accessors!();
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }
    /// True when the matrix has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn storage_name(&self) -> &'static str {
        match self.storage {
            Storage::Host(_) => "host memory",
            Storage::Cuda(_) => "cuda",
        }
    }
    /// Copies the elements back to the host (row-major).
    pub fn to_vec(&self) -> Result<Vec<T>> {
        crate::hooks::count(crate::hooks::Queued::ReadBack);
        self.elements()
    }
    /// [`Matrix::to_vec`] without the count.
    fn elements(&self) -> Result<Vec<T>> {
        match &self.storage {
            Storage::Host(v) => crate::error::try_to_vec(v),
            Storage::Cuda(s) => Ok(s.stream().clone_dtoh(s)?),
        }
    }
    /// Host elements, when the storage is on the host (Cpu and Emulated devices).
    pub fn host(&self) -> Option<&[T]> {
        match &self.storage {
            Storage::Host(v) => Some(v),
            Storage::Cuda(_) => None,
        }
    }
    /// Host elements, mutable, when the storage is on the host.
    pub fn host_mut(&mut self) -> Option<&mut [T]> {
        match &mut self.storage {
            Storage::Host(v) => Some(v),
            Storage::Cuda(_) => None,
        }
    }
    /// Exchanges the host buffer with `v` (O(1), no copy) when the storage is on the host and
    /// `v` has the same length; returns whether it did (GPU storage or another length: no).
    pub fn swap_host_vec(&mut self, v: &mut Vec<T>) -> bool {
        match &mut self.storage {
            Storage::Host(h) if h.len() == v.len() => {
                std::mem::swap(h, v);
                true
            }
            _ => false,
        }
    }
    /// GPU elements, when the storage is on a GPU (the Cuda device).
    pub fn cuda_slice(&self) -> Option<&cudarc::driver::CudaSlice<T>> {
        match &self.storage {
            Storage::Host(_) => None,
            Storage::Cuda(s) => Some(s),
        }
    }
    /// Wraps a row-major `rows x cols` host buffer without copying it (a matrix of the Cpu or
    /// Emulated device): how `grng_candle` views a candle tensor's storage in place.
    ///
    /// # Errors
    /// [`Error::Shape`] when `data.len() != rows * cols`.
    pub fn from_host_vec(rows: usize, cols: usize, data: Vec<T>) -> Result<Self> {
        crate::error::check_len("Matrix::from_host_vec", "data", data.len(), rows * cols)?;
        Ok(Self {
            rows,
            cols,
            storage: Storage::Host(data),
        })
    }
    /// Wraps a row-major `rows x cols` GPU buffer without copying it (a matrix of the Cuda
    /// device whose context the buffer belongs to): how `grng_candle` views a candle CUDA
    /// tensor's storage in place.
    ///
    /// # Errors
    /// [`Error::Shape`] when `data.len() != rows * cols`.
    pub fn from_cuda_slice(
        rows: usize,
        cols: usize,
        data: cudarc::driver::CudaSlice<T>,
    ) -> Result<Self> {
        crate::error::check_len("Matrix::from_cuda_slice", "data", data.len(), rows * cols)?;
        Ok(Self {
            rows,
            cols,
            storage: Storage::Cuda(data),
        })
    }
    /// The matrix's own GPU buffer (no copy).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for host storage (there is no stream to upload it on).
    pub fn into_cuda_slice(self) -> Result<cudarc::driver::CudaSlice<T>> {
        match self.storage {
            Storage::Cuda(s) => Ok(s),
            Storage::Host(_) => Err(Error::DeviceMismatch {
                op: "Matrix::into_cuda_slice",
                a: "cuda",
                b: "host memory",
            }),
        }
    }
    /// The elements as a host buffer: the matrix's own buffer (no copy) for host storage, a
    /// download for GPU storage.
    pub fn into_host_vec(self) -> Result<Vec<T>> {
        match self.storage {
            Storage::Host(v) => Ok(v),
            Storage::Cuda(s) => Ok(s.stream().clone_dtoh(&s)?),
        }
    }
    /// A device-side copy.
    pub fn try_clone(&self) -> Result<Self> {
        let storage = match &self.storage {
            Storage::Host(v) => Storage::Host(crate::error::try_to_vec(v)?),
            Storage::Cuda(s) => Storage::Cuda(s.stream().clone_dtod(s)?),
        };
        Ok(Self {
            rows: self.rows,
            cols: self.cols,
            storage,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// `Device::scratch` poisons on the host: an element a kernel leaves unwritten is NaN, so
    /// the emulated tests of every kernel writing into scratch buffers see it (zeros would hide
    /// it), in both element types; and it is no zero-filled allocation.
    #[test]
    fn scratch_is_poisoned_on_the_host() {
        for dev in [Device::Cpu, Device::Emulated] {
            #[cfg(feature = "test-hooks")]
            let fills = crate::hooks::zero_fills();
            let f: Matrix = dev.scratch(3, 5).unwrap();
            assert_eq!(f.shape(), (3, 5));
            assert!(
                f.to_vec().unwrap().iter().all(|v| v.is_nan()),
                "{}",
                dev.name()
            );
            let b: Matrix<bf16> = dev.scratch(2, 7).unwrap();
            assert!(
                b.to_vec().unwrap().iter().all(|v| v.is_nan()),
                "{}",
                dev.name()
            );
            #[cfg(feature = "test-hooks")]
            assert_eq!(crate::hooks::zero_fills(), fills, "{}", dev.name());
        }
    }
}
