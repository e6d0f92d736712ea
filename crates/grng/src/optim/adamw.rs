//! AdamW (Loshchilov & Hutter 2019) with linear warm-up (docs/math.md §4 baseline).

use super::multi::{one_tensor, HostArray, Tensors, Validate};
use crate::device::{Device, Matrix};
use crate::error::{check_value, Result};
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

/// Hyperparameters of [`AdamW`]; defaults from docs/math.md §6 (paper: lr 4e-5..2e-4 with 100–500
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

impl Validate for AdamWConfig {
    fn validate(&self) -> Result<()> {
        AdamWConfig::validate(self)
    }
}

/// Everything [`AdamW`] carries between steps, on the host (for checkpoints).
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWState {
    /// Completed steps `t` (the next step is `t + 1`).
    pub steps: u64,
    /// First moment `m`, length `n` (all tensors concatenated in order).
    pub m: Vec<f32>,
    /// Second moment `v`, length `n`, entries `≥ 0`.
    pub v: Vec<f32>,
}

/// AdamW over a model's parameter tensors: one fused device op per step for all of them
/// ([`Device::adamw_update_many`]: one kernel launch on a GPU) with the scheduled learning
/// rate [`AdamWConfig::lr_at`] and bias corrections `1 − βₖᵗ`. [`AdamW::new`] makes it for
/// one flat `n x 1` vector, [`AdamW::for_tensors`] for a list of shapes stepped together by
/// [`AdamW::step_many`].
#[derive(Debug)]
pub struct AdamW {
    /// `m` (array 0), `v` (array 1) and the step counter.
    inner: Tensors<AdamWConfig>,
}

super::multi::tensor_accessors!(AdamW, AdamWConfig);

impl AdamW {
    /// A new optimizer for one `n x 1` parameter vector, `n ≥ 1`, with zero moments.
    ///
    /// # Errors
    /// [`Error::Value`](crate::Error::Value) for a bad config,
    /// [`Error::Shape`](crate::Error::Shape) for `n = 0`, device errors.
    pub fn new(device: &Device, n: usize, config: AdamWConfig) -> Result<Self> {
        Self::for_tensors(device, &[(n, 1)], config)
    }

    /// A new optimizer for parameter tensors of `shapes` (in the order [`AdamW::step_many`]
    /// takes them; empty tensors allowed, at least one parameter in all), zero moments.
    ///
    /// # Errors
    /// As [`AdamW::new`].
    pub fn for_tensors(
        device: &Device,
        shapes: &[(usize, usize)],
        config: AdamWConfig,
    ) -> Result<Self> {
        Ok(Self {
            inner: Tensors::new("AdamW::new", device, shapes, config, 2)?,
        })
    }

    /// One step of an optimizer made by [`AdamW::new`]: `params` and `grad` are `n x 1` on
    /// this optimizer's device.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
    /// [`Error::Shape`](crate::Error::Shape), [`Error::NonFinite`](crate::Error::NonFinite).
    /// On error neither `params` nor the optimizer changes.
    pub fn step(&mut self, params: &mut Matrix, grad: &Matrix) -> Result<()> {
        self.step_many(&mut [params], &[grad]).map_err(one_tensor)
    }

    /// One step of every tensor: `params[t]` and `grads[t]` have the `t`-th shape given at
    /// construction. One device op, so one kernel launch and one status read-back.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
    /// [`Error::Shape`](crate::Error::Shape) (count or shapes),
    /// [`Error::NonFiniteTensor`](crate::Error::NonFiniteTensor) naming the tensor and index
    /// of the first NaN/Inf (or overflowing result). On error neither `params` nor the
    /// optimizer changes.
    pub fn step_many(&mut self, params: &mut [&mut Matrix], grads: &[&Matrix]) -> Result<()> {
        self.inner.step_with_grads(
            "AdamW::step",
            params,
            grads,
            |device, state, config, t, params, grads| {
                device.adamw_update_many(params, grads, state, &config.coeffs(t))
            },
        )
    }

    /// The learning rate the next step will use.
    pub fn current_lr(&self) -> f32 {
        self.inner
            .config()
            .lr_at(self.inner.steps().saturating_add(1))
    }

    /// `‖g‖₂` of the last step's gradients (all tensors), where the update measured it
    /// ([`MultiState::last_grad_sq`](crate::ops::elementwise::MultiState::last_grad_sq): on
    /// the CPU, in the read-only pass the update makes anyway before writing in place); `None`
    /// on the kernel devices and before the first step.
    pub fn last_grad_norm(&self) -> Option<f32> {
        self.inner.last_grad_norm()
    }

    /// Replaces the configuration; the moments and the step counter are kept.
    ///
    /// # Errors
    /// [`Error::Value`](crate::Error::Value) for a bad config; the old one stays in use.
    pub fn set_config(&mut self, config: AdamWConfig) -> Result<()> {
        self.inner.set_config(config)
    }

    /// The first moment `m` on the device, as the flat state array of
    /// [`MultiState`](crate::ops::elementwise::MultiState) (tensor `t` at
    /// `layout().segment(t)`; [`AdamW::state`] gives the plain concatenation).
    pub fn first_moment(&self) -> &Matrix {
        self.inner.array(0)
    }

    /// The second moment `v`, laid out as [`AdamW::first_moment`].
    pub fn second_moment(&self) -> &Matrix {
        self.inner.array(1)
    }

    /// A host copy of the state (each moment of all tensors concatenated in order).
    ///
    /// # Errors
    /// Device errors.
    pub fn state(&self) -> Result<AdamWState> {
        Ok(AdamWState {
            steps: self.inner.steps(),
            m: self.inner.to_host(0)?,
            v: self.inner.to_host(1)?,
        })
    }

    /// Restores a state taken by [`AdamW::state`] from an optimizer with the same `n`.
    ///
    /// # Errors
    /// [`Error::Shape`](crate::Error::Shape) for a different `n`,
    /// [`Error::NonFinite`](crate::Error::NonFinite), [`Error::Value`](crate::Error::Value)
    /// for a negative `v`, device errors; on error the optimizer is unchanged.
    pub fn restore(&mut self, state: &AdamWState) -> Result<()> {
        let arrays = [
            HostArray::finite("m", &state.m),
            HostArray::nonnegative("v", &state.v),
        ];
        self.inner.restore("AdamW::restore", &arrays, state.steps)
    }
}
