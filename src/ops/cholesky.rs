//! Exact SPD inverse on a device: the reference the Newton inversion is checked against, and
//! the optimizers' Cholesky method and fallback.

use super::host_ref;
use crate::cuda::cusolver;
use crate::device::{Device, Matrix};
use crate::error::{check_shape, Result};

impl Device {
    /// Inverse of a symmetric positive definite `n x n` matrix through its Cholesky factor,
    /// resident on this device, exactly symmetric. Only the lower triangle of `a` is read.
    ///
    /// - [`Device::Cpu`]: `f64` Cholesky (faer), rounded once to `f32`.
    /// - [`Device::Cuda`]: cuSOLVER `potrf` + `potri` in `f32` (the state's precision) on the
    ///   device, no host round trip ([`crate::cuda::cusolver`]). When `libcusolver` does not
    ///   load, or `potrf` meets a non-positive pivot in `f32`, the host path below runs
    ///   instead — counted ([`crate::cuda::cusolver::host_fallbacks`]), recorded and said once
    ///   on stderr; a non-SPD matrix then gets exactly the CPU's error.
    /// - [`Device::Emulated`]: the host path, always (no cuSOLVER under the emulator),
    ///   counted the same way: `a` is downloaded, inverted by the CPU backend in `f64` and
    ///   the inverse uploaded.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
    /// [`Error::Shape`](crate::Error::Shape) unless square,
    /// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `a` (anywhere) or an
    /// inverse that overflows `f32` (`"result (overflow)"`),
    /// [`Error::NotSpd`](crate::Error::NotSpd); [`Error::Cuda`](crate::Error::Cuda) for a
    /// cuSOLVER failure. `a` is never written.
    pub fn cholesky_inverse(&self, a: &Matrix) -> Result<Matrix> {
        const OP: &str = "Device::cholesky_inverse";
        self.check_on(OP, a)?;
        check_shape(OP, "a", a.shape(), (a.rows(), a.rows()))?;
        match self {
            // The result's own buffer becomes the matrix (no copy).
            Device::Cpu => {
                let inv = crate::cpu::cholesky_inverse(host_ref(a)?)?;
                Matrix::from_host_vec(a.rows(), a.rows(), inv.into_vec())
            }
            Device::Emulated => {
                cusolver::note_host_fallback("the emulator has no cuSOLVER");
                self.host_cholesky_inverse(a)
            }
            Device::Cuda(_) if !cusolver::available() => {
                cusolver::note_host_fallback("libcusolver could not be loaded");
                self.host_cholesky_inverse(a)
            }
            Device::Cuda(_) => {
                self.check_finite(OP, "a", a)?;
                match cusolver::cholesky_inverse(self, a)? {
                    Some(inv) => {
                        self.check_finite(OP, "result (overflow)", &inv)?;
                        Ok(inv)
                    }
                    None => {
                        cusolver::note_host_fallback(
                            "cuSOLVER's f32 potrf met a non-positive pivot; settled in f64",
                        );
                        self.host_cholesky_inverse(a)
                    }
                }
            }
        }
    }

    /// The CPU backend's inverse of a kernel device's `a`: download, `f64` Cholesky, upload.
    fn host_cholesky_inverse(&self, a: &Matrix) -> Result<Matrix> {
        let host = a.to_vec()?;
        let n = a.rows();
        let inv = crate::cpu::cholesky_inverse(crate::mat::MatRef::new(&host, n, n)?)?;
        self.upload(n, n, inv.as_slice())
    }
}
