//! Exact inverse of a damped Gram matrix of low rank by the Woodbury identity, in `f64`:
//! `(λI + XᵀX/m)⁻¹` from the `m x n` rows `X` when `m` is well below `n`, at a fraction of a
//! Cholesky inverse's `~n³` flops.
//!
//! # Algorithm
//! With `U = X/√m`, `(λI + UᵀU)⁻¹ = (1/λ)·(I − Wᵀ W)`, `W = L⁻¹U`, `L Lᵀ = λI_m + U Uᵀ`
//! (push-through: `Uᵀ(λI + UUᵀ)⁻¹U = I − λ(λI + UᵀU)⁻¹`). The scaling is folded into the
//! small system — `K = X Xᵀ + mλ·I_m = m(λI_m + UUᵀ)`, `W = L_K⁻¹ X` — so `X` is used exactly
//! as widened. Flops: `m²n` (lower triangle of `X Xᵀ`) + `m³/3` (Cholesky of `K`) + `m²n`
//! (triangular solve) + `mn²` (lower triangle of `Wᵀ W`), against `~n³` for the Cholesky
//! inverse of `F + λI` ([`super::cholesky_inverse`]: `n³/3` factor, `2n³/3` inverse), so it
//! pays below `m ≈ 0.48n` by flop count; [`low_rank_is_cheaper`] has the measured crossover.
//!
//! # Error
//! `X` widens exactly; everything runs in `f64` and is rounded once to `f32`. The computed
//! `L`, `W` are exact for a perturbed `K + E`, `‖E‖ ≲ c·(m + n)·ε_f64·‖|X||X|ᵀ‖₂` (the Gram's
//! sums of `n` products; Cholesky and the triangular solve are backward stable), which moves
//! `WᵀW = XᵀK⁻¹X` by about `‖W‖₂²·‖E‖/λ_min(K) ≤ c·(m + n)·ε_f64·κ` (`‖W‖₂ < 1`,
//! `λ_min(K) ≥ mλ`), `κ = (λ + ‖|X||X|ᵀ‖₂/m)/λ`: the condition number `(λ + ‖F‖₂)/λ` of
//! `F + λI`, `F = XᵀX/m`, up to the signs of `X` (and at most `(λ + tr F)/λ`). The
//! cancellation in `I − WᵀW` — its eigenvalues `λ/(λ + s)`, for the eigenvalues `s` of `F`,
//! are tiny where `s ≫ λ` — keeps this absolute: `c·(m + n)·ε_f64·κ/λ`, i.e.
//! `c·(m + n)·ε_f64·κ·‖Z‖₂` on the result `Z` (`‖Z‖₂ ≤ 1/λ`, equal when `m < n`). That is
//! the order, `ε_f64·κ` relative to `‖Z‖₂`, of the Cholesky inverse of `F + λI`, and below
//! `κ ≈ 5·10⁸/(m + n)` it is under the final `f32` rounding. The Cholesky path also inverts
//! the `f32`-rounded factor; this one the exact Gram matrix of the rows.
//! `tests/cpu_woodbury.rs` checks the bound against an `f64` reference.

use std::sync::OnceLock;

use faer::linalg::matmul::triangular::{matmul, BlockStructure};
use faer::linalg::triangular_solve::solve_lower_triangular_in_place;
use faer::Accum;
use rayon::prelude::*;

use super::cholesky::{factor, faer_par, widen_finite};
use crate::element::Element;
use crate::error::{check_shape, check_value, try_vec, Result};
use crate::mat::{Mat, MatRef};
use crate::shape::check_batch;

