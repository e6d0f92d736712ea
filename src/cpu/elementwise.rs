//! Element-wise vector operations and the fused optimizer updates on the host.
//!
//! Every function takes flat `f32` slices of one length `n`, validates lengths, scalars and
//! finiteness of every input **before** writing anything (a failed call leaves all outputs
//! unchanged), then runs sequentially below [`PAR_MIN`] elements and over rayon chunks of
//! [`CHUNK`] elements above it. Element-wise results do not depend on the chunking; the
//! reductions ([`dot`], [`norm2`]) sum each chunk in `f64` and add the chunk sums in `f64` in
//! index order, so they are deterministic whatever the thread count.
//!
//! The fused updates compute in `f32` with exactly the operation order their doc comments
//! state: the GPU kernels of `kernels/elementwise.cu` implement the same formulas 1:1.

use rayon::prelude::*;

use crate::error::{check_finite, check_len, check_value, Result};
use crate::params::elementwise::{check_beta, AdamWCoeffs, SgdCoeffs, SophiaCoeffs};

/// Elements per rayon work item (64 KiB of `f32`: large enough to amortize scheduling).
pub const CHUNK: usize = 1 << 14;

/// Below this length everything runs on the calling thread.
pub const PAR_MIN: usize = 1 << 16;

/// Applies `f` to matching chunks of one mutable and one shared slice of equal length.
fn zip2(y: &mut [f32], x: &[f32], f: impl Fn(&mut [f32], &[f32]) + Sync) {
    if y.len() < PAR_MIN {
        f(y, x);
    } else {
        y.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(y, x)| f(y, x));
    }
}

/// `y ← α x + y`.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) unless `x.len() == y.len()`,
/// [`Error::Value`](crate::Error::Value) for a non-finite `α`,
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `x` or `y`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) -> Result<()> {
    const OP: &str = "cpu::axpy";
    check_len(OP, "x", x.len(), y.len())?;
    check_value(OP, "alpha", alpha as f64, true, "a finite number")?;
    check_finite(OP, "x", x)?;
    check_finite(OP, "y", y)?;
    zip2(y, x, |y, x| {
        y.iter_mut().zip(x).for_each(|(y, &x)| *y += alpha * x);
    });
    Ok(())
}

/// `x ← α x`.
///
/// # Errors
/// [`Error::Value`](crate::Error::Value) for a non-finite `α`,
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `x`.
pub fn scale(alpha: f32, x: &mut [f32]) -> Result<()> {
    const OP: &str = "cpu::scale";
    check_value(OP, "alpha", alpha as f64, true, "a finite number")?;
    check_finite(OP, "x", x)?;
    let f = |x: &mut [f32]| x.iter_mut().for_each(|v| *v *= alpha);
    if x.len() < PAR_MIN {
        f(x);
    } else {
        x.par_chunks_mut(CHUNK).for_each(f);
    }
    Ok(())
}

/// `dst ← src`.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) unless the lengths agree. Non-finite values are
/// copied as they are (a copy is how a caller snapshots any state).
pub fn copy(src: &[f32], dst: &mut [f32]) -> Result<()> {
    check_len("cpu::copy", "src", src.len(), dst.len())?;
    zip2(dst, src, |d, s| d.copy_from_slice(s));
    Ok(())
}

