//! Dense GEMM on a device.

use super::{host_mut, host_ref, OVERFLOW};
use crate::cpu::gemm::check_gemm;
use crate::device::{Device, Matrix};
use crate::error::Result;
use crate::mat::Trans;

impl Device {
    /// `C ← α·op(A)·op(B) + β·C` with `op(A)` `m x k`, `op(B)` `k x n`, `C` `m x n`.
    ///
    /// `β = 0` never reads `C`; `α = 0` never reads `A`, `B`.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) for an operand on another device, [`Error::Shape`](crate::Error::Shape) for
    /// disagreeing dimensions, [`Error::Value`](crate::Error::Value) for a non-finite `α`/`β`,
    /// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `A`, `B`, or in `C` when `β ≠ 0` (checked on every
    /// device by [`Device::check_finite`]: one status read-back each on a GPU), and for a
    /// result that overflows (`arg` `"result (overflow)"`; computed into scratch, so `c` is
    /// unchanged on error).
    ///
    /// On the kernel devices this is one launch of the tiled fp32 GEMM of
    /// `kernels/precond.cu` ([`crate::cuda::precond::gemm`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        ta: Trans,
        tb: Trans,
        alpha: f32,
        a: &Matrix,
        b: &Matrix,
        beta: f32,
        c: &mut Matrix,
    ) -> Result<()> {
        const OP: &str = "Device::gemm";
        self.check_on(OP, a)?;
        self.check_on(OP, b)?;
        self.check_on(OP, c)?;
        check_gemm(OP, ta, a.shape(), tb, b.shape(), alpha, beta, c.shape())?;
        self.check_finite(OP, "a", a)?;
        self.check_finite(OP, "b", b)?;
        if beta != 0.0 {
            self.check_finite(OP, "c", c)?;
        }
        self.commit_finite(OP, [(OVERFLOW, c, beta != 0.0)], |[c]| match self {
            Device::Cpu => crate::cpu::gemm(
                ta,
                tb,
                alpha,
                host_ref(a)?,
                host_ref(b)?,
                beta,
                host_mut(c)?,
            ),
            Device::Emulated | Device::Cuda(_) => {
                crate::cuda::precond::gemm(self, ta, tb, alpha, a, b, beta, c)
            }
        })
    }
}
