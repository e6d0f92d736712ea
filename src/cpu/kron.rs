//! Kronecker-factor accumulation (SPEC §1, §5.1): `Λ ← ε Λ + (1−ε)/m · AᵀA` as a SYRK, and
//! the batch gradient `G = (1/m) Eᵀ A`.

use std::any::TypeId;

use rayon::prelude::*;

use super::check_finite_view;
use super::gemm::gemm;
use crate::device::Element;
use crate::error::{check_shape, check_value, Error, Result};
use crate::mat::{MatMut, MatRef, Trans};

/// Diagonal blocks at most this wide are computed as one full GEMM (its upper half is wasted
/// work, `≤ n·BASE·m/2` flops in all, a few percent at n ≥ 1024) instead of being split again.
const BASE: usize = 192;

/// `Err(Error::Shape)` when the batch `arg` (`m x cols`) has no row.
pub(crate) fn check_batch(
    op: &'static str,
    arg: &'static str,
    (m, cols): (usize, usize),
) -> Result<()> {
    if m == 0 {
        return Err(Error::Shape {
            op,
            arg,
            expected: "at least one row (sample)".into(),
            got: format!("0x{cols}"),
        });
    }
    Ok(())
}

/// The SYRK-EMA argument checks every backend shares: `0 ≤ ε < 1`, `a` `m x n` with
/// `m ≥ 1`, `factor` `n x n`.
pub(crate) fn check_syrk_args(
    op: &'static str,
    a: (usize, usize),
    eps: f32,
    factor: (usize, usize),
) -> Result<()> {
    check_value(
        op,
        "eps",
        eps as f64,
        (0.0..1.0).contains(&eps),
        "0 <= eps < 1",
    )?;
    check_batch(op, "a", a)?;
    check_shape(op, "factor", factor, (a.1, a.1))
}

/// The batch-gradient shape checks every backend shares: `e` `m x d_out` with `m ≥ 1`, `a`
/// `m x d_in`, `g` `d_out x d_in`.
pub(crate) fn check_batch_gradient_args(
    op: &'static str,
    e: (usize, usize),
    a: (usize, usize),
    g: (usize, usize),
) -> Result<()> {
    check_batch(op, "e", e)?;
    check_shape(op, "a", a, (e.0, a.1))?;
    check_shape(op, "g", g, (e.1, a.1))
}

/// `Λ ← ε Λ + (1−ε)/m · AᵀA` for `A` of shape `m x n` (`T` = `f32` or `bf16`) and `Λ`
/// (`factor`) of shape `n x n`, both row-major views.
///
/// `bf16` inputs are widened to `f32` (exactly); all products accumulate in `f32`. Only the lower
/// triangle is computed (recursively: the off-diagonal block as one GEMM, the two diagonal
/// blocks by recursion, small diagonal blocks as full GEMMs) and then mirrored into the upper
/// one, so the result is exactly symmetric. Only the lower triangle of the old `Λ` is read, and
/// not at all when `ε = 0` (it may then hold NaN).
///
/// # Errors
/// [`Error::Shape`] when `m = 0` or `factor` is not `n x n`; [`Error::Value`] unless
/// `0 ≤ ε < 1`; [`Error::NonFinite`] for NaN/Inf in `A`, or in `Λ` when `ε > 0`.
/// `factor` is unchanged on error.
pub fn syrk_ema<T: Element>(a: MatRef<'_, T>, eps: f32, mut factor: MatMut<'_, f32>) -> Result<()> {
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
    let widened;
    let a32: MatRef<'_, f32> = if TypeId::of::<T>() == TypeId::of::<f32>() {
        // T is f32: same layout, reinterpret in place.
        MatRef::with_ld(bytemuck::cast_slice(a.data()), m, n, a.ld())?
    } else {
        let mut w = vec![0.0f32; m * n];
        w.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
            for (x, v) in row.iter_mut().zip(a.row(i)) {
                *x = v.to_f32();
            }
        });
        widened = w;
        MatRef::new(&widened, m, n)?
    };
    let alpha = (1.0 - eps) / m as f32;
    let ld = factor.ld();
    lower_syrk(a32, (alpha, eps), factor.data_mut(), ld, (0, n))?;
    mirror_lower(factor);
    Ok(())
}

