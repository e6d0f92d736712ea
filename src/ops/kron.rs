//! Kronecker-factor accumulation and the batch gradient on a device.

use super::{host_mut, host_ref, no_kernel};
use crate::device::{Device, Element, Matrix};
use crate::error::{check_shape, check_value, Error, Result};

fn check_batch(op: &'static str, arg: &'static str, m: usize, cols: usize) -> Result<()> {
    if m == 0 {
        return Err(Error::Shape {
            op,
            arg,
            expected: "at least one row (sample)".into(),
            got: format!("0x{cols}"),
        });
    }
    Ok(())
}

impl Device {
    /// Kronecker-factor EMA `Λ ← ε Λ + (1−ε)/m · AᵀA` for `A` of shape `m x n` (`f32` or `bf16`,
    /// widened to `f32`, `f32` accumulation) and `factor` `n x n`. `ε = 0` replaces the factor
    /// without reading it. See [`crate::cpu::syrk_ema`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`] (also for `m = 0`), [`Error::Value`] unless
    /// `0 ≤ ε < 1`, [`Error::NonFinite`] for NaN/Inf in `A` (or in `Λ` when `ε > 0`).
    /// `factor` is unchanged on error.
    pub fn kron_factor_update<T: Element>(
        &self,
        a: &Matrix<T>,
        eps: f32,
        factor: &mut Matrix,
    ) -> Result<()> {
        const OP: &str = "Device::kron_factor_update";
        self.check_on(OP, a)?;
        self.check_on(OP, factor)?;
        check_value(
            OP,
            "eps",
            eps as f64,
            (0.0..1.0).contains(&eps),
            "0 <= eps < 1",
        )?;
        check_batch(OP, "a", a.rows(), a.cols())?;
        check_shape(OP, "factor", factor.shape(), (a.cols(), a.cols()))?;
        match self {
            Device::Cpu => crate::cpu::syrk_ema(host_ref(a)?, eps, host_mut(factor)?),
            Device::Emulated | Device::Cuda(_) => Err(no_kernel(self, OP)),
        }
    }

    /// Batch gradient `G = (1/m) Eᵀ A` for `E` `m x d_out`, `A` `m x d_in`, `G` `d_out x d_in`.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`] (also for `m = 0`), [`Error::NonFinite`] for
    /// NaN/Inf in `E` or `A`. `g` is unchanged on error.
    pub fn batch_gradient(&self, e: &Matrix, a: &Matrix, g: &mut Matrix) -> Result<()> {
        const OP: &str = "Device::batch_gradient";
        self.check_on(OP, e)?;
        self.check_on(OP, a)?;
        self.check_on(OP, g)?;
        check_batch(OP, "e", e.rows(), e.cols())?;
        check_shape(OP, "a", a.shape(), (e.rows(), a.cols()))?;
        check_shape(OP, "g", g.shape(), (e.cols(), a.cols()))?;
        match self {
            Device::Cpu => crate::cpu::batch_gradient(host_ref(e)?, host_ref(a)?, host_mut(g)?),
            Device::Emulated | Device::Cuda(_) => Err(no_kernel(self, OP)),
        }
    }
}
