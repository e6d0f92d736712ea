//! Cholesky factor, solve and inverse of SPD matrices: the exact reference, computed in `f64`
//! by faer (its blocked, rayon-parallel `llt`: ~7x a hand-written blocked factor at n = 1024,
//! `docs/benchmarks.md` §3).
//!
//! The `f32` input is widened to `f64`, factored and solved there, and rounded to `f32` once at
//! the end, so results carry no `f32` accumulation error. The factor and the inverse pass
//! between the row-major `f32` matrices and faer's column-major `f64` ones by cache-sized tiles
//! of their lower triangles (`factor_view`, `symmetric_from_lower`), checking what they read
//! or write as they go: no separate pass for the checks, none strided.

use faer::linalg::solvers::Solve;

use crate::element::Element;
use crate::error::{
    check_shape, check_value, first_non_finite, out_of_memory, try_vec, try_with_capacity, Error,
    Result, OVERFLOW,
};
use crate::mat::{Mat, MatMut, MatRef};

/// Widens a view to a contiguous row-major `f64` buffer (exact for `f32` and `bf16`),
/// rejecting NaN/Inf (flat index `i * cols + j`) row by row on the way: each row is scanned
/// while it is in cache, so the check costs no extra pass over `a`.
pub(super) fn widen_finite<T: Element>(
    op: &'static str,
    arg: &'static str,
    a: MatRef<'_, T>,
) -> Result<Vec<f64>> {
    let (rows, cols) = a.shape();
    let mut w = try_with_capacity("host", rows, cols)?;
    for i in 0..rows {
        let row = a.row(i);
        if let Some(j) = first_non_finite(row) {
            return Err(Error::NonFinite {
                op,
                arg,
                index: i * cols + j,
                value: row[j].to_f32(),
            });
        }
        w.extend(row.iter().map(|v| v.to_f32() as f64));
    }
    Ok(w)
}

/// Widens a square view to contiguous `f64`, after shape and finiteness checks.
fn widen_square(op: &'static str, arg: &'static str, a: MatRef<'_, f32>) -> Result<Vec<f64>> {
    let n = a.rows();
    check_shape(op, arg, a.shape(), (n, n))?;
    widen_finite(op, arg, a)
}

/// faer's parallelism for an `n x n` factorization: one thread below 512. Measured on 2 cores
/// (`f64` factor + inverse, on a rayon worker): 17 µs on one thread vs 56 µs parallel at
/// n = 65, 0.80 vs 0.95 ms at 257, even at 513; 5.3 vs 12.4 ms at 785 (and from a thread
/// outside the pool the parallel path was slower still, hence [`super::on_pool`] around
/// the entry points).
pub(super) fn faer_par(n: usize) -> faer::Par {
    if n < 512 {
        faer::Par::Seq
    } else {
        faer::Par::rayon(0)
    }
}

/// Multiply-adds of an `n x n` factorization and inverse (`n³/3 + 2n³/3`): the size
/// [`super::on_pool`] decides by.
fn inverse_work(n: usize) -> usize {
    n.saturating_mul(n).saturating_mul(n)
}

/// Lower Cholesky factor `L` (column-major, strict upper triangle zero) of the row-major
/// `n x n` `w` (only its lower triangle is read), by faer with [`faer_par`], or
/// [`Error::NotSpd`] with the first pivot that is not positive.
pub(super) fn factor(op: &'static str, w: &[f64], n: usize) -> Result<faer::Mat<f64>> {
    let mut l = faer::Mat::<f64>::zeros(n, n);
    l.copy_from_triangular_lower(faer::MatRef::from_row_major_slice(w, n, n));
    match llt_in_place(&mut l)? {
        Some(index) => Err(Error::NotSpd {
            op,
            index,
            pivot: pivot_at(w, n, index),
        }),
        None => Ok(l),
    }
}

