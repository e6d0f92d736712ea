//! Sophia-G (Liu et al. 2023, "Sophia: A Scalable Stochastic Second-order Optimizer"):
//! a diagonal Gauss–Newton–Bartlett curvature estimate refreshed every `k` steps, momentum,
//! and per-coordinate clipping (docs/math.md §4 baseline).
//!
//! Step `t` (0-based counter `t` = [`Sophia::steps`]) with gradient `g`:
//! 1. if a Hessian sample is given (required when `t mod k == 0`):
//!    `h ← β₂h + (1−β₂)·B·ĝ⊙ĝ`, `ĝ` the mean gradient of a batch of `B` samples whose labels
//!    were drawn from the model's predictive distribution (the GNB estimator);
//! 2. `m ← β₁m + (1−β₁)g`;  `θ ← θ − lr·λ·θ − lr·clip(m / max(γ·h, ε), −1, 1)`.
//!
//! The first step always refreshes `h`, so the ratio never starts from `h = 0` (where it would
//! be plain sign momentum).

use super::multi::{one_tensor, HostArray, Tensors, Validate};
use crate::device::{Device, Matrix};
use crate::error::{check_value, Result};
use crate::ops::elementwise::{SophiaCoeffs, SophiaRefresh};
use crate::params::elementwise::check_beta;

/// Hyperparameters of [`Sophia`]. `β₁, β₂` follow docs/math.md §6; the rest Liu et al.'s released
/// SophiaG defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SophiaConfig {
    /// Learning rate (the largest per-coordinate step), finite and `≥ 0`. Default `2e-4`.
    pub lr: f32,
    /// Momentum decay `β₁ ∈ [0, 1)`. Default `0.965`.
    pub beta1: f32,
    /// Hessian-EMA decay `β₂ ∈ [0, 1)`. Default `0.98` (docs/math.md §6; Liu et al. use 0.99).
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

impl Validate for SophiaConfig {
    fn validate(&self) -> Result<()> {
        SophiaConfig::validate(self)
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
    /// `m` (array 0), `h` (array 1) and the step counter.
    inner: Tensors<SophiaConfig>,
}

super::multi::tensor_accessors!(Sophia, SophiaConfig);

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
        Ok(Self {
            inner: Tensors::new("Sophia::new", device, shapes, config, 2)?,
        })
    }

    /// True when the coming step must be given a Hessian sample (`steps mod k == 0`).
    pub fn needs_hessian(&self) -> bool {
        let every = self.inner.config().hessian_every;
        self.inner.steps().is_multiple_of(every)
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
        let missing = if hess.is_none() && self.needs_hessian() {
            check_value(
                OP,
                "hess",
                0.0,
                false,
                "a Hessian sample on this step (needs_hessian() is true)",
            )
        } else {
            Ok(())
        };
        // Single-process: fail now. Data-parallel: fail inside the agreement, on every rank.
        let missing = match (&self.inner.dp, missing) {
            (None, m) => {
                m?;
                Ok(())
            }
            (Some(_), m) => m,
        };
        // Data-parallel: the gradients averaged by rows, the Hessian sample by its batch
        // (the concatenated batch's `ĝ`, over `Σ_p B_p` samples).
        let also = hess.map(|h| ("hess.sampled_grads", h.sampled_grads, h.batch));
        let reduced = self.inner.reduced(OP, missing, params, grads, also)?;
        let reduces_grads = self.inner.dp.as_ref().is_some_and(|d| !d.grads_reduced());
        let mut lists = reduced.iter().flatten();
        let means: Option<Vec<&Matrix>> = reduces_grads
            .then(|| lists.next().map(|(g, _)| g.iter().collect()))
            .flatten();
        let sampled: Option<(Vec<&Matrix>, usize)> =
            lists.next().map(|(h, b)| (h.iter().collect(), *b));
        let grads = means.as_deref().unwrap_or(grads);
        let hess = match &sampled {
            Some((s, batch)) => Some(SophiaHessians {
                sampled_grads: s,
                batch: *batch,
            }),
            None => hess,
        };
        self.inner.step(|device, state, config, _| {
            let refresh = hess.map(|h| SophiaRefresh {
                sampled_grads: h.sampled_grads,
                beta2: config.beta2,
                batch: h.batch,
            });
            device.sophia_update_many(params, grads, state, refresh, &config.coeffs())
        })
    }

    /// Replaces the configuration; `m`, `h` and the step counter are kept (a new
    /// `hessian_every` applies from the next step's `steps mod k`).
    ///
    /// # Errors
    /// [`Error::Value`](crate::Error::Value) for a bad config; the old one stays in use.
    pub fn set_config(&mut self, config: SophiaConfig) -> Result<()> {
        self.inner.set_config(config)
    }

    /// The momentum `m` on the device, as the flat state array of
    /// [`MultiState`](crate::ops::elementwise::MultiState) (tensor `t` at
    /// `layout().segment(t)`; [`Sophia::state`] gives the plain concatenation).
    pub fn momentum(&self) -> &Matrix {
        self.inner.array(0)
    }

    /// The diagonal Hessian estimate `h`, laid out as [`Sophia::momentum`].
    pub fn hessian(&self) -> &Matrix {
        self.inner.array(1)
    }

    /// A host copy of the state.
    ///
    /// # Errors
    /// Device errors.
    pub fn state(&self) -> Result<SophiaState> {
        Ok(SophiaState {
            steps: self.inner.steps(),
            m: self.inner.to_host(0)?,
            h: self.inner.to_host(1)?,
        })
    }

    /// Restores a state taken by [`Sophia::state`] from an optimizer with the same `n`.
    ///
    /// # Errors
    /// [`Error::Shape`](crate::Error::Shape) for a different `n`,
    /// [`Error::NonFinite`](crate::Error::NonFinite), [`Error::Value`](crate::Error::Value)
    /// for a negative `h`, device errors; on error the optimizer is unchanged.
    pub fn restore(&mut self, state: &SophiaState) -> Result<()> {
        let arrays = [
            HostArray::finite("m", &state.m),
            HostArray::nonnegative("h", &state.h),
        ];
        self.inner.restore("Sophia::restore", &arrays, state.steps)
    }
}
