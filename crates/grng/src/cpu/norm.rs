//! Spectral norm by power iteration and trace, for the PSD Kronecker factors.

use rayon::prelude::*;

use super::check_finite_view;
use crate::error::{check_len, check_shape, Error, Result};
use crate::iteration::PowerStep;
use crate::mat::MatRef;
use crate::params::norm::{PowerInfo, PowerOptions};
use crate::simd::multiversion;

/// Largest eigenvalue of a symmetric PSD `n x n` matrix by power iteration.
///
/// Starts from the normalized all-ones vector plus a fixed aperiodic perturbation (so a
/// top eigenvector orthogonal to all-ones is still found, and runs are deterministic);
/// matrix-vector products accumulate in `f64`. Stops when the Rayleigh quotient `vᵀAv`
/// changes by at most `opts.tol` relative to its value. The returned value is that Rayleigh
/// quotient; its error shrinks like `(λ₂/λ₁)^(2k)`, so a tiny eigen-gap converges slowly and
/// the relative change is an estimate of the error, not a bound. A value below the largest
/// diagonal element `A_kk` (a lower bound of `λ_max`) means the stop fired near a smaller
/// eigenvalue; the iteration then restarts from `e_k` within `opts.max_iter` steps in all.
/// `n = 0` gives `0`. `opts.max_batch` is ignored: steps run one at a time.
///
/// # Errors
/// [`Error::Shape`] unless `a` is square, [`Error::Value`] for bad options,
/// [`Error::NonFinite`] for NaN/Inf in `a`.
pub fn spectral_norm(a: MatRef<'_, f32>, opts: &PowerOptions) -> Result<PowerInfo> {
    spectral_norm_warm(a, opts, None).map(|(info, _)| info)
}

/// [`spectral_norm`] from the warm start `warm` (`n` values, normalized here; the fixed start
/// when absent, of another length, zero or not finite), and the last iterate (a unit vector
/// in `f32`, empty for `n = 0`): the next call's warm start on a nearby matrix.
///
/// # Errors
/// As [`spectral_norm`].
pub(crate) fn spectral_norm_warm(
    a: MatRef<'_, f32>,
    opts: &PowerOptions,
    warm: Option<&[f32]>,
) -> Result<(PowerInfo, Vec<f32>)> {
    const OP: &str = "cpu::spectral_norm";
    let n = a.rows();
    check_shape(OP, "a", a.shape(), (n, n))?;
    opts.validate(OP)?;
    check_finite_view(OP, "a", a)?;
    if n == 0 {
        let info = PowerInfo {
            value: 0.0,
            iterations: 0,
            converged: true,
        };
        return Ok((info, Vec::new()));
    }
    // Nothing is read back here, so a batch would only add steps past the stop.
    let opts = PowerOptions {
        max_batch: 1,
        ..*opts
    };
    let warm = warm.filter(|w| w.len() == n).and_then(|w| {
        let norm = w.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
        (norm.is_finite() && norm > 0.0).then(|| w.iter().map(|&x| x as f64 / norm).collect())
    });
    let mut steps = HostPower::new(a, warm);
    let info = crate::iteration::power_iteration(&mut steps, n, &opts)?;
    Ok((info, steps.v.iter().map(|&x| x as f32).collect()))
}

/// Power steps on a host matrix (`f64` iterate, products accumulated in `f64`).
pub(crate) struct HostPower<'a> {
    a: MatRef<'a, f32>,
    v: Vec<f64>,
    w: Vec<f64>,
    /// The unit warm start ([`PowerStep::start_warm`]).
    warm: Option<Vec<f64>>,
}

impl<'a> HostPower<'a> {
    /// Steps on the square `a`, with the unit warm start `warm` when given.
    pub(crate) fn new(a: MatRef<'a, f32>, warm: Option<Vec<f64>>) -> Self {
        Self {
            a,
            v: Vec::new(),
            w: vec![0.0; a.rows()],
            warm,
        }
    }

    /// One step: `w = A v`, `v ← w/‖w‖` when `‖w‖ > 0`; returns `(vᵀw, ‖w‖)`.
    fn step(&mut self) -> (f64, f64) {
        let (a, v) = (self.a, &self.v);
        self.w
            .par_iter_mut()
            .enumerate()
            .for_each(|(i, wi)| *wi = dot(a.row(i), v));
        let rq = dot(v, &self.w);
        let wn = dot(&self.w, &self.w).sqrt();
        if wn > 0.0 {
            self.v
                .iter_mut()
                .zip(&self.w)
                .for_each(|(x, y)| *x = y / wn);
        }
        (rq, wn)
    }
}

impl PowerStep for HostPower<'_> {
    fn start(&mut self, v0: &[f64]) -> Result<()> {
        check_len("cpu::power_step", "v0", v0.len(), self.a.rows())?;
        self.v = v0.to_vec();
        Ok(())
    }

    fn start_warm(&mut self) -> Result<bool> {
        match &self.warm {
            Some(w) => {
                self.v.clone_from(w);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn steps(&mut self, k: usize) -> Result<Vec<(f64, f64)>> {
        Ok((0..k).map(|_| self.step()).collect())
    }

    fn top_diagonal(&mut self) -> Result<Option<(usize, f64)>> {
        let a = self.a;
        // `>` keeps the first row on ties; the caller checked `a` finite.
        Ok((0..a.rows()).fold(None, |best, k| {
            let d = a.row(k)[k] as f64;
            match best {
                Some((_, b)) if d <= b => best,
                _ => Some((k, d)),
            }
        }))
    }
}

/// An element the power iteration's dot widens exactly to `f64` (`f32` rows, `f64` iterates).
trait Wide: Copy {
    fn wide(self) -> f64;
}

impl Wide for f32 {
    #[inline(always)]
    fn wide(self) -> f64 {
        self as f64
    }
}

impl Wide for f64 {
    #[inline(always)]
    fn wide(self) -> f64 {
        self
    }
}

multiversion! {
    /// `Σ xᵢyᵢ` in `f64`, four independent lanes (vectorizes without reassociation flags; the
    /// same bits at every instruction-set level): the power iteration's matrix-vector product
    /// (an `f32` row against the `f64` iterate) and its `f64` dots. The baseline's SSE2 copy of
    /// the matrix-vector product took about a tenth of a RING refresh at n = 1024.
    fn dot<T: Wide>(x: &[T], y: &[f64]) -> f64 {
        let mut acc = [0.0f64; 4];
        let (xc, xr) = x.split_at(x.len() - x.len() % 4);
        let (yc, yr) = y.split_at(xc.len());
        for (a, b) in xc.chunks_exact(4).zip(yc.chunks_exact(4)) {
            for l in 0..4 {
                acc[l] += a[l].wide() * b[l];
            }
        }
        let tail: f64 = xr.iter().zip(yr).map(|(a, b)| a.wide() * b).sum();
        acc.iter().sum::<f64>() + tail
    }
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