/// [`factor`] of a square `f32` view, `shift` (`λ`) added to the diagonal in `f32` as it is
/// widened ([`shifted`]): the factor of `A + λI` as [`crate::cpu::add_diagonal`] would form
/// it, without forming it.
///
/// The lower triangle of `a` is widened to `f64` (exact) straight into a column-major faer
/// matrix whose strict upper triangle is zero — what faer's factorization reads: the same
/// `f64` lower triangle, so the same factor bit for bit, without the row-major `f64` copy and
/// faer's strided transposing copy of it (~1.2 ms of a 1024-wide inverse's ~15 ms). By blocks
/// of [`TILE`] rows: each block's rows are checked whole (contiguous), then written
/// transposed tile by tile while they are in cache, so each column of the result is written
/// in runs of `TILE` values.
///
/// # Errors
/// [`Error::Shape`] unless `a` is square, [`Error::NonFinite`] for NaN/Inf anywhere in `a`
/// (the first in row order, flat index `i * n + j`, as [`widen_finite`] reports it) or naming
/// [`OVERFLOW`] for a shifted diagonal entry that overflows, [`Error::NotSpd`] with the first
/// pivot that is not positive.
fn factor_view(
    op: &'static str,
    arg: &'static str,
    a: MatRef<'_, f32>,
    shift: f32,
) -> Result<faer::Mat<f64>> {
    let n = a.rows();
    check_shape(op, arg, a.shape(), (n, n))?;
    let mut l = faer::Mat::<f64>::zeros(n, n);
    for i0 in (0..n).step_by(TILE) {
        let i1 = (i0 + TILE).min(n);
        for i in i0..i1 {
            let row = a.row(i);
            if let Some(j) = first_non_finite(row) {
                return Err(Error::NonFinite {
                    op,
                    arg,
                    index: i * n + j,
                    value: row[j],
                });
            }
        }
        for j in 0..i1 {
            let r0 = i0.max(j);
            for (i, v) in (r0..i1).zip(&mut l.col_as_slice_mut(j)[r0..i1]) {
                *v = a.row(i)[j] as f64;
            }
        }
        for i in i0..i1 {
            let d = shifted(a.row(i)[i], shift);
            if !d.is_finite() {
                return Err(Error::NonFinite {
                    op,
                    arg: OVERFLOW,
                    index: i * n + i,
                    value: d,
                });
            }
            l[(i, i)] = d as f64;
        }
    }
    match super::on_pool(inverse_work(n) / 3, || llt_in_place(&mut l))? {
        // Error path only: the pivot's value from the row-major widening.
        Some(index) => Err(Error::NotSpd {
            op,
            index,
            pivot: {
                let mut w = widen_finite(op, arg, a)?;
                (0..n).for_each(|i| w[i * n + i] = shifted(a.row(i)[i], shift) as f64);
                pivot_at(&w, n, index)
            },
        }),
        None => Ok(l),
    }
}

/// `a_ii + λ` in `f32`, as [`crate::cpu::add_diagonal`] rounds it (`λ = 0` leaves `a_ii` as
/// is, `−0` included).
fn shifted(a_ii: f32, shift: f32) -> f32 {
    if shift == 0.0 {
        a_ii
    } else {
        a_ii + shift
    }
}

/// faer's Cholesky factorization of the lower triangle of `l` in place (with [`faer_par`]):
/// `Some` index of the first pivot that is not positive, or [`Error::OutOfMemory`] for its
/// workspace. The strict upper triangle is neither read nor written.
fn llt_in_place(l: &mut faer::Mat<f64>) -> Result<Option<usize>> {
    use faer::dyn_stack::MemStack;
    use faer::linalg::cholesky::llt::factor::{cholesky_in_place, cholesky_in_place_scratch};
    let n = l.nrows();
    let par = faer_par(n);
    let mut mem = scratch(cholesky_in_place_scratch::<f64>(n, par, Default::default()))?;
    let r = cholesky_in_place(
        l.as_mut(),
        Default::default(),
        par,
        MemStack::new(&mut mem),
        Default::default(),
    );
    Ok(r.err().map(|e| {
        let faer::linalg::cholesky::llt::factor::LltError::NonPositivePivot { index } = e;
        index
    }))
}

/// Rows and columns of the tiles of [`factor_view`] and [`symmetric_from_lower`]: a tile of
/// `f64` is 32 KiB, so a tile's strided side stays in L1/L2 while the other is streamed.
const TILE: usize = 64;

/// The row-major `n x n` symmetric matrix whose lower triangle is `x`'s (column-major; its
/// strict upper triangle is not read), each value mapped by `f`, by [`TILE`] x [`TILE`] tiles
/// of the lower triangle: a tile's column segments are contiguous in `x` and in the rows of
/// the upper triangle they mirror to, and go to the lower triangle's rows through a tile
/// transposed in a local buffer, so every store is a run of `TILE` values (element-wise stores
/// down a column, `4n` bytes apart, all land in the same cache sets when `n` is a power of
/// two). One pass where mirroring `x` in place and then reading its columns was two.
fn symmetric_from_lower<T: Copy + Default>(
    x: &faer::Mat<f64>,
    f: impl Fn(f64) -> T,
) -> Result<(Vec<T>, f64)> {
    let n = x.nrows();
    let mut out = try_vec(n, n, T::default())?;
    let mut max = 0.0f64;
    let mut buf = [[T::default(); TILE]; TILE];
    for j0 in (0..n).step_by(TILE) {
        let j1 = (j0 + TILE).min(n);
        for i0 in (j0..n).step_by(TILE) {
            let i1 = (i0 + TILE).min(n);
            for j in j0..j1 {
                let r0 = i0.max(j);
                let col = &x.col_as_slice(j)[r0..i1];
                // Row j, columns r0..i1: the upper triangle's mirror, contiguous.
                for (o, &v) in out[j * n + r0..j * n + i1].iter_mut().zip(col) {
                    *o = f(v);
                    max = max.max(v.abs());
                }
                for (i, &v) in (r0..i1).zip(col) {
                    buf[i - i0][j - j0] = f(v);
                }
            }
            // Rows i0..i1, columns j0..min(j1, i + 1): the lower triangle.
            for (i, row) in (i0..i1).zip(&buf) {
                let c1 = j1.min(i + 1);
                out[i * n + j0..i * n + c1].copy_from_slice(&row[..c1 - j0]);
            }
        }
    }
    Ok((out, max))
}

