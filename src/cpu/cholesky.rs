//! Cholesky factor, solve and inverse of SPD matrices: the exact reference, computed in `f64`.
//!
//! The `f32` input is widened to `f64` and factored by a blocked left-looking algorithm whose
//! bulk (the block updates) runs on the `gemm` crate's `f64` kernel with rayon; only the
//! small diagonal blocks and panels are scalar code. Results are rounded to `f32` once at the
//! end, so they carry no `f32` accumulation error.

use rayon::prelude::*;

use super::check_finite_view;
use crate::error::{check_shape, Error, Result};
use crate::mat::{Mat, MatMut, MatRef};

/// Block width: diagonal blocks and panels of this width are done by scalar code.
const NB: usize = 64;

/// `dst ← dst − op(L)·op(R)` on raw row-major `f64` storage (`(rs, cs)` strides per operand).
///
/// # Safety
/// Every pointer must address its `m x k`, `k x n` or `m x n` region in bounds for the given
/// strides, and the `dst` region must not overlap the two read regions.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_sub_f64(
    (m, n, k): (usize, usize, usize),
    dst: *mut f64,
    ld_dst: usize,
    lhs: *const f64,
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: *const f64,
    (rhs_rs, rhs_cs): (usize, usize),
) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    // The crate computes dst := alpha·dst + beta·lhs·rhs (alpha/beta swapped against BLAS).
    ::gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        ld_dst as isize,
        true,
        lhs,
        lhs_cs as isize,
        lhs_rs as isize,
        rhs,
        rhs_cs as isize,
        rhs_rs as isize,
        1.0f64,
        -1.0f64,
        false,
        false,
        false,
        ::gemm::Parallelism::Rayon(0),
    );
}

/// In-place lower Cholesky factor of the `n x n` row-major `w` (only its lower triangle is
/// read; the strict upper triangle is zeroed on success).
fn factor_f64(w: &mut [f64], n: usize) -> Result<()> {
    for jb in (0..n).step_by(NB) {
        let bw = NB.min(n - jb);
        // Left-looking update of block column jb: A[jb.., jb..jb+bw] −= L[jb.., ..jb]·L[jb..jb+bw, ..jb]ᵀ.
        // SAFETY: w is n x n; reads cover columns 0..jb, the write covers columns jb..jb+bw of
        // rows jb..n: in bounds and disjoint.
        unsafe {
            let p = w.as_mut_ptr();
            gemm_sub_f64(
                (n - jb, bw, jb),
                p.add(jb * n + jb),
                n,
                p.add(jb * n),
                (n, 1),
                p.add(jb * n),
                (1, n),
            );
        }
        // Unblocked factor of the diagonal block.
        for j in jb..jb + bw {
            let d = w[j * n + j] - (jb..j).map(|q| w[j * n + q] * w[j * n + q]).sum::<f64>();
            if !(d > 0.0 && d.is_finite()) {
                return Err(Error::NotSpd {
                    op: "cpu::cholesky",
                    index: j,
                    pivot: d,
                });
            }
            let ljj = d.sqrt();
            w[j * n + j] = ljj;
            for i in j + 1..jb + bw {
                let s = (jb..j).map(|q| w[i * n + q] * w[j * n + q]).sum::<f64>();
                w[i * n + j] = (w[i * n + j] - s) / ljj;
            }
        }
        // Panel below the diagonal block: L[i, jb..jb+bw] = A[i, ..] · L_diag⁻ᵀ, row by row.
        let (top, bottom) = w.split_at_mut((jb + bw) * n);
        let top = &*top;
        bottom.par_chunks_mut(n).for_each(|row| {
            for j in jb..jb + bw {
                let s = (jb..j).map(|q| row[q] * top[j * n + q]).sum::<f64>();
                row[j] = (row[j] - s) / top[j * n + j];
            }
        });
    }
    for i in 0..n {
        w[i * n + i + 1..(i + 1) * n].fill(0.0);
    }
    Ok(())
}

