//! Sophia-G (Liu et al. 2023, "Sophia: A Scalable Stochastic Second-order Optimizer"):
//! a diagonal Gauss–Newton–Bartlett curvature estimate refreshed every `k` steps, momentum,
//! and per-coordinate clipping (SPEC §4 baseline).
//!
//! Step `t` (0-based counter `t` = [`Sophia::steps`]) with gradient `g`:
//! 1. if a Hessian sample is given (required when `t mod k == 0`):
//!    `h ← β₂h + (1−β₂)·B·ĝ⊙ĝ`, `ĝ` the mean gradient of a batch of `B` samples whose labels
//!    were drawn from the model's predictive distribution (the GNB estimator);
//! 2. `m ← β₁m + (1−β₁)g`;  `θ ← θ − lr·λ·θ − lr·clip(m / max(γ·h, ε), −1, 1)`.
//!
//! The first step always refreshes `h`, so the ratio never starts from `h = 0` (where it would
//! be plain sign momentum).

use super::sgd::check_n;
use crate::cpu::elementwise::check_nonnegative;
use crate::device::{Device, Matrix};
use crate::error::{check_finite, check_len, check_shape, check_value, Result};
use crate::ops::elementwise::SophiaCoeffs;
use crate::params::elementwise::check_beta;

/// Hyperparameters of [`Sophia`]. `β₁, β₂` follow SPEC §6; the rest Liu et al.'s released
/// SophiaG defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SophiaConfig {
    /// Learning rate (the largest per-coordinate step), finite and `≥ 0`. Default `2e-4`.
    pub lr: f32,
    /// Momentum decay `β₁ ∈ [0, 1)`. Default `0.965`.
    pub beta1: f32,
    /// Hessian-EMA decay `β₂ ∈ [0, 1)`. Default `0.98` (SPEC §6; Liu et al. use 0.99).
    pub beta2: f32,
    /// Hessian scale `γ > 0` in `max(γ·h, ε)`. Default `0.01`.
    pub gamma: f32,
    /// Denominator floor `ε > 0`. Default `1e-12`.
    pub eps: f32,
    /// Decoupled weight decay `λ ≥ 0`. Default `0.1`.
    pub weight_decay: f32,
    /// Hessian refresh period `k ≥ 1`. Default `10`.
    pub hessian_every: u64,
}

impl Default for SophiaConfig {
    fn default() -> Self {
        Self {
            lr: 2e-4,
            beta1: 0.965,
            beta2: 0.98,
            gamma: 0.01,
            eps: 1e-12,
            weight_decay: 0.1,
            hessian_every: 10,
        }
    }
}

impl SophiaConfig {
    /// `Err(Error::Value)` naming the first field outside its documented range.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "SophiaConfig::validate";
        self.coeffs().validate(OP)?;
        check_beta(OP, "beta2", self.beta2)?;
        check_value(
            OP,
            "hessian_every",
            self.hessian_every as f64,
            self.hessian_every >= 1,
            "hessian_every >= 1",
        )
    }

    fn coeffs(&self) -> SophiaCoeffs {
        SophiaCoeffs {
            lr: self.lr,
            beta1: self.beta1,
            gamma: self.gamma,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
    }
}

/// A Gauss–Newton–Bartlett sample for [`Sophia::step`].
#[derive(Clone, Copy, Debug)]
pub struct SophiaHessian<'a> {
    /// `ĝ`, `n x 1`: the mean gradient of the mini-batch loss with labels sampled from the
    /// model's predictive distribution at the current parameters.
    pub sampled_grad: &'a Matrix,
    /// `B ≥ 1`, the number of samples `ĝ` averages over.
    pub batch: usize,
}

/// Everything [`Sophia`] carries between steps, on the host (for checkpoints).
#[derive(Clone, Debug, PartialEq)]
pub struct SophiaState {
    /// Completed steps.
    pub steps: u64,
    /// Momentum `m`, length `n`.
    pub m: Vec<f32>,
    /// Diagonal Hessian estimate `h`, length `n`, entries `≥ 0`.
    pub h: Vec<f32>,
}

/// Sophia-G over a flat parameter vector of `n` entries (`n x 1` [`Matrix`]); see the module
/// docs for the update.
#[derive(Debug)]
pub struct Sophia {
    device: Device,
    config: SophiaConfig,
    m: Matrix,
    h: Matrix,
    /// Receives the refreshed `h` and is swapped in only when the whole step succeeded.
    h_next: Matrix,
    steps: u64,
}

