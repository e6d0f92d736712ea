//! One layer's preconditioning and quadratic-model terms, from a dense gradient `G` or from
//! the batch factors of `G = (1/m) EᵀA` ([`KronGrad`]).
//!
//! # Why the factored form
//! A dense-layer gradient is `G = (1/m) EᵀA` with `E` (`m x d_out`) the per-sample output
//! gradients and `A` (`m x d_in`) the layer inputs (docs/math.md §1). With `U = Γ̃⁻¹Eᵀ` (`d_out x m`)
//! and `V = AΛ̃⁻¹` (`m x d_in`):
//!
//! - `P = Γ̃⁻¹GΛ̃⁻¹ = (1/m)·U·V`;
//! - `⟨G, P⟩ = (1/m²)·⟨E·U, A·Vᵀ⟩` (two `m x m` products: `tr(AᵀE·UV) = tr((EU)(VAᵀ))`);
//! - `⟨P, ΓPΛ⟩ = (1/m²)·⟨UᵀΓU, VΛVᵀ⟩` (`tr(VᵀUᵀ·ΓU·VΛ)`, both `m x m` and symmetric).
//!
//! These are identities, not approximations: the same `P` and the same model terms (docs/math.md §2)
//! up to rounding. Every `m x m` product here is symmetric (`EU = E·Γ̃⁻¹·Eᵀ`, `UᵀΓU`, and
//! likewise on the `Λ` side), so every device computes its lower triangle only and mirrors
//! it ([`Device::symmetric_product_of`]: the CPU's SYRK tiles, the engine's lower-triangle
//! tile pairs).
//!
//! Flops (a GEMM `p x q x r` counted `2pqr`): the dense route costs
//! `4·d_out·d_in·(d_out + d_in)` (two products for `P`, two for `ΓPΛ`), the factored one
//! `2m·(2d_out² + 2d_in² + d_out·d_in) + 4m²·(d_out + d_in)`; at `m = 256`,
//! `d_out = d_in = 1024` that is 3.2 against 8.6 GFLOP. [`factored_is_cheaper`] picks per
//! layer; when it says no, `G` is formed (`2m·d_out·d_in`) and the dense route runs.
//!
//! # The model's curvature without a product by the factor
//! Where `X = Γ̃⁻¹` is an inverse as formed at the damping `λ` (no first-order update of
//! one), `ΓX = I − λX`, so `ΓU = Eᵀ − λU` and `UᵀΓU = EU − λ·UᵀU` (`EU = EXEᵀ` is symmetric);
//! likewise `VΛVᵀ = AVᵀ − λ·VVᵀ` with `V = AΛ̃⁻¹`. The `n²m`-flop product by the factor becomes
//! an `m x m` Gram matrix, on every side where [`by_identity`] allows it (the kept `EU`, `AVᵀ`
//! of `⟨G, P⟩` serve again). The identity holds for the inverse actually applied only to its
//! rounding: for an inverse computed in `f64` and rounded once, the curvature moves by about
//! `2⁻²⁴·κ` of `⟨G, P⟩` at most (`κ` the damped factor's condition number, through the
//! rounding of `F + λI` and of `X`), so [`by_identity`] asks for `κ ≤ IDENTITY_MAX_COND`:
//! `≲ 2.4e-4` of the linear term, far inside what the Levenberg–Marquardt ratio's thresholds
//! (1/4, 3/4) resolve. The dense route takes it too: with `T = GΛ̃⁻¹` and `P = Γ̃⁻¹T`,
//! `ΓP = T − λ_Γ·P`, so `ΓPΛ` costs one product by `Λ` instead of two where the `Γ` side
//! qualifies: three `n³`-sized products, not four.
//!
//! # A lazy step's first-order inverse by products
//! The first-order inverse `X = X₀ − d·X₀²` of a lazy step ([`super::layer`]) misses the
//! identity by `d²X₀²`, but the identity of `X₀` (formed at `λ₀`) gives its curvature exactly:
//! `ΓX = I − (λ₀ + d)X₀ + dλ₀X₀²`. With `U₀ = X₀Eᵀ`, `U₁ = X₀U₀` and `U = U₀ − d·U₁ = XEᵀ`,
//! `ΓU = Eᵀ − d·U₀ − λ₀·U`, so `UᵀΓU = EU − λ₀·Uᵀ(U + (d/λ₀)·U₀)`; likewise `VΛVᵀ = AVᵀ −
//! λ₀·V(V + (d/λ₀)·V₀)ᵀ` with `V₀ = AX₀`, `V = V₀ − d·V₀X₀`. Where a layer takes this route
//! with the model and `X₀` meets [`by_identity`], the lazy step never forms `X` (no `S₀ = X₀²`,
//! `n³` per formation, no `n x n` axpy per step: [`super::layer::Retarget::ByProducts`]); the
//! product `X₀U₀` takes the place of the product by the factor, so the flops stay as they were.

