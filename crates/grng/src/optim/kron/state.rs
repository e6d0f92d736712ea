//! The optimizer's state as plain data: per-layer factors and inverses, scalars, counters.
//! [`super::KronOptimizer::state`] returns a deep copy, [`super::KronOptimizer::restore`]
//! checks and installs one. [`KronState::matrices`] and [`KronState::scalars`] name every
//! part (the checkpoint stores them, less the cached squares).

use super::low_rank::LowRank;
use crate::device::Matrix;
use crate::error::Result;
use crate::ops::gemm::Product;
use crate::ops::SplitCache;

/// One damped Kronecker factor of one layer (`Λ`, `d_in x d_in`, or `Γ`, `d_out x d_out`).
///
/// The inverse is kept *as formed* (at a refresh, or recomputed on a lazy step): lazy steps
/// whose damping target `λ` differs from its damping `λ₀` use `X₀ − (λ − λ₀)·X₀²` (docs/math.md §2;
/// [`super::KronOptimizer`]'s module docs), with the square `X₀·X₀` cached here once formed
/// ([`KronFactorState::square`]), and the last such inverse with its `λ` (so that lazy steps
/// at an unchanged target, as between the adaptations of
/// [`super::KronConfig::damping_interval`], pass over no `n x n` matrix).
#[derive(Debug)]
pub struct KronFactorState {
    /// The undamped factor `F` (EMA of `(1/m) AᵀA` or `(1/m') ÊᵀÊ`), `n x n`, symmetric.
    /// (Inside the optimizer, RING's factor replaced on the CPU's low-rank route is formed
    /// from its rows on first need, as the inverse is; every copy
    /// [`super::KronOptimizer::state`] returns holds it.)
    pub factor: Matrix,
    /// `X₀ ≈ (F + damping·I)⁻¹` as formed, `n x n`. (Inside the optimizer, a factor on the
    /// CPU's low-rank route forms it from its rows on first need; every copy
    /// [`super::KronOptimizer::state`] returns holds it.)
    pub inverse: Matrix,
    /// `λ₀`, the damping `X₀` was formed at: that step's target, or more after a Newton retry
    /// ([`super::NEWTON_RETRY_DAMPING`]).
    pub damping: f32,
    /// Bound on `‖X₀‖₂`: `1/damping` (`F` is PSD, so the damped factor's eigenvalues are at
    /// least the damping). A lazy step uses the first-order inverse while
    /// `|λ − λ₀|·inverse_norm ≤ 1/2`, and recomputes it beyond.
    pub inverse_norm: f32,
    /// `‖F‖₂` at the last refresh (RING's damping; `0` for RENG and NGD, which never read it).
    pub norm: f32,
    /// `tr F` at the last refresh (NGD's π; `0` for RING and RENG, which never read it).
    pub trace: f32,
    /// RING: the power iteration's last iterate for `‖F‖₂` (`n x 1`, a unit vector), the
    /// next refresh's warm start (its factor, blended by the EMA, has nearly the same top
    /// eigenvector, so the iteration stops in a few steps instead of tens). `None` for the
    /// other variants, before a refresh of a formed factor, and where the norm came from the
    /// rows' `m x m` Gram matrix. Copied by [`super::KronOptimizer::state`], stored by the
    /// checkpoint (`top`), checked unit by [`super::KronOptimizer::restore`].
    pub(crate) top: Option<Matrix>,
    /// `S₀ = X₀·X₀`, formed at the first lazy step whose target differs from `λ₀`; dropped
    /// with `X₀`. A cache: a pure function of `inverse` (see [`KronFactorState::square`]).
    pub(crate) square: Option<Matrix>,
    /// The last first-order inverse `X₀ − (λ − λ₀)·S₀` (with the split planes its pass wrote
    /// on a kernel device) and its `λ`; dropped with `X₀`. A cache like `square`: not copied
    /// by [`super::KronOptimizer::state`] nor stored by the checkpoint, and formed again from
    /// `X₀` and `S₀` with the same bits.
    pub(crate) retargeted: Option<(Product, f32)>,
    /// The rows a replaced factor was formed from, with the `m x m` kernel of its inverse
    /// (the CPU's low-rank route, `low_rank.rs`). A cache the lazy steps read, not part of
    /// the state: [`super::KronOptimizer::state`] does not copy it and the checkpoint does
    /// not store it, so a restored or loaded optimizer takes the dense route until its next
    /// refresh.
    pub(crate) low_rank: Option<Box<LowRank>>,
    /// The split planes of `factor` and `inverse` (the kernel devices' operands of their
    /// f32-accurate products, [`crate::Device`]'s `kept_operand`), made at the first product
    /// that reads each and kept for the steps after it; empty on the CPU. A cache: dropped
    /// where its matrix is replaced, not copied, not stored.
    pub(crate) splits: Splits,
    /// The factor's host copy where it was refreshed on the host
    /// ([`super::KronConfig::host_refresh_max`]): a lazy step that recomputes the inverse
    /// inverts it without reading the factor back. A cache like `splits`: dropped with the
    /// factor, not copied, not stored (a restored factor is read back when it is inverted).
    pub(crate) host_factor: Option<Matrix>,
}

