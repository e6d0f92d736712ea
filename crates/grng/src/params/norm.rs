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
}

impl Default for PowerOptions {
    fn default() -> Self {
        Self {
            tol: 1e-4,
            max_iter: 100,
        }
    }
}

impl PowerOptions {
    /// `Err(Error::Value)` unless `tol` is finite and positive and `max_iter ≥ 1`.
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
        )
    }
}

/// What a power iteration found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PowerInfo {
    /// The last Rayleigh quotient `vᵀAv` (`‖v‖ = 1`): the largest-eigenvalue estimate, a lower
    /// bound on it for a symmetric `A`.
    pub value: f32,
    /// Matrix-vector products performed.
    pub iterations: usize,
    /// Whether the relative tolerance was met within `max_iter`.
    pub converged: bool,
}
