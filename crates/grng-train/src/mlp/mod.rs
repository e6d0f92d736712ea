//! The reference trainer: a multilayer perceptron with hand-written forward and backward passes
//! that expose what the optimizers consume.
//!
//! # Layout
//! Layer `l` (`0..L`) maps `d_l → d_{l+1}` with the augmented weights `W̄_l = [W_l b_l]`,
//! `d_{l+1} x (d_l + 1)` row-major (docs/math.md §1). All layers live in one flat parameter vector,
//! layer 0 first, each `W̄_l` row-major: element `(p, q)` of layer `l` is
//! `params[layer_range(l).start + p * (d_l + 1) + q]`. Element-wise and Kalman optimizers use
//! the flat view ([`Mlp::params`]), Kronecker-factored ones the per-layer views
//! ([`Mlp::layer`], [`Mlp::layer_shape`], [`Mlp::layer_range`]).
//!
//! # Model
//! `x̄_0 = [x; 1]`, `z_l = W̄_l x̄_l`, hidden layers `x̄_{l+1} = [φ(z_l); 1]` with `φ` the
//! configured [`Activation`]; the last layer is linear. Batches are row-major `m x d_0` with one
//! sample per row. The loss is the mean over the batch of the per-sample loss `ℓ_k`:
//! - [`Loss::SoftmaxCrossEntropy`]: `ℓ_k = −log softmax(z_k)_{y_k}`; outputs `ŷ` are the class
//!   probabilities; `e_k = ∂ℓ_k/∂z_k = p_k − onehot(y_k)`.
//! - [`Loss::SquaredError`]: `ℓ_k = ½‖z_k − t_k‖²` (the negative log-likelihood of a
//!   unit-variance Gaussian up to a constant); outputs `ŷ = z`; `e_k = z_k − t_k`.
//!
//! # What the passes return
//! - [`Mlp::backward`]: per layer `A_l` (`m x (d_l+1)`, rows `x̄_l`) and `E_l` (`m x d_{l+1}`,
//!   rows `∂ℓ_k/∂z_l`, NOT divided by `m`), the flat mean-loss gradient (`G_l = (1/m) E_lᵀ A_l`)
//!   and the loss.
//! - [`Mlp::fisher_stats`]: the same statistics for the Fisher factors in three
//!   [`FisherMode`]s (sampled labels, exact expectation, empirical).
//! - [`Mlp::output_jacobian`]: `H = ∂ŷ/∂θ` for the Kalman methods (docs/math.md §3 step 2).
//! - [`Mlp::hessian_vector_product`] / [`Mlp::regularized_gradient`]: exact `H_L v` by
//!   Pearlmutter's R-operator and RENG's `g + 2c·H_L g` (docs/math.md §2).

mod backward;
mod checkpoint;
mod hvp;
mod jacobian;
mod model;

pub use backward::{BackwardScratch, GradientNorm};
pub use grng::optim::fisher::{sample_class, FisherMode};
pub use jacobian::OutputJacobian;
pub use model::{Forward, Mlp};

use grng::mat::{Mat, MatRef};

/// Hidden-layer nonlinearity (the output layer is always linear).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Activation {
    /// `max(z, 0)`; its derivative at 0 is taken as 0.
    Relu,
    /// `tanh(z)`: smooth, the choice for derivative checks.
    #[default]
    Tanh,
}

/// Per-sample loss on the last layer's output `z` (see the module docs for the formulas).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Loss {
    /// Softmax followed by cross-entropy with class labels.
    #[default]
    SoftmaxCrossEntropy,
    /// `½‖z − t‖²`: unit-variance Gaussian likelihood.
    SquaredError,
}

/// Shape and kind of an [`Mlp`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlpConfig {
    /// Layer widths `[d_0, d_1, …, d_L]`: input, hidden layers, output. At least two entries,
    /// all ≥ 1. For softmax the output width is the number of classes.
    pub sizes: Vec<usize>,
    /// Nonlinearity of the hidden layers.
    pub activation: Activation,
    /// Loss on the output layer.
    pub loss: Loss,
}

/// Training targets for a batch of `m` samples.
#[derive(Clone, Copy, Debug)]
pub enum Targets<'a> {
    /// One class label per sample, each `< d_L`. Valid for both losses: with squared error the
    /// target is the one-hot vector of the label.
    Classes(&'a [usize]),
    /// `m x d_L` real targets (squared error only), finite.
    Values(MatRef<'a, f32>),
}

/// Owned targets, e.g. labels sampled from the model ([`Mlp::sample_targets`]).
#[derive(Clone, Debug, PartialEq)]
pub enum TargetsBuf {
    /// One class label per sample.
    Classes(Vec<usize>),
    /// `m x d_L` real targets.
    Values(Mat),
}

impl TargetsBuf {
    /// Borrow as [`Targets`].
    pub fn as_targets(&self) -> Targets<'_> {
        match self {
            Self::Classes(c) => Targets::Classes(c),
            Self::Values(v) => Targets::Values(v.as_ref()),
        }
    }
}

/// One layer's statistics: `G = (1/m) eᵀ a`, `Λ = (1/rows) aᵀ a`, `Γ = (1/rows) eᵀ e`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStats {
    /// `rows x (d_in + 1)`: augmented layer inputs `x̄_k` as rows (last column 1).
    pub a: Mat,
    /// `rows x d_out`: `e_k = ∂ℓ_k/∂z_k` at this layer, not divided by the batch size.
    pub e: Mat,
}

/// Result of [`Mlp::backward`].
#[derive(Clone, Debug, PartialEq)]
pub struct Backward {
    /// Per layer, layer 0 first; `m` rows each.
    pub layers: Vec<LayerStats>,
    /// Flat gradient of the mean loss, in the parameter layout.
    pub grad: Vec<f32>,
    /// Mean loss over the batch.
    pub loss: f32,
}