/// Computes the lower triangle of rows/columns `lo..hi` of `C ← α AᵀA + β C` (plus the upper
/// half of the smallest diagonal blocks). `c` holds rows `lo..` of `C`, `ld` apart.
///
/// The diagonal block above the split and the rows below it touch disjoint rows of `C`, so
/// they run as two rayon tasks: small GEMMs alone cannot keep both cores busy.
fn lower_syrk(
    a: MatRef<'_, f32>,
    (alpha, beta): (f32, f32),
    c: &mut [f32],
    ld: usize,
    (lo, hi): (usize, usize),
) -> Result<()> {
    let w = hi - lo;
    let m = a.rows();
    let cols_of_a = |from: usize, to: usize| -> Result<MatRef<'_, f32>> {
        // A[:, from..to], an m x (to − from) view into the same buffer.
        MatRef::with_ld(&a.data()[from..], m, to - from, a.ld())
    };
    if w <= BASE {
        let blk = cols_of_a(lo, hi)?;
        let dst = MatMut::with_ld(&mut c[lo..], w, w, ld)?;
        return gemm(Trans::Yes, Trans::No, alpha, blk, blk, beta, dst);
    }
    // Split at a multiple of 16 so the GEMM tiles stay aligned with the micro-kernel.
    let mid = lo + (w / 2).next_multiple_of(16).min(w - 1);
    let (top, bottom) = c.split_at_mut((mid - lo) * ld);
    let (r_top, r_bottom) = rayon::join(
        || lower_syrk(a, (alpha, beta), top, ld, (lo, mid)),
        || -> Result<()> {
            // Off-diagonal block C[mid..hi, lo..mid] = α A[:, mid..hi]ᵀ A[:, lo..mid] + β C[…].
            let dst = MatMut::with_ld(&mut bottom[lo..], hi - mid, mid - lo, ld)?;
            gemm(
                Trans::Yes,
                Trans::No,
                alpha,
                cols_of_a(mid, hi)?,
                cols_of_a(lo, mid)?,
                beta,
                dst,
            )?;
            lower_syrk(a, (alpha, beta), bottom, ld, (mid, hi))
        },
    );
    r_top.and(r_bottom)
}

/// Copies the strict lower triangle of a square view into its upper triangle.
fn mirror_lower(mut c: MatMut<'_, f32>) {
    // 32 x 32 tiles keep both the row-wise reads and the column-wise writes in cache.
    const TILE: usize = 32;
    let n = c.rows();
    let ld = c.ld();
    let data = c.data_mut();
    for ib in (0..n).step_by(TILE) {
        for jb in (ib..n).step_by(TILE) {
            for i in ib..(ib + TILE).min(n) {
                for j in jb.max(i + 1)..(jb + TILE).min(n) {
                    data[i * ld + j] = data[j * ld + i];
                }
            }
        }
    }
}

/// Batch gradient `G = (1/m) Eᵀ A` for `E` of shape `m x d_out` (per-sample output gradients,
/// not divided by m) and `A` of shape `m x d_in`; `G` is `d_out x d_in`.
///
/// # Errors
/// [`Error::Shape`] when `m = 0` or the shapes disagree; [`Error::NonFinite`] for NaN/Inf in
/// `E` or `A`. `g` is unchanged on error.
pub fn batch_gradient(e: MatRef<'_, f32>, a: MatRef<'_, f32>, g: MatMut<'_, f32>) -> Result<()> {
    const OP: &str = "cpu::batch_gradient";
    let m = e.rows();
    check_batch_gradient_args(OP, e.shape(), a.shape(), g.shape())?;
    check_finite_view(OP, "e", e)?;
    check_finite_view(OP, "a", a)?;
    gemm(Trans::Yes, Trans::No, 1.0 / m as f32, e, a, 0.0, g)
}
