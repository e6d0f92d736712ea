//! Hyperparameters and report of one R-Kalman step (docs/math.md §3), used by
//! [`Device::kalman_step`](crate::Device::kalman_step) and both backends.

use crate::error::{check_value, Result};

/// How the regularized observation noise `R̃` is formed from `R` (docs/math.md §3 step 5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RForm {
    /// `R̃ = R (I + ρR)⁻¹`, through a Cholesky solve with the SPD `I + ρR`.
    #[default]
    Exact,
    /// First-order Neumann form `R̃ = R (I − ρR)`: agrees with the exact form to `O(ρ²)`,
    /// valid for `ρ‖R‖₂ ≪ 1` (for `ρ‖R‖₂ ≥ 1` it is no longer PSD).
    Neumann,
}

/// Hyperparameters of one R-Kalman step. Defaults follow docs/math.md §6.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KalmanOptions {
    /// Forgetting factor of the `R` EMA, `0 ≤ β ≤ 1`. Default `0.97` (paper: 0.96–0.98).
    pub beta: f32,
    /// Gradient regularizer `ρ ≥ 0`; `0` is the plain diagonal EKF. Default `1e-4` (the
    /// paper's well-performing ρ for its regularized optimizers).
    pub rho: f32,
    /// Diagonal process noise `q ≥ 0` added to `σ` before the update. Default `0`.
    pub process_noise: f32,
    /// Positivity floor of `σ`, `> 0`: an entry that the update would push below it is set to
    /// `min(floor, σ⁻_i)`. Default `1e-10` (σ₀ is 0.04–0.2, so only collapsed entries hit it).
    pub sigma_floor: f32,
    /// Relative jitter `> 0`: `S` is factored as `S + δI`, `δ = jitter · mean(diag S)`
    /// (`δ = jitter` when that diagonal is all zero). Default `1e-7`, far below the `f32`
    /// resolution of the streaming pass yet enough for a rank-deficient `S` in `f64`.
    pub jitter: f32,
    /// How many times `δ` may be multiplied by 10 while the Cholesky factorization of `S`
    /// fails. Default `6`.
    pub max_jitter_escalations: usize,
    /// Exact or Neumann `R̃`. Default [`RForm::Exact`].
    pub r_form: RForm,
}

impl Default for KalmanOptions {
    fn default() -> Self {
        Self {
            beta: 0.97,
            rho: 1e-4,
            process_noise: 0.0,
            sigma_floor: 1e-10,
            jitter: 1e-7,
            max_jitter_escalations: 6,
            r_form: RForm::Exact,
        }
    }
}

impl KalmanOptions {
    /// `Err(Error::Value)` for a parameter outside the range its field documents.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        check_value(
            op,
            "beta",
            self.beta as f64,
            (0.0..=1.0).contains(&self.beta),
            "0 <= beta <= 1",
        )?;
        check_value(op, "rho", self.rho as f64, self.rho >= 0.0, "rho >= 0")?;
        check_value(
            op,
            "process_noise",
            self.process_noise as f64,
            self.process_noise >= 0.0,
            "process_noise >= 0",
        )?;
        check_value(
            op,
            "sigma_floor",
            self.sigma_floor as f64,
            self.sigma_floor > 0.0,
            "sigma_floor > 0",
        )?;
        check_value(
            op,
            "jitter",
            self.jitter as f64,
            self.jitter > 0.0,
            "jitter > 0",
        )?;
        check_value(
            op,
            "max_jitter_escalations",
            self.max_jitter_escalations as f64,
            self.max_jitter_escalations <= 30,
            "at most 30 (δ grows 10x per escalation)",
        )
    }
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KalmanInfo {
    /// The absolute jitter `δ` added to `S`'s diagonal by the factorization that succeeded.
    pub jitter: f32,
    /// How many times `δ` was multiplied by 10 before `S + δI` factored.
    pub jitter_escalations: usize,
    /// How many `σ_i` were set by the positivity floor.
    pub sigma_floored: usize,
    /// Normalized innovation squared `vᵀ S⁻¹ v` (≈ `d_o` on average for a calibrated filter).
    pub nis: f32,
}
