//! Spectral norm and trace of PSD factors (SPEC §2: RING's damping `√ρ·‖Λ‖₂`, NGD's π).

use crate::device::{Device, Matrix};
use crate::error::{check_shape, Result};
pub use crate::params::power::{PowerInfo, PowerOptions};

impl Device {
    /// Spectral norm (largest eigenvalue) of a symmetric PSD `n x n` matrix by power iteration
    /// from a fixed start vector, so the result is deterministic; a stop below the largest
    /// diagonal element (a lower bound of `λ_max`) restarts from that element's unit vector
    /// ([`crate::cpu::spectral_norm`]). Running out of iterations is not an error: the
    /// estimate is returned with `converged = false`.
    ///
    /// On [`Device::Emulated`] / [`Device::Cuda`] the matrix-vector products and the
    /// normalization run on the device (`kernels/newton.cu`) and the Rayleigh quotient is read
    /// back each iteration for the stop test; the iterate is kept in `f32` there (`f64` on the
    /// CPU), which moves the estimate by about `1e-7` relative.
    ///
    /// # Errors
    /// [`Error::Shape`](crate::Error::Shape) unless `a` is square,
    /// [`Error::Value`](crate::Error::Value) for bad options,
    /// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `a`, and device errors.
    pub fn spectral_norm(&self, a: &Matrix, opts: &PowerOptions) -> Result<PowerInfo> {
        const OP: &str = "Device::spectral_norm";
        self.check_on(OP, a)?;
        check_shape(OP, "a", a.shape(), (a.rows(), a.rows()))?;
        opts.validate(OP)?;
        match self {
            Device::Cpu => crate::cpu::spectral_norm(super::host_ref(a)?, opts),
            Device::Emulated | Device::Cuda(_) => crate::cuda::newton::spectral_norm(self, a, opts),
        }
    }

    /// Trace of a square matrix (summed in `f64`).
    ///
    /// # Errors
    /// [`Error::Shape`](crate::Error::Shape) unless `a` is square,
    /// [`Error::NonFinite`](crate::Error::NonFinite) for a NaN/Inf diagonal or a sum that
    /// overflows `f32` (`"result (overflow)"`), device errors.
    pub fn trace(&self, a: &Matrix) -> Result<f32> {
        const OP: &str = "Device::trace";
        self.check_on(OP, a)?;
        check_shape(OP, "a", a.shape(), (a.rows(), a.rows()))?;
        let t = match self {
            Device::Cpu => crate::cpu::trace(super::host_ref(a)?),
            // One-block reduction kernel; the scalar (and any non-finite index) comes back.
            Device::Emulated | Device::Cuda(_) => crate::cuda::precond::trace(self, a),
        }?;
        // A finite diagonal whose f64 sum does not fit in f32.
        super::finite_result(OP, t)
    }
}
