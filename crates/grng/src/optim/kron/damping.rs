//! Scalar damping rules: per-variant factor dampings (docs/math.md §2 table) and the
//! Levenberg–Marquardt update of `ρ`. Host arithmetic on a handful of scalars only.

use super::config::{KronConfig, KronVariant};

/// Scalars of one undamped Kronecker factor that the damping rules read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct FactorScalars {
    /// Side length `n` of the factor.
    pub dim: usize,
    /// `‖F‖₂` (RING only; 0 for the other variants, which never read it).
    pub norm: f32,
    /// `tr F` (NGD's π; 0 for the other variants, which never read it).
    pub trace: f32,
}

/// `(λ_Λ, λ_Γ)` for the current `ρ`, each at least `cfg.damping_floor`.
pub(super) fn factor_dampings(
    cfg: &KronConfig,
    rho: f32,
    lambda: FactorScalars,
    gamma: FactorScalars,
) -> (f32, f32) {
    let s = (rho as f64).sqrt();
    let (dl, dg) = match cfg.variant {
        KronVariant::Ring => (s * lambda.norm as f64, s * gamma.norm as f64),
        KronVariant::Reng => (s, s),
        KronVariant::Ngd => {
            let pi = ngd_pi(lambda, gamma);
            (pi * s, s / pi)
        }
    };
    let floor = cfg.damping_floor as f64;
    (dl.max(floor) as f32, dg.max(floor) as f32)
}

/// `π = √((tr Λ / d_in) / (tr Γ / d_out))`; 1 when either mean eigenvalue is zero (a dead
/// layer), where the ratio carries no information.
fn ngd_pi(lambda: FactorScalars, gamma: FactorScalars) -> f64 {
    let ml = lambda.trace as f64 / lambda.dim as f64;
    let mg = gamma.trace as f64 / gamma.dim as f64;
    let pi = (ml / mg).sqrt();
    if ml > 0.0 && mg > 0.0 && pi.is_finite() && pi > 0.0 {
        pi
    } else {
        1.0
    }
}

/// The Levenberg–Marquardt rule (docs/math.md §2) for a reduction ratio `r` (actual over predicted
/// change of the loss): `ρ ← φρ` if `r > 3/4`, `ρ ← ρ/φ` if `r < 1/4` (NaN counts as a
/// poor model), otherwise unchanged; the result is clamped to `[rho_min, rho_max]`. With a
/// [`KronConfig::damping_interval`] `T > 1` the factor is `φᵀ` (Martens & Grosse's
/// `ω₁ = (19/20)^T₁`): one adaptation stands for `T` steps.
pub fn levenberg_marquardt(cfg: &KronConfig, rho: f32, r: f32) -> f32 {
    let rho = rho as f64;
    let phi = (cfg.phi as f64).powf(cfg.damping_interval as f64);
    let next = if r > 0.75 {
        rho * phi
    } else if r >= 0.25 {
        rho
    } else {
        rho / phi
    };
    (next as f32).clamp(cfg.rho_min, cfg.rho_max)
}
