//! Replaced factors applied through their statistics rows (the CPU's low-rank route).
//!
//! # Why
//! A factor replaced at a refresh (`ε = 0`, SPEC's default) from `m ≤ n/2` rows is
//! `F = RᵀR/m` of rank `≤ m`, and every inverse a lazy step uses — `X₀ = (F + λ₀I)⁻¹` and
//! SPEC §2's first-order `X₀ − (λ − λ₀)·X₀²` — is `g₀·I + RᵀHR` with an `m x m` `H`
//! ([`crate::cpu::LowRankKernel`]). Applied to a batch factor `Y` (`m_b x n`):
//! `Y·X = g₀·Y + ((Y·Rᵀ)·H)·R`, `4·m·m_b·n` flops against the dense `2n²·m_b` (half at
//! `m = m_b = 256`, `n = 1024`), and the quadratic model's curvature `UᵀΓU` is
//! `(R·U)ᵀ(R·U)/m` with `R·U = T·(R·Yᵀ)`, an `m x m` product, where the dense route multiplies
//! by the `n x n` factor. A new damping target costs `O(m²)` (the dense route: an axpy over
//! `n²` and, once per formation, the `n³` square `X₀²`). The same operator as the dense
//! first-order inverse, so the same step up to rounding.
//!
//! The state keeps the dense factor and the Woodbury inverse as before (what
//! [`super::KronOptimizer::state`] reports and the checkpoint stores); the rows ride along as
//! a crate-private cache that the state's copies leave out (a restored or loaded optimizer
//! takes the dense route until its next refresh: the same step, other rounding).

use super::layer::Rows;
use crate::cpu::LowRankKernel;
use crate::device::{Device, Matrix};
use crate::error::Result;
use crate::mat::Trans;
use crate::ops::host_ref;
use crate::optim::StatsView;

/// A replaced factor's rows `R` (`m x n`, as the SYRK read them, widened to `f32`) and the
/// `m x m` kernel of its inverse at the formation damping.
#[derive(Debug)]
pub(crate) struct LowRank {
    rows: Matrix,
    kernel: LowRankKernel,
    /// The inverse's terms at the formation damping `λ₀`.
    formed: Terms,
    /// The last first-order terms and their target (a cache, like the dense route's).
    pub(super) retargeted: Option<Terms>,
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
    /// The rows `rows` of a factor replaced at this refresh, its inverse formed at `damping`,
    /// and that inverse `(F + λI)⁻¹` (`n x n`, [`crate::cpu::low_rank_damped_inverse`]'s),
    /// both from one Gram matrix of the rows.
    pub fn form(rows: &Rows<'_>, damping: f32) -> Result<(Self, Matrix)> {
        let (m, n) = rows.view().shape();
        let (rows, (kernel, inverse)) = match rows.view() {
            StatsView::F32(x) => (
                x.try_clone()?,
                LowRankKernel::with_inverse(host_ref(x)?, damping)?,
            ),
            StatsView::Bf16(x) => {
                let wide: Vec<f32> = x.to_vec()?.iter().map(|v| v.to_f32()).collect();
                let formed = LowRankKernel::with_inverse(host_ref(x)?, damping)?;
                (Matrix::from_host_vec(m, n, wide)?, formed)
            }
        };
        Ok((Self::with_kernel(rows, kernel)?, inverse_matrix(inverse)?))
    }

    /// The same rows with the inverse formed again at `damping` (a lazy recompute), and that
    /// inverse.
    pub fn reformed(&self, damping: f32) -> Result<(Self, Matrix)> {
        let (kernel, inverse) = self
            .kernel
            .reformed_with_inverse(host_ref(&self.rows)?, damping)?;
        let rows = self.rows.try_clone()?;
        Ok((Self::with_kernel(rows, kernel)?, inverse_matrix(inverse)?))
    }

    fn with_kernel(rows: Matrix, kernel: LowRankKernel) -> Result<Self> {
        Ok(Self {
            formed: terms(&kernel, kernel.damping())?,
            rows,
            kernel,
            retargeted: None,
        })
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
    /// T·(R·Yᵀ)` (`m x m_b`), whose Gram `KᵀK/m` is `(Y·X)·F·(Y·X)ᵀ`. `y` is checked by the
    /// caller; each product checks its result.
    pub fn right(
        &self,
        d: &Device,
        t: &Terms,
        y: &Matrix,
        model: bool,
    ) -> Result<(Matrix, Option<Matrix>)> {
        let (no, yes) = (Trans::No, Trans::Yes);
        let c = d.product_valid_inputs(no, yes, 1.0, &self.rows, y)?;
        let hc = d.product_valid_inputs(no, no, 1.0, &t.h, &c)?;
        let yx = d.axpy_new(
            t.g0,
            y,
            &d.product_valid_inputs(yes, no, 1.0, &hc, &self.rows)?,
        )?;
        let k = if model {
            Some(d.product_valid_inputs(no, no, 1.0, &t.t, &c)?)
        } else {
            None
        };
        Ok((yx, k))
    }
}

/// A host inverse as a device matrix (the CPU's: a move).
fn inverse_matrix(x: crate::mat::Mat) -> Result<Matrix> {
    let (n, _) = x.shape();
    Matrix::from_host_vec(n, n, x.into_vec())
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
