//! Kronecker-factor accumulation (SPEC §1, §5.1): `Λ ← ε Λ + (1−ε)/m · AᵀA` as a SYRK, and
//! the batch gradient `G = (1/m) Eᵀ A`.

use std::any::TypeId;

use rayon::prelude::*;

use super::check_finite_view;
use super::gemm::gemm;
use crate::device::Element;
use crate::error::{check_shape, check_value, Error, Result};
use crate::mat::{MatMut, MatRef, Trans};

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
/// `bf16` inputs are widened to `f32` (exactly) a panel of rows at a time; all products
/// accumulate in `f32`. Only the lower triangle is computed (faer's triangular-output matmul)
/// and then mirrored into the upper one, so the result is exactly symmetric. Only the lower
/// triangle of the old `Λ` is read, and not at all when `ε = 0` (it may then hold NaN).
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
    let alpha = (1.0 - eps) / m as f32;
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        // T is f32: same layout, reinterpret in place.
        let a32 = MatRef::with_ld(bytemuck::cast_slice(a.data()), m, n, a.ld())?;
        lower_syrk(a32, (alpha, eps), factor.rb());
    } else {
        // bf16: widened (exactly) one panel of WIDEN_ROWS rows at a time and accumulated
        // panel by panel (`β = ε`, then 1), so no widened copy of the whole `A` is made.
        let rows = WIDEN_ROWS.min(m);
        let mut w = crate::error::try_vec(rows, n, 0.0f32)?;
        for (p, s0) in (0..m).step_by(rows).enumerate() {
            let h = rows.min(m - s0);
            let panel = &mut w[..h * n];
            panel.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
                for (x, v) in row.iter_mut().zip(a.row(s0 + i)) {
                    *x = v.to_f32();
                }
            });
            let beta = if p == 0 { eps } else { 1.0 };
            lower_syrk(MatRef::new(panel, h, n)?, (alpha, beta), factor.rb());
        }
    }
    mirror_lower(factor);
    Ok(())
}

/// Rows of `bf16` statistics widened to `f32` at a time by [`syrk_ema`]: 256 rows keep the
/// panel small (256·n floats) and still give faer's GEMM a deep enough `k` to run at speed.
const WIDEN_ROWS: usize = 256;

/// Lower triangle of `C ← α AᵀA + β C` for `A` `m x n`, `C` `n x n` (the strict upper
/// triangle is left alone), through faer's triangular-output matmul: it recurses on the lower
/// triangle with its blocked, rayon-parallel GEMM kernels, so no upper tile is computed and
/// the big off-diagonal blocks keep the GEMM's packing efficiency (`docs/benchmarks.md` §2).
fn lower_syrk(a: MatRef<'_, f32>, (alpha, beta): (f32, f32), mut c: MatMut<'_, f32>) {
    use faer::linalg::matmul::triangular::{matmul, BlockStructure};
    let (m, n) = a.shape();
    let ld = c.ld();
    let data = c.data_mut();
    let accum = if beta == 0.0 {
        // Replace never reads C (it may hold NaN).
        faer::Accum::Replace
    } else if beta == 1.0 {
        faer::Accum::Add
    } else {
        data.par_chunks_mut(ld).enumerate().for_each(|(i, row)| {
            row[..=i].iter_mut().for_each(|x| *x *= beta);
        });
        faer::Accum::Add
    };
    let fa = faer::MatRef::from_row_major_slice_with_stride(a.data(), m, n, a.ld());
    // Row-major C as the transpose of a column-major view: faer 0.24.4's
    // `from_row_major_slice_with_stride_mut` builds a column-major view (strides swapped).
    let fc = faer::MatMut::from_column_major_slice_with_stride_mut(data, n, n, ld).transpose_mut();
    matmul(
        fc,
        BlockStructure::TriangularLower,
        accum,
        fa.transpose(),
        BlockStructure::Rectangular,
        fa,
        BlockStructure::Rectangular,
        alpha,
        faer::Par::rayon(0),
    );
}

/// Raw pointer to the factor's storage, shared by the mirror tasks (see [`mirror_lower`]).
#[derive(Clone, Copy)]
struct SharedPtr(*mut f32);
// SAFETY: only used by `mirror_lower`, whose tasks read and write disjoint elements.
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

/// Copies the strict lower triangle of a square view into its upper triangle, bands of
/// `TILE` rows in parallel.
fn mirror_lower(mut c: MatMut<'_, f32>) {
    // 32 x 32 tiles keep both the row-wise reads and the column-wise writes in cache.
    const TILE: usize = 32;
    let n = c.rows();
    let ld = c.ld();
    let base = SharedPtr(c.data_mut().as_mut_ptr());
    (0..n.div_ceil(TILE)).into_par_iter().for_each(move |band| {
        let p = base;
        let (ib, iend) = (band * TILE, ((band + 1) * TILE).min(n));
        for jb in (ib..n).step_by(TILE) {
            for i in ib..iend {
                for j in jb.max(i + 1)..(jb + TILE).min(n) {
                    // SAFETY: i, j < n, so both offsets are inside the n x n view. Each task
                    // writes only (i, j) with j > i of its own rows and reads only (j, i) with
                    // j > i, the strict lower triangle, which nobody writes: no element is
                    // both read and written, no two tasks write the same one.
                    unsafe { *p.0.add(i * ld + j) = *p.0.add(j * ld + i) };
                }
            }
        }
    });
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
