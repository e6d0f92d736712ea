//! AdamW (Loshchilov & Hutter 2019) with linear warm-up (SPEC §4 baseline).

use super::sgd::check_n;
use crate::cpu::elementwise::check_nonnegative;
use crate::device::{Device, Matrix};
use crate::error::{check_finite, check_len, check_shape, check_value, Result};
use crate::ops::elementwise::AdamWCoeffs;

/// What the learning rate does after the warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum LrSchedule {
    /// Stays at the peak `lr`.
    #[default]
    Constant,
    /// Cosine decay from `lr` to `min_lr` over the steps `warmup_steps < t ≤ total_steps`,
    /// then `min_lr`.
    Cosine {
        /// Step at which the decay reaches `min_lr`, `> warmup_steps`.
        total_steps: u64,
        /// Final learning rate, `0 ≤ min_lr ≤ lr`.
        min_lr: f32,
    },
}

/// Hyperparameters of [`AdamW`]; defaults from SPEC §6 (paper: lr 4e-5..2e-4 with 100–500
/// warm-up steps) and the usual Adam moments.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Peak learning rate, finite and `≥ 0`. Default `1e-4`.
    pub lr: f32,
    /// First-moment decay `β₁ ∈ [0, 1)`. Default `0.9`.
    pub beta1: f32,
    /// Second-moment decay `β₂ ∈ [0, 1)`. Default `0.999`.
    pub beta2: f32,
    /// Denominator offset `ε > 0`. Default `1e-8`.
    pub eps: f32,
    /// Decoupled weight decay `λ ≥ 0` (scaled by the scheduled lr). Default `0.01`.
    pub weight_decay: f32,
    /// Linear warm-up length `W`: step `t` (1-based) uses `lr·t/W` for `t ≤ W`; `0` disables
    /// it. Default `100`.
    pub warmup_steps: u64,
    /// After the warm-up. Default [`LrSchedule::Constant`].
    pub schedule: LrSchedule,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            warmup_steps: 100,
            schedule: LrSchedule::Constant,
        }
    }
}

impl AdamWConfig {
    /// `Err(Error::Value)` naming the first field outside its documented range.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "AdamWConfig::validate";
        // The peak lr itself, not the warm-up's first fraction of it.
        AdamWCoeffs {
            lr: self.lr,
            ..self.coeffs(1)
        }
        .validate(OP)?;
        if let LrSchedule::Cosine {
            total_steps,
            min_lr,
        } = self.schedule
        {
            check_value(
                OP,
                "schedule.total_steps",
                total_steps as f64,
                total_steps > self.warmup_steps,
                "total_steps > warmup_steps",
            )?;
            check_value(
                OP,
                "schedule.min_lr",
                min_lr as f64,
                (0.0..=self.lr).contains(&min_lr),
                "0 <= min_lr <= lr",
            )?;
        }
        Ok(())
    }

    /// The learning rate of step `t` (1-based; `t = 0` is treated as 1):
    /// - `t ≤ W`: `lr · t / W` (linear warm-up);
    /// - otherwise [`LrSchedule::Constant`]: `lr`; [`LrSchedule::Cosine`] with `T` =
    ///   `total_steps`: `min_lr + (lr − min_lr)·½(1 + cos(π·min(t − W, T − W)/(T − W)))`.
    pub fn lr_at(&self, t: u64) -> f32 {
        let t = t.max(1);
        let w = self.warmup_steps;
        if t <= w {
            return (self.lr as f64 * t as f64 / w as f64) as f32;
        }
        match self.schedule {
            LrSchedule::Constant => self.lr,
            LrSchedule::Cosine {
                total_steps,
                min_lr,
            } => {
                let span = total_steps.saturating_sub(w).max(1) as f64;
                let frac = ((t - w) as f64 / span).min(1.0);
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * frac).cos());
                (min_lr as f64 + (self.lr - min_lr) as f64 * cos) as f32
            }
        }
    }

    fn coeffs(&self, t: u64) -> AdamWCoeffs {
        AdamWCoeffs {
            lr: self.lr_at(t),
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            step: t.max(1),
        }
    }
}

