//! Replaced factors applied through their statistics rows (the CPU's low-rank route).
//!
//! # Why
//! A factor replaced at a refresh (`ε = 0`, docs/math.md §1's default) from `m ≤ n/2` rows is
//! `F = RᵀR/m` of rank `≤ m`, and every inverse a lazy step uses — `X₀ = (F + λ₀I)⁻¹` and
//! docs/math.md §2's first-order `X₀ − (λ − λ₀)·X₀²` — is `g₀·I + RᵀHR` with an `m x m` `H`
//! ([`crate::cpu::LowRankKernel`]). Applied to a batch factor `Y` (`m_b x n`):
//! `Y·X = g₀·Y + ((Y·Rᵀ)·H)·R`, `4·m·m_b·n` flops against the dense `2n²·m_b` (half at
//! `m = m_b = 256`, `n = 1024`), and the quadratic model's curvature `UᵀΓU` is
//! `(R·U)ᵀ(R·U)/m` with `R·U = T·(R·Yᵀ)`, an `m x m` product, where the dense route multiplies
//! by the `n x n` factor. A new damping target costs `O(m²)` (the dense route: an axpy over
//! `n²` and, once per formation, the `n³` square `X₀²`). The same operator as the dense
//! first-order inverse, so the same step up to rounding.
//!
//! The dense inverse (the Woodbury inverse, `f64`, `~2m²n + mn²` flops and an `n x n`
//! rounding pass) is formed only when something reads it — a dense gradient,
//! [`super::KronOptimizer::state`] (so the checkpoint stores it) — with the bits it had when
//! every refresh formed it. So is RING's dense factor (its SYRK, `mn²` flops, and two `n x n`
//! zero-fills): RING's `‖F‖₂` comes from the rows' `m x m` Gram matrix, and nothing else of
//! a factored step reads `F` (NGD keeps forming it for its trace, RENG reads neither). The
//! rows ride along as a crate-private part that the state's copies leave out (a restored or
//! loaded optimizer takes the dense route until its next refresh: the same step, other
//! rounding).

use std::sync::OnceLock;

use super::rows::{replaced_factor, Rows};
use crate::cpu::LowRankKernel;
use crate::device::{Device, Matrix};
use crate::error::Result;
use crate::mat::Trans;
use crate::ops::elementwise::AxpyOver;
use crate::ops::host_ref;
use crate::optim::StatsView;
use crate::shape::MatMul;

/// A replaced factor's rows `R` (`m x n`, as the SYRK read them, widened to `f32`), the
/// `m x m` kernel of its inverse at the formation damping, and that inverse's dense form
/// once something needed it.
#[derive(Debug)]
pub(crate) struct LowRank {
    rows: Matrix,
    kernel: LowRankKernel,
    /// The inverse's terms at the formation damping `λ₀`.
    formed: Terms,
    /// The last first-order terms and their target (a cache, like the dense route's).
    pub(super) retargeted: Option<Terms>,
    /// The dense `X₀ = (F + λ₀I)⁻¹`, formed on first need ([`LowRank::dense_inverse`]).
    dense: OnceLock<Matrix>,
    /// The dense factor `F = RᵀR/m` of a state that left it to the rows, formed on first
    /// need ([`LowRank::dense_factor`]).
    factor: OnceLock<Matrix>,
}

/// `X(λ) = g₀·I + RᵀHR` and `R·X(λ) = T·R` at the damping `λ` (on the CPU).
#[derive(Debug)]
pub(crate) struct Terms {
    pub damping: f32,
    g0: f32,
    h: Matrix,
    t: Matrix,
}

impl LowRank {
    /// The rows `rows` of a factor replaced at this refresh, its inverse formed at `damping`
    /// (the `m x m` kernel; the dense inverse is left for [`LowRank::dense_inverse`]).
    pub fn form(rows: &Rows<'_>, damping: f32) -> Result<Self> {
        // `bf16` rows widen exactly, so the kernel of the `f32` copy is the kernel of the rows.
        let rows = match rows.view() {
            StatsView::F32(x) => x.try_clone()?,
            StatsView::Bf16(x) => crate::ops::gemm::widen(x)?,
        };
        let kernel = LowRankKernel::new(host_ref(&rows)?, damping)?;
        Self::with_kernel(rows, kernel)
    }

    /// The same rows with the inverse formed again at `damping` (a lazy recompute).
    pub fn reformed(&self, damping: f32) -> Result<Self> {
        Self::with_kernel(self.rows.try_clone()?, self.kernel.reformed(damping)?)
    }

    fn with_kernel(rows: Matrix, kernel: LowRankKernel) -> Result<Self> {
        Ok(Self {
            formed: terms(&kernel, kernel.damping())?,
            rows,
            kernel,
            retargeted: None,
            dense: OnceLock::new(),
            factor: OnceLock::new(),
        })
    }