use super::config::{InverseMethod, KronConfig};
use super::low_rank::{LowRank, Terms};
use super::state::KronFactorState;
use super::tasks;
use crate::device::{Device, Matrix};
use crate::error::Result;
use crate::mat::Trans;
use crate::ops::elementwise::AxpyOver;
use crate::ops::gemm::{Operand, Product};
use crate::ops::{Readout, Scalar, SplitCache};
use crate::shape::MatMul;

/// A factor's inverse as one step applies it: dense, or through the rows (`low_rank.rs`).
#[derive(Clone, Copy)]
pub(super) enum InverseView<'a> {
    /// `formed`: `x` is the inverse as formed at the view's damping (a refresh, a recompute,
    /// or the Woodbury inverse formed densely), not a first-order update of one.
    Dense {
        x: &'a Matrix,
        formed: bool,
        /// `x`'s kept split planes where `x` is the state's `X₀` (not a first-order inverse
        /// or a formation of this step).
        kept: Option<&'a SplitCache>,
    },
    LowRank(&'a LowRank, &'a Terms),
    /// `X₀ − d·X₀²` applied by products with `X₀` (formed at `lambda0`) on the factored
    /// route, where the model takes its curvature by `X₀`'s identity
    /// (this module's docs).
    FirstOrder {
        x0: &'a Matrix,
        /// `x0`'s kept split planes.
        kept: &'a SplitCache,
        lambda0: f32,
        d: f32,
    },
}

/// One layer's gradient as [`super::KronOptimizer::step_grads`] and
/// [`super::KronOptimizer::precondition_grads`] take it.
#[derive(Clone, Copy, Debug)]
pub enum KronGrad<'a> {
    /// `G` itself, `d_out x d_in` (RENG's regularized gradient, or any gradient).
    Dense(&'a Matrix),
    /// `G = (1/m) EᵀA` by its batch factors, never formed unless that is cheaper (module
    /// docs): `e` is `m x d_out` (rows `e_k = ∂ℓ_k/∂z`, NOT divided by `m`), `a` is
    /// `m x d_in` (rows the layer inputs, augmented by the bias column 1 when `W̄` has one),
    /// `m ≥ 1` the same for both — the reference trainer's `grng_train::mlp::Backward::layers` as uploaded.
    Factored {
        /// Output gradients, `m x d_out`.
        e: &'a Matrix,
        /// Layer inputs, `m x d_in`.
        a: &'a Matrix,
    },
    /// [`KronGrad::Factored`] with the rows' Gram matrices the caller has formed anyway (for
    /// `‖G‖_F² = ⟨EEᵀ, AAᵀ⟩/m²`, `grng_train::mlp::LayerStats::gradient_norm`): `ee = (1/m)·EEᵀ`,
    /// `aa = (1/m)·AAᵀ`, both `m x m`. On the rows' route (`ε = 0`, `low_rank.rs`) they give
    /// the model's linear term `⟨G, P⟩` by `m x m x m` products instead of `m x m x d` ones
    /// (`LowRank::right`); elsewhere they are not read. They are trusted
    /// to be the Gram matrices of `e` and `a` (checked for shape and finiteness only): others
    /// give a wrong predicted change, not an error.
    FactoredWithGrams {
        /// Output gradients, `m x d_out`.
        e: &'a Matrix,
        /// Layer inputs, `m x d_in`.
        a: &'a Matrix,
        /// `(1/m)·EEᵀ`, `m x m`.
        ee: &'a Matrix,
        /// `(1/m)·AAᵀ`, `m x m`.
        aa: &'a Matrix,
    },
}

/// A [`KronGrad`] by its form.
pub(super) enum Parts<'a> {
    Dense(&'a Matrix),
    Factored(Factors<'a>),
}

/// A factored gradient's parts: `e`, `a` and the Gram matrices `(ee, aa)` when given.
pub(super) struct Factors<'a> {
    pub e: &'a Matrix,
    pub a: &'a Matrix,
    pub grams: Option<(&'a Matrix, &'a Matrix)>,
}

impl<'a> KronGrad<'a> {
    /// The gradient by its form.
    pub(super) fn parts(&self) -> Parts<'a> {
        match *self {
            KronGrad::Dense(g) => Parts::Dense(g),
            KronGrad::Factored { e, a } => Parts::Factored(Factors { e, a, grams: None }),
            KronGrad::FactoredWithGrams { e, a, ee, aa } => Parts::Factored(Factors {
                e,
                a,
                grams: Some((ee, aa)),
            }),
        }
    }
}