impl Sophia {
    /// A new optimizer for `n ≥ 1` parameters with `m = h = 0`.
    ///
    /// # Errors
    /// [`Error::Value`](crate::Error::Value) for a bad config,
    /// [`Error::Shape`](crate::Error::Shape) for `n = 0`, device errors.
    pub fn new(device: &Device, n: usize, config: SophiaConfig) -> Result<Self> {
        config.validate()?;
        check_n("Sophia::new", n)?;
        Ok(Self {
            device: device.clone(),
            config,
            m: device.zeros(n, 1)?,
            h: device.zeros(n, 1)?,
            h_next: device.zeros(n, 1)?,
            steps: 0,
        })
    }

    /// True when the coming step must be given a [`SophiaHessian`] (`steps mod k == 0`).
    pub fn needs_hessian(&self) -> bool {
        self.steps % self.config.hessian_every == 0
    }

    /// One step with the mini-batch gradient `grad` (`n x 1`). `hess` is required when
    /// [`Sophia::needs_hessian`] and, when given on another step, used as well.
    ///
    /// # Errors
    /// [`Error::Value`](crate::Error::Value) when a required `hess` is missing or its batch is
    /// 0; [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
    /// [`Error::Shape`](crate::Error::Shape), [`Error::NonFinite`](crate::Error::NonFinite).
    /// On error neither `params` nor the optimizer changes.
    pub fn step(
        &mut self,
        params: &mut Matrix,
        grad: &Matrix,
        hess: Option<SophiaHessian<'_>>,
    ) -> Result<()> {
        const OP: &str = "Sophia::step";
        let n = self.n();
        check_shape(OP, "params", params.shape(), (n, 1))?;
        check_shape(OP, "grad", grad.shape(), (n, 1))?;
        if hess.is_none() && self.needs_hessian() {
            return check_value(
                OP,
                "hess",
                0.0,
                false,
                "a Hessian sample on this step (needs_hessian() is true)",
            );
        }
        let coeffs = self.config.coeffs();
        match hess {
            Some(hs) => {
                check_shape(OP, "hess.sampled_grad", hs.sampled_grad.shape(), (n, 1))?;
                // Refresh into the spare buffer: if the update below rejects `params` or
                // `grad`, `h` has not moved.
                self.device.copy(&self.h, &mut self.h_next)?;
                self.device.sophia_hessian_ema(
                    &mut self.h_next,
                    hs.sampled_grad,
                    self.config.beta2,
                    hs.batch,
                )?;
                self.device
                    .sophia_update(params, grad, &mut self.m, &self.h_next, &coeffs)?;
                std::mem::swap(&mut self.h, &mut self.h_next);
            }
            None => self
                .device
                .sophia_update(params, grad, &mut self.m, &self.h, &coeffs)?,
        }
        self.steps = self.steps.saturating_add(1);
        Ok(())
    }

    /// Number of parameters `n`.
    pub fn n(&self) -> usize {
        self.m.rows()
    }

    /// Completed steps.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The configuration in use.
    pub fn config(&self) -> &SophiaConfig {
        &self.config
    }

    /// Replaces the configuration; `m`, `h` and the step counter are kept (a new
    /// `hessian_every` applies from the next step's `steps mod k`).
    ///
    /// # Errors
    /// [`Error::Value`](crate::Error::Value) for a bad config; the old one stays in use.
    pub fn set_config(&mut self, config: SophiaConfig) -> Result<()> {
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// The momentum `m` (`n x 1`, on the device).
    pub fn momentum(&self) -> &Matrix {
        &self.m
    }

    /// The diagonal Hessian estimate `h` (`n x 1`, on the device).
    pub fn hessian(&self) -> &Matrix {
        &self.h
    }

    /// A host copy of the state.
    ///
    /// # Errors
    /// Device errors.
    pub fn state(&self) -> Result<SophiaState> {
        Ok(SophiaState {
            steps: self.steps,
            m: self.m.to_vec()?,
            h: self.h.to_vec()?,
        })
    }

    /// Restores a state taken by [`Sophia::state`] from an optimizer with the same `n`.
    ///
    /// # Errors
    /// [`Error::Shape`](crate::Error::Shape) for a different `n`,
    /// [`Error::NonFinite`](crate::Error::NonFinite), [`Error::Value`](crate::Error::Value)
    /// for a negative `h`, device errors; on error the optimizer is unchanged.
    pub fn restore(&mut self, state: &SophiaState) -> Result<()> {
        const OP: &str = "Sophia::restore";
        let n = self.n();
        check_len(OP, "m", state.m.len(), n)?;
        check_len(OP, "h", state.h.len(), n)?;
        check_finite(OP, "m", &state.m)?;
        check_finite(OP, "h", &state.h)?;
        check_nonnegative(OP, "h", &state.h)?;
        let m = self.device.upload(n, 1, &state.m)?;
        let h = self.device.upload(n, 1, &state.h)?;
        self.m = m;
        self.h = h;
        self.steps = state.steps;
        Ok(())
    }
}