/// `A⁻¹` (row-major, exactly symmetric) of the row-major SPD `n x n` `a` (lower triangle
/// read), in `f64`: [`Error::NotSpd`] naming the first bad pivot otherwise.
pub(super) fn spd_inverse_f64(op: &'static str, a: &[f64], n: usize) -> Result<Vec<f64>> {
    Ok(symmetric_from_lower(&llt_inverse(&factor(op, a, n)?)?, |v| v)?.0)
}

/// faer's workspace for one call, or [`Error::OutOfMemory`] where the allocator refuses.
fn scratch(req: faer::dyn_stack::StackReq) -> Result<faer::dyn_stack::MemBuffer> {
    faer::dyn_stack::MemBuffer::try_new(req).map_err(|_| {
        out_of_memory::<u8>(
            "host",
            req.size_bytes(),
            1,
            "faer's Cholesky workspace".into(),
        )
    })
}

/// The lower triangle of `A⁻¹` (column-major; the strict upper triangle is zero) from the
/// lower factor `l` of `A`: faer computes one triangle, and [`symmetric_from_lower`] reads it.
fn llt_inverse(l: &faer::Mat<f64>) -> Result<faer::Mat<f64>> {
    use faer::dyn_stack::MemStack;
    use faer::linalg::cholesky::llt::inverse::{inverse, inverse_scratch};
    let n = l.nrows();
    let par = faer_par(n);
    let mut out = faer::Mat::<f64>::zeros(n, n);
    let mut mem = scratch(inverse_scratch::<f64>(n, par))?;
    inverse(out.as_mut(), l.as_ref(), par, MemStack::new(&mut mem));
    Ok(out)
}

/// The `j`-th Cholesky pivot `A[j,j] − A[j,..j]·A[..j,..j]⁻¹·A[..j,j]` (the Schur complement of
/// the leading block, which is SPD when pivot `j` is the first bad one). Error path only: faer
/// reports the index, the error also carries the value.
fn pivot_at(w: &[f64], n: usize, j: usize) -> f64 {
    let lead: Vec<f64> = (0..j).flat_map(|i| w[i * n..i * n + j].to_vec()).collect();
    let mut y = faer::Mat::<f64>::from_fn(j, 1, |i, _| w[j * n + i]);
    let a_jj = w[j * n + j];
    if j == 0 {
        return a_jj;
    }
    match faer::MatRef::from_row_major_slice(&lead, j, j).llt(faer::Side::Lower) {
        Ok(l) => {
            let rhs = y.clone();
            l.solve_in_place(y.as_mut());
            a_jj - (0..j).map(|i| rhs[(i, 0)] * y[(i, 0)]).sum::<f64>()
        }
        // Not reached when `j` is the first bad pivot; NaN still fails every `> 0` test.
        Err(_) => f64::NAN,
    }
}

/// The row-major `f32` matrix of `at(i, j)`, filled by `64 x 64` tiles: `at` reads faer's
/// column-major results, so a plain row-by-row fill strides through memory `n` values at a
/// time (once per refresh and factor, it was ~3% of a RING step at n = 1024).
fn round(rows: usize, cols: usize, at: impl Fn(usize, usize) -> f64) -> Result<Mat> {
    const TILE: usize = 64;
    let mut data = try_vec(rows * cols, 1, 0.0f32)?;
    for i0 in (0..rows).step_by(TILE) {
        for j0 in (0..cols).step_by(TILE) {
            for i in i0..(i0 + TILE).min(rows) {
                let row = &mut data[i * cols..(i + 1) * cols];
                for (j, v) in row
                    .iter_mut()
                    .enumerate()
                    .take((j0 + TILE).min(cols))
                    .skip(j0)
                {
                    *v = at(i, j) as f32;
                }
            }
        }
    }
    Mat::from_vec(data, rows, cols)
}