/// [`KronFactorState::splits`].
#[derive(Debug, Default)]
pub(crate) struct Splits {
    /// `factor`'s.
    pub factor: SplitCache,
    /// `inverse`'s (`X₀` as formed).
    pub inverse: SplitCache,
}

impl KronFactorState {
    /// `X₀`, dense: [`KronFactorState::inverse`], or on the low-rank route the one its rows
    /// form on first need (`inverse` is then a placeholder, [`super::low_rank::deferred`]).
    pub(crate) fn dense_inverse(&self) -> Result<&Matrix> {
        match &self.low_rank {
            Some(lr) => lr.dense_inverse(),
            None => Ok(&self.inverse),
        }
    }

    /// The dense factor `F` (`n x n`): [`KronFactorState::factor`], or for one left to its
    /// rows (`factor` is then the empty placeholder [`super::low_rank::deferred`]) the one the
    /// low-rank kernel's rows form on first need, with the bits the refresh's SYRK would have.
    pub(crate) fn dense_factor(&self) -> Result<&Matrix> {
        match &self.low_rank {
            Some(lr) if self.factor.rows() == 0 => lr.dense_factor(),
            _ => Ok(&self.factor),
        }
    }

    /// `n`, the factor's dimension (also while it is left to its rows).
    pub(crate) fn dim(&self) -> usize {
        match &self.low_rank {
            Some(lr) => lr.dim(),
            None => self.factor.rows(),
        }
    }

    /// The warm start a Newton inversion may read: `X₀`, except on the low-rank route, which
    /// only the Cholesky method takes (so no Newton reads it, and it is not formed for one).
    pub(crate) fn warm_start(&self) -> Option<&Matrix> {
        match &self.low_rank {
            Some(_) => None,
            None => Some(&self.inverse),
        }
    }

    /// The cached `S₀ = X₀·X₀` (`n x n`), `None` until a lazy step needed it since `X₀` was
    /// formed. [`super::KronOptimizer::state`] copies it;
    /// [`super::KronOptimizer::restore`] recomputes it from the restored `inverse` when
    /// present (so it always matches `inverse`), and the checkpoint does not store it (a
    /// loaded optimizer forms it again at its first lazy step that needs it) — the same
    /// device product of the same `X₀`, so the same bits either way.
    pub fn square(&self) -> Option<&Matrix> {
        self.square.as_ref()
    }

    /// RING's warm start for the next refresh's power iteration (`n x 1`, unit; see the
    /// field's docs), `None` where none is kept.
    pub fn top(&self) -> Option<&Matrix> {
        self.top.as_ref()
    }

