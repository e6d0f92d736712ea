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

use super::sgd::{check_n, one_tensor, total_len};
use crate::cpu::elementwise::check_nonnegative;
use crate::device::{Device, Matrix};
use crate::error::{check_finite, check_len, check_value, Result};
use crate::ops::elementwise::{MultiState, SophiaCoeffs, SophiaRefresh};
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

/// A Gauss–Newton–Bartlett sample for [`Sophia::step_many`]: [`SophiaHessian`] per tensor.
#[derive(Clone, Copy, Debug)]
pub struct SophiaHessians<'a> {
    /// `ĝ` of each tensor, shaped like it.
    pub sampled_grads: &'a [&'a Matrix],
    /// `B ≥ 1`, the number of samples `ĝ` averages over.
    pub batch: usize,
}

/// Everything [`Sophia`] carries between steps, on the host (for checkpoints).
#[derive(Clone, Debug, PartialEq)]
pub struct SophiaState {
    /// Completed steps.
    pub steps: u64,
    /// Momentum `m`, length `n` (all tensors concatenated in order).
    pub m: Vec<f32>,
    /// Diagonal Hessian estimate `h`, length `n`, entries `≥ 0`.
    pub h: Vec<f32>,
}

/// Sophia-G over a model's parameter tensors (see the module docs for the update): one fused
/// device op per step for all of them, the Hessian EMA of a refresh step included
/// ([`Device::sophia_update_many`]: one kernel launch on a GPU). [`Sophia::new`] makes it for
/// one flat `n x 1` vector, [`Sophia::for_tensors`] for a list of shapes stepped together by
/// [`Sophia::step_many`].
#[derive(Debug)]
pub struct Sophia {
    device: Device,
    config: SophiaConfig,
    /// `m` (array 0) and `h` (array 1).
    state: MultiState,
    steps: u64,
}

impl Sophia {
    /// A new optimizer for one `n x 1` parameter vector, `n ≥ 1`, with `m = h = 0`.
    ///
    /// # Errors
    /// [`Error::Value`](crate::Error::Value) for a bad config,
    /// [`Error::Shape`](crate::Error::Shape) for `n = 0`, device errors.
    pub fn new(device: &Device, n: usize, config: SophiaConfig) -> Result<Self> {
        Self::for_tensors(device, &[(n, 1)], config)
    }

    /// A new optimizer for parameter tensors of `shapes` (in the order
    /// [`Sophia::step_many`] takes them; empty tensors allowed, at least one parameter in
    /// all), `m = h = 0`.
    ///
    /// # Errors
    /// As [`Sophia::new`].
    pub fn for_tensors(
        device: &Device,
        shapes: &[(usize, usize)],
        config: SophiaConfig,
    ) -> Result<Self> {
        config.validate()?;
        check_n("Sophia::new", total_len(shapes))?;
        Ok(Self {
            device: device.clone(),
            config,
            state: MultiState::new(device, shapes, 2)?,
            steps: 0,
        })
    }

    /// True when the coming step must be given a Hessian sample (`steps mod k == 0`).
    pub fn needs_hessian(&self) -> bool {
        self.steps.is_multiple_of(self.config.hessian_every)
    }

    /// One step of an optimizer made by [`Sophia::new`] with the mini-batch gradient `grad`
    /// (`n x 1`). `hess` is required when [`Sophia::needs_hessian`] and, when given on
    /// another step, used as well.
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
        let sampled = hess.map(|h| [h.sampled_grad]);
        let hess = hess.zip(sampled.as_ref()).map(|(h, s)| SophiaHessians {
            sampled_grads: s,
            batch: h.batch,
        });
        self.step_many(&mut [params], &[grad], hess)
            .map_err(one_tensor)
    }

    /// One step of every tensor: `params[t]`, `grads[t]` (and the samples) have the `t`-th
    /// shape given at construction; the Hessian EMA of a refresh step and the update are ONE
    /// device op (one kernel launch and one status read-back). `hess` as in [`Sophia::step`].
    ///
    /// # Errors
    /// As [`Sophia::step`], with [`Error::NonFiniteTensor`](crate::Error::NonFiniteTensor)
    /// naming the tensor and index of the first NaN/Inf. On error neither `params` nor the
    /// optimizer changes.
    pub fn step_many(
        &mut self,
        params: &mut [&mut Matrix],
        grads: &[&Matrix],
        hess: Option<SophiaHessians<'_>>,
    ) -> Result<()> {
        const OP: &str = "Sophia::step";
        if hess.is_none() && self.needs_hessian() {
            return check_value(
                OP,
                "hess",
                0.0,
                false,
                "a Hessian sample on this step (needs_hessian() is true)",
            );
        }
        let refresh = hess.map(|h| SophiaRefresh {
            sampled_grads: h.sampled_grads,
            beta2: self.config.beta2,
            batch: h.batch,
        });
        self.device.sophia_update_many(
            params,
            grads,
            &mut self.state,
            refresh,
            &self.config.coeffs(),
        )?;
        self.steps = self.steps.saturating_add(1);
        Ok(())
    }

    /// Number of parameters `n` (over all tensors).
    pub fn n(&self) -> usize {
        self.state.layout().total()
    }

    /// The parameter tensors' shapes.
    pub fn shapes(&self) -> &[(usize, usize)] {
        self.state.shapes()
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

    /// The momentum `m` on the device, as the flat state array of
    /// [`MultiState`] (tensor `t` at
    /// `layout().segment(t)`; [`Sophia::state`] gives the plain concatenation).
    pub fn momentum(&self) -> &Matrix {
        self.state.state(0)
    }

    /// The diagonal Hessian estimate `h`, laid out as [`Sophia::momentum`].
    pub fn hessian(&self) -> &Matrix {
        self.state.state(1)
    }

    /// A host copy of the state.
    ///
    /// # Errors
    /// Device errors.
    pub fn state(&self) -> Result<SophiaState> {
        Ok(SophiaState {
            steps: self.steps,
            m: self.state.to_host(0)?,
            h: self.state.to_host(1)?,
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
        // Both uploads before either replaces anything: unchanged on a device error.
        let mut next = MultiState::new(&self.device, self.state.shapes(), 2)?;
        next.load(&self.device, 0, &state.m)?;
        next.load(&self.device, 1, &state.h)?;
        self.state = next;
        self.steps = state.steps;
        Ok(())
    }
}
