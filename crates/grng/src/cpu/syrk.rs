//! Kronecker-factor accumulation (docs/math.md §1, §5.1): `Λ ← ε Λ + (1−ε)/m · AᵀA` as a SYRK, and
//! its Gram-matrix relatives (`XXᵀ`, the symmetric product).

mod tiles;

pub(crate) use tiles::mirror_lower;

use super::check_finite_view;
use super::gemm::op_strides;
use crate::element::Element;
#[cfg(doc)]
use crate::error::Error;
use crate::error::{check_shape, Result};
use crate::mat::{MatMut, MatRef, Trans};
use crate::shape::{check_gemm, check_syrk_args};

/// `Λ ← ε Λ + (1−ε)/m · AᵀA` for `A` of shape `m x n` (`T` = `f32` or `bf16`) and `Λ`
/// (`factor`) of shape `n x n`, both row-major views.
///
/// `bf16` inputs are widened to `f32` (exactly) a panel of rows at a time; all products
/// accumulate in `f32`. Only the lower triangle is computed (a blocked SYRK on the `gemm`
/// crate's micro-kernels) and each tile is then mirrored into the upper one, so the result is
/// exactly symmetric. The result depends only on the lower triangle of the old `Λ`, which is
/// not read at all when `ε = 0` (it may then hold NaN).
///
/// # Errors
/// [`Error::Shape`] when `m = 0` or `factor` is not `n x n`; [`Error::Value`] unless
/// `0 ≤ ε < 1`; [`Error::NonFinite`] for NaN/Inf in `A`, or in `Λ` when `ε > 0`;
/// [`Error::OutOfMemory`] when the panel buffers cannot be allocated. `factor` is unchanged
/// on error.
pub fn syrk_ema<T: Element>(a: MatRef<'_, T>, eps: f32, factor: MatMut<'_, f32>) -> Result<()> {
    const OP: &str = "cpu::syrk_ema";
    let (m, n) = a.shape();
    check_syrk_args(OP, a.shape(), eps, factor.shape())?;
    check_finite_view(OP, "a", a)?;
    if eps > 0.0 {
        check_finite_view(OP, "factor", factor.as_ref())?;
    }
    if n == 0 {
        return Ok(());
    }
    tiles::syrk_lower_mirror(a, ((1.0 - eps) / m as f32, eps), factor)
}

/// `C ← α·AᵀA` for `A` `m x n` and `C` `n x n`, by the SYRK of [`syrk_ema`] (lower triangle,
/// mirrored: exactly symmetric, half a GEMM's flops) for operands the caller has validated;
/// `C` is not read.
///
/// # Errors
/// [`Error::Shape`] unless `C` is `n x n`, [`Error::OutOfMemory`] for the panel buffers;
/// `C` is unchanged then.
pub(crate) fn gram(a: MatRef<'_, f32>, alpha: f32, mut c: MatMut<'_, f32>) -> Result<()> {
    let n = a.cols();
    check_shape("cpu::gram", "c", c.shape(), (n, n))?;
    if n == 0 {
        return Ok(());
    }
    if a.rows() == 0 {
        // No rows: AᵀA = 0 (the SYRK, which scales C on its first panel, would leave C as is).
        (0..n).for_each(|i| c.row_mut(i).fill(0.0));
        return Ok(());
    }
    tiles::syrk_lower_mirror(a, (alpha, 0.0), c)
}

/// `C = α·XXᵀ` (`X` `n x k`, `C` `n x n`), the Gram matrix of the rows: the
/// symmetric product of `X` and `Xᵀ` (no copy of `X`).
///
/// # Errors
/// [`Error::Shape`] unless `C` is `n x n`; `C` is unchanged then.
pub fn gram_rows(x: MatRef<'_, f32>, alpha: f32, c: MatMut<'_, f32>) -> Result<()> {
    symmetric_product((Trans::No, x), (Trans::Yes, x), alpha, c)
}

/// `C = α·op(A)·op(B)` (`op(A)` `n x k`, `op(B)` `k x n`, `C` `n x n`) for a product the
/// caller knows to be symmetric in exact arithmetic (`E·X·Eᵀ` with `X` symmetric, `UᵀΓU`,
/// `XXᵀ`), of validated operands: the lower triangle by the SYRK's tiles, mirrored — exactly
/// symmetric, ~half a GEMM's flops (62.5% of them at `n = 256`: the diagonal blocks are
/// computed whole), the operands read in place. `C` is not read.
///
/// # Errors
/// [`Error::Shape`] unless the shapes are as above; `C` is unchanged then.
pub(crate) fn symmetric_product(
    (ta, a): (Trans, MatRef<'_, f32>),
    (tb, b): (Trans, MatRef<'_, f32>),
    alpha: f32,
    mut c: MatMut<'_, f32>,
) -> Result<()> {
    const OP: &str = "cpu::symmetric_product";
    let n = c.rows();
    check_shape(OP, "c", c.shape(), (n, n))?;
    let (_, _, k) = check_gemm(OP, ta, a.shape(), tb, b.shape(), alpha, 0.0, (n, n))?;
    if n == 0 {
        return Ok(());
    }
    if k == 0 || alpha == 0.0 {
        // An empty sum (the crate's k = 0 product would leave C as is).
        (0..n).for_each(|i| c.row_mut(i).fill(0.0));
        return Ok(());
    }
    // `X·Yᵀ` packs `X` along its rows' stride (`gemm::unaliased`; the other layouts read
    // their left operand along unit strides).
    let mut copy = super::gemm::take_scratch();
    let a = match (ta, tb) {
        (Trans::No, Trans::Yes) => super::gemm::unaliased(a, n, &mut copy),
        _ => a,
    };
    let ((a_rs, a_cs), (b_rs, b_cs)) = (op_strides(ta, a.ld()), op_strides(tb, b.ld()));
    // SAFETY: `check_gemm` fixed op(A) as n x k and op(B) as k x n, which the views' strides
    // address in bounds; both are only read, and `c` (n x n, borrowed mutably) aliases
    // neither.
    unsafe {
        tiles::symmetric_product_mirror(
            (a.data().as_ptr(), a_rs, a_cs),
            (b.data().as_ptr(), b_rs, b_cs),
            k,
            alpha,
            c,
        )
    };
    super::gemm::put_scratch(copy);
    Ok(())
}

/// Whether the SYRK of the rows `a` (`m x n`), `α·aᵀa` with `|α| ≤ 1`, is finite without
/// forming it: every entry is finite and every column's `Σᵢ aᵢⱼ²` (in `f64`) is at most
/// `f32::MAX / 2`. Every entry and partial sum of the product is then bounded by
/// `√(Σᵢaᵢⱼ² · Σᵢaᵢₖ²) ≤ f32::MAX / 2` (Cauchy–Schwarz), and `f32` accumulation grows that by
/// at most `(1 + m·2⁻²⁴)`, below `f32::MAX` for any `m < 2²³`. One pass over `a`.
pub(crate) fn syrk_fits<T: Element>(a: MatRef<'_, T>) -> bool {
    let mut sq = vec![0.0f64; a.cols()];
    for i in 0..a.rows() {
        for (s, &v) in sq.iter_mut().zip(a.row(i)) {
            let v = v.to_f32() as f64;
            *s += v * v;
        }
    }
    // NaN (from NaN/Inf entries) fails the comparison too.
    sq.iter().all(|&s| s <= f32::MAX as f64 / 2.0)
}
