//! # grng — Gradient Regularized Natural Gradients
//!
//! Second-order optimizers for neural-network training — RING, RENG and R-Kalman from
//! "Gradient Regularized Natural Gradients" (AISTATS 2026), with the baselines the paper compares
//! against — built on hand-written CUDA kernels with a rayon CPU backend that is both the
//! fallback and the test oracle. Notation and math follow `SPEC.md` (see the README).
//!
//! Layout conventions: matrices are dense row-major; a dense layer `y = W x + b` has `W` of
//! shape `d_out x d_in`, and with a bias the augmented `W̄ = [W b]` / `x̄ = [x; 1]` are used.

pub mod checkpoint;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod device;
pub mod error;
pub mod mat;
pub mod mlp;
pub mod ops;
pub mod optim;
pub mod report;
pub mod train;

pub use device::{Device, Element, Matrix};
pub use error::{DivergenceReason, Error, Result};
pub use mat::{Mat, MatMut, MatRef, Trans};