    fn try_clone(&self) -> Result<Self> {
        Ok(Self {
            factor: self.dense_factor()?.try_clone()?,
            inverse: self.dense_inverse()?.try_clone()?,
            damping: self.damping,
            inverse_norm: self.inverse_norm,
            norm: self.norm,
            trace: self.trace,
            top: self.top.as_ref().map(Matrix::try_clone).transpose()?,
            square: self.square.as_ref().map(Matrix::try_clone).transpose()?,
            retargeted: None,
            low_rank: None,
            splits: Splits::default(),
            host_factor: None,
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
    /// Inverses a lazy step took by the first-order update `X₀ − (λ − λ₀)·X₀²` (one per
    /// factor and lazy step whose damping target `λ` differs from the damping `λ₀` its
    /// inverse `X₀` was formed at, with `|λ − λ₀|·‖X₀‖₂ ≤ 1/2`). Each is an axpy, or none
    /// when the factor's last one was at the same `λ` (cached); the square `X₀²` is formed
    /// once per formation.
    pub first_order_updates: u64,
    /// Inverses recomputed on a lazy step because `|λ − λ₀|·‖X₀‖₂ > 1/2` (each becomes a new
    /// formation).
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
    /// Cholesky inversions of a formed damped factor, both as the configured method and as a
    /// fallback.
    pub cholesky_inversions: u64,
    /// Inverses formed at a refresh by the low-rank (Woodbury) path instead of a Cholesky
    /// inversion: the method resolves to Cholesky on [`crate::Device::Cpu`], the factor was
    /// replaced (ε = 0 or the first refresh) from `m ≤ n/2` statistics rows, `n > 64`
    /// ([`crate::cpu::low_rank_damped_inverse`], [`super::InverseMethod::Auto`]). Not in
    /// [`KronCounters::cholesky_inversions`].
    pub low_rank_inversions: u64,
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
    /// Adds `o`'s counts to these (the counts of tasks run apart).
    pub(crate) fn add(&mut self, o: &KronCounters) {
        // Through the values: `from_values` names every field, so a new counter cannot be
        // left out.
        let (a, b) = (self.values(), o.values());
        *self = Self::from_values(std::array::from_fn(|k| a[k] + b[k]));
    }

    /// The counts in declaration order ([`KronCounters::named`]'s values), and back
    /// ([`KronCounters::from_values`]): what a spread refresh sends.
    pub(crate) fn values(&self) -> [u64; 14] {
        self.named().map(|(_, v)| v)
    }

    /// The counters of [`KronCounters::values`].
    pub(crate) fn from_values(v: [u64; 14]) -> Self {
        let [refreshes, first_order_updates, lazy_recomputes, newton_inversions, newton_iterations, newton_divergences, newton_retries, cholesky_fallbacks, cholesky_inversions, low_rank_inversions, power_unconverged, lm_updates, lm_skipped, nonfinite_losses] =
            v;
        Self {
            refreshes,
            first_order_updates,
            lazy_recomputes,
            newton_inversions,
            newton_iterations,
            newton_divergences,
            newton_retries,
            cholesky_fallbacks,
            cholesky_inversions,
            low_rank_inversions,
            power_unconverged,
            lm_updates,
            lm_skipped,
            nonfinite_losses,
        }
    }

    /// All fallbacks taken: Newton retries with more damping plus Cholesky fallbacks.
    pub fn fallbacks(&self) -> u64 {
        self.newton_retries + self.cholesky_fallbacks
    }

    /// The counters as `(name, value)` pairs, in declaration order.
    pub fn named(&self) -> [(&'static str, u64); 14] {
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
            ("low_rank_inversions", self.low_rank_inversions),
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
    /// The quadratic model's predicted change `q(δ) − q(0)` summed over layers (≤ 0), on a
    /// step that formed the model ([`super::KronOptimizer::adapts_damping`]); `None` on the
    /// others.
    pub predicted_change: Option<f32>,
    /// `ρ` used by this step.
    pub rho: f32,
    /// Effective step size `α/L` (or `α`).
    pub lr: f32,
    /// Inverses taken by the first-order update `X₀ − (λ − λ₀)·X₀²` on this step.
    pub first_order_updates: u32,
    /// Inverses recomputed on this lazy step (`|λ − λ₀|·‖X₀‖₂ > 1/2`).
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

    /// Every device matrix with a stable name: `layer{l}.{lambda|gamma}.{factor|inverse}`,
    /// `layer{l}.{lambda|gamma}.square` for each cached [`KronFactorState::square`], and
    /// `layer{l}.{lambda|gamma}.top` for each kept warm start of RING's power iteration.
    pub fn matrices(&self) -> Vec<(String, &Matrix)> {
        let mut out = Vec::with_capacity(6 * self.layers.len());
        for (l, layer) in self.layers.iter().enumerate() {
            for (side, f) in [("lambda", &layer.lambda), ("gamma", &layer.gamma)] {
                out.push((format!("layer{l}.{side}.factor"), &f.factor));
                out.push((format!("layer{l}.{side}.inverse"), &f.inverse));
                if let Some(sq) = &f.square {
                    out.push((format!("layer{l}.{side}.square"), sq));
                }
                if let Some(top) = &f.top {
                    out.push((format!("layer{l}.{side}.top"), top));
                }
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

#[cfg(test)]
mod tests {
    use super::KronCounters;

    /// `named` and `from_values` must list the fields in one order (a spread refresh's
    /// counters travel so, and `add` goes through them).
    #[test]
    fn counter_values_round_trip() {
        let v: [u64; 14] = std::array::from_fn(|k| k as u64 + 1);
        let c = KronCounters::from_values(v);
        assert_eq!(c.values(), v);
        assert_eq!((c.refreshes, c.nonfinite_losses), (1, 14));
        let mut d = c;
        d.add(&c);
        assert_eq!(d.values(), v.map(|x| 2 * x));
    }
}
