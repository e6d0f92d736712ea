//! Exact SPD inverse on a device (the reference the Newton inversion is checked against).

use super::{host_ref, no_kernel};
use crate::device::{Device, Matrix};
use crate::error::{check_shape, Result};

impl Device {
    /// Inverse of a symmetric positive definite `n x n` matrix through its Cholesky factor
    /// (computed in `f64`, result exactly symmetric, resident on this device). Only the lower
    /// triangle of `a` is read.
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
            Device::Emulated | Device::Cuda(_) => Err(no_kernel(self, OP)),
        }
    }
}