/// True when `g` comes by its batch factors and the factored route (module docs) costs fewer
/// flops than the dense one for its `d_out x d_in` layer: [`precondition`] then takes the
/// factored route whatever the inverses' views, which the lazy plan's
/// [`super::layer::Retarget::ByProducts`] relies on. Both routes run on one engine per
/// device — the CPU's GEMM, or the kernel devices' split3 tensor-core products (the
/// preconditioning's, and [`Device::product_valid_inputs`] for every other product) — so
/// flops decide. `with_model`: the quadratic model's terms are needed too (a step, not a bare
/// preconditioning).
pub(super) fn factored_is_cheaper(
    g: &KronGrad<'_>,
    (d_out, d_in): (usize, usize),
    with_model: bool,
) -> bool {
    let Parts::Factored(Factors { e, .. }) = g.parts() else {
        return false;
    };
    let (m, o, i) = (e.rows() as f64, d_out as f64, d_in as f64);
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
    /// The factors' states: [`KronFactorState::dense_factor`] is read only where a product
    /// needs the dense factor (one left to its rows is then formed).
    pub lambda: &'a KronFactorState,
    pub gamma: &'a KronFactorState,
    pub lambda_inv: InverseView<'a>,
    pub gamma_inv: InverseView<'a>,
    pub damping: (f32, f32),
    /// `(Λ, Γ)`: the model's curvature on that side by the identity of the module docs
    /// ([`by_identity`]).
    pub identity: (bool, bool),
}

/// Largest condition bound `(‖F‖₂ + λ)/λ` of a damped factor for which the model's curvature
/// takes the identity `FX = I − λX` (module docs): its rounding then moves the curvature by
/// at most about `2⁻²⁴·4096 ≈ 2.4e-4` of `⟨G, P⟩`. RING's damping `√ρ‖F‖₂` keeps the bound at
/// `1 + 1/√ρ`, 1001 at the default `ρ_min`.
pub(super) const IDENTITY_MAX_COND: f32 = 4096.0;

/// True when the model may take the curvature of the factor `s` by the identity `FX = I − λX`
/// (module docs): `formed` (the inverse in use is `s`'s as formed at `damping`), computed in
/// `f64` and rounded once (the CPU's Cholesky and Woodbury inverses — a Newton inverse
/// carries its residual, cuSOLVER's `f32` Cholesky `κ·2⁻²⁴` in every entry), and
/// `(‖F‖₂ + λ)/λ ≤ IDENTITY_MAX_COND` with `‖F‖₂` as the state knows it: RING's norm (a
/// power-iteration estimate, well inside the limit: RING's own bound is `1 + 1/√ρ`), or NGD's
/// trace (a bound: `‖F‖₂ ≤ tr F` for PSD `F`). RENG stores neither and keeps the products.
pub(super) fn by_identity(
    d: &Device,
    cfg: &KronConfig,
    s: &KronFactorState,
    damping: f32,
    formed: bool,
) -> bool {
    let f64_inverse =
        matches!(d, Device::Cpu) && !matches!(cfg.inverse.resolve(d), InverseMethod::Newton(_));
    let bound = if s.norm > 0.0 { s.norm } else { s.trace };
    formed
        && f64_inverse
        && bound > 0.0
        && damping > 0.0
        && bound + damping <= IDENTITY_MAX_COND * damping
}

/// `P` of one layer and, when asked for, what the model terms `⟨G, P⟩`, `⟨P, ΓPΛ⟩`, `‖P‖²`
/// are summed from ([`model_terms`]).
pub(super) struct Preconditioned {
    pub p: Matrix,
    pub operands: Option<TermOperands>,
    /// `α·A·Pᵀ` (`m x d_out`) when [`precondition`] was asked for it and could give it.
    pub output_change: Option<Matrix>,
    /// `(λ_Λ, λ_Γ)` of the inverses applied.
    damping: (f32, f32),
}

/// The model's three inner products of one layer, `⟨G, P⟩`, `⟨P, ΓPΛ⟩`, `‖P‖²`, and the
/// dampings `(λ_Λ, λ_Γ)` of its inverses.
pub(super) struct ModelTerms([Scalar; 3], (f32, f32));

/// What a layer's model terms are summed from besides `P` and the gradient: the dense route's
/// `ΓPΛ` (with the `G` it formed from the factors, where it did), or the factored route's
/// `m x m` pairs `[EU, AVᵀ, UᵀΓU, VΛVᵀ]` (each scaled by `1/m`: `⟨EU, AVᵀ⟩ = ⟨G, P⟩`,
/// `⟨UᵀΓU, VΛVᵀ⟩ = ⟨P, ΓPΛ⟩`).
pub(super) enum TermOperands {
    Dense {
        gpl: Matrix,
        formed_g: Option<Matrix>,
    },
    Factored([Matrix; 4]),
}

