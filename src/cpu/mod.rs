//! CPU backend (rayon): the fallback and the oracle for the kernels.

pub mod cholesky;
pub mod elementwise;
pub mod gemm;
pub mod kalman;
pub mod kron;
pub mod math;
pub mod newton;
pub mod norm;
pub mod precond;
pub mod simd;
pub mod woodbury;

pub use cholesky::{cholesky, cholesky_inverse, cholesky_solve};
pub use gemm::gemm;
pub use kron::{batch_gradient, syrk_ema};
pub use norm::{spectral_norm, trace};
pub use precond::{add_diagonal, damped_inverse_update, precondition};
pub use woodbury::{low_rank_damped_inverse, low_rank_is_cheaper};

use crate::device::Element;
use crate::error::{first_non_finite, Error, Result};
use crate::mat::MatRef;

/// `Err(Error::NonFinite)` at the first NaN/Inf of a view (flat index `i * cols + j`): the
/// scan of [`crate::error::first_non_finite`], once over the data when the view is
/// contiguous, else row by row.
pub(crate) fn check_finite_view<T: Element>(
    op: &'static str,
    arg: &'static str,
    a: MatRef<'_, T>,
) -> Result<()> {
    let (rows, cols) = a.shape();
    let found = if a.ld() == cols || rows <= 1 {
        first_non_finite(&a.data()[..rows * cols]).map(|k| (k / cols.max(1), k % cols.max(1)))
    } else {
        (0..rows).find_map(|i| first_non_finite(a.row(i)).map(|j| (i, j)))
    };
    match found {
        None => Ok(()),
        Some((i, j)) => Err(Error::NonFinite {
            op,
            arg,
            index: i * cols + j,
            value: a.at(i, j).to_f32(),
        }),
    }
}