/// `Σ xᵢ yᵢ` of one chunk in `f64`, four independent lanes (vectorizes without fast-math).
/// Also the Kalman backend's inner product ([`crate::cpu::kalman`]).
pub(crate) fn dot_chunk(x: &[f32], y: &[f32]) -> f64 {
    let mut acc = [0.0f64; 4];
    let split = x.len() - x.len() % 4;
    for (xs, ys) in x[..split].chunks_exact(4).zip(y[..split].chunks_exact(4)) {
        for k in 0..4 {
            acc[k] += xs[k] as f64 * ys[k] as f64;
        }
    }
    let tail: f64 = x[split..]
        .iter()
        .zip(&y[split..])
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum();
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// `Σ xᵢ yᵢ` in `f64` over chunks of [`CHUNK`], chunk sums added in index order.
fn dot_f64(x: &[f32], y: &[f32]) -> f64 {
    if x.len() < PAR_MIN {
        return x
            .chunks(CHUNK)
            .zip(y.chunks(CHUNK))
            .map(|(x, y)| dot_chunk(x, y))
            .sum();
    }
    let partial: Vec<f64> = x
        .par_chunks(CHUNK)
        .zip(y.par_chunks(CHUNK))
        .map(|(x, y)| dot_chunk(x, y))
        .collect();
    partial.iter().sum()
}

/// Dot product `xᵀy`.
///
/// Products of `f32` inputs are exact in `f64` and accumulate in `f64` (chunk partials added
/// in a fixed order), so the only error that matters is the final rounding to `f32`:
/// `|result − xᵀy| ≤ 2⁻²⁴|xᵀy| + n·2⁻⁵³·Σ|xᵢyᵢ|`. Deterministic for any thread count.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) unless the lengths agree,
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in an input.
pub fn dot(x: &[f32], y: &[f32]) -> Result<f32> {
    const OP: &str = "cpu::dot";
    check_len(OP, "y", y.len(), x.len())?;
    check_finite(OP, "x", x)?;
    check_finite(OP, "y", y)?;
    Ok(dot_f64(x, y) as f32)
}

/// Euclidean norm `‖x‖₂ = √(Σ xᵢ²)`, accumulated like [`dot`] in `f64` (no overflow for any
/// finite `f32` input before the final rounding; a norm above `f32::MAX` rounds to `+∞`).
///
/// # Errors
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `x`.
pub fn norm2(x: &[f32]) -> Result<f32> {
    check_finite("cpu::norm2", "x", x)?;
    Ok(dot_f64(x, x).sqrt() as f32)
}

/// Fused SGD step with heavy-ball momentum and decoupled weight decay (`lr`, `μ` momentum,
/// `λ` weight decay from `c`), for every `i`:
///
/// ```text
/// b_i ← μ·b_i + g_i
/// θ_i ← θ_i − lr·λ·θ_i − lr·b_i
/// ```
///
/// (with `b = 0` initially the first step uses `b = g`, as PyTorch's SGD without dampening).
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) for unequal lengths, [`Error::Value`](crate::Error::Value)
/// for bad coefficients (see [`SgdCoeffs::validate`]),
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `θ`, `g` or `b`.
pub fn sgd_update(
    params: &mut [f32],
    grad: &[f32],
    momentum_buf: &mut [f32],
    c: &SgdCoeffs,
) -> Result<()> {
    const OP: &str = "cpu::sgd_update";
    let n = params.len();
    check_len(OP, "grad", grad.len(), n)?;
    check_len(OP, "momentum_buf", momentum_buf.len(), n)?;
    c.validate(OP)?;
    check_finite(OP, "params", params)?;
    check_finite(OP, "grad", grad)?;
    check_finite(OP, "momentum_buf", momentum_buf)?;
    let (lr, mu, wd) = (c.lr, c.momentum, c.weight_decay);
    let f = |p: &mut [f32], g: &[f32], b: &mut [f32]| {
        for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
            let bi = mu * *b + g;
            *b = bi;
            *p = *p - lr * wd * *p - lr * bi;
        }
    };
    if n < PAR_MIN {
        f(params, grad, momentum_buf);
    } else {
        params
            .par_chunks_mut(CHUNK)
            .zip(grad.par_chunks(CHUNK))
            .zip(momentum_buf.par_chunks_mut(CHUNK))
            .for_each(|((p, g), b)| f(p, g, b));
    }
    Ok(())
}

/// Fused AdamW step (Loshchilov & Hutter 2019) with bias correction and decoupled weight
/// decay. With `t = c.step ≥ 1`, `bc₁ = 1 − β₁ᵗ`, `bc₂ = 1 − β₂ᵗ` (computed once in `f64`,
/// rounded to `f32`, see [`AdamWCoeffs::bias_corrections`]), for every `i`:
///
/// ```text
/// m_i ← β₁·m_i + (1 − β₁)·g_i
/// v_i ← β₂·v_i + (1 − β₂)·g_i²
/// θ_i ← θ_i − lr·λ·θ_i − lr·(m_i / bc₁) / (√(v_i / bc₂) + ε)
/// ```
///
/// `lr` is the already-scheduled learning rate (warm-up lives in the optimizer).
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) for unequal lengths, [`Error::Value`](crate::Error::Value)
/// for bad coefficients (see [`AdamWCoeffs::validate`]),
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `θ`, `g`, `m` or `v`, and
/// [`Error::Value`](crate::Error::Value) for a negative `v_i`.
pub fn adamw_update(
    params: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    c: &AdamWCoeffs,
) -> Result<()> {
    const OP: &str = "cpu::adamw_update";
    let n = params.len();
    check_len(OP, "grad", grad.len(), n)?;
    check_len(OP, "m", m.len(), n)?;
    check_len(OP, "v", v.len(), n)?;
    c.validate(OP)?;
    check_finite(OP, "params", params)?;
    check_finite(OP, "grad", grad)?;
    check_finite(OP, "m", m)?;
    check_finite(OP, "v", v)?;
    check_nonnegative(OP, "v", v)?;
    let (bc1, bc2) = c.bias_corrections();
    let (lr, b1, b2, eps, wd) = (c.lr, c.beta1, c.beta2, c.eps, c.weight_decay);
    let f = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let mi = b1 * *m + (1.0 - b1) * g;
            let vi = b2 * *v + (1.0 - b2) * (g * g);
            *m = mi;
            *v = vi;
            *p = *p - lr * wd * *p - lr * (mi / bc1) / ((vi / bc2).sqrt() + eps);
        }
    };
    if n < PAR_MIN {
        f(params, grad, m, v);
    } else {
        params
            .par_chunks_mut(CHUNK)
            .zip(grad.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| f(p, g, m, v));
    }
    Ok(())
}