/// Whether [`low_rank_damped_inverse`] of `m` rows is expected to beat the Cholesky inverse
/// of the formed `n x n` damped factor ([`super::cholesky_inverse`]): `m ≤ n/2` and
/// `n > 64`.
///
/// By flop count (module docs: `2m²n + mn² + m³/3` against `n³`) the two meet at
/// `m ≈ 0.48n`. Measured (least time of 30–200 interleaved repetitions on the 2-core
/// AVX-512 machine of `docs/benchmarks.md` §3, under load), the low-rank path still wins at
/// `m = n/2` — 1.2x at n = 1024, 1.5–2.1x at n = 256, 1.7x at n = 128 — and breaks even near
/// `m ≈ 0.6–0.7n`: its work is GEMM-shaped, while half of the Cholesky inverse's is the less
/// efficient inversion of the factor. At m = 256: ~4x at n = 1024, 2.5x at 785; at
/// `m = n/4`, 4.3x at n = 256. Up to n = 64 its fixed costs (four faer calls, a parallel
/// rounding pass) eat the cubic saving (0.3–1.2x, tens of microseconds either way); from
/// n = 72 on it wins (1.2x, then 1.9x at n = 80). `m ≤ n/2`, `n > 64` stays on the safe
/// side of both.
pub fn low_rank_is_cheaper(m: usize, n: usize) -> bool {
    const MIN_N: usize = 64;
    n > MIN_N && 2 * m <= n
}

