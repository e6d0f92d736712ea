//! The device-agnostic operations: one file per hot path, each an `impl Device` block whose
//! methods validate their [`Matrix`] operands (device placement, shapes, scalar ranges, and
//! finiteness through [`Device::check_finite`], the same check on every device) before
//! anything is written, then match on the device. Ops with matrix outputs compute into
//! scratch and commit only finite results (`Device::commit_finite`); scalar results are
//! checked too: finite but huge inputs whose result overflows give [`Error::NonFinite`]
//! naming `result (overflow)` (or `<output> (overflow)`) and leave every output unchanged.
//!
//! [`Device::Cpu`] runs the rayon backend of [`crate::cpu`] on the host storage;
//! [`Device::Emulated`] and [`Device::Cuda`] run the kernels of `kernels/*.cu` through the
//! launchers of [`crate::cuda`].
//!
//! This is where arguments are validated, once: the kernel launchers of [`crate::cuda`]
//! keep only the checks memory safety needs (buffer lengths and shapes against the sizes
//! they pass to a kernel, each marked as such), and the backends take their option and
//! coefficient types from below both (the crate-internal `params` module, whose docs give the
//! layering; `tests/layering.rs` keeps it). The CPU backend's functions are public on their
//! own (slices in, no [`Matrix`]), so they keep the checks of their own arguments.

pub mod cholesky;
pub mod elementwise;
pub mod gemm;
pub mod kalman;
pub mod newton;
pub mod norm;
pub mod precondition;
pub mod syrk;

pub(crate) use crate::cuda::deferred::{Readout, Scalar};
pub(crate) use crate::cuda::gemm::SplitCache;
use crate::device::{Device, Element, Matrix};
use crate::error::{Error, Result};
use crate::mat::{MatMut, MatRef};

/// Host view of a matrix already checked to live on a host device.
pub(crate) fn host_ref<T: Element>(m: &Matrix<T>) -> Result<MatRef<'_, T>> {
    let data = m
        .host()
        .ok_or_else(|| Error::DeviceUnavailable("matrix is not in host memory".into()))?;
    MatRef::new(data, m.rows(), m.cols())
}

/// The host elements of a matrix already checked to live on a host device.
pub(crate) fn host<T: Element>(m: &Matrix<T>) -> Result<&[T]> {
    Ok(host_ref(m)?.data())
}

/// Mutable host view of a matrix already checked to live on a host device.
pub(crate) fn host_mut<T: Element>(m: &mut Matrix<T>) -> Result<MatMut<'_, T>> {
    let (rows, cols) = m.shape();
    let data = m
        .host_mut()
        .ok_or_else(|| Error::DeviceUnavailable("matrix is not in host memory".into()))?;
    MatMut::new(data, rows, cols)
}

impl Device {
    // Here, above both backends, because opening a GPU loads the CUDA launchers' modules.
    /// The device named by `GRNG_DEVICE` (`cpu`, `cuda`, `emulated`) if set, else CUDA when a
    /// driver, a GPU and the compiled kernels are all present, else the CPU (printing one line
    /// to stderr saying why there is no GPU, so a fallback is never silent). The kernel modules
    /// are loaded here, so a driver that rejects their PTX also means the CPU.
    ///
    /// Asking for `cuda` where there is none is an error, never a CPU fallback.
    pub fn auto() -> Result<Self> {
        match std::env::var("GRNG_DEVICE").ok().as_deref().map(str::trim) {
            None | Some("") | Some("auto") => Ok(
                match crate::cuda::CudaDevice::new(0)
                    .and_then(|d| crate::cuda::load_modules(&d).map(|()| d))
                {
                    Ok(d) => Device::Cuda(d),
                    Err(e) => {
                        eprintln!("grng: using the CPU: {e}");
                        Device::Cpu
                    }
                },
            ),
            Some("cpu") => Ok(Device::Cpu),
            Some("emulated") => Ok(Device::Emulated),
            Some("cuda") => crate::cuda::CudaDevice::new(0).map(Device::Cuda),
            Some(other) => Err(Error::DeviceUnavailable(format!(
                "GRNG_DEVICE={other:?}: expected one of cpu, cuda, emulated, auto"
            ))),
        }
    }
}

impl Device {
    /// `Err(Error::NonFinite)` naming `arg` at the first NaN/Inf of `m` (flat row-major index):
    /// the one finiteness check every op runs on its inputs (and on its results, see
    /// `Device::commit_finite`), so an op accepts and rejects the same inputs on every device.
    ///
    /// [`Device::Cpu`]: a host scan (`crate::error::first_non_finite`).
    /// [`Device::Emulated`] / [`Device::Cuda`]: the `elementwise_check` kernel (its `bf16`
    /// twin for `bf16`) and one 20-byte status read-back — on a GPU that read-back synchronizes
    /// the stream, the price of rejecting a bad input before anything is written. The emulator
    /// runs the same launch code, so the GPU path is what the CPU-only tests exercise.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::NonFinite`], device errors.
    pub fn check_finite<T: Element>(
        &self,
        op: &'static str,
        arg: &'static str,
        m: &Matrix<T>,
    ) -> Result<()> {
        self.check_all_finite(op, &[(arg, m)])
    }