/// Fused Sophia step (Liu et al. 2023, Algorithm 3) with decoupled weight decay, given the
/// current diagonal Hessian estimate `h` (read only), for every `i`:
///
/// ```text
/// m_i ← β₁·m_i + (1 − β₁)·g_i
/// θ_i ← θ_i − lr·λ·θ_i − lr·clip(m_i / max(γ·h_i, ε), −1, 1)
/// ```
///
/// Where `γ·h_i ≤ ε` (e.g. before the first Hessian estimate) the step is `lr·sign(m_i)` for
/// all but tiny `|m_i|`: Sophia degenerates to sign momentum there, as in the paper.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) for unequal lengths, [`Error::Value`](crate::Error::Value)
/// for bad coefficients (see [`SophiaCoeffs::validate`]) or a negative `h_i`,
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `θ`, `g`, `m` or `h`.
pub fn sophia_update(
    params: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    h: &[f32],
    c: &SophiaCoeffs,
) -> Result<()> {
    const OP: &str = "cpu::sophia_update";
    let n = params.len();
    check_len(OP, "grad", grad.len(), n)?;
    check_len(OP, "m", m.len(), n)?;
    check_len(OP, "h", h.len(), n)?;
    c.validate(OP)?;
    check_finite(OP, "params", params)?;
    check_finite(OP, "grad", grad)?;
    check_finite(OP, "m", m)?;
    check_finite(OP, "h", h)?;
    check_nonnegative(OP, "h", h)?;
    let (lr, b1, gamma, eps, wd) = (c.lr, c.beta1, c.gamma, c.eps, c.weight_decay);
    let f = |p: &mut [f32], g: &[f32], m: &mut [f32], h: &[f32]| {
        for (((p, &g), m), &h) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(h) {
            let mi = b1 * *m + (1.0 - b1) * g;
            *m = mi;
            let ratio = (mi / (gamma * h).max(eps)).clamp(-1.0, 1.0);
            *p = *p - lr * wd * *p - lr * ratio;
        }
    };
    if n < PAR_MIN {
        f(params, grad, m, h);
    } else {
        params
            .par_chunks_mut(CHUNK)
            .zip(grad.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(h.par_chunks(CHUNK))
            .for_each(|(((p, g), m), h)| f(p, g, m, h));
    }
    Ok(())
}

/// Sophia-G's Gauss–Newton–Bartlett Hessian EMA: with `ĝ` the mean gradient of a batch of
/// `B = batch` samples under labels sampled from the model, for every `i`:
///
/// ```text
/// h_i ← β₂·h_i + (1 − β₂)·(B·ĝ_i·ĝ_i)
/// ```
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) for unequal lengths, [`Error::Value`](crate::Error::Value)
/// unless `0 ≤ β₂ < 1` and `batch ≥ 1`, or for a negative `h_i`,
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `h` or `ĝ`.
pub fn sophia_hessian_ema(
    h: &mut [f32],
    sampled_grad: &[f32],
    beta2: f32,
    batch: usize,
) -> Result<()> {
    const OP: &str = "cpu::sophia_hessian_ema";
    check_len(OP, "sampled_grad", sampled_grad.len(), h.len())?;
    check_beta(OP, "beta2", beta2)?;
    check_value(OP, "batch", batch as f64, batch >= 1, "batch >= 1")?;
    check_finite(OP, "h", h)?;
    check_finite(OP, "sampled_grad", sampled_grad)?;
    check_nonnegative(OP, "h", h)?;
    let bs = batch as f32;
    zip2(h, sampled_grad, |h, g| {
        for (h, &g) in h.iter_mut().zip(g) {
            *h = beta2 * *h + (1.0 - beta2) * (bs * g * g);
        }
    });
    Ok(())
}

/// `Err(Error::Value)` naming the first negative entry of a quantity that must be `≥ 0`.
pub(crate) fn check_nonnegative(op: &'static str, arg: &'static str, xs: &[f32]) -> Result<()> {
    match xs.iter().find(|v| **v < 0.0) {
        None => Ok(()),
        Some(&v) => check_value(op, arg, v as f64, false, "every entry >= 0"),
    }
}