/// Everything [`AdamW`] carries between steps, on the host (for checkpoints).
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWState {
    /// Completed steps `t` (the next step is `t + 1`).
    pub steps: u64,
    /// First moment `m`, length `n`.
    pub m: Vec<f32>,
    /// Second moment `v`, length `n`, entries `≥ 0`.
    pub v: Vec<f32>,
}

/// AdamW over a flat parameter vector of `n` entries (`n x 1` [`Matrix`]): one fused device
/// op per step ([`Device::adamw_update`]) with the scheduled learning rate
/// [`AdamWConfig::lr_at`] and bias corrections `1 − βₖᵗ`.
#[derive(Debug)]
pub struct AdamW {
    device: Device,
    config: AdamWConfig,
    m: Matrix,
    v: Matrix,
    steps: u64,
}

impl AdamW {
    /// A new optimizer for `n ≥ 1` parameters with zero moments.
    ///
    /// # Errors
    /// [`Error::Value`](crate::Error::Value) for a bad config,
    /// [`Error::Shape`](crate::Error::Shape) for `n = 0`, device errors.
    pub fn new(device: &Device, n: usize, config: AdamWConfig) -> Result<Self> {
        config.validate()?;
        check_n("AdamW::new", n)?;
        Ok(Self {
            device: device.clone(),
            config,
            m: device.zeros(n, 1)?,
            v: device.zeros(n, 1)?,
            steps: 0,
        })
    }

    /// One step: `params` and `grad` are `n x 1` on this optimizer's device.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
    /// [`Error::Shape`](crate::Error::Shape), [`Error::NonFinite`](crate::Error::NonFinite).
    /// On error neither `params` nor the optimizer changes.
    pub fn step(&mut self, params: &mut Matrix, grad: &Matrix) -> Result<()> {
        const OP: &str = "AdamW::step";
        let n = self.n();
        check_shape(OP, "params", params.shape(), (n, 1))?;
        check_shape(OP, "grad", grad.shape(), (n, 1))?;
        let coeffs = self.config.coeffs(self.steps.saturating_add(1));
        self.device
            .adamw_update(params, grad, &mut self.m, &mut self.v, &coeffs)?;
        self.steps = self.steps.saturating_add(1);
        Ok(())
    }

    /// The learning rate the next step will use.
    pub fn current_lr(&self) -> f32 {
        self.config.lr_at(self.steps.saturating_add(1))
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
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Replaces the configuration; the moments and the step counter are kept.
    ///
    /// # Errors
    /// [`Error::Value`](crate::Error::Value) for a bad config; the old one stays in use.
    pub fn set_config(&mut self, config: AdamWConfig) -> Result<()> {
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// The first moment `m` (`n x 1`, on the device).
    pub fn first_moment(&self) -> &Matrix {
        &self.m
    }

    /// The second moment `v` (`n x 1`, on the device).
    pub fn second_moment(&self) -> &Matrix {
        &self.v
    }

    /// A host copy of the state.
    ///
    /// # Errors
    /// Device errors.
    pub fn state(&self) -> Result<AdamWState> {
        Ok(AdamWState {
            steps: self.steps,
            m: self.m.to_vec()?,
            v: self.v.to_vec()?,
        })
    }

    /// Restores a state taken by [`AdamW::state`] from an optimizer with the same `n`.
    ///
    /// # Errors
    /// [`Error::Shape`](crate::Error::Shape) for a different `n`,
    /// [`Error::NonFinite`](crate::Error::NonFinite), [`Error::Value`](crate::Error::Value)
    /// for a negative `v`, device errors; on error the optimizer is unchanged.
    pub fn restore(&mut self, state: &AdamWState) -> Result<()> {
        const OP: &str = "AdamW::restore";
        let n = self.n();
        check_len(OP, "m", state.m.len(), n)?;
        check_len(OP, "v", state.v.len(), n)?;
        check_finite(OP, "m", &state.m)?;
        check_finite(OP, "v", &state.v)?;
        check_nonnegative(OP, "v", &state.v)?;
        let m = self.device.upload(n, 1, &state.m)?;
        let v = self.device.upload(n, 1, &state.v)?;
        self.m = m;
        self.v = v;
        self.steps = state.steps;
        Ok(())
    }
}