/// `(XᵀX/m + λI)⁻¹` (`n x n`) for the rows `X` (`m x n`, `f32` or `bf16`) and the damping
/// `λ` by the Woodbury identity in `f64` (module docs), rounded once to `f32`, exactly
/// symmetric. Exact for any `m ≥ 1`; cheaper than [`super::cholesky_inverse`] of the formed
/// factor when [`low_rank_is_cheaper`]. Accuracy: `~(m + n)·ε_f64·κ` relative to `1/λ`
/// before the final rounding, `κ ≈ (λ + ‖XᵀX/m‖₂)/λ` (module docs). Beyond `κ ~ 1/ε_f64`
/// the result means nothing (or the factorization fails, below).
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) when `m = 0`,
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `x` (found while it is
/// widened), [`Error::Value`](crate::Error::Value)
/// unless `λ` is a normal positive `f32` (so `1/λ`, the inverse's norm, fits `f32`),
/// [`Error::OutOfMemory`](crate::Error::OutOfMemory) when a buffer cannot be allocated.
/// [`Error::NotSpd`](crate::Error::NotSpd) if the Cholesky factorization of
/// `XXᵀ + mλI` fails: it cannot in exact arithmetic (its eigenvalues are at least
/// `mλ > 0`), and in `f64` only if rounding made a pivot non-positive, which needs
/// `κ ≳ 1/ε_f64`.
pub fn low_rank_damped_inverse<T: Element>(x: MatRef<'_, T>, lambda: f32) -> Result<Mat> {
    const OP: &str = "cpu::low_rank_damped_inverse";
    let work = check_rows(OP, x, lambda)?;
    super::on_pool(work, || {
        let (m, n) = x.shape();
        let w = widen_finite(OP, "x", x)?;
        let xxt = gram_lower(&w, m, n)?;
        woodbury(OP, w, &xxt, m, n, lambda)
    })
}

/// The argument checks of [`low_rank_damped_inverse`]; returns the multiply-adds of its
/// largest product (the `n x n` SYRK, `m·n²/2`), for [`super::on_pool`].
fn check_rows<T: Element>(op: &'static str, x: MatRef<'_, T>, lambda: f32) -> Result<usize> {
    let (m, n) = x.shape();
    check_batch(op, "x", (m, n))?;
    check_damping(op, lambda)?;
    Ok(m.saturating_mul(n).saturating_mul(n) / 2)
}

/// A damping the inverse's norm `1/λ` fits `f32` for.
fn check_damping(op: &'static str, lambda: f32) -> Result<()> {
    check_value(
        op,
        "lambda",
        lambda as f64,
        lambda.is_normal() && lambda > 0.0,
        "a normal lambda > 0 (1/lambda, the inverse's norm, fits f32)",
    )
}

/// The lower triangle of `XXᵀ` (row-major `m x m`, the strict upper triangle zero) of the
/// widened row-major rows `w` (`m x n`).
fn gram_lower(w: &[f64], m: usize, n: usize) -> Result<Vec<f64>> {
    let mut g = try_vec(m, m, 0.0f64)?;
    let xv = faer::MatRef::from_row_major_slice(w, m, n);
    // One thread for small factors, as for the Cholesky (`faer_par`): faer's parallel
    // products at n = 65 cost more in rayon hand-offs than they compute.
    matmul(
        faer::MatMut::from_row_major_slice_mut(&mut g, m, m),
        BlockStructure::TriangularLower,
        Accum::Replace,
        xv,
        BlockStructure::Rectangular,
        xv.transpose(),
        BlockStructure::Rectangular,
        1.0,
        faer_par(n),
    );
    Ok(g)
}

/// [`low_rank_damped_inverse`] after its checks, from the widened rows `w` (`m x n`,
/// row-major; solved in place into `W`) and the lower triangle of their Gram `xxt = XXᵀ`.
fn woodbury(
    op: &'static str,
    mut w: Vec<f64>,
    xxt: &[f64],
    m: usize,
    n: usize,
    lambda: f32,
) -> Result<Mat> {
    let par = faer_par(n);
    // Row-major: K (m x m), R (n x n).
    let mut k = try_vec(m, m, 0.0f64)?;
    k.copy_from_slice(xxt);
    let shift = m as f64 * lambda as f64;
    (0..m).for_each(|i| k[i * m + i] += shift);
    // `factor` reads the lower triangle only, the one computed.
    let l = factor(op, &k, m)?;
    solve_lower_triangular_in_place(
        l.as_ref(),
        faer::MatMut::from_row_major_slice_mut(&mut w, m, n),
        par,
    );
    let mut r = try_vec(n, n, 0.0f64)?;
    let wv = faer::MatRef::from_row_major_slice(&w, m, n);
    let inv_lambda = 1.0 / lambda as f64;
    matmul(
        faer::MatMut::from_row_major_slice_mut(&mut r, n, n),
        BlockStructure::TriangularLower,
        Accum::Replace,
        wv.transpose(),
        BlockStructure::Rectangular,
        wv,
        BlockStructure::Rectangular,
        -inv_lambda,
        par,
    );
    round_mirrored(&r, n, inv_lambda)
}

/// The row-major `n x n` `f32` matrix whose both triangles are the lower one of `r` (row-major
/// `f64`), `diag` added to the diagonal, each entry rounded once: exactly symmetric. The lower
/// triangle is rounded row by row (contiguous, vectorized; one rayon task per block of rows),
/// then mirrored by the SYRK's tiled transposes ([`super::syrk::mirror_lower`]): only `r`'s
/// lower half is read. Element by element with a strided read of the upper half it took
/// 1.3 ms at n = 1024 on 2 cores, a tenth of a RING refresh's inverse time.
fn round_mirrored(r: &[f64], n: usize, diag: f64) -> Result<Mat> {
    const ROWS: usize = 16;
    let mut out = try_vec(n, n, 0.0f32)?;
    // `max(1)`: a chunk size of 0 panics, and n = 0 leaves nothing to write.
    out.par_chunks_mut((ROWS * n).max(1))
        .enumerate()
        .for_each(|(b, rows)| {
            for (di, row) in rows.chunks_mut(n).enumerate() {
                let i = b * ROWS + di;
                let src = &r[i * n..i * n + i + 1];
                row[..=i]
                    .iter_mut()
                    .zip(src)
                    .for_each(|(o, &v)| *o = v as f32);
                row[i] = (diag + src[i]) as f32;
            }
        });
    let mut out = Mat::from_vec(out, n, n)?;
    super::syrk::mirror_lower(out.as_mut());
    Ok(out)
}

/// The `m x m` part of the Woodbury form of `X₀ = (F + λ₀I)⁻¹`, `F = XᵀX/m`, for applying
/// `X₀` — and docs/math.md §2's first-order update `X₀ − (λ − λ₀)·X₀²` of it — through the rows `X`
/// (`m x n`) without forming any `n x n` matrix.
///
/// # Algorithm
/// With `Ĝ = XXᵀ/m` (`m x m`), `FXᵀ = XᵀĜ`, so every function `g` of `F` is
/// `g(F) = g(0)·I + Xᵀ·h(Ĝ)·X/m` with `h(s) = (g(s) − g(0))/s`. For `B = (Ĝ + λ₀I)⁻¹`:
/// - `X₀`: `g(s) = 1/(s + λ₀)`, `h(Ĝ) = −B/λ₀`;
/// - `X₀²`: `h(Ĝ) = −(B + λ₀B²)/λ₀²`;
///
/// so `X(λ) = X₀ − Δ·X₀²` (`Δ = λ − λ₀`) is `g₀·I + XᵀHX` with `g₀ = 1/λ₀ − Δ/λ₀²` and
/// `H = (−B/λ₀ + Δ·(B/λ₀² + B²/λ₀))/m`: the same operator as the dense first-order inverse,
/// exactly. Also `X·X(λ) = T·X` with `T = B − Δ·B²` (push-through: `X(F + λ₀I)⁻¹ =
/// (Ĝ + λ₀I)⁻¹X`), which the quadratic model's curvature reads without cancellation.
///
/// # Error
/// `Ĝ`, `B`, `B²` are `f64` (backward-stable Gram, Cholesky and inverse: relative error
/// `~m·ε_f64·κ`, `κ = (λ₀ + ‖Ĝ‖₂)/λ₀`), `g₀`, `H` and `T` are rounded once to `f32`. Applied
/// in `f32` (`g₀·Y + ((Y·Xᵀ)·H)·X`), the cancellation between `g₀·Y` and the correction along
/// the large eigenvalues of `F` leaves an error of order `2⁻²⁴·(n + m)·κ·‖Y‖/λ₀`: the order of
/// the `f32`-rounded dense inverse times `Y` (its entries carry `2⁻²⁴/λ₀` each).
/// `tests/cpu_woodbury.rs` (`lazy_steps_through_the_rows_match_the_dense_route`) checks the whole
/// step against the dense route.
#[derive(Debug)]
pub struct LowRankKernel {
    m: usize,
    lambda0: f32,
    /// The lower triangle of `XXᵀ = m·Ĝ` (strict upper triangle zero).
    xxt: Vec<f64>,
    b: Vec<f64>,
    /// `B²`, formed when a first-order term first needs it (a kernel used only at `λ₀`, or
    /// recomputed before any lazy step moves the damping, never does).
    b2: OnceLock<Vec<f64>>,
}

/// `g₀`, `H` and `T` of [`LowRankKernel::at`]: `X(λ) = g₀·I + XᵀHX`, `X·X(λ) = T·X`.
#[derive(Debug)]
pub struct LowRankTerms {
    /// The identity part `g₀`.
    pub g0: f32,
    /// `H`, `m x m` row-major, symmetric.
    pub h: Vec<f32>,
    /// `T`, `m x m` row-major, symmetric.
    pub t: Vec<f32>,
}

impl LowRankKernel {
    /// The kernel of the rows `x` (`m x n`, `f32` or `bf16`) at the damping `λ₀`: the Gram
    /// matrix of the rows (`m²n` multiply-adds) and `B`.
    ///
    /// # Errors
    /// As [`low_rank_damped_inverse`].
    pub fn new<T: Element>(x: MatRef<'_, T>, lambda0: f32) -> Result<Self> {
        const OP: &str = "cpu::LowRankKernel::new";
        check_rows(OP, x, lambda0)?;
        let (m, n) = x.shape();
        super::on_pool(m.saturating_mul(m).saturating_mul(n), || {
            let w = widen_finite(OP, "x", x)?;
            Self::from_gram(OP, m, gram_lower(&w, m, n)?, lambda0)
        })
    }

    /// The same rows at another formation damping `λ₀` (a recomputed inverse): `B` again from
    /// the stored Gram matrix, `O(m³)`.
    ///
    /// # Errors
    /// As [`low_rank_damped_inverse`] for `λ₀`.
    pub fn reformed(&self, lambda0: f32) -> Result<Self> {
        const OP: &str = "cpu::LowRankKernel::reformed";
        check_damping(OP, lambda0)?;
        let mut xxt = try_vec(self.m, self.m, 0.0f64)?;
        xxt.copy_from_slice(&self.xxt);
        Self::from_gram(OP, self.m, xxt, lambda0)
    }

    /// The dense inverse `(XᵀX/m + λ₀I)⁻¹` (`n x n`) of the kernel's rows `x` (those it was
    /// made from) at its damping, from the stored Gram matrix: the bits of
    /// [`low_rank_damped_inverse`] of `x` at `λ₀`, without its Gram product.
    ///
    /// # Errors
    /// As [`low_rank_damped_inverse`]; [`Error::Shape`](crate::Error::Shape) when `x` does
    /// not have the kernel's `m` rows.
    pub fn inverse<T: Element>(&self, x: MatRef<'_, T>) -> Result<Mat> {
        const OP: &str = "cpu::LowRankKernel::inverse";
        let work = check_rows(OP, x, self.lambda0)?;
        let (m, n) = x.shape();
        check_shape(OP, "x", (m, n), (self.m, n))?;
        super::on_pool(work, || {
            let w = widen_finite(OP, "x", x)?;
            woodbury(OP, w, &self.xxt, m, n, self.lambda0)
        })
    }

    /// `B = (Ĝ + λ₀I)⁻¹` from the lower triangle of `XXᵀ`.
    fn from_gram(op: &'static str, m: usize, xxt: Vec<f64>, lambda0: f32) -> Result<Self> {
        let mut k = try_vec(m, m, 0.0f64)?;
        let inv_m = 1.0 / m as f64;
        k.iter_mut().zip(&xxt).for_each(|(k, g)| *k = g * inv_m);
        (0..m).for_each(|i| k[i * m + i] += lambda0 as f64);
        let b = super::cholesky::spd_inverse_f64(op, &k, m)?;
        Ok(Self {
            m,
            lambda0,
            xxt,
            b,
            b2: OnceLock::new(),
        })
    }

    /// `B²`, formed on first use.
    fn b2(&self) -> Result<&[f64]> {
        if let Some(b2) = self.b2.get() {
            return Ok(b2);
        }
        let m = self.m;
        let mut b2 = try_vec(m, m, 0.0f64)?;
        let bv = faer::MatRef::from_row_major_slice(&self.b, m, m);
        faer::linalg::matmul::matmul(
            faer::MatMut::from_row_major_slice_mut(&mut b2, m, m),
            Accum::Replace,
            bv,
            bv,
            1.0,
            faer_par(m),
        );
        Ok(self.b2.get_or_init(|| b2))
    }

    /// Rows `m`.
    pub fn rows(&self) -> usize {
        self.m
    }

    /// The formation damping `λ₀`.
    pub fn damping(&self) -> f32 {
        self.lambda0
    }

    /// `g₀`, `H`, `T` of `X(λ) = X₀ − (λ − λ₀)·X₀²` (type docs; `X₀` itself at `λ = λ₀`).
    pub fn at(&self, lambda: f32) -> Result<LowRankTerms> {
        let (l0, d) = (self.lambda0 as f64, lambda as f64 - self.lambda0 as f64);
        let inv_m = 1.0 / self.m as f64;
        let (cb, cb2) = ((d / (l0 * l0) - 1.0 / l0) * inv_m, d / l0 * inv_m);
        let mut h = try_vec(self.m, self.m, 0.0f32)?;
        let mut t = try_vec(self.m, self.m, 0.0f32)?;
        // `X₀` itself (`d = 0`) has no `B²` term: left unformed there.
        let b2 = if d == 0.0 { None } else { Some(self.b2()?) };
        for (i, &b) in self.b.iter().enumerate() {
            let b2 = b2.map_or(0.0, |b2| b2[i]);
            h[i] = (cb * b + cb2 * b2) as f32;
            t[i] = (b - d * b2) as f32;
        }
        Ok(LowRankTerms {
            g0: (1.0 / l0 - d / (l0 * l0)) as f32,
            h,
            t,
        })
    }
}
