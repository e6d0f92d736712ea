//! One layer's preconditioning and quadratic-model terms, from a dense gradient `G` or from
//! the batch factors of `G = (1/m) EᵀA` ([`KronGrad`]).
//!
//! # Why the factored form
//! A dense-layer gradient is `G = (1/m) EᵀA` with `E` (`m x d_out`) the per-sample output
//! gradients and `A` (`m x d_in`) the layer inputs (SPEC §1). With `U = Γ̃⁻¹Eᵀ` (`d_out x m`)
//! and `V = AΛ̃⁻¹` (`m x d_in`):
//!
//! - `P = Γ̃⁻¹GΛ̃⁻¹ = (1/m)·U·V`;
//! - `⟨G, P⟩ = (1/m²)·⟨E·U, A·Vᵀ⟩` (two `m x m` products: `tr(AᵀE·UV) = tr((EU)(VAᵀ))`);
//! - `⟨P, ΓPΛ⟩ = (1/m²)·⟨UᵀΓU, VΛVᵀ⟩` (`tr(VᵀUᵀ·ΓU·VΛ)`, both `m x m` and symmetric).
//!
//! These are identities, not approximations: the same `P` and the same model terms (SPEC §2)
//! up to rounding. Flops (a GEMM `p x q x r` counted `2pqr`): the dense route costs
//! `4·d_out·d_in·(d_out + d_in)` (two products for `P`, two for `ΓPΛ`), the factored one
//! `2m·(2d_out² + 2d_in² + d_out·d_in) + 4m²·(d_out + d_in)`; at `m = 256`,
//! `d_out = d_in = 1024` that is 3.2 against 8.6 GFLOP. [`factored_is_cheaper`] picks per
//! layer; when it says no, `G` is formed (`2m·d_out·d_in`) and the dense route runs.

use crate::device::{Device, Matrix};
use crate::error::Result;
use crate::mat::Trans;
use crate::ops::{Readout, Scalar};

/// One layer's gradient as [`super::KronOptimizer::step_grads`] and
/// [`super::KronOptimizer::precondition_grads`] take it.
#[derive(Clone, Copy, Debug)]
pub enum KronGrad<'a> {
    /// `G` itself, `d_out x d_in` (RENG's regularized gradient, or any gradient).
    Dense(&'a Matrix),
    /// `G = (1/m) EᵀA` by its batch factors, never formed unless that is cheaper (module
    /// docs): `e` is `m x d_out` (rows `e_k = ∂ℓ_k/∂z`, NOT divided by `m`), `a` is
    /// `m x d_in` (rows the layer inputs, augmented by the bias column 1 when `W̄` has one),
    /// `m ≥ 1` the same for both — [`crate::mlp::Backward::layers`] as uploaded.
    Factored {
        /// Output gradients, `m x d_out`.
        e: &'a Matrix,
        /// Layer inputs, `m x d_in`.
        a: &'a Matrix,
    },
}

/// True when the factored route (module docs) costs fewer flops than the dense one for a
/// `d_out x d_in` layer and `m` samples. Both routes run on one engine per device — the CPU's
/// GEMM, or the kernel devices' split3 tensor-core products (the preconditioning's, and
/// [`Device::product_valid_inputs`] for every other product) — so flops decide. `with_model`:
/// the quadratic model's terms are needed too (a step, not a bare preconditioning).
pub(super) fn factored_is_cheaper(m: usize, d_out: usize, d_in: usize, with_model: bool) -> bool {
    let (m, o, i) = (m as f64, d_out as f64, d_in as f64);
    let mut factored = 2.0 * m * (o * o + i * i + o * i);
    let mut dense = 2.0 * m * o * i + 2.0 * o * i * (o + i);
    if with_model {
        factored += 2.0 * m * (o * o + i * i) + 4.0 * m * m * (o + i);
        dense += 2.0 * o * i * (o + i);
    }
    factored < dense
}

/// The matrices one layer's preconditioning reads: the undamped factors (the model's
/// curvature) and the damped inverses in use this step.
pub(super) struct LayerView<'a> {
    pub lambda: &'a Matrix,
    pub gamma: &'a Matrix,
    pub lambda_inv: &'a Matrix,
    pub gamma_inv: &'a Matrix,
    pub damping: (f32, f32),
}

/// `P` of one layer and, when asked for, the model terms `(⟨G, P⟩, ⟨P, ΓPΛ⟩)` (deferred
/// inside [`Device::deferred`]).
pub(super) struct Preconditioned {
    pub p: Matrix,
    pub terms: Option<(Scalar, Scalar)>,
}

/// The model's three inner products of one layer: `⟨G, P⟩`, `⟨P, ΓPΛ⟩`, `‖P‖²`.
pub(super) struct ModelTerms([Scalar; 3]);

impl Preconditioned {
    /// The terms with `‖P‖²` added (one more reduction); `None` when they were not computed.
    pub fn model_terms(&self, d: &Device) -> Result<Option<ModelTerms>> {
        let Some((lin, curv)) = self.terms else {
            return Ok(None);
        };
        Ok(Some(ModelTerms([
            lin,
            curv,
            d.dot_deferred(&self.p, &self.p)?,
        ])))
    }
}