    /// The dense inverse `X₀` (`n x n`) as [`crate::cpu::low_rank_damped_inverse`] computes it
    /// from the rows (the same bits), formed at the first call: for a dense gradient or a copy
    /// of the state, never on the rows' route itself.
    pub fn dense_inverse(&self) -> Result<&Matrix> {
        if let Some(x) = self.dense.get() {
            return Ok(x);
        }
        let x = self.kernel.inverse(host_ref(&self.rows)?)?;
        let (n, _) = x.shape();
        let x = Matrix::from_host_vec(n, n, x.into_vec())?;
        Ok(self.dense.get_or_init(|| x))
    }

    /// The factor `F = RᵀR/m` (`n x n`) by the refresh's SYRK of the rows
    /// ([`super::layer::replaced_factor`]: `bf16` rows widen exactly, so the same bits),
    /// formed at the first call: for a state that left it to the rows, when something reads
    /// it (a dense gradient, a copy of the state).
    pub fn dense_factor(&self) -> Result<&Matrix> {
        if let Some(f) = self.factor.get() {
            return Ok(f);
        }
        let rows = Rows::Given(StatsView::F32(&self.rows));
        let f = replaced_factor(&Device::Cpu, &rows)?;
        Ok(self.factor.get_or_init(|| f))
    }

    /// The dense factor, if [`LowRank::dense_factor`] formed it.
    pub fn into_dense_factor(self: Box<Self>) -> Option<Matrix> {
        self.factor.into_inner()
    }

    /// `m`, the number of rows.
    pub fn rank(&self) -> usize {
        self.rows.rows()
    }

    /// `n`, the rows' width.
    pub fn dim(&self) -> usize {
        self.rows.cols()
    }

    /// The first-order terms at `target` (`X₀ − (target − λ₀)·X₀²`).
    pub fn terms_at(&self, target: f32) -> Result<Terms> {
        terms(&self.kernel, target)
    }

    /// The terms as formed (at `λ₀`).
    pub fn formed(&self) -> &Terms {
        &self.formed
    }

    /// `Y·X(λ)` for the batch factor `y` (`m_b x n`) and, with `model`, `K = R·(Y·X(λ))ᵀ =
    /// T·(R·Yᵀ)` (`m x m_b`), whose Gram `KᵀK/m` is `(Y·X)·F·(Y·X)ᵀ`. With `gram` = `YYᵀ/m_b`
    /// too (the caller's, [`super::KronGrad::FactoredWithGrams`]), also the model's linear
    /// factor `Y·X·Yᵀ/m_b = g₀·gram + CᵀHC/m_b` with `C = R·Yᵀ`: two `m x m x m_b` products in
    /// place of an `m_b x m_b x n` one. `y` is checked by the caller; each product checks
    /// its result.
    pub fn right(
        &self,
        d: &Device,
        t: &Terms,
        y: &Matrix,
        model: bool,
        gram: Option<&Matrix>,
    ) -> Result<Applied> {
        let (no, yes) = (Trans::No, Trans::Yes);
        let c = d.product_valid_inputs(MatMul::new(no, yes, 1.0, &self.rows, y))?;
        let hc = d.product_valid_inputs(MatMul::new(no, no, 1.0, &t.h, &c))?;
        let hco = d.operand(&hc)?;
        // The correction is checked by the axpy it feeds.
        let corr = d.product_consumed(MatMul::new(yes, no, 1.0, &hco, &d.operand(&self.rows)?))?;
        let yx = d.axpy_over(t.g0, AxpyOver::Y { x: y, y: corr })?;
        let k = if model {
            Some(d.product_valid_inputs(MatMul::new(no, no, 1.0, &t.t, &c))?)
        } else {
            None
        };
        let linear = match gram.filter(|_| model) {
            // `CᵀHC` is symmetric (`H` is).
            Some(g) => {
                let inv_m = 1.0 / y.rows() as f32;
                let chc =
                    d.symmetric_product_of(MatMul::new(yes, no, inv_m, &d.operand(&c)?, &hco))?;
                Some(d.axpy_over(t.g0, AxpyOver::Y { x: g, y: chc })?)
            }
            None => None,
        };
        Ok(Applied { yx, k, linear })
    }
}

/// What [`LowRank::right`] gives.
pub(crate) struct Applied {
    /// `Y·X(λ)`, `m_b x n`.
    pub yx: Matrix,
    /// `K = R·(Y·X(λ))ᵀ`, `m x m_b`, with the model.
    pub k: Option<Matrix>,
    /// `Y·X(λ)·Yᵀ/m_b`, `m_b x m_b`, with the model and the caller's Gram matrix.
    pub linear: Option<Matrix>,
}

/// What a factor state's `inverse` holds while its [`LowRank`] forms the dense inverse on
/// demand: an empty matrix. Readers go through
/// [`super::KronFactorState::dense_inverse`].
pub(crate) fn deferred() -> Result<Matrix> {
    Matrix::from_host_vec(0, 0, Vec::new())
}

fn terms(kernel: &LowRankKernel, damping: f32) -> Result<Terms> {
    let m = kernel.rows();
    let t = kernel.at(damping)?;
    Ok(Terms {
        damping,
        g0: t.g0,
        h: Matrix::from_host_vec(m, m, t.h)?,
        t: Matrix::from_host_vec(m, m, t.t)?,
    })
}
