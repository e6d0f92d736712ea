//! Exact SPD inverse on a device (the reference the Newton inversion is checked against).

use super::host_ref;
use crate::device::{Device, Matrix};
use crate::error::{check_shape, Result};

impl Device {
    /// Inverse of a symmetric positive definite `n x n` matrix through its Cholesky factor
    /// (computed in `f64`, result exactly symmetric, resident on this device). Only the lower
    /// triangle of `a` is read.
    ///
    /// On [`Device::Emulated`] and [`Device::Cuda`] this is **not** a device kernel: `a` is
    /// downloaded, factored and inverted by the CPU backend, and the inverse uploaded (an
    /// `O(n²)` round trip around `O(n³/3)` host work). It serves as an exact reference and for
    /// small systems; the device-resident inverse of the optimizers is
    /// [`Device::newton_inverse`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
    /// [`Error::Shape`](crate::Error::Shape) unless square,
    /// [`Error::NonFinite`](crate::Error::NonFinite), [`Error::NotSpd`](crate::Error::NotSpd).
    pub fn cholesky_inverse(&self, a: &Matrix) -> Result<Matrix> {
        const OP: &str = "Device::cholesky_inverse";
        self.check_on(OP, a)?;
        check_shape(OP, "a", a.shape(), (a.rows(), a.rows()))?;
        match self {
            Device::Cpu => {
                let inv = crate::cpu::cholesky_inverse(host_ref(a)?)?;
                self.upload(a.rows(), a.rows(), inv.as_slice())
            }
            Device::Emulated | Device::Cuda(_) => {
                // Not a hot path: the exact inverse is the reference the Newton inversion is
                // checked against, so it runs on the host (f64 Cholesky) and is uploaded.
                let host = a.to_vec()?;
                let n = a.rows();
                let inv = crate::cpu::cholesky_inverse(crate::mat::MatRef::new(&host, n, n)?)?;
                self.upload(n, n, inv.as_slice())
            }
        }
    }
}
