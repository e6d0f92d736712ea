//! # grng-candle — grng's optimizers inside [candle](https://github.com/huggingface/candle)
//!
//! Depends on `grng` (the optimizers, devices and kernels) and candle 0.11 (`candle-core`,
//! `candle-nn`); nothing of the reference trainer.
//!
//! - [`with_matrices`]: zero-copy views of candle tensors as grng [`Matrix`](grng::Matrix)es.
//! - [`KronLinear`]: a linear layer `y = W̄ x̄` (`W̄ = [W b]`, `x̄ = [x; 1]`, docs/math.md §1) that
//!   records its inputs `A` and output gradients `E` for the Kronecker factors;
//!   [`capture_fisher`] forms them in the reference trainer's three [`FisherMode`]s.
//! - [`LoraLinear`]: a frozen linear layer with LoRA adapters `A`, `B` that are bias-free
//!   `KronLinear`s of their own, so the Kronecker methods precondition each adapter.
//! - [`GrngOptimizer`]: a `candle_nn::Optimizer` running RING, RENG, NGD, AdamW, SGD or
//!   Sophia, with `KronLinear` weights Kronecker-preconditioned and every other variable
//!   updated by AdamW; [`GrngOptimizer::regularize`] forms RENG's `g + 2c·H_L g` and
//!   [`GrngOptimizer::step_observed`] adds the reference trainer's rejection and damping rule.
//!
//! Scope: candle's CPU tensors (grng's [`Device::Cpu`](grng::Device::Cpu)), and with the
//! `cuda` feature (candle's `cuda`) its CUDA tensors: grng's
//! [`Device::Cuda`](grng::Device::Cuda) on candle's own context and stream
//! ([`CudaDevice::from_stream`](grng::cuda::CudaDevice::from_stream)), matrices holding the
//! tensors' own device buffers. Without the feature CUDA tensors are refused with
//! [`Error::DeviceUnavailable`](grng::Error::DeviceUnavailable). candle's CUDA build compiles
//! its kernels with `nvcc` and links the CUDA libraries (its cudarc uses `dynamic-linking`,
//! which grng's `fallback-dynamic-loading` gives way to); `scripts/install-cuda-tools.sh
//! --candle` provides a CUDA 13.0 toolchain from pip. That path is built and its tests
//! compiled, but has not run on a GPU yet (no GPU where it was written): the CUDA arms of
//! `tests/candle_grng.rs` skip without one.
//!
//! Where things are: `view.rs` (views), `cuda.rs` (CUDA storages, feature `cuda`), `layer.rs`
//! (layer, statistics), `lora.rs` (LoRA), `optim.rs` (optimizer); tests `tests/candle_grng.rs`; examples
//! `examples/candle_{mlp,gpt}.rs`; bench `benches/candle_step.rs`.
//!
//! [`FisherMode`]: grng::optim::fisher::FisherMode

mod buffer;
#[cfg(feature = "cuda")]
mod cuda;
mod layer;
mod lora;
mod optim;
mod view;

pub use layer::{capture_fisher, output_jacobian, KronLinear, OutputJacobian};
pub use lora::{LoraConfig, LoraLinear};
pub use optim::{GrngConfig, GrngOptimizer, Observed};
pub use view::{candle_device, grng_device, with_matrices, with_matrix, ViewAs};
