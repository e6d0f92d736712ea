//! Inversion of an SPD matrix by Newton iteration (docs/math.md §2): options, report and the
//! device-agnostic entry point [`Device::newton_inverse`]. The arithmetic, the stopping rules
//! and the measured residual floors are documented in [`crate::cpu::newton`].

use crate::device::{Device, Matrix};
use crate::error::{check_shape, Result};
pub use crate::params::newton::{
    InitialGuess, NewtonInfo, NewtonOptions, NewtonOrder, NewtonStop, Precision,
};
use crate::shape::check_square;

/// The stopping thresholds of the Newton iteration (its control lives below both backends,
/// in the crate-internal `iteration` module; see [`crate::cpu::newton`] for the rules).
pub mod driver {
    pub use crate::iteration::{ARMED, GROWTH_SLACK, ROUNDING_MARGIN, SYM_SWITCH, SYM_TOL};
}

impl Device {
    /// Inverse of the symmetric positive definite `n x n` matrix `a` by Newton iteration,
    /// with an optional warm start (`n x n`, used with [`InitialGuess::Warm`], ignored
    /// otherwise). Returns `X ≈ A⁻¹` (exactly symmetric, on this device) and what was achieved.
    ///
    /// `a` must be symmetric to `|a_ij − a_ji| ≤ 1e-5·max|a|`; its symmetric part is used.
    /// `warm` is only a hint: its symmetric part is used whatever its asymmetry (so an
    /// inverse returned here, symmetric only to rounding, can be passed back), and the
    /// residual test of [`InitialGuess::Warm`] decides whether it is used at all.
    ///
    /// On [`Device::Emulated`] / [`Device::Cuda`] the whole iteration runs on the device
    /// (`kernels/newton.cu`, [`crate::cuda::newton`]): `Bf16` products on tensor cores with the
    /// step's algebra fused into the GEMM epilogues, only the residual read back per step for
    /// the stop test. Same rules and results as the CPU backend up to the products' rounding
    /// (the iteration count may differ by one where a residual lands near `tol`).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch);
    /// [`Error::Shape`](crate::Error::Shape) (`a` not square or empty, `warm` not `n x n`);
    /// [`Error::Value`](crate::Error::Value) (bad options, asymmetric or zero `a`, no
    /// positive eigenvalue); [`Error::NonFinite`](crate::Error::NonFinite);
    /// [`Error::Diverged`](crate::Error::Diverged) when the residual becomes non-finite, grows,
    /// stalls above `tol` in `F32` mode, or the budget runs out — never a silent wrong inverse.
    pub fn newton_inverse(
        &self,
        a: &Matrix,
        warm: Option<&Matrix>,
        opts: &NewtonOptions,
    ) -> Result<(Matrix, NewtonInfo)> {
        const OP: &str = "Device::newton_inverse";
        opts.validate(OP)?;
        self.check_on(OP, a)?;
        let n = check_square(OP, a.shape())?;
        if let Some(w) = warm {
            self.check_on(OP, w)?;
            check_shape(OP, "warm", w.shape(), (n, n))?;
        }
        match self {
            Device::Cpu => {
                let warm = warm.map(super::host_ref).transpose()?;
                let (x, info) =
                    crate::cpu::newton::newton_inverse(super::host_ref(a)?, warm, opts)?;
                Ok((self.upload(n, n, x.as_slice())?, info))
            }
            Device::Emulated | Device::Cuda(_) => {
                let run = crate::cuda::gemm_plan::newton_product;
                crate::cuda::newton::newton_inverse(self, a, warm, opts, run)
            }
        }
    }
}
