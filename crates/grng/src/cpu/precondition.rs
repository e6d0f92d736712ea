//! Kronecker preconditioning and damping helpers (docs/math.md §1–2).

use super::check_finite_view;
use super::gemm::gemm;
use crate::error::{check_shape, check_value, Result};
use crate::mat::{Mat, MatMut, MatRef, Trans};
use crate::shape::MatMul;

/// Square-shape check: `Err(Error::Shape)` unless `shape` is `n x n` for `n = shape.0`.
fn check_square(op: &'static str, arg: &'static str, shape: (usize, usize)) -> Result<()> {
    check_shape(op, arg, shape, (shape.0, shape.0))
}

/// Preconditioned gradient `P = Γ̃⁻¹ G Λ̃⁻¹` with `Γ̃⁻¹` (`gamma_inv`) `d_out x d_out`,
/// `G` `d_out x d_in`, `Λ̃⁻¹` (`lambda_inv`) `d_in x d_in`; `P` is `d_out x d_in`.
///
/// Computed as `Γ̃⁻¹ (G Λ̃⁻¹)` through one `d_out x d_in` temporary.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) on any shape mismatch,
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in an input. `p` is unchanged on
/// error.
pub fn precondition(
    gamma_inv: MatRef<'_, f32>,
    g: MatRef<'_, f32>,
    lambda_inv: MatRef<'_, f32>,
    p: MatMut<'_, f32>,
) -> Result<()> {
    const OP: &str = "cpu::precondition";
    let (d_out, d_in) = g.shape();
    check_shape(OP, "gamma_inv", gamma_inv.shape(), (d_out, d_out))?;
    check_shape(OP, "lambda_inv", lambda_inv.shape(), (d_in, d_in))?;
    check_shape(OP, "p", p.shape(), (d_out, d_in))?;
    check_finite_view(OP, "gamma_inv", gamma_inv)?;
    check_finite_view(OP, "g", g)?;
    check_finite_view(OP, "lambda_inv", lambda_inv)?;
    let mut t = Mat::zeros(d_out, d_in);
    gemm(
        MatMul::new(Trans::No, Trans::No, 1.0, g, lambda_inv),
        0.0,
        t.as_mut(),
    )?;
    gemm(
        MatMul::new(Trans::No, Trans::No, 1.0, gamma_inv, t.as_ref()),
        0.0,
        p,
    )
}

/// First-order damped-inverse update `X ← X − dλ · X X` (docs/math.md §2, lazy Fisher) for a square
/// `X = Ã⁻¹` whose damping changed by `dλ`.
///
/// Valid for small `dλ`: docs/math.md §2 has callers recompute the inverse instead when
/// `|dλ|·‖X‖₂ > 0.5`; this function does not check that (it needs a norm estimate).
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) unless `inv` is square,
/// [`Error::Value`](crate::Error::Value) for a non-finite `dλ`,
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `inv`. `inv` is unchanged on
/// error.
pub fn damped_inverse_update(mut inv: MatMut<'_, f32>, dlambda: f32) -> Result<()> {
    const OP: &str = "cpu::damped_inverse_update";
    check_square(OP, "inv", inv.shape())?;
    check_value(OP, "dlambda", dlambda as f64, true, "a finite number")?;
    check_finite_view(OP, "inv", inv.as_ref())?;
    if dlambda == 0.0 {
        return Ok(());
    }
    let n = inv.rows();
    // A contiguous copy of the old X serves as both factors; the GEMM then fuses the update.
    let mut x = Mat::zeros(n, n);
    for i in 0..n {
        x.as_mut().row_mut(i).copy_from_slice(inv.as_ref().row(i));
    }
    gemm(
        MatMul::new(Trans::No, Trans::No, -dlambda, x.as_ref(), x.as_ref()),
        1.0,
        inv.rb(),
    )
}

/// `A ← A + λ I` for a square `A` (Tikhonov damping).
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) unless `a` is square,
/// [`Error::Value`](crate::Error::Value) for a non-finite `λ`. `a` is unchanged on error.
pub fn add_diagonal(mut a: MatMut<'_, f32>, lambda: f32) -> Result<()> {
    const OP: &str = "cpu::add_diagonal";
    check_square(OP, "a", a.shape())?;
    check_value(OP, "lambda", lambda as f64, true, "a finite number")?;
    for i in 0..a.rows() {
        a.row_mut(i)[i] += lambda;
    }
    Ok(())
}
