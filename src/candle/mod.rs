//! grng inside [candle](https://github.com/huggingface/candle) (cargo feature `candle`).
//!
//! - [`with_matrices`]: zero-copy views of candle tensors as grng [`Matrix`](crate::Matrix)es.
//! - [`KronLinear`]: a linear layer `y = W̄ x̄` (`W̄ = [W b]`, `x̄ = [x; 1]`, SPEC §1) that
//!   records its inputs `A` and output gradients `E` for the Kronecker factors;
//!   [`capture_fisher`] forms them in the reference trainer's three [`FisherMode`]s.
//! - [`GrngOptimizer`]: a `candle_nn::Optimizer` running RING, RENG, NGD, AdamW, SGD or
//!   Sophia, with `KronLinear` weights Kronecker-preconditioned and every other variable
//!   updated by AdamW; [`GrngOptimizer::regularize`] forms RENG's `g + 2c·H_L g` and
//!   [`GrngOptimizer::step_observed`] adds the reference trainer's rejection and damping rule.
//!
//! Scope: candle's CPU tensors (grng's [`Device::Cpu`](crate::Device::Cpu)). CUDA tensors are
//! refused with [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable): candle's `cuda`
//! feature compiles its kernels with `nvcc` at build time, which the machine this was written on
//! lacks, so that path could not be built. grng's cudarc is already configured to link with
//! candle's (`fallback-dynamic-loading`).
//!
//! Where things are: `view.rs` (views), `layer.rs` (layer, statistics), `optim.rs`
//! (optimizer); tests `tests/candle_grng.rs`; examples `examples/candle_{mlp,gpt}.rs`; bench
//! `benches/candle_step.rs`.
//!
//! [`FisherMode`]: crate::mlp::FisherMode

mod layer;
mod optim;
mod view;

pub use layer::{capture_fisher, KronLinear};
pub use optim::{GrngConfig, GrngOptimizer, Observed};
pub use view::{candle_device, grng_device, with_matrices, with_matrix, ViewAs};
