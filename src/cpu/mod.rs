//! CPU backend (rayon): the fallback and the oracle for the kernels.

pub mod cholesky;
pub mod elementwise;
pub mod gemm;
pub mod kalman;
pub mod kron;
pub mod newton;
pub mod norm;
pub mod precond;

pub use cholesky::{cholesky, cholesky_inverse, cholesky_solve};
pub use gemm::gemm;
pub use kron::{batch_gradient, syrk_ema};
pub use norm::{spectral_norm, trace};
pub use precond::{add_diagonal, damped_inverse_update, precondition};

use crate::device::Element;
use crate::error::{Error, Result};
use crate::mat::MatRef;

/// `Err(Error::NonFinite)` at the first NaN/Inf of a view (flat index `i * cols + j`).
pub(crate) fn check_finite_view<T: Element>(
    op: &'static str,
    arg: &'static str,
    a: MatRef<'_, T>,
) -> Result<()> {
    for i in 0..a.rows() {
        let row = a.row(i);
        // Branch-free exponent test first (vectorizes); locate the culprit only on failure.
        const EXP: u32 = 0x7f80_0000;
        if !row
            .iter()
            .fold(false, |bad, v| bad | (v.to_f32().to_bits() & EXP == EXP))
        {
            continue;
        }
        if let Some(j) = row.iter().position(|v| !v.to_f32().is_finite()) {
            return Err(Error::NonFinite {
                op,
                arg,
                index: i * a.cols() + j,
                value: a.at(i, j).to_f32(),
            });
        }
    }
    Ok(())
}
