//! Spectral norm by power iteration and trace, for the PSD Kronecker factors.

use rayon::prelude::*;

use super::check_finite_view;
use crate::error::{check_shape, Error, Result};
use crate::mat::MatRef;
use crate::ops::norm::{PowerInfo, PowerOptions};

/// Largest eigenvalue of a symmetric PSD `n x n` matrix by power iteration.
///
/// Starts from the normalized all-ones vector plus a fixed aperiodic perturbation (so a
/// top eigenvector orthogonal to all-ones is still found, and runs are deterministic);
/// matrix-vector products accumulate in `f64`. Stops when the Rayleigh quotient `vᵀAv`
/// changes by at most `opts.tol` relative to its value. The returned value is that Rayleigh
/// quotient; its error shrinks like `(λ₂/λ₁)^(2k)`, so a tiny eigen-gap converges slowly and
/// the relative change is an estimate of the error, not a bound. `n = 0` gives `0`.
///
/// # Errors
/// [`Error::Shape`] unless `a` is square, [`Error::Value`] for bad options,
/// [`Error::NonFinite`] for NaN/Inf in `a`.
pub fn spectral_norm(a: MatRef<'_, f32>, opts: &PowerOptions) -> Result<PowerInfo> {
    const OP: &str = "cpu::spectral_norm";
    let n = a.rows();
    check_shape(OP, "a", a.shape(), (n, n))?;
    opts.validate(OP)?;
    check_finite_view(OP, "a", a)?;
    if n == 0 {
        return Ok(PowerInfo {
            value: 0.0,
            iterations: 0,
            converged: true,
        });
    }
    // Golden-ratio fractional parts: deterministic, never periodic in i.
    let mut v: Vec<f64> = (0..n)
        .map(|i| 1.0 + 0.5 * ((i as f64 * 0.618_033_988_749_895).fract() - 0.5))
        .collect();
    let norm = dot(&v, &v).sqrt();
    v.iter_mut().for_each(|x| *x /= norm);
    let mut w = vec![0.0f64; n];
    let mut prev: Option<f64> = None;
    for it in 1..=opts.max_iter {
        w.par_iter_mut()
            .enumerate()
            .for_each(|(i, wi)| *wi = dot_f32_f64(a.row(i), &v));
        let rq = dot(&v, &w);
        let wn = dot(&w, &w).sqrt();
        if wn == 0.0 {
            // A v = 0: v lies in the null space; for the start vector above this means A = 0
            // for every practical purpose.
            return Ok(PowerInfo {
                value: 0.0,
                iterations: it,
                converged: true,
            });
        }
        if let Some(p) = prev {
            if (rq - p).abs() <= opts.tol as f64 * rq.abs() {
                return Ok(PowerInfo {
                    value: rq as f32,
                    iterations: it,
                    converged: true,
                });
            }
        }
        prev = Some(rq);
        v.iter_mut().zip(&w).for_each(|(x, y)| *x = y / wn);
    }
    Ok(PowerInfo {
        value: prev.unwrap_or(0.0) as f32,
        iterations: opts.max_iter,
        converged: false,
    })
}

/// `Σ xᵢyᵢ` in four independent lanes (vectorizes without reassociation flags).
fn dot(x: &[f64], y: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let (xc, xr) = x.split_at(x.len() - x.len() % 4);
    let (yc, yr) = y.split_at(xc.len());
    for (a, b) in xc.chunks_exact(4).zip(yc.chunks_exact(4)) {
        for l in 0..4 {
            acc[l] += a[l] * b[l];
        }
    }
    let tail: f64 = xr.iter().zip(yr).map(|(a, b)| a * b).sum();
    acc.iter().sum::<f64>() + tail
}

/// `Σ xᵢyᵢ` for an `f32` row against an `f64` vector, accumulated in `f64`.
fn dot_f32_f64(x: &[f32], y: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let (xc, xr) = x.split_at(x.len() - x.len() % 4);
    let (yc, yr) = y.split_at(xc.len());
    for (a, b) in xc.chunks_exact(4).zip(yc.chunks_exact(4)) {
        for l in 0..4 {
            acc[l] += a[l] as f64 * b[l];
        }
    }
    let tail: f64 = xr.iter().zip(yr).map(|(a, b)| *a as f64 * b).sum();
    acc.iter().sum::<f64>() + tail
}

/// Trace of a square matrix, summed in `f64` and rounded to `f32`.
///
/// # Errors
/// [`Error::Shape`] unless `a` is square, [`Error::NonFinite`] for a NaN/Inf diagonal entry.
pub fn trace(a: MatRef<'_, f32>) -> Result<f32> {
    const OP: &str = "cpu::trace";
    let n = a.rows();
    check_shape(OP, "a", a.shape(), (n, n))?;
    let mut s = 0.0f64;
    for i in 0..n {
        let v = a.at(i, i);
        if !v.is_finite() {
            return Err(Error::NonFinite {
                op: OP,
                arg: "a",
                index: i * n + i,
                value: v,
            });
        }
        s += v as f64;
    }
    Ok(s as f32)
}
