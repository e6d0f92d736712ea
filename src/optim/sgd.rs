//! SGD with heavy-ball momentum and decoupled weight decay (SPEC §4 baseline).

use crate::device::{Device, Matrix};
use crate::error::{check_finite, check_len, check_shape, Error, Result};
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

/// Everything [`Sgd`] carries between steps, on the host (for checkpoints).
#[derive(Clone, Debug, PartialEq)]
pub struct SgdState {
    /// Completed steps.
    pub steps: u64,
    /// Momentum buffer `b`, length `n`.
    pub momentum: Vec<f32>,
}

/// SGD over a flat parameter vector of `n` entries (`n x 1` [`Matrix`]):
/// `b ← μ b + g`, `θ ← θ − lr·λ·θ − lr·b` (one fused device op, [`Device::sgd_update`]).
#[derive(Debug)]
pub struct Sgd {
    device: Device,
    config: SgdConfig,
    momentum: Matrix,
    steps: u64,
}

impl Sgd {
    /// A new optimizer for `n ≥ 1` parameters with a zero momentum buffer.
    ///
    /// # Errors
    /// [`Error::Value`] for a bad config, [`Error::Shape`] for `n = 0`, device errors.
    pub fn new(device: &Device, n: usize, config: SgdConfig) -> Result<Self> {
        config.validate()?;
        check_n("Sgd::new", n)?;
        Ok(Self {
            device: device.clone(),
            config,
            momentum: device.zeros(n, 1)?,
            steps: 0,
        })
    }

    /// One step: `params` and `grad` are `n x 1` on this optimizer's device.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`], [`Error::Shape`], [`Error::NonFinite`] (NaN/Inf in `params`
    /// or `grad`). On error neither `params` nor the optimizer changes.
    pub fn step(&mut self, params: &mut Matrix, grad: &Matrix) -> Result<()> {
        const OP: &str = "Sgd::step";
        let n = self.n();
        check_shape(OP, "params", params.shape(), (n, 1))?;
        check_shape(OP, "grad", grad.shape(), (n, 1))?;
        self.device
            .sgd_update(params, grad, &mut self.momentum, &self.config.coeffs())?;
        self.steps = self.steps.saturating_add(1);
        Ok(())
    }

    /// Number of parameters `n`.
    pub fn n(&self) -> usize {
        self.momentum.rows()
    }

    /// Completed steps.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The configuration in use.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// Replaces the configuration (e.g. a learning-rate schedule kept by the caller).
    ///
    /// # Errors
    /// [`Error::Value`] for a bad config; the old one stays in use.
    pub fn set_config(&mut self, config: SgdConfig) -> Result<()> {
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// The momentum buffer `b` (`n x 1`, on the device).
    pub fn momentum(&self) -> &Matrix {
        &self.momentum
    }

    /// A host copy of the state.
    ///
    /// # Errors
    /// Device errors.
    pub fn state(&self) -> Result<SgdState> {
        Ok(SgdState {
            steps: self.steps,
            momentum: self.momentum.to_vec()?,
        })
    }

    /// Restores a state taken by [`Sgd::state`] from an optimizer with the same `n`.
    ///
    /// # Errors
    /// [`Error::Shape`] for a different `n`, [`Error::NonFinite`], device errors; on error
    /// the optimizer is unchanged.
    pub fn restore(&mut self, state: &SgdState) -> Result<()> {
        const OP: &str = "Sgd::restore";
        check_len(OP, "momentum", state.momentum.len(), self.n())?;
        check_finite(OP, "momentum", &state.momentum)?;
        self.momentum = self.device.upload(self.n(), 1, &state.momentum)?;
        self.steps = state.steps;
        Ok(())
    }
}

/// `Err(Error::Shape)` unless the parameter count is at least 1.
pub(crate) fn check_n(op: &'static str, n: usize) -> Result<()> {
    if n == 0 {
        return Err(Error::Shape {
            op,
            arg: "n",
            expected: "at least 1 parameter".into(),
            got: "0".into(),
        });
    }
    Ok(())
}