/// The model's terms of every layer of `ps` (`None` where a layer formed none; `grads` the
/// gradients `ps` were preconditioned from), with the dampings: every inner product of the
/// step in one [`Device::dots_deferred`] (deferred inside [`Device::deferred`]; on the kernel
/// devices one launch for all layers, each sum the bits of its own launch).
pub(super) fn model_terms(
    d: &Device,
    ps: &[Preconditioned],
    grads: &[KronGrad<'_>],
) -> Result<Vec<Option<ModelTerms>>> {
    let mut groups: Vec<Vec<(&Matrix, &Matrix)>> = Vec::new();
    for (pc, g) in ps.iter().zip(grads) {
        let p = &pc.p;
        match (&pc.operands, g.parts()) {
            (None, _) => {}
            (Some(TermOperands::Dense { gpl, formed_g }), parts) => {
                let g = match (formed_g, parts) {
                    (Some(g), _) | (None, Parts::Dense(g)) => g,
                    (None, Parts::Factored(_)) => {
                        return Err(crate::Error::Value {
                            op: "KronOptimizer::step",
                            arg: "grads",
                            value: f64::NAN,
                            expected: "the dense gradient the dense route preconditioned",
                        })
                    }
                };
                groups.push(vec![(g, p), (p, gpl), (p, p)]);
            }
            (Some(TermOperands::Factored([eu, awt, ugu, wlw])), _) => {
                groups.push(vec![(eu, awt), (ugu, wlw)]);
                groups.push(vec![(p, p)]);
            }
        }
    }
    let refs: Vec<&[(&Matrix, &Matrix)]> = groups.iter().map(Vec::as_slice).collect();
    let mut sums = vec![Scalar::default(); groups.iter().map(Vec::len).sum()];
    d.dots_deferred(&refs, &mut sums)?;
    let mut sums = sums.into_iter();
    Ok(ps
        .iter()
        .map(|pc| {
            pc.operands.as_ref()?;
            let t = [sums.next()?, sums.next()?, sums.next()?];
            Some(ModelTerms(t, pc.damping))
        })
        .collect())
}

impl ModelTerms {
    /// `q(δ) − q(0) = ⟨G, Δ⟩ + ½⟨Δ, ΓΔΛ⟩ + ½λ‖Δ‖²` for `Δ = −ηP`, `λ = λ_Λλ_Γ` (docs/math.md §2), in
    /// `f64`, with the values `r` resolves (`None` while a deferred one is unknown).
    pub fn model_change(&self, r: &Readout, eta: f32) -> Option<f64> {
        let [lin, curv, sq] = self.0.map(|s| r.get(s).map(f64::from));
        let (lin, curv, sq) = (lin?, curv?, sq?);
        let eta = eta as f64;
        let lambda = self.1 .0 as f64 * self.1 .1 as f64;
        Some(-eta * lin + 0.5 * eta * eta * (curv + lambda * sq))
    }
}

/// `P = Γ̃⁻¹GΛ̃⁻¹` for one layer (and the model terms when `with_model`), by the cheaper route.
/// Every operand is checked (state, or inputs checked by the caller): each product checks its
/// result only, so a non-finite `P` or term is an [`crate::Error::NonFinite`].
///
/// `spare`: a matrix of `P`'s shape the caller gives up (the layer's weights of the last step),
/// which the factored route writes `P` over instead of allocating it.
///
/// `output_change`: `Some(α)` asks for `α·A·Pᵀ` (`m x d_out`): for `α = −η`, the change of the
/// layer's outputs `A·W̄ᵀ` on the batch rows `A` of its factored gradient under the update
/// `W̄ ← W̄ − ηP`. The factored route with the model gives it as `α·(AVᵀ/m)·Uᵀ` from its own
/// `m x m` term (`P = UV/m`): one `m x m x d_out` product where `A·W̄'ᵀ` costs `m·d_in·d_out`.
/// `None` on the other routes (and for factors refactored by [`thin_factors`]).
pub(super) fn precondition(
    d: &Device,
    v: &LayerView<'_>,
    (g, [s0, s1]): (KronGrad<'_>, &[SplitCache; 2]),
    (with_model, output_change): (bool, Option<f32>),
    spare: Option<Matrix>,
) -> Result<Preconditioned> {
    let (o, i) = (v.gamma.dim(), v.lambda.dim());
    let rows_route = |x: &InverseView<'_>| matches!(x, InverseView::LowRank(..));
    let f = match g.parts() {
        Parts::Dense(g) => return dense(d, v, (g, s0), with_model),
        Parts::Factored(f) => f,
    };
    // New matrices (thinner factors, the dense gradient) are split by their first product.
    let fresh = SplitCache::default;
    let model = |grams, output_change| Model {
        with: with_model,
        grams,
        output_change,
    };
    // The rows' route (`low_rank.rs`) multiplies the batch factors themselves: fewer of them
    // where the layer's narrow side is narrower than the batch ([`thin_factors`], whose
    // factors are not the ones the Gram matrices are of).
    if rows_route(&v.gamma_inv) || rows_route(&v.lambda_inv) {
        return match thin_factors(d, v, f.e, f.a)? {
            Some((e, a)) => {
                let (se, sa) = (fresh(), fresh());
                factored(d, v, ((&e, &se), (&a, &sa)), model(None, None), spare)
            }
            None => factored(
                d,
                v,
                ((f.e, s0), (f.a, s1)),
                model(f.grams, output_change),
                spare,
            ),
        };
    }
    if factored_is_cheaper(&g, (o, i), with_model) {
        return factored(
            d,
            v,
            ((f.e, s0), (f.a, s1)),
            model(f.grams, output_change),
            spare,
        );
    }
    let g = gemm(d, Trans::Yes, Trans::No, 1.0 / f.e.rows() as f32, f.e, f.a)?;
    let mut pc = dense(d, v, (&g, &fresh()), with_model)?;
    if let Some(TermOperands::Dense { formed_g, .. }) = &mut pc.operands {
        *formed_g = Some(g);
    }
    Ok(pc)
}

/// What [`factored`] computes besides `P`: the model's terms (`with`), with the caller's Gram
/// matrices `(ee, aa)` of the factors ([`KronGrad::FactoredWithGrams`]) if any, and
/// [`precondition`]'s `output_change` (with the terms only).
#[derive(Clone, Copy)]
struct Model<'a> {
    with: bool,
    grams: Option<(&'a Matrix, &'a Matrix)>,
    output_change: Option<f32>,
}

/// The gradient `G = (1/m)EᵀA` of a layer with a narrow side `k = min(d_out, d_in) < m`
/// refactored by `k` rows: `Ẽ = I_k`, `Ã = (k/m)·EᵀA` (`d_out < d_in`), or `Ã = I_k`,
/// `Ẽ = (k/m)·AᵀE`; `(1/k)ẼᵀÃ = G` either way, so [`factored`] gives the same `P` and model
/// terms up to rounding. Every product of the factored route costs in proportion to the
/// factors' rows (the model's `m x m` terms less), so the route costs about `m_b·c` flops
/// for `m_b` rows with `c = 2·d_out·d_in` (forming `P`) plus per side `2n²` for a dense
/// inverse, `4n²` for a first-order one by products, `4m'·n` through `m'` rows. `Some` when
/// `(m − k)·c` exceeds the `2m·d_out·d_in` of forming `EᵀA`: e.g. the 10-wide output layer
/// of a 1024-wide MLP at batch 256, whose `1025`-wide input side the rows' route applies to
/// `k = 10` rows instead of 256 (0.27 GFLOP a step less). The route forced by the rows is the
/// one this serves: elsewhere [`factored_is_cheaper`] already forms `G` where that pays.
fn thin_factors(
    d: &Device,
    v: &LayerView<'_>,
    e: &Matrix,
    a: &Matrix,
) -> Result<Option<(Matrix, Matrix)>> {
    let (m, o, i) = (e.rows(), e.cols(), a.cols());
    let k = o.min(i);
    let side = |x: &InverseView<'_>, n: usize| -> usize {
        match x {
            InverseView::Dense { .. } => 2 * n * n,
            InverseView::FirstOrder { .. } => 4 * n * n,
            InverseView::LowRank(lr, _) => 4 * lr.rank() * n,
        }
    };
    let per_row = 2 * o * i + side(&v.gamma_inv, o) + side(&v.lambda_inv, i);
    if k >= m || (m - k).saturating_mul(per_row) <= 2 * m * o * i {
        return Ok(None);
    }
    let mut id = d.zeros(k, k)?;
    d.add_diagonal(&mut id, 1.0)?;
    let scale = k as f32 / m as f32;
    // The inputs were checked by the caller: the product checks its result.
    Ok(Some(if o <= i {
        (id, gemm(d, Trans::Yes, Trans::No, scale, e, a)?)
    } else {
        (gemm(d, Trans::Yes, Trans::No, scale, a, e)?, id)
    }))
}

