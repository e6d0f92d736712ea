//! Optimizers (SPEC §2–4), written once against the device-agnostic ops on [`crate::Device`].
//!
//! Every optimizer validates shapes, finiteness and hyperparameters before mutating any
//! state, so a failed call leaves it bit-for-bit unchanged.

pub mod adamw;
pub mod kalman;
pub mod kron;
pub mod sgd;
pub mod sophia;

use crate::device::Matrix;

/// Kronecker statistics of one layer (SPEC §1).
///
/// - `a`: layer inputs `x̄_k` as rows, `m x d_in` (augmented with the bias column of ones when
///   the layer has a bias, so `d_in` matches the columns of `W̄`);
/// - `e`: output gradients `e_k = ∂ℓ_k/∂y_k` backpropagated from labels sampled from the model
///   (or exact / empirical, the trainer's choice), `m' x d_out`, NOT divided by the batch size.
///
/// The row counts `m` and `m'` may differ from each other and from the gradient batch.
#[derive(Clone, Copy, Debug)]
pub struct KronStats<'a> {
    /// Layer inputs, `m x d_in`.
    pub a: &'a Matrix,
    /// Output gradients, `m' x d_out`.
    pub e: &'a Matrix,
}