impl ModelTerms {
    /// `q(δ) − q(0) = ⟨G, Δ⟩ + ½⟨Δ, ΓΔΛ⟩ + ½λ‖Δ‖²` for `Δ = −ηP`, `λ = λ_Λλ_Γ` (SPEC §2), in
    /// `f64`, with the values `r` resolves (`None` while a deferred one is unknown).
    pub fn model_change(&self, r: &Readout, damping: (f32, f32), eta: f32) -> Option<f64> {
        let [lin, curv, sq] = self.0.map(|s| r.get(s).map(f64::from));
        let (lin, curv, sq) = (lin?, curv?, sq?);
        let eta = eta as f64;
        let lambda = damping.0 as f64 * damping.1 as f64;
        Some(-eta * lin + 0.5 * eta * eta * (curv + lambda * sq))
    }
}

/// `P = Γ̃⁻¹GΛ̃⁻¹` for one layer (and the model terms when `with_model`), by the cheaper route.
/// Every operand is checked (state, or inputs checked by the caller): each product checks its
/// result only, so a non-finite `P` or term is an [`crate::Error::NonFinite`].
pub(super) fn precondition(
    d: &Device,
    v: &LayerView<'_>,
    g: KronGrad<'_>,
    with_model: bool,
) -> Result<Preconditioned> {
    let (o, i) = (v.gamma.rows(), v.lambda.rows());
    match g {
        KronGrad::Factored { e, a } if factored_is_cheaper(e.rows(), o, i, with_model) => {
            factored(d, v, e, a, with_model)
        }
        KronGrad::Factored { e, a } => {
            let g = gemm(d, Trans::Yes, Trans::No, 1.0 / e.rows() as f32, e, a)?;
            dense(d, v, &g, with_model)
        }
        KronGrad::Dense(g) => dense(d, v, g, with_model),
    }
}

/// `α·op(A)·op(B)` as a new matrix (operands already validated).
fn gemm(d: &Device, ta: Trans, tb: Trans, alpha: f32, a: &Matrix, b: &Matrix) -> Result<Matrix> {
    d.product_valid_inputs(ta, tb, alpha, a, b)
}

/// The dense route: two products for `P`, two for `ΓPΛ`.
fn dense(d: &Device, v: &LayerView<'_>, g: &Matrix, with_model: bool) -> Result<Preconditioned> {
    let (o, i) = g.shape();
    let mut p = d.zeros(o, i)?;
    d.precondition_valid_inputs(v.gamma_inv, g, v.lambda_inv, &mut p)?;
    let terms = if with_model {
        let gp = gemm(d, Trans::No, Trans::No, 1.0, v.gamma, &p)?;
        let gpl = gemm(d, Trans::No, Trans::No, 1.0, &gp, v.lambda)?;
        Some((d.dot_deferred(g, &p)?, d.dot_deferred(&p, &gpl)?))
    } else {
        None
    };
    Ok(Preconditioned { p, terms })
}

/// The factored route of the module docs.
fn factored(
    d: &Device,
    v: &LayerView<'_>,
    e: &Matrix,
    a: &Matrix,
    with_model: bool,
) -> Result<Preconditioned> {
    let m = e.rows();
    // Each operand prepared once (on the kernel devices: split into bf16 planes once, where
    // every product would split both of its operands again): `e`, `a`, `U` and `W` are read
    // by up to four products each.
    let (eo, ao) = (d.operand(e)?, d.operand(a)?);
    let (no, yes) = (Trans::No, Trans::Yes);
    let u = d.product_of(no, yes, 1.0, &d.operand(v.gamma_inv)?, &eo)?;
    let w = d.product_of(no, no, 1.0, &ao, &d.operand(v.lambda_inv)?)?;
    let (uo, wo) = (d.operand(&u)?, d.operand(&w)?);
    let p = d.product_of(no, no, 1.0 / m as f32, &uo, &wo)?;
    let terms = if with_model {
        // Each m x m pair scaled by 1/m so the inner products need no further 1/m².
        let inv_m = 1.0 / m as f32;
        let eu = d.product_of(no, no, inv_m, &eo, &uo)?;
        let awt = d.product_of(no, yes, inv_m, &ao, &wo)?;
        let gu = d.product_of(no, no, 1.0, &d.operand(v.gamma)?, &uo)?;
        let ugu = d.product_of(yes, no, inv_m, &uo, &d.operand(&gu)?)?;
        let wl = d.product_of(no, no, 1.0, &wo, &d.operand(v.lambda)?)?;
        let wlw = d.product_of(no, yes, inv_m, &d.operand(&wl)?, &wo)?;
        Some((d.dot_deferred(&eu, &awt)?, d.dot_deferred(&ugu, &wlw)?))
    } else {
        None
    };
    Ok(Preconditioned { p, terms })
}
