//! Optimizers (docs/math.md §2–4), written once against the device-agnostic ops on [`crate::Device`].
//!
//! Every optimizer validates shapes, finiteness and hyperparameters before mutating any
//! state, so a failed call leaves it bit-for-bit unchanged.

pub mod adamw;
pub mod fisher;
pub mod kalman;
pub mod kron;
mod multi;
pub mod sgd;
pub mod sophia;

use crate::device::Matrix;
use half::bf16;

/// The optimizer-side hyperparameters of a method.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    /// RING, RENG, NGD (RENG's `c` is [`KronConfig::grad_reg`](kron::KronConfig::grad_reg)).
    Kron(kron::KronConfig),
    /// SGD with momentum.
    Sgd(sgd::SgdConfig),
    /// AdamW with warm-up.
    AdamW(adamw::AdamWConfig),
    /// Sophia-G.
    Sophia(sophia::SophiaConfig),
    /// R-Kalman and Kalman (`ρ = 0`).
    Kalman(kalman::RKalmanConfig),
}

/// Kronecker statistics of one layer (docs/math.md §1).
///
/// - `a`: layer inputs `x̄_k` as rows, `m x d_in` (augmented with the bias column of ones when
///   the layer has a bias, so `d_in` matches the columns of `W̄`);
/// - `e`: output gradients `e_k = ∂ℓ_k/∂y_k` backpropagated from labels sampled from the model
///   (or exact / empirical, the trainer's choice), `m' x d_out`, NOT divided by the batch size.
///
/// The row counts `m` and `m'` may differ from each other and from the gradient batch. Each
/// matrix is a [`Matrix`] of `f32` or of `bf16` ([`StatsMatrix`]; `KronStats { a: &a, e: &e }`
/// takes either): `bf16` statistics are accumulated by the tensor-core SYRK on a kernel device
/// and without a widened copy on the CPU; `f32` ones as
/// [`KronConfig::stats_precision`](kron::KronConfig::stats_precision) says.
#[derive(Clone, Copy, Debug)]
pub struct KronStats<'a> {
    /// Layer inputs, `m x d_in`.
    pub a: &'a dyn StatsMatrix,
    /// Output gradients, `m' x d_out`.
    pub e: &'a dyn StatsMatrix,
}

/// A statistics matrix of [`KronStats`]: `Matrix<f32>` or `Matrix<bf16>` (sealed: the
/// optimizer has a factor kernel for these two element types only).
pub trait StatsMatrix: std::fmt::Debug + Sync + sealed::Sealed {
    /// The matrix with its element type.
    fn view(&self) -> StatsView<'_>;
}

/// A [`StatsMatrix`] with its element type.
#[derive(Clone, Copy, Debug)]
pub enum StatsView<'a> {
    /// `f32` statistics.
    F32(&'a Matrix),
    /// `bf16` statistics.
    Bf16(&'a Matrix<bf16>),
}

impl StatsView<'_> {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            StatsView::F32(m) => m.shape(),
            StatsView::Bf16(m) => m.shape(),
        }
    }
}

impl StatsMatrix for Matrix {
    fn view(&self) -> StatsView<'_> {
        StatsView::F32(self)
    }
}

impl StatsMatrix for Matrix<bf16> {
    fn view(&self) -> StatsView<'_> {
        StatsView::Bf16(self)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::device::Matrix {}
    impl Sealed for crate::device::Matrix<half::bf16> {}
}

/// `Err(Error::Value)` naming `arg` unless the symmetric `n x n` matrix `a` (row-major host
/// data; only its lower triangle is read) is positive semidefinite after a shift: the
/// Cholesky factorization of `a + (shift + tol)·I` must succeed, with
/// `tol = max(n·ε_f32·max|aᵢᵢ|, f32::MIN_POSITIVE)` — the rounding of an `f32` PSD matrix
/// (its largest eigenvalue is at least `max aᵢᵢ`), so a singular PSD matrix (zero included)
/// passes and a matrix with an eigenvalue below `−(shift + tol)` does not. `O(n³/3)` on the
/// host in `f64`: for checkpoint restores, not steps.
pub(crate) fn check_psd(
    op: &'static str,
    arg: &'static str,
    a: &[f32],
    n: usize,
    shift: f32,
    expected: &'static str,
) -> crate::Result<()> {
    crate::error::check_len(op, arg, a.len(), n * n)?;
    crate::error::check_finite(op, arg, a)?;
    let max_diag = (0..n).map(|i| a[i * n + i].abs()).fold(0.0f32, f32::max);
    let tol = (n as f32 * f32::EPSILON * max_diag).max(f32::MIN_POSITIVE);
    let mut w = crate::error::try_to_vec(a)?;
    for i in 0..n {
        w[i * n + i] += shift + tol;
    }
    match crate::cpu::cholesky(crate::mat::MatRef::new(&w, n, n)?) {
        Ok(_) => Ok(()),
        Err(crate::Error::NotSpd { pivot, .. }) => Err(crate::Error::Value {
            op,
            arg,
            value: pivot,
            expected,
        }),
        Err(e) => Err(e),
    }
}