/// `α·KᵀK` (the CPU's SYRK).
fn gram(d: &Device, k: &Matrix, alpha: f32) -> Result<Matrix> {
    d.product_valid_inputs(MatMul::new(Trans::Yes, Trans::No, alpha, k, k))
}

/// `x` as a product operand, with its kept split planes where it has them.
fn operand<'a>(d: &Device, x: &'a Matrix, kept: Option<&'a SplitCache>) -> Result<Operand<'a>> {
    match kept {
        Some(c) => d.kept_operand(x, c),
        None => d.operand(x),
    }
}

/// The dense factor `F` of `s` as a product operand, its split planes kept in `s` (`F` is
/// the same on every step between two refreshes).
fn factor_operand<'a>(d: &Device, s: &'a KronFactorState) -> Result<Operand<'a>> {
    d.kept_operand(s.dense_factor()?, &s.splits.factor)
}

/// `α·op(A)·op(B)` as a new matrix (operands already validated).
fn gemm(d: &Device, ta: Trans, tb: Trans, alpha: f32, a: &Matrix, b: &Matrix) -> Result<Matrix> {
    d.product_valid_inputs(MatMul::new(ta, tb, alpha, a, b))
}

/// The model's curvature on one side of a first-order inverse `X = X₀ − d·X₀²` applied by
/// products (module docs): `lin` the kept `EU` (`AVᵀ`), `u = U₀ − d·U₁`, `u0 = U₀`, and
/// `UᵀΓU = EU − λ₀·Uᵀ(U + (d/λ₀)·U₀)` (`(ta, tb)` orient the `m x m` product: `(Yes, No)`
/// for `U`, `d_out x m`, and `(No, Yes)` for `V`, `m x d_in`), scaled by `alpha`.
fn by_first_order(
    d: &Device,
    (lin, u, u0): (&Matrix, &Matrix, Matrix),
    (ta, tb): (Trans, Trans),
    alpha: f32,
    (lambda0, dl): (f32, f32),
) -> Result<Matrix> {
    let z = d.axpy_over(dl / lambda0, AxpyOver::X { x: u0, y: u })?;
    // `Uᵀ(U + c·U₀) = E(X² + cXX₀)Eᵀ` is symmetric (`X` and `X₀` commute).
    let uz = d.symmetric_product_of(MatMul::new(ta, tb, alpha, &d.operand(u)?, &d.operand(&z)?))?;
    d.axpy_over(-lambda0, AxpyOver::X { x: uz, y: lin })
}