    /// [`Device::check_finite`] of several matrices, in order; on the kernel devices
    /// consecutive `f32` matrices of one length share one launch and one read-back.
    pub(crate) fn check_all_finite<T: Element>(
        &self,
        op: &'static str,
        arrays: &[(&'static str, &Matrix<T>)],
    ) -> Result<()> {
        for &(_, m) in arrays {
            self.check_on(op, m)?;
        }
        match self {
            Device::Cpu => arrays
                .iter()
                .try_for_each(|&(arg, m)| crate::cpu::check_finite_view(op, arg, host_ref(m)?)),
            Device::Emulated | Device::Cuda(_) => {
                crate::cuda::elementwise::check_finite(self, op, arrays)
            }
        }
    }

    /// [`Device::check_all_finite`] of `f32` matrices, each with a cache where the caller
    /// wants its split3 planes: on the kernel devices the check writes them as it reads the
    /// matrix (`cuda::elementwise::check_finite_split`), so that the f32-accurate products
    /// reading it next ([`Device::split_operand`]) split nothing; on the CPU the caches stay
    /// empty.
    ///
    /// # Errors
    /// As [`Device::check_all_finite`].
    pub(crate) fn check_finite_split(
        &self,
        op: &'static str,
        arrays: &[(&'static str, &Matrix, Option<&SplitCache>)],
    ) -> Result<()> {
        match self {
            Device::Emulated | Device::Cuda(_) => {
                for &(_, m, _) in arrays {
                    self.check_on(op, m)?;
                }
                crate::cuda::elementwise::check_finite_split(self, op, arrays)
            }
            Device::Cpu => {
                let named: Vec<_> = arrays.iter().map(|&(arg, m, _)| (arg, m)).collect();
                self.check_all_finite(op, &named)
            }
        }
    }

    /// Runs `f` on scratch stand-ins for `outs` and commits them only when `f` succeeded and
    /// every result is finite: a failed or overflowing op (finite but huge inputs whose result
    /// is ±Inf/NaN) leaves each output bit-for-bit unchanged and returns
    /// [`Error::NonFinite`] naming the output's `arg` (e.g. `"result (overflow)"`).
    ///
    /// Each entry is `(arg, output, copy)`: `copy` starts the scratch as a copy of the output
    /// (the op reads it), otherwise as zeros on the CPU and unset on the kernel devices, whose
    /// ops write every element of a write-only output (no memset queued; the emulator's NaN
    /// shows any element they miss). Commit is a move of the scratch into place, so the cost
    /// is one allocation (plus a copy) per output and one finiteness check of the results
    /// ([`Device::check_all_finite`]).
    pub(crate) fn commit_finite<const N: usize>(
        &self,
        op: &'static str,
        outs: [(&'static str, &mut Matrix, bool); N],
        f: impl FnOnce(&mut [Matrix; N]) -> Result<()>,
    ) -> Result<()> {
        let mut scratch = Vec::with_capacity(N);
        for (_, m, copy) in &outs {
            scratch.push(match (copy, self) {
                (true, _) => m.try_clone()?,
                (false, Device::Cpu) => self.zeros(m.rows(), m.cols())?,
                (false, _) => self.scratch(m.rows(), m.cols())?,
            });
        }
        let mut scratch: [Matrix; N] = scratch
            .try_into()
            .map_err(|_| Error::DeviceUnavailable(format!("{op}: scratch allocation")))?;
        f(&mut scratch)?;
        let results: Vec<(&'static str, &Matrix)> = outs
            .iter()
            .zip(&scratch)
            .map(|((arg, ..), m)| (*arg, m))
            .collect();
        self.check_all_finite(op, &results)?;
        for ((_, out, _), m) in outs.into_iter().zip(scratch) {
            *out = m;
        }
        Ok(())
    }
}

impl Device {
    /// Runs `body` with the finiteness checks and the [`Device::dots_deferred`] reductions of
    /// the ops it calls on this device deferred. On the kernel devices they write into one
    /// device buffer that is read back once at the end instead of once per op (a stream
    /// synchronization each on a GPU; `cuda::deferred`); on the CPU a check is a host scan
    /// that synchronizes nothing, and `body` simply runs. If a check flagged, a reduction was
    /// not finite or `body` failed, `body` runs again without deferral, so the result — an
    /// error included — is exactly the eager one.
    ///
    /// `body` must commit nothing (write no state it does not create): inside it an op may
    /// return `Ok` for inputs or results that are not finite. The returned [`Readout`]
    /// resolves the deferred [`Scalar`]s `body` returned.
    pub(crate) fn deferred<R>(&self, mut body: impl FnMut() -> Result<R>) -> Result<(R, Readout)> {
        match self {
            Device::Cpu => body().map(|r| (r, Readout::default())),
            Device::Emulated | Device::Cuda(_) => crate::cuda::deferred::scope(self, body),
        }
    }
}

/// `Err(Error::Value)` unless the scalar argument `v` is finite.
pub(crate) fn check_finite_scalar(op: &'static str, arg: &'static str, v: f32) -> Result<()> {
    crate::error::check_value(op, arg, v as f64, true, "a finite number")
}

pub(crate) use crate::error::OVERFLOW;

/// `Ok(v)` for a finite scalar result, else `Err(Error::NonFinite)` naming [`OVERFLOW`]
/// (the inputs were checked finite, so only overflow is left).
pub(crate) fn finite_result(op: &'static str, v: f32) -> Result<f32> {
    if v.is_finite() {
        Ok(v)
    } else {
        Err(Error::NonFinite {
            op,
            arg: OVERFLOW,
            index: 0,
            value: v,
        })
    }
}
