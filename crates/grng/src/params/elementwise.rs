//! Scalars of the fused first-order updates (SGD, AdamW, Sophia) and their range checks,
//! used by the device ops of [`crate::ops::elementwise`] and both backends.

use crate::error::{check_value, Error, Result};

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

/// Where the tensors of a multi-tensor update live in its flat state arrays, shared by both
/// backends: tensor `t` (of `lens[t]` elements, possibly 0) owns the state segment
/// `segment(t)`, which starts at a multiple of 4 elements (the kernels' float4 items never
/// straddle two tensors and stay 16-byte aligned), and the flat positions
/// `first(t)..first(t) + lens[t]` of the concatenation of all tensors, which is how errors and
/// checkpoints see the state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MultiLayout {
    lens: Vec<usize>,
    /// Start of each tensor's state segment, and the padded total last.
    seg: Vec<usize>,
    /// Prefix sums of `lens` (flat positions), the total last.
    pos: Vec<usize>,
}

impl MultiLayout {
    /// The layout of tensors of `lens` elements, in order.
    pub fn new(lens: &[usize]) -> Self {
        let mut seg = Vec::with_capacity(lens.len() + 1);
        let mut pos = Vec::with_capacity(lens.len() + 1);
        let (mut s, mut p) = (0usize, 0usize);
        for &n in lens {
            seg.push(s);
            pos.push(p);
            s = s.saturating_add(n.div_ceil(4).saturating_mul(4));
            p = p.saturating_add(n);
        }
        seg.push(s);
        pos.push(p);
        Self {
            lens: lens.to_vec(),
            seg,
            pos,
        }
    }

    /// The tensors' lengths, in order.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Elements over all tensors.
    pub fn total(&self) -> usize {
        self.pos[self.lens.len()]
    }

    /// Length of each flat state array (the segments, padded to multiples of 4).
    pub fn state_len(&self) -> usize {
        self.seg[self.lens.len()]
    }

    /// Tensor `t`'s elements in a flat state array.
    pub fn segment(&self, t: usize) -> std::ops::Range<usize> {
        self.seg[t]..self.seg[t] + self.lens[t]
    }

    /// The flat position of tensor `t`'s first element.
    pub fn first(&self, t: usize) -> usize {
        self.pos[t]
    }

    /// `(tensor, index inside it)` of flat position `pos < total()`.
    pub fn locate(&self, pos: usize) -> (usize, usize) {
        // The last tensor starting at or before `pos` (empty tensors start where the next does).
        let t = self.pos[1..].partition_point(|&end| end <= pos);
        (t, pos - self.pos[t])
    }
}

/// Status slots of a multi-tensor update (`EW_MSLOTS` in `kernels/elementwise.cu`), in the
/// order both backends report them: the first NaN/Inf of 0 params, 1 grads, 2 state `s0`,
/// 3 state `s1`, 4 the Hessian samples; 5 the first `s1 < 0`; the first non-finite result
/// (overflow from finite inputs) of 6 params, 7 `s0`, 8 `s1`.
pub(crate) const MULTI_SLOTS: usize = 9;

/// One multi-tensor update with its scalars: which state arrays it has, reads and writes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum MultiUpdate {
    /// SGD; state `s0` = momentum buffer.
    Sgd(SgdCoeffs),
    /// AdamW; state `s0 = m`, `s1 = v ≥ 0`.
    AdamW(AdamWCoeffs),
    /// Sophia; state `s0 = m`, `s1 = h ≥ 0`; `Some((β₂, B))` fuses the Hessian EMA with
    /// batch-`B` samples before the update (and writes `h`).
    Sophia(SophiaCoeffs, Option<(f32, usize)>),
}

/// Largest magnitudes of a multi-tensor update's inputs, every one finite: the parameters
/// `p`, the gradients `g`, the Hessian samples `gh` (0 without them) and the state arrays `s0`
/// and `s1` (`s1 ≥ 0`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct InputBounds {
    pub p: f32,
    pub g: f32,
    pub gh: f32,
    pub s0: f32,
    pub s1: f32,
}

impl MultiUpdate {
    /// The error `arg` of each status slot.
    pub(crate) fn names(&self) -> [&'static str; MULTI_SLOTS] {
        match self {
            MultiUpdate::Sgd(_) => [
                "params",
                "grad",
                "momentum_buf",
                "",
                "",
                "",
                "params (overflow)",
                "momentum_buf (overflow)",
                "",
            ],
            MultiUpdate::AdamW(_) => [
                "params",
                "grad",
                "m",
                "v",
                "",
                "v",
                "params (overflow)",
                "m (overflow)",
                "v (overflow)",
            ],
            MultiUpdate::Sophia(..) => [
                "params",
                "grad",
                "m",
                "h",
                "sampled_grad",
                "h",
                "params (overflow)",
                "m (overflow)",
                "h (overflow)",
            ],
        }
    }

