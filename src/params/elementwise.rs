//! Scalars of the fused first-order updates (SGD, AdamW, Sophia) and their range checks,
//! used by the device ops of [`crate::ops::elementwise`] and both backends.

use crate::error::{check_value, Result};

/// `Err(Error::Value)` unless the learning rate is finite and `≥ 0`.
fn check_lr(op: &'static str, lr: f32) -> Result<()> {
    check_value(op, "lr", lr as f64, lr >= 0.0, "lr >= 0")
}

/// `Err(Error::Value)` unless the decoupled weight decay is finite and `≥ 0`.
fn check_weight_decay(op: &'static str, wd: f32) -> Result<()> {
    check_value(
        op,
        "weight_decay",
        wd as f64,
        wd >= 0.0,
        "weight_decay >= 0",
    )
}

/// Scalars of one fused SGD step ([`Device::sgd_update`](crate::Device::sgd_update)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdCoeffs {
    /// Learning rate, finite and `≥ 0`.
    pub lr: f32,
    /// Heavy-ball momentum `μ`, `0 ≤ μ < 1`.
    pub momentum: f32,
    /// Decoupled weight decay `λ`, finite and `≥ 0`.
    pub weight_decay: f32,
}

impl SgdCoeffs {
    /// `Err(Error::Value)` naming the first field outside its documented range.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        check_lr(op, self.lr)?;
        check_beta(op, "momentum", self.momentum)?;
        check_weight_decay(op, self.weight_decay)
    }
}

/// Scalars of one fused AdamW step ([`Device::adamw_update`](crate::Device::adamw_update)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWCoeffs {
    /// Learning rate of this step (after the optimizer's schedule), finite and `≥ 0`.
    pub lr: f32,
    /// First-moment decay `β₁`, `0 ≤ β₁ < 1`.
    pub beta1: f32,
    /// Second-moment decay `β₂`, `0 ≤ β₂ < 1`.
    pub beta2: f32,
    /// Denominator offset `ε`, finite and `> 0`.
    pub eps: f32,
    /// Decoupled weight decay `λ`, finite and `≥ 0`.
    pub weight_decay: f32,
    /// The 1-based index `t ≥ 1` of this step, for the bias corrections.
    pub step: u64,
}

impl AdamWCoeffs {
    /// `Err(Error::Value)` naming the first field outside its documented range.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        check_lr(op, self.lr)?;
        check_beta(op, "beta1", self.beta1)?;
        check_beta(op, "beta2", self.beta2)?;
        check_value(op, "eps", self.eps as f64, self.eps > 0.0, "eps > 0")?;
        check_weight_decay(op, self.weight_decay)?;
        check_value(op, "step", self.step as f64, self.step >= 1, "step >= 1")
    }

    /// `(1 − β₁ᵗ, 1 − β₂ᵗ)` computed in `f64` and rounded to `f32`; both are `> 0` for a
    /// valid `t ≥ 1` (the smallest, `1 − β` at `t = 1`, is at least `2⁻²⁴` for `β < 1`).
    pub fn bias_corrections(&self) -> (f32, f32) {
        let t = self.step.min(i32::MAX as u64) as i32;
        let bc = |b: f32| (1.0 - (b as f64).powi(t)) as f32;
        (bc(self.beta1), bc(self.beta2))
    }
}

/// Scalars of one fused Sophia step ([`Device::sophia_update`](crate::Device::sophia_update)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SophiaCoeffs {
    /// Learning rate, finite and `≥ 0`.
    pub lr: f32,
    /// Momentum decay `β₁`, `0 ≤ β₁ < 1`.
    pub beta1: f32,
    /// Hessian scale `γ` of the clipped ratio, finite and `> 0`.
    pub gamma: f32,
    /// Denominator floor `ε`, finite and `> 0`.
    pub eps: f32,
    /// Decoupled weight decay `λ`, finite and `≥ 0`.
    pub weight_decay: f32,
}

impl SophiaCoeffs {
    /// `Err(Error::Value)` naming the first field outside its documented range.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        check_lr(op, self.lr)?;
        check_beta(op, "beta1", self.beta1)?;
        check_value(
            op,
            "gamma",
            self.gamma as f64,
            self.gamma > 0.0,
            "gamma > 0",
        )?;
        check_value(op, "eps", self.eps as f64, self.eps > 0.0, "eps > 0")?;
        check_weight_decay(op, self.weight_decay)
    }
}

/// `Err(Error::Value)` unless `0 ≤ β < 1`.
pub(crate) fn check_beta(op: &'static str, arg: &'static str, beta: f32) -> Result<()> {
    check_value(
        op,
        arg,
        beta as f64,
        (0.0..1.0).contains(&beta),
        "0 <= beta < 1",
    )
}