/// Solves `L Lᵀ X = B` in place for `B` (`n x k`, contiguous) given the lower factor `l`.
fn solve_f64(l: &[f64], n: usize, b: &mut [f64], k: usize) {
    // Forward: L Y = B.
    for ib in (0..n).step_by(NB) {
        let end = (ib + NB).min(n);
        // SAFETY: B rows 0..ib are read, rows ib..end written (disjoint); L[ib..end, 0..ib] is
        // in bounds of the n x n factor.
        unsafe {
            gemm_sub_f64(
                (end - ib, k, ib),
                b.as_mut_ptr().add(ib * k),
                k,
                l.as_ptr().add(ib * n),
                (n, 1),
                b.as_ptr(),
                (k, 1),
            );
        }
        for i in ib..end {
            let (done, rest) = b.split_at_mut(i * k);
            let bi = &mut rest[..k];
            for q in ib..i {
                let lq = l[i * n + q];
                bi.iter_mut()
                    .zip(&done[q * k..(q + 1) * k])
                    .for_each(|(x, y)| *x -= lq * y);
            }
            let d = l[i * n + i];
            bi.iter_mut().for_each(|x| *x /= d);
        }
    }
    // Backward: Lᵀ X = Y.
    let starts: Vec<usize> = (0..n).step_by(NB).collect();
    for &ib in starts.iter().rev() {
        let end = (ib + NB).min(n);
        // SAFETY: B rows end..n are read, rows ib..end written (disjoint); Lᵀ[ib..end, end..n]
        // = L[end..n, ib..end] is in bounds of the factor.
        unsafe {
            gemm_sub_f64(
                (end - ib, k, n - end),
                b.as_mut_ptr().add(ib * k),
                k,
                l.as_ptr().add(end * n + ib),
                (1, n),
                b.as_ptr().add(end * k),
                (k, 1),
            );
        }
        for i in (ib..end).rev() {
            let (head, done) = b.split_at_mut((i + 1) * k);
            let bi = &mut head[i * k..];
            for q in i + 1..end {
                let lq = l[q * n + i];
                let off = (q - i - 1) * k;
                bi.iter_mut()
                    .zip(&done[off..off + k])
                    .for_each(|(x, y)| *x -= lq * y);
            }
            let d = l[i * n + i];
            bi.iter_mut().for_each(|x| *x /= d);
        }
    }
}

/// Widens a square view to contiguous `f64`, after shape and finiteness checks.
fn widen_square(op: &'static str, arg: &'static str, a: MatRef<'_, f32>) -> Result<Vec<f64>> {
    let n = a.rows();
    check_shape(op, arg, a.shape(), (n, n))?;
    check_finite_view(op, arg, a)?;
    let mut w = vec![0.0f64; n * n];
    for i in 0..n {
        for (x, v) in w[i * n..(i + 1) * n].iter_mut().zip(a.row(i)) {
            *x = *v as f64;
        }
    }
    Ok(w)
}

fn round(w: &[f64], rows: usize, cols: usize) -> Result<Mat> {
    Mat::from_vec(w.iter().map(|&x| x as f32).collect(), rows, cols)
}

/// Lower Cholesky factor `L` (`L Lᵀ = A`, strict upper triangle zero) of a symmetric positive
/// definite `n x n` matrix. Only the lower triangle of `a` is read.
///
/// # Errors
/// [`Error::Shape`] unless `a` is square, [`Error::NonFinite`] for NaN/Inf in `a`,
/// [`Error::NotSpd`] with the index and value of the first pivot that is not positive.
pub fn cholesky(a: MatRef<'_, f32>) -> Result<Mat> {
    let n = a.rows();
    let mut w = widen_square("cpu::cholesky", "a", a)?;
    factor_f64(&mut w, n)?;
    round(&w, n, n)
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
    check_finite_view(OP, "b", b.as_ref())?;
    for i in 0..n {
        let d = lw[i * n + i];
        if d <= 0.0 {
            return Err(Error::NotSpd {
                op: OP,
                index: i,
                pivot: d,
            });
        }
        lw[i * n + i + 1..(i + 1) * n].fill(0.0);
    }
    let mut bw = vec![0.0f64; n * k];
    for i in 0..n {
        for (x, v) in bw[i * k..(i + 1) * k].iter_mut().zip(b.as_ref().row(i)) {
            *x = *v as f64;
        }
    }
    solve_f64(&lw, n, &mut bw, k);
    for i in 0..n {
        for (x, v) in b.row_mut(i).iter_mut().zip(&bw[i * k..(i + 1) * k]) {
            *x = *v as f32;
        }
    }
    Ok(())
}

/// Inverse of a symmetric positive definite `n x n` matrix through its Cholesky factor, all in
/// `f64`; the result is exactly symmetric. Only the lower triangle of `a` is read.
///
/// # Errors
/// As [`cholesky`].
pub fn cholesky_inverse(a: MatRef<'_, f32>) -> Result<Mat> {
    let n = a.rows();
    let mut w = widen_square("cpu::cholesky_inverse", "a", a)?;
    factor_f64(&mut w, n)?;
    let mut x = vec![0.0f64; n * n];
    for i in 0..n {
        x[i * n + i] = 1.0;
    }
    solve_f64(&w, n, &mut x, n);
    for i in 0..n {
        for j in 0..i {
            let s = 0.5 * (x[i * n + j] + x[j * n + i]);
            x[i * n + j] = s;
            x[j * n + i] = s;
        }
    }
    round(&x, n, n)
}