    /// Number of flat state arrays (1 or 2).
    pub(crate) fn arrays(&self) -> usize {
        match self {
            MultiUpdate::Sgd(_) => 1,
            _ => 2,
        }
    }

    /// Whether `s1` is written (else the update leaves it as it is).
    pub(crate) fn writes1(&self) -> bool {
        match self {
            MultiUpdate::Sgd(_) => false,
            MultiUpdate::AdamW(_) => true,
            MultiUpdate::Sophia(_, refresh) => refresh.is_some(),
        }
    }

    /// Whether every value the update writes is finite for all finite inputs within `b`: a
    /// proof from the per-element formulas (`cpu::elementwise`'s `*_elem`, the kernels' `Ew*`
    /// functors), in which every intermediate magnitude is bounded in `f64` and must stay below
    /// `f32::MAX / 8`. The bound is a sum of non-negative terms; each `f32` rounding adds at most
    /// a factor `1 + 2⁻²⁴` and no formula has more than a dozen, so the factor 8 covers them.
    /// No NaN can arise either: every divisor is `≥ eps > 0` (validated coefficients), square
    /// roots take sums of non-negative terms, and nothing infinite enters a product.
    ///
    /// With the proof the CPU updates in place: the result check that otherwise decides whether
    /// a step may be committed cannot fail. A `false` only sends the step to the checked route.
    pub(crate) fn cannot_overflow(&self, b: &InputBounds) -> bool {
        const LIMIT: f64 = f32::MAX as f64 / 8.0;
        let (p, g, gh, s0, s1) = (
            b.p as f64,
            b.g as f64,
            b.gh as f64,
            b.s0 as f64,
            b.s1 as f64,
        );
        // `p − lr·λ·p − lr·u` for an update direction `|u| ≤ u`: its three products and sum.
        let decayed = |lr: f32, wd: f32, u: f64| {
            let (lr, lw) = (lr as f64, lr as f64 * wd as f64);
            [lw, lw * p, lr * u, p + lw * p + lr * u]
        };
        // `β·s + (1 − β)·x`, a convex combination: at most the larger bound.
        let ema = |beta: f32, s: f64, x: f64| beta as f64 * s + (1.0 - beta as f64) * x;
        let terms: Vec<f64> = match *self {
            MultiUpdate::Sgd(c) => {
                let b = c.momentum as f64 * s0 + g;
                [b].into_iter()
                    .chain(decayed(c.lr, c.weight_decay, b))
                    .collect()
            }
            MultiUpdate::AdamW(c) => {
                let (bc1, bc2) = c.bias_corrections();
                let (m, g2) = (ema(c.beta1, s0, g), g * g);
                let v = ema(c.beta2, s1, g2);
                let m_hat = m / bc1 as f64;
                // `(m/bc₁) / (√(v/bc₂) + eps)`: the divisor is at least `eps`.
                let u = m_hat / c.eps as f64;
                [m, g2, v, m_hat, v / bc2 as f64, u]
                    .into_iter()
                    .chain(decayed(c.lr, c.weight_decay, u))
                    .collect()
            }
            MultiUpdate::Sophia(c, refresh) => {
                // With the refresh, `h ← β₂·h + (1 − β₂)·(B·ĝ·ĝ)` comes first.
                let (h, sample) = match refresh {
                    Some((beta2, batch)) => {
                        let bg = batch as f64 * gh;
                        (ema(beta2, s1, bg * gh), [bg, bg * gh])
                    }
                    None => (s1, [0.0; 2]),
                };
                let m = ema(c.beta1, s0, g);
                // `clamp(m / max(γ·h, eps), −1, 1)`: the divisor is at least `eps`, and a
                // quotient that overflows clamps to ±1.
                [m, h, c.gamma as f64 * h]
                    .into_iter()
                    .chain(sample)
                    .chain(decayed(c.lr, c.weight_decay, 1.0))
                    .collect()
            }
        };
        terms.iter().all(|&t| t <= LIMIT)
    }

    /// The error reported for the first bad value: status slot `slot`, flat position `pos`
    /// (see [`MultiLayout::locate`]), the value found there.
    pub(crate) fn error(
        &self,
        op: &'static str,
        layout: &MultiLayout,
        slot: usize,
        pos: usize,
        value: f32,
    ) -> Error {
        let arg = self.names()[slot];
        if slot == 5 {
            return Error::Value {
                op,
                arg,
                value: value as f64,
                expected: "every entry >= 0",
            };
        }
        let (tensor, index) = layout.locate(pos);
        Error::NonFiniteTensor {
            op,
            arg,
            tensor,
            index,
            value,
        }
    }
}
