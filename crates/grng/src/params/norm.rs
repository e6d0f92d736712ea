//! Settings and report of the power iteration behind
//! [`Device::spectral_norm`](crate::Device::spectral_norm).

use crate::error::{check_value, Result};

/// Power-iteration settings for [`Device::spectral_norm`](crate::Device::spectral_norm).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PowerOptions {
    /// Stop when the Rayleigh quotient changes by at most `tol` relative to its value between
    /// two iterations. Default `1e-4`: the damping `√ρ·‖Λ‖₂` needs a few digits only.
    pub tol: f32,
    /// Iteration budget. Default `100`.
    pub max_iter: usize,
    /// Most steps the kernel devices queue between two reads of their Rayleigh quotients
    /// (each read waits for the device): batches of 2, 4, 8, … up to `max_batch`, the stop
    /// test applied to each step in order, so the result is the same for every `max_batch`
    /// and a stop inside a batch discards that batch's later steps (at most `max_batch − 1`
    /// matrix-vector products). `1` reads each step before queuing the next: the least work,
    /// for matrices so large that a product costs more than a read. At most
    /// [`PowerOptions::MAX_BATCH`]; the CPU, which reads nothing back, steps one at a time
    /// whatever it is. Default `16`.
    pub max_batch: usize,
}

impl Default for PowerOptions {
    fn default() -> Self {
        Self {
            tol: 1e-4,
            max_iter: 100,
            max_batch: 16,
        }
    }
}

impl PowerOptions {
    /// Largest [`PowerOptions::max_batch`] (a batch's results share one small device buffer).
    pub const MAX_BATCH: usize = 1024;

    /// `Err(Error::Value)` unless `tol` is finite and positive, `max_iter ≥ 1` and
    /// `1 ≤ max_batch ≤ MAX_BATCH`.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        check_value(
            op,
            "tol",
            self.tol as f64,
            self.tol > 0.0,
            "a finite tolerance > 0",
        )?;
        check_value(
            op,
            "max_iter",
            self.max_iter as f64,
            self.max_iter >= 1,
            "at least 1",
        )?;
        check_value(
            op,
            "max_batch",
            self.max_batch as f64,
            (1..=Self::MAX_BATCH).contains(&self.max_batch),
            "1 to 1024",
        )
    }
}

/// What a power iteration found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PowerInfo {
    /// The last Rayleigh quotient `vᵀAv` (`‖v‖ = 1`): the largest-eigenvalue estimate, a lower
    /// bound on it for a symmetric `A`.
    pub value: f32,
    /// Steps up to the one that stopped (matrix-vector products, not counting those a kernel
    /// device ran past the stop in the same batch, [`PowerOptions::max_batch`]).
    pub iterations: usize,
    /// Whether the relative tolerance was met within `max_iter`.
    pub converged: bool,
}
