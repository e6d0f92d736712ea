//! The optimizer's state as plain data: per-layer factors and inverses, scalars, counters.
//! [`super::KronOptimizer::state`] returns a deep copy, [`super::KronOptimizer::restore`]
//! checks and installs one (the checkpoint format builds on [`KronState::matrices`] and
//! [`KronState::scalars`]).

use crate::device::Matrix;
use crate::error::Result;

/// One damped Kronecker factor of one layer (`Λ`, `d_in x d_in`, or `Γ`, `d_out x d_out`).
#[derive(Debug)]
pub struct KronFactorState {
    /// The undamped factor `F` (EMA of `(1/m) AᵀA` or `(1/m') ÊᵀÊ`), `n x n`, symmetric.
    pub factor: Matrix,
    /// `X ≈ (F + damping·I)⁻¹`, `n x n`.
    pub inverse: Matrix,
    /// The damping `X` corresponds to (after first-order updates: the damping they moved it
    /// to). Differs from the current target only after a Newton retry with more damping.
    pub damping: f32,
    /// Bound on `‖X‖₂`: `1/damping` when `X` is formed (`F` is PSD, so the damped factor's
    /// eigenvalues are at least the damping), then carried through each first-order update
    /// (`μ ← μ − dλ·μ²` maps the largest eigenvalue of `X` to the largest eigenvalue of
    /// `X − dλ·X²` while `dλ·μ ≤ 1/2`, and stays at most `1/(damping + dλ)`).
    pub inverse_norm: f32,
    /// `‖F‖₂` at the last refresh (RING's damping; `0` for RENG and NGD, which never read it).
    pub norm: f32,
    /// `tr F` at the last refresh (NGD's π; `0` for RING and RENG, which never read it).
    pub trace: f32,
}

impl KronFactorState {
    fn try_clone(&self) -> Result<Self> {
        Ok(Self {
            factor: self.factor.try_clone()?,
            inverse: self.inverse.try_clone()?,
            damping: self.damping,
            inverse_norm: self.inverse_norm,
            norm: self.norm,
            trace: self.trace,
        })
    }
}

/// Both factors of one layer.
#[derive(Debug)]
pub struct KronLayerState {
    /// Activation factor `Λ` (`d_in x d_in`).
    pub lambda: KronFactorState,
    /// Error factor `Γ` (`d_out x d_out`).
    pub gamma: KronFactorState,
}

/// Running counts, including every numerical fallback (issue 5: reported, never hidden).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KronCounters {
    /// Steps that recomputed the factors from statistics.
    pub refreshes: u64,
    /// Inverses moved to a new damping by `X ← X − dλ·X·X` on a lazy step.
    pub first_order_updates: u64,
    /// Inverses recomputed on a lazy step because `|dλ|·‖X‖₂ > 1/2`.
    pub lazy_recomputes: u64,
    /// Newton inversions that succeeded at the requested damping.
    pub newton_inversions: u64,
    /// Newton iterations spent in all successful Newton inversions.
    pub newton_iterations: u64,
    /// Newton inversions that returned [`crate::Error::Diverged`] at the requested damping.
    pub newton_divergences: u64,
    /// Fallback 1: the retry with [`super::NEWTON_RETRY_DAMPING`] times the damping succeeded.
    pub newton_retries: u64,
    /// Fallback 2: the retry diverged too and the factor was inverted by Cholesky.
    pub cholesky_fallbacks: u64,
    /// Cholesky inversions, both as the configured method and as a fallback.
    pub cholesky_inversions: u64,
    /// Power iterations that stopped at their budget (their estimate was still used).
    pub power_unconverged: u64,
    /// Levenberg–Marquardt updates applied.
    pub lm_updates: u64,
    /// [`super::KronOptimizer::observe_loss`] calls that left `ρ` alone because the predicted
    /// change was not negative (zero gradient), so no ratio exists.
    pub lm_skipped: u64,
    /// Non-finite losses after a step (treated as `r = −∞`: `ρ` grows).
    pub nonfinite_losses: u64,
}

impl KronCounters {
    /// All fallbacks taken: Newton retries with more damping plus Cholesky fallbacks.
    pub fn fallbacks(&self) -> u64 {
        self.newton_retries + self.cholesky_fallbacks
    }

