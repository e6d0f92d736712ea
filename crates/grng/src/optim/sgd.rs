//! SGD with heavy-ball momentum and decoupled weight decay (docs/math.md §4 baseline).

use super::multi::{one_tensor, HostArray, Tensors, Validate};
use crate::device::{Device, Matrix};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::ops::elementwise::SgdCoeffs;

/// Hyperparameters of [`Sgd`]. The paper gives none for SGD; the defaults are the usual
/// classification baseline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate, finite and `≥ 0`. Default `0.1`.
    pub lr: f32,
    /// Heavy-ball momentum `μ`, `0 ≤ μ < 1` (`0` is plain SGD). Default `0.9`.
    pub momentum: f32,
    /// Decoupled weight decay `λ ≥ 0`: `θ ← θ − lr·λ·θ` each step. Default `0`.
    pub weight_decay: f32,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        }
    }
}

impl SgdConfig {
    /// `Err(Error::Value)` naming the first field outside its documented range.
    pub fn validate(&self) -> Result<()> {
        self.coeffs().validate("SgdConfig::validate")
    }

    fn coeffs(&self) -> SgdCoeffs {
        SgdCoeffs {
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
        }
    }
}

impl Validate for SgdConfig {
    fn validate(&self) -> Result<()> {
        SgdConfig::validate(self)
    }
}

/// Everything [`Sgd`] carries between steps, on the host (for checkpoints).
#[derive(Clone, Debug, PartialEq)]
pub struct SgdState {
    /// Completed steps.
    pub steps: u64,
    /// Momentum buffer `b`, length `n` (all tensors concatenated in order).
    pub momentum: Vec<f32>,
}

/// SGD over a model's parameter tensors: `b ← μ b + g`, `θ ← θ − lr·λ·θ − lr·b` for every
/// tensor in one fused device op ([`Device::sgd_update_many`]: one kernel launch for all of
/// them on a GPU). [`Sgd::new`] makes it for one flat `n x 1` vector, [`Sgd::for_tensors`]
/// for a list of shapes stepped together by [`Sgd::step_many`].
#[derive(Debug)]
pub struct Sgd {
    /// The momentum buffer (array 0) and the step counter.
    inner: Tensors<SgdConfig>,
}

super::multi::tensor_accessors!(Sgd, SgdConfig);

impl Sgd {
    /// A new optimizer for one `n x 1` parameter vector, `n ≥ 1`, with a zero momentum buffer.
    ///
    /// # Errors
    /// [`Error::Value`] for a bad config, [`Error::Shape`] for `n = 0`, device errors.
    pub fn new(device: &Device, n: usize, config: SgdConfig) -> Result<Self> {
        Self::for_tensors(device, &[(n, 1)], config)
    }

    /// A new optimizer for parameter tensors of `shapes` (in the order [`Sgd::step_many`]
    /// takes them; empty tensors allowed, at least one parameter in all).
    ///
    /// # Errors
    /// [`Error::Value`] for a bad config, [`Error::Shape`] for no parameter, device errors.
    pub fn for_tensors(
        device: &Device,
        shapes: &[(usize, usize)],
        config: SgdConfig,
    ) -> Result<Self> {
        Ok(Self {
            inner: Tensors::new("Sgd::new", device, shapes, config, 1)?,
        })
    }

    /// One step of an optimizer made by [`Sgd::new`]: `params` and `grad` are `n x 1` on this
    /// optimizer's device.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`], [`Error::NonFinite`] (NaN/Inf in `params`
    /// or `grad`, or an overflowing result). On error neither `params` nor the optimizer
    /// changes.
    pub fn step(&mut self, params: &mut Matrix, grad: &Matrix) -> Result<()> {
        self.step_many(&mut [params], &[grad]).map_err(one_tensor)
    }

    /// One step of every tensor: `params[t]` and `grads[t]` have the `t`-th shape given at
    /// construction. One device op, so one kernel launch and one status read-back.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`] (count or shapes),
    /// [`Error::NonFiniteTensor`] naming the tensor and index of the first NaN/Inf (or
    /// overflowing result). On error neither `params` nor the optimizer changes.
    pub fn step_many(&mut self, params: &mut [&mut Matrix], grads: &[&Matrix]) -> Result<()> {
        self.inner.step_with_grads(
            "Sgd::step",
            params,
            grads,
            |device, state, config, _, params, grads| {
                device.sgd_update_many(params, grads, state, &config.coeffs())
            },
        )
    }

    /// `‖g‖₂` of the last step's gradients (all tensors), where the update measured it
    /// ([`MultiState::last_grad_sq`](crate::ops::elementwise::MultiState::last_grad_sq): on
    /// the CPU, in the read-only pass the update makes anyway before writing in place); `None`
    /// on the kernel devices and before the first step.
    pub fn last_grad_norm(&self) -> Option<f32> {
        self.inner.last_grad_norm()
    }

    /// Replaces the configuration (e.g. a learning-rate schedule kept by the caller).
    ///
    /// # Errors
    /// [`Error::Value`] for a bad config; the old one stays in use.
    pub fn set_config(&mut self, config: SgdConfig) -> Result<()> {
        self.inner.set_config(config)
    }

    /// The momentum buffer `b` on the device: the flat state array of
    /// [`MultiState`](crate::ops::elementwise::MultiState) (tensor `t` at
    /// `layout().segment(t)`; [`Sgd::state`] gives the plain concatenation).
    pub fn momentum(&self) -> &Matrix {
        self.inner.array(0)
    }

    /// A host copy of the state (the momentum of all tensors concatenated in order).
    ///
    /// # Errors
    /// Device errors.
    pub fn state(&self) -> Result<SgdState> {
        Ok(SgdState {
            steps: self.inner.steps(),
            momentum: self.inner.to_host(0)?,
        })
    }

    /// Restores a state taken by [`Sgd::state`] from an optimizer with the same `n`.
    ///
    /// # Errors
    /// [`Error::Shape`] for a different `n`, [`Error::NonFinite`], device errors; on error
    /// the optimizer is unchanged.
    pub fn restore(&mut self, state: &SgdState) -> Result<()> {
        let momentum = [HostArray::finite("momentum", &state.momentum)];
        self.inner.restore("Sgd::restore", &momentum, state.steps)
    }
}