/// The dense route: two products for `P`, two for `ΓPΛ`, or one where `Γ̃⁻¹` takes the
/// identity (module docs). Both inverses are dense here: the rows' route is planned only
/// for factored gradients, which take [`factored`] then.
fn dense(
    d: &Device,
    v: &LayerView<'_>,
    (g, g_planes): (&Matrix, &SplitCache),
    with_model: bool,
) -> Result<Preconditioned> {
    let (
        InverseView::Dense {
            x: gamma_inv,
            kept: kept_g,
            ..
        },
        InverseView::Dense {
            x: lambda_inv,
            kept: kept_l,
            ..
        },
    ) = (v.gamma_inv, v.lambda_inv)
    else {
        return Err(crate::Error::Value {
            op: "KronOptimizer::precondition",
            arg: "grads",
            value: f64::NAN,
            expected: "factored gradients where the low-rank or by-products route is planned",
        });
    };
    let no = Trans::No;
    // The inverses with their kept planes where they are the state's `X₀`.
    let (gamma_inv, lambda_inv) = (
        operand(d, gamma_inv, kept_g)?,
        operand(d, lambda_inv, kept_l)?,
    );
    // `G` with the planes its check wrote (`KronOptimizer::check_inputs`).
    let go = d.split_operand(g, g_planes)?;
    // A result read by the next product comes with the split planes the engine's epilogue
    // wrote (`Device::product_split_of`): that product splits nothing.
    let (p, gpl) = match (with_model, v.identity) {
        // `ΓP = T − λ_Γ·P` with `T = GΛ̃⁻¹`, `P = Γ̃⁻¹T` (module docs): one product by `Λ`.
        (true, (_, true)) => {
            let t = d.product_split_of(MatMul::new(no, no, 1.0, &go, &lambda_inv))?;
            let p = d.product_of(MatMul::new(
                no,
                no,
                1.0,
                &gamma_inv,
                &d.product_operand(&t)?,
            ))?;
            let y = t.into_matrix();
            let gp = d.axpy_over(-v.damping.1, AxpyOver::Y { x: &p, y })?;
            let lambda = factor_operand(d, v.lambda)?;
            let gpl = d.product_of(MatMul::new(no, no, 1.0, &d.operand(&gp)?, &lambda))?;
            (p, Some(gpl))
        }
        (false, _) => {
            let (o, i) = g.shape();
            let mut p = d.zeros(o, i)?;
            d.precondition_of((&gamma_inv, &go, &lambda_inv), &mut p, None)?;
            (p, None)
        }
        (true, _) => {
            let p = d.precondition_split_of((&gamma_inv, &go, &lambda_inv))?;
            let gamma = factor_operand(d, v.gamma)?;
            let gp =
                d.product_split_of(MatMul::new(no, no, 1.0, &gamma, &d.product_operand(&p)?))?;
            let lambda = factor_operand(d, v.lambda)?;
            let gpl = d.product_of(MatMul::new(no, no, 1.0, &d.product_operand(&gp)?, &lambda))?;
            (p.into_matrix(), Some(gpl))
        }
    };
    // The terms' pairs `(G, P)`, `(P, ΓPΛ)`, `(P, P)` are summed with every layer's.
    let operands = gpl.map(|gpl| TermOperands::Dense {
        gpl,
        formed_g: None,
    });
    Ok(Preconditioned {
        p,
        operands,
        output_change: None,
        damping: v.damping,
    })
}

