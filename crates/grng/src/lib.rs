//! # grng — Gradient Regularized Natural Gradients
//!
//! Second-order optimizers for neural-network training — RING, RENG and R-Kalman from
//! "Gradient Regularized Natural Gradients" (AISTATS 2026), with the baselines the paper compares
//! against — built on hand-written CUDA kernels with a rayon CPU backend that is both the
//! fallback and the test oracle. Notation and math follow `docs/math.md` (see the README).
//!
//! The library alone: devices ([`Device`], [`Matrix`]), the CPU backend ([`cpu`]), the CUDA
//! backend ([`cuda`], over the runtime in [`driver`]; the kernels of `kernels/*.cu` are
//! compiled by this crate's build script, for GPUs and for the emulator), the operations
//! ([`ops`]), the optimizers ([`optim`]) and checkpoints ([`checkpoint`]). Depends on cudarc
//! (CUDA loaded at run time: nothing to link), the `gemm` and `faer` CPU kernels, rayon and a
//! few small crates; no CLI, progress-bar or plotting crate. The reference trainer is
//! `grng-train`, the candle integration `grng-candle`. Layers: `docs/architecture.md`.
//!
//! Layout conventions: matrices are dense row-major; a dense layer `y = W x + b` has `W` of
//! shape `d_out x d_in`, and with a bias the augmented `W̄ = [W b]` / `x̄ = [x; 1]` are used.
//!
//! # Example: RING as a whole optimizer on one dense layer
//!
//! ```
//! use grng::optim::kron::{KronConfig, KronOptimizer};
//! use grng::optim::KronStats;
//! use grng::{Device, Result};
//!
//! fn main() -> Result<()> {
//!     let dev = Device::Cpu; // or Device::auto()?: CUDA when present, else the CPU
//!     let (m, d_in, d_out) = (16, 4 + 1, 3); // batch 16, 4 inputs plus the bias column
//!     // Layer inputs x̄_k as rows (the last column is the bias 1) and per-sample output
//!     // gradients e_k (here made up; a trainer gets them from its backward pass).
//!     let x: Vec<f32> = (0..m * d_in)
//!         .map(|i| if i % d_in == d_in - 1 { 1.0 } else { ((i * 7 % 11) as f32 - 5.0) / 5.0 })
//!         .collect();
//!     let e: Vec<f32> = (0..m * d_out).map(|i| ((i * 5 % 7) as f32 - 3.0) / 3.0).collect();
//!     let a = dev.upload(m, d_in, &x)?;
//!     let e = dev.upload(m, d_out, &e)?;
//!
//!     let mut g = dev.zeros(d_out, d_in)?;
//!     dev.batch_gradient(&e, &a, &mut g)?; // G = (1/m) Eᵀ A
//!
//!     let mut w = vec![dev.zeros(d_out, d_in)?]; // W̄ = [W b], d_out x (d_in + 1)
//!     let mut opt = KronOptimizer::new(&dev, &[(d_out, d_in)], KronConfig::ring())?;
//!     // On refresh steps (step mod S == 0) pass the statistics; `e` should come from labels
//!     // sampled from the model (true Fisher) — reused here for brevity.
//!     let stats = opt.needs_stats().then(|| vec![KronStats { a: &a, e: &e }]);
//!     let info = opt.step(&mut w, &[&g], stats.as_deref())?;
//!     println!("{info:?}, rho = {}", opt.rho());
//!     Ok(())
//! }
//! ```
//!
//! # Threads
//!
//! Every public type is `Send + Sync`: [`Device`] (a [`cuda::CudaDevice`] is reference-counted
//! handles to the CUDA context, its one stream and a mutex-guarded kernel cache, all shareable),
//! [`Matrix`], [`Error`], the optimizers in [`optim`] (and the reference trainer's `Mlp` and `Trainer`, in `grng-train`). A
//! step takes `&mut self`, so one optimizer is driven by one thread at a time; different
//! optimizers may run on different threads against one device at once and get bit-for-bit what
//! running them one after the other gets (each owns its buffers; on a GPU all clones of a
//! device share its stream, so their launches are serialized). Checked by
//! `tests/concurrency.rs`.

pub mod checkpoint;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod dist;
pub mod driver;
pub mod element;
pub mod error;
pub mod hooks;
mod iteration;
pub mod mat;
pub mod ops;
pub mod optim;
mod params;
pub(crate) mod shape;
pub mod simd;
#[cfg(test)]
mod testing;

pub use device::{Device, Element, Matrix};
pub use error::{DivergenceReason, Error, Result};
pub use mat::{Mat, MatMut, MatRef, Trans};
pub use shape::MatMul;

/// Compiles the README's code blocks as doctests so the example there cannot rot.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
