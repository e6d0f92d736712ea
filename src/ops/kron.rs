//! Kronecker-factor accumulation and the batch gradient on a device.

use std::any::Any;

use super::{host_mut, host_ref, OVERFLOW};
use crate::cpu::kron::{check_batch_gradient_args, check_syrk_args};
use crate::device::{Device, Element, Matrix};
use crate::error::{Error, Result};
use half::bf16;

impl Device {
    /// Kronecker-factor EMA `Λ ← ε Λ + (1−ε)/m · AᵀA` for `A` of shape `m x n` (`f32` or `bf16`,
    /// widened to `f32`, `f32` accumulation) and `factor` `n x n`. `ε = 0` replaces the factor
    /// without reading it. See [`crate::cpu::syrk_ema`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`] (also for `m = 0`), [`Error::Value`] unless
    /// `0 ≤ ε < 1`, [`Error::NonFinite`] for NaN/Inf in `A` (or in `Λ` when `ε > 0`; checked on
    /// every device by [`Device::check_finite`], one status read-back each on a GPU) and for an
    /// overflowing result (`"result (overflow)"`: computed into scratch, committed only when
    /// finite). `factor` is unchanged on error.
    ///
    /// On the kernel devices: `f32` `A` runs `kron_syrk_ema_f32`, `bf16` `A` the tensor-core
    /// `kron_syrk_ema_tc` ([`crate::cuda::kron`]); both compute the lower-triangle tiles only
    /// and mirror them (exactly symmetric result).
    pub fn kron_factor_update<T: Element>(
        &self,
        a: &Matrix<T>,
        eps: f32,
        factor: &mut Matrix,
    ) -> Result<()> {
        const OP: &str = "Device::kron_factor_update";
        self.check_on(OP, a)?;
        self.check_on(OP, factor)?;
        check_syrk_args(OP, a.shape(), eps, factor.shape())?;
        self.check_finite(OP, "a", a)?;
        if eps > 0.0 {
            self.check_finite(OP, "factor", factor)?;
        }
        self.commit_finite(OP, [(OVERFLOW, factor, eps > 0.0)], |[factor]| match self {
            Device::Cpu => crate::cpu::syrk_ema(host_ref(a)?, eps, host_mut(factor)?),
            Device::Emulated | Device::Cuda(_) => {
                // grng implements `Element` for f32 and bf16: pick the kernel of the concrete type.
                let any: &dyn Any = a;
                if let Some(a) = any.downcast_ref::<Matrix<f32>>() {
                    crate::cuda::kron::syrk_ema_f32(self, a, eps, factor)
                } else if let Some(a) = any.downcast_ref::<Matrix<bf16>>() {
                    crate::cuda::kron::syrk_ema_tc(self, a, eps, factor)
                } else {
                    Err(Error::DeviceUnavailable(format!(
                        "{OP}: no kernel for elements of type {}",
                        std::any::type_name::<T>()
                    )))
                }
            }
        })
    }

    /// `a` rounded to `bf16` (round-to-nearest-even, as [`Element::from_f32`]), a new matrix on
    /// this device: how [`crate::optim::kron::KronConfig::stats_precision`] feeds `f32`
    /// statistics to the tensor-core SYRK of [`Device::kron_factor_update`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], allocation and launch errors. NaN/Inf round to NaN/Inf (the
    /// op that consumes the result rejects them).
    ///
    /// On the kernel devices: one launch of `kron_round_bf16`.
    pub fn round_to_bf16(&self, a: &Matrix) -> Result<Matrix<bf16>> {
        const OP: &str = "Device::round_to_bf16";
        self.check_on(OP, a)?;
        match self {
            Device::Cpu => {
                let host = host_ref(a)?.data();
                let mut v = crate::error::try_vec(a.rows(), a.cols(), bf16::ZERO)?;
                v.iter_mut()
                    .zip(host)
                    .for_each(|(y, &x)| *y = bf16::from_f32(x));
                Matrix::from_host_vec(a.rows(), a.cols(), v)
            }
            Device::Emulated | Device::Cuda(_) => {
                let mut y = self.zeros(a.rows(), a.cols())?;
                crate::cuda::kron::round_bf16(self, a, &mut y)?;
                Ok(y)
            }
        }
    }

    /// Batch gradient `G = (1/m) Eᵀ A` for `E` `m x d_out`, `A` `m x d_in`, `G` `d_out x d_in`.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`] (also for `m = 0`), [`Error::NonFinite`] for
    /// NaN/Inf in `E` or `A` ([`Device::check_finite`]) or an overflowing result
    /// (`"result (overflow)"`). `g` is unchanged on error.
    ///
    /// On the kernel devices: the GEMM kernel `precond_gemm_tn` with `α = 1/m`.
    pub fn batch_gradient(&self, e: &Matrix, a: &Matrix, g: &mut Matrix) -> Result<()> {
        const OP: &str = "Device::batch_gradient";
        self.check_on(OP, e)?;
        self.check_on(OP, a)?;
        self.check_on(OP, g)?;
        check_batch_gradient_args(OP, e.shape(), a.shape(), g.shape())?;
        self.check_finite(OP, "e", e)?;
        self.check_finite(OP, "a", a)?;
        self.commit_finite(OP, [(OVERFLOW, g, false)], |[g]| match self {
            Device::Cpu => crate::cpu::batch_gradient(host_ref(e)?, host_ref(a)?, host_mut(g)?),
            Device::Emulated | Device::Cuda(_) => crate::cuda::kron::batch_gradient(self, e, a, g),
        })
    }
}