/// The factored route of the module docs.
fn factored(
    d: &Device,
    v: &LayerView<'_>,
    ((e, se), (a, sa)): ((&Matrix, &SplitCache), (&Matrix, &SplitCache)),
    model: Model<'_>,
    spare: Option<Matrix>,
) -> Result<Preconditioned> {
    let with_model = model.with;
    let (ee, aa) = model.grams.unzip();
    let m = e.rows();
    // Each operand prepared once (on the kernel devices: split into bf16 planes once, where
    // every product would split both of its operands again, or by the inputs' check):
    // `e`, `a`, `U` and `W` are read by up to four products each.
    let (eo, ao) = (d.split_operand(e, se)?, d.split_operand(a, sa)?);
    let (no, yes) = (Trans::No, Trans::Yes);
    let inv_m = 1.0 / m as f32;
    // `U = Γ̃⁻¹Eᵀ` (`d_out x m`) dense, or `Uᵀ = E·Γ̃⁻¹` (`m x d_out`) through the rows with
    // `K_Γ = R_Γ·U` (and `EU` from the caller's `EEᵀ`); `t_u` says which one `u` holds. A
    // first-order inverse by products keeps `U₀ = X₀Eᵀ` (and `W₀ = AX₀`) for the model.
    // The two sides are independent tasks (`tasks.rs`).
    let ((u, t_u, k_gamma, u0, eu_rows), (w, k_lambda, w0, awt_rows)) = tasks::join(
        d,
        || match v.gamma_inv {
            InverseView::Dense { x, kept, .. } => Ok((
                d.product_split_of(MatMul::new(no, yes, 1.0, &operand(d, x, kept)?, &eo))?,
                no,
                None,
                None,
                None,
            )),
            InverseView::FirstOrder {
                x0, kept, d: dl, ..
            } => {
                let x0 = d.kept_operand(x0, kept)?;
                let u0 = d.product_split_of(MatMul::new(no, yes, 1.0, &x0, &eo))?;
                let u1 = d.product_of(MatMul::new(no, no, 1.0, &x0, &d.product_operand(&u0)?))?;
                let u0 = u0.into_matrix();
                let u = d.axpy_over(-dl, AxpyOver::X { x: u1, y: &u0 })?;
                Ok((Product::new(u), no, None, Some(u0), None))
            }
            InverseView::LowRank(lr, t) => {
                let r = lr.right(d, t, e, with_model, ee)?;
                Ok((Product::new(r.yx), yes, r.k, None, r.linear))
            }
        },
        || match v.lambda_inv {
            InverseView::Dense { x, kept, .. } => Ok((
                d.product_split_of(MatMul::new(no, no, 1.0, &ao, &operand(d, x, kept)?))?,
                None,
                None,
                None,
            )),
            InverseView::FirstOrder {
                x0, kept, d: dl, ..
            } => {
                let x0 = d.kept_operand(x0, kept)?;
                let w0 = d.product_split_of(MatMul::new(no, no, 1.0, &ao, &x0))?;
                let w1 = d.product_of(MatMul::new(no, no, 1.0, &d.product_operand(&w0)?, &x0))?;
                let w0 = w0.into_matrix();
                let w = d.axpy_over(-dl, AxpyOver::X { x: w1, y: &w0 })?;
                Ok((Product::new(w), None, Some(w0), None))
            }
            InverseView::LowRank(lr, t) => {
                let r = lr.right(d, t, a, with_model, aa)?;
                Ok((Product::new(r.yx), r.k, None, r.linear))
            }
        },
    )?;
    let (uo, wo) = (d.product_operand(&u)?, d.product_operand(&w)?);
    // Checked by the update it feeds (`Device::axpy_over`), and by the model's `‖P‖²`.
    let p = d.product_consumed_over(MatMul::new(t_u, no, inv_m, &uo, &wo), spare)?;
    let (operands, output_change) = if with_model {
        // Each m x m pair scaled by 1/m so the inner products need no further 1/m². The Γ
        // side's two products and the Λ side's are independent tasks.
        let (lambda_l, lambda_g) = v.damping;
        let ((eu, ugu), (awt, wlw)) = tasks::join(
            d,
            || {
                // `EU = E·Γ̃⁻¹·Eᵀ` and every `UᵀΓU` below are symmetric (module docs).
                let eu = match eu_rows {
                    Some(eu) => eu,
                    None => d.symmetric_product_of(MatMul::new(no, t_u, inv_m, &eo, &uo))?,
                };
                // `UᵀΓU`: through the rows `KᵀK/m'` (`Γ = R_ΓᵀR_Γ/m'`), by `X₀`'s identity
                // for a first-order inverse, by the identity `EU − λ·UᵀU` (`u` is `U` on the
                // dense side), else by the factor.
                let ugu = match (&k_gamma, u0, v.gamma_inv) {
                    (Some(k), ..) => gram(d, k, inv_m / k.rows() as f32)?,
                    (None, Some(u0), InverseView::FirstOrder { lambda0, d: dl, .. }) => {
                        let u = u.matrix();
                        by_first_order(d, (&eu, u, u0), (yes, no), inv_m, (lambda0, dl))?
                    }
                    (None, ..) if v.identity.1 => {
                        let utu = gram(d, u.matrix(), inv_m)?;
                        d.axpy_over(-lambda_g, AxpyOver::X { x: utu, y: &eu })?
                    }
                    (None, ..) => {
                        let gamma = factor_operand(d, v.gamma)?;
                        let gu = d.product_split_of(MatMul::new(no, no, 1.0, &gamma, &uo))?;
                        let gu = d.product_operand(&gu)?;
                        d.symmetric_product_of(MatMul::new(yes, no, inv_m, &uo, &gu))?
                    }
                };
                Ok((eu, ugu))
            },
            || {
                let awt = match awt_rows {
                    Some(awt) => awt,
                    None => d.symmetric_product_of(MatMul::new(no, yes, inv_m, &ao, &wo))?,
                };
                let wlw = match (&k_lambda, w0, v.lambda_inv) {
                    (Some(k), ..) => gram(d, k, inv_m / k.rows() as f32)?,
                    (None, Some(w0), InverseView::FirstOrder { lambda0, d: dl, .. }) => {
                        let w = w.matrix();
                        by_first_order(d, (&awt, w, w0), (no, yes), inv_m, (lambda0, dl))?
                    }
                    // `VΛVᵀ = AVᵀ − λ·VVᵀ` (`AVᵀ = AΛ̃⁻¹Aᵀ` is symmetric).
                    (None, ..) if v.identity.0 => {
                        let vvt = d.product_of(MatMul::new(no, yes, inv_m, &wo, &wo))?;
                        d.axpy_over(-lambda_l, AxpyOver::X { x: vvt, y: &awt })?
                    }
                    (None, ..) => {
                        let lambda = factor_operand(d, v.lambda)?;
                        let wl = d.product_split_of(MatMul::new(no, no, 1.0, &wo, &lambda))?;
                        let wl = d.product_operand(&wl)?;
                        d.symmetric_product_of(MatMul::new(no, yes, inv_m, &wl, &wo))?
                    }
                };
                Ok((awt, wlw))
            },
        )?;
        // `A·Pᵀ = (AVᵀ/m)·Uᵀ` (`u` holds `Uᵀ` where `t_u` is `Yes`). The CPU does not check
        // it (a non-finite change makes the loss after the step non-finite where it is
        // evaluated); the kernel devices' epilogue does, as for every product.
        let output_change = match model.output_change {
            Some(alpha) => {
                let tu = if t_u == yes { no } else { yes };
                Some(d.product_consumed(MatMul::new(no, tu, alpha, &d.operand(&awt)?, &uo))?)
            }
            None => None,
        };
        // The two `m x m` pairs, and `(P, P)`, are summed with every layer's.
        (
            Some(TermOperands::Factored([eu, awt, ugu, wlw])),
            output_change,
        )
    } else {
        (None, None)
    };
    Ok(Preconditioned {
        p,
        operands,
        output_change,
        damping: v.damping,
    })
}
