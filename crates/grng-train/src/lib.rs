//! # grng-train — the reference trainer and the main job
//!
//! The application around the `grng` library: a multilayer perceptron with hand-written
//! forward and backward passes that expose exactly what the optimizers consume ([`mlp`]), the
//! UCI handwritten digits shipped in `data/` ([`data`]), the training loop that drives every
//! optimizer through one [`Trainer`](train::Trainer) with the main job and the sweep
//! ([`train`]), and the table and SVG curves ([`report`]). The `grng` binary
//! (`cargo run --release` at the workspace root) is [`cli`].
//!
//! Depends on `grng` (devices, optimizers, checkpoints) and on the application's own crates
//! (`clap`, `indicatif`); a trainer that links only `grng` compiles none of this.

pub mod cli;
pub mod data;
pub mod mlp;
pub mod report;
pub mod train;
