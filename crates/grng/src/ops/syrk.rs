//! Kronecker-factor accumulation (the SYRK with its EMA) on a device.

use std::any::Any;

use super::{host_mut, host_ref, OVERFLOW};
use crate::device::{Device, Element, Matrix};
use crate::error::{Error, Result};
use crate::shape::check_syrk_args;
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
    /// On the kernel devices: `f32` `A` runs `syrk_ema_f32`, `bf16` `A` the tensor-core
    /// `syrk_ema_tc` ([`crate::cuda::syrk`]); both compute the lower-triangle tiles only
    /// and mirror them (exactly symmetric result). On a GPU with cuBLAS the GEMM plan may run
    /// cuBLAS instead, with the same symmetry ([`crate::cuda::gemm_plan::syrk_ema`]).
    pub fn syrk_ema<T: Element>(&self, a: &Matrix<T>, eps: f32, factor: &mut Matrix) -> Result<()> {
        const OP: &str = "Device::syrk_ema";
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
                    crate::cuda::gemm_plan::syrk_ema(self, a, eps, factor)
                } else if let Some(a) = any.downcast_ref::<Matrix<bf16>>() {
                    crate::cuda::gemm_plan::syrk_ema(self, a, eps, factor)
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
    /// statistics to the tensor-core SYRK of [`Device::syrk_ema`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], allocation and launch errors. NaN/Inf round to NaN/Inf (the
    /// op that consumes the result rejects them).
    ///
    /// On the kernel devices: one launch of `syrk_round_bf16`.
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
                crate::cuda::syrk::round_bf16(self, a, &mut y)?;
                Ok(y)
            }
        }
    }
}