    /// The counters as `(name, value)` pairs, in declaration order.
    pub fn named(&self) -> [(&'static str, u64); 13] {
        [
            ("refreshes", self.refreshes),
            ("first_order_updates", self.first_order_updates),
            ("lazy_recomputes", self.lazy_recomputes),
            ("newton_inversions", self.newton_inversions),
            ("newton_iterations", self.newton_iterations),
            ("newton_divergences", self.newton_divergences),
            ("newton_retries", self.newton_retries),
            ("cholesky_fallbacks", self.cholesky_fallbacks),
            ("cholesky_inversions", self.cholesky_inversions),
            ("power_unconverged", self.power_unconverged),
            ("lm_updates", self.lm_updates),
            ("lm_skipped", self.lm_skipped),
            ("nonfinite_losses", self.nonfinite_losses),
        ]
    }
}

/// What one [`super::KronOptimizer::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KronStepInfo {
    /// Whether the factors were recomputed from statistics on this step.
    pub refreshed: bool,
    /// The quadratic model's predicted change `q(δ) − q(0)` summed over layers (≤ 0).
    pub predicted_change: f32,
    /// `ρ` used by this step.
    pub rho: f32,
    /// Effective step size `α/L` (or `α`).
    pub lr: f32,
    /// Inverses moved by the first-order update on this step.
    pub first_order_updates: u32,
    /// Inverses recomputed on this lazy step (`|dλ|·‖X‖₂ > 1/2`).
    pub lazy_recomputes: u32,
    /// Fallbacks (Newton retries and Cholesky fallbacks) on this step.
    pub fallbacks: u32,
}

/// A deep copy of a [`super::KronOptimizer`]'s mutable state.
#[derive(Debug)]
pub struct KronState {
    /// Current damping parameter `ρ`.
    pub rho: f32,
    /// Completed steps ([`super::KronOptimizer::step`] and
    /// [`super::KronOptimizer::precondition`] calls).
    pub steps: u64,
    /// Predicted change of the last `step`, waiting for `observe_loss`.
    pub predicted: Option<f32>,
    /// Reduction ratio of the last `observe_loss` that formed one.
    pub last_ratio: Option<f32>,
    /// Counters.
    pub counters: KronCounters,
    /// Per layer (layer 0 first); empty before the first refresh.
    pub layers: Vec<KronLayerState>,
}

impl KronState {
    /// A deep (device-side) copy.
    pub fn try_clone(&self) -> Result<Self> {
        Ok(Self {
            rho: self.rho,
            steps: self.steps,
            predicted: self.predicted,
            last_ratio: self.last_ratio,
            counters: self.counters,
            layers: self
                .layers
                .iter()
                .map(|l| {
                    Ok(KronLayerState {
                        lambda: l.lambda.try_clone()?,
                        gamma: l.gamma.try_clone()?,
                    })
                })
                .collect::<Result<_>>()?,
        })
    }

    /// Every device matrix with a stable name: `layer{l}.{lambda|gamma}.{factor|inverse}`.
    pub fn matrices(&self) -> Vec<(String, &Matrix)> {
        let mut out = Vec::with_capacity(4 * self.layers.len());
        for (l, layer) in self.layers.iter().enumerate() {
            for (side, f) in [("lambda", &layer.lambda), ("gamma", &layer.gamma)] {
                out.push((format!("layer{l}.{side}.factor"), &f.factor));
                out.push((format!("layer{l}.{side}.inverse"), &f.inverse));
            }
        }
        out
    }

    /// Every scalar with a stable name: `rho`, `steps`, `predicted` / `last_ratio` (when
    /// present), `counters.*`, and `layer{l}.{lambda|gamma}.{damping|inverse_norm|norm|trace}`.
    pub fn scalars(&self) -> Vec<(String, f64)> {
        let mut out = vec![
            ("rho".to_string(), self.rho as f64),
            ("steps".to_string(), self.steps as f64),
        ];
        if let Some(p) = self.predicted {
            out.push(("predicted".into(), p as f64));
        }
        if let Some(r) = self.last_ratio {
            out.push(("last_ratio".into(), r as f64));
        }
        for (name, v) in self.counters.named() {
            out.push((format!("counters.{name}"), v as f64));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            for (side, f) in [("lambda", &layer.lambda), ("gamma", &layer.gamma)] {
                for (name, v) in [
                    ("damping", f.damping),
                    ("inverse_norm", f.inverse_norm),
                    ("norm", f.norm),
                    ("trace", f.trace),
                ] {
                    out.push((format!("layer{l}.{side}.{name}"), v as f64));
                }
            }
        }
        out
    }
}