/// Lower Cholesky factor `L` (`L Lᵀ = A`, strict upper triangle zero) of a symmetric positive
/// definite `n x n` matrix. Only the lower triangle of `a` is read.
///
/// # Errors
/// [`Error::Shape`] unless `a` is square, [`Error::NonFinite`] for NaN/Inf in `a`,
/// [`Error::NotSpd`] with the index and value of the first pivot that is not positive.
pub fn cholesky(a: MatRef<'_, f32>) -> Result<Mat> {
    const OP: &str = "cpu::cholesky";
    let n = a.rows();
    let l = factor_view(OP, "a", a, 0.0)?;
    round(n, n, |i, j| if j <= i { l[(i, j)] } else { 0.0 })
}

/// Solves `L Lᵀ X = B` in place (`B ← X`) for a lower factor `l` (`n x n`, from [`cholesky`];
/// its upper triangle is ignored) and `B` of shape `n x k`.
///
/// # Errors
/// [`Error::Shape`] on a shape mismatch, [`Error::NonFinite`] for NaN/Inf in `l` or `b`,
/// [`Error::NotSpd`] for a diagonal entry of `l` that is not positive. `b` is unchanged on error.
pub fn cholesky_solve(l: MatRef<'_, f32>, mut b: MatMut<'_, f32>) -> Result<()> {
    const OP: &str = "cpu::cholesky_solve";
    let n = l.rows();
    let k = b.cols();
    check_shape(OP, "b", b.shape(), (n, k))?;
    let mut lw = widen_square(OP, "l", l)?;
    let bw = widen_finite(OP, "b", b.as_ref())?;
    if let Some(i) = (0..n).find(|&i| lw[i * n + i] <= 0.0) {
        return Err(Error::NotSpd {
            op: OP,
            index: i,
            pivot: lw[i * n + i],
        });
    }
    // The upper triangle is documented as ignored: zero it rather than rely on which entries
    // faer's triangular solves happen to read.
    for i in 0..n {
        lw[i * n + i + 1..(i + 1) * n].fill(0.0);
    }
    let lf = faer::MatRef::from_row_major_slice(&lw, n, n);
    let mut x = faer::Mat::<f64>::from_fn(n, k, |i, j| bw[i * k + j]);
    // L Lᵀ X = B: forward then backward substitution, reading only the lower triangle of L.
    let par = faer_par(n);
    super::on_pool(n.saturating_mul(n).saturating_mul(k), || {
        faer::linalg::triangular_solve::solve_lower_triangular_in_place(lf, x.as_mut(), par);
        faer::linalg::triangular_solve::solve_upper_triangular_in_place(
            lf.transpose(),
            x.as_mut(),
            par,
        );
    });
    for i in 0..n {
        for (j, v) in b.row_mut(i).iter_mut().enumerate() {
            *v = x[(i, j)] as f32;
        }
    }
    Ok(())
}

/// Inverse of a symmetric positive definite `n x n` matrix through its Cholesky factor, all in
/// `f64`; the result is exactly symmetric. Only the lower triangle of `a` is read.
///
/// # Errors
/// As [`cholesky`]; [`Error::NonFinite`] naming `"result (overflow)"` for an inverse beyond
/// `f32`'s range.
pub fn cholesky_inverse(a: MatRef<'_, f32>) -> Result<Mat> {
    damped_cholesky_inverse(a, 0.0)
}

/// [`cholesky_inverse`] of `A + λI` with the diagonal added in `f32` — the bits of
/// [`crate::cpu::add_diagonal`] on a copy, then [`cholesky_inverse`] — without the copy: the
/// shift is added as the factor is widened. An overflowing `a_ii + λ` is an
/// [`Error::NonFinite`] naming [`OVERFLOW`], as `add_diagonal` reports it.
pub(crate) fn damped_cholesky_inverse(a: MatRef<'_, f32>, lambda: f32) -> Result<Mat> {
    const OP: &str = "cpu::cholesky_inverse";
    check_value(OP, "lambda", lambda as f64, true, "a finite number")?;
    let n = a.rows();
    let l = factor_view(OP, "a", a, lambda)?;
    let x = super::on_pool(inverse_work(n), || llt_inverse(&l))?;
    let (out, max) = symmetric_from_lower(&x, |v| v as f32)?;
    if (max as f32).is_infinite() {
        // Error path only: where the first overflow is.
        let index = out.iter().position(|v| v.is_infinite()).unwrap_or(0);
        return Err(Error::NonFinite {
            op: OP,
            arg: OVERFLOW,
            index,
            value: out[index],
        });
    }
    Mat::from_vec(out, n, n)
}
