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

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::error::{check_finite, check_len, check_value, try_with_capacity, Result};
use crate::params::elementwise::{
    check_beta, AdamWCoeffs, InputBounds, MultiLayout, MultiUpdate, SgdCoeffs, SophiaCoeffs,
};
use crate::simd::multiversion;

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
    zip2(y, x, |y, x| axpy_chunk(alpha, x, y));
    Ok(())
}

/// `y + α x` as a new vector, in one pass that writes it and flags a non-finite result
/// (per chunk, a branch-free flag the loop vectorizes with); only a flagged call reads the
/// inputs again, to name the first bad value. A non-finite `x` or `y` always gives a
/// non-finite result (`α` is finite), so the one flag covers the inputs too.
///
/// # Errors
/// As [`axpy`], plus [`Error::NonFinite`](crate::Error::NonFinite) with `arg`
/// `"result (overflow)"` for finite inputs whose sum overflows, and
/// [`Error::OutOfMemory`](crate::Error::OutOfMemory).
pub fn axpy_new(alpha: f32, x: &[f32], y: &[f32]) -> Result<Vec<f32>> {
    const OP: &str = "cpu::axpy_new";
    check_len(OP, "x", x.len(), y.len())?;
    check_value(OP, "alpha", alpha as f64, true, "a finite number")?;
    let n = x.len();
    let chunk = |o: &mut [MaybeUninit<f32>], x: &[f32], y: &[f32]| axpy_new_chunk(alpha, x, y, o);
    // Written element by element, not zero-filled first.
    let mut out: Vec<f32> = try_with_capacity("host", n, 1)?;
    let spare = &mut out.spare_capacity_mut()[..n];
    let ok = if n < PAR_MIN {
        chunk(spare, x, y)
    } else {
        spare
            .par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK).zip(y.par_chunks(CHUNK)))
            .map(|(o, (x, y))| chunk(o, x, y))
            .reduce(|| true, |a, b| a & b)
    };
    // SAFETY: the capacity holds `n` elements, and the chunks above, which cover `0..n`,
    // wrote every one of them.
    unsafe { out.set_len(n) };
    if !ok {
        check_finite(OP, "x", x)?;
        check_finite(OP, "y", y)?;
        check_finite(OP, "result (overflow)", &out)?;
    }
    Ok(out)
}

/// Which operand of `y + α x` [`axpy_over`] writes over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Over {
    /// The result replaces `x`.
    X,
    /// The result replaces `y`.
    Y,
}

/// `y + α x` written over one of its operands, `over` (which the caller no longer needs: a
/// product's result, say): [`axpy_new`]'s pass, the same expression and so the same bits,
/// without a new vector (no allocation, no zero-fill, no first-touch page faults). `o` holds
/// the overwritten operand on entry and the result on return; `other` is the other one.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) unless the lengths agree,
/// [`Error::Value`](crate::Error::Value) for a non-finite `α`,
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `other` (by name, `"x"` or
/// `"y"`), else at the first non-finite result with `arg` [`OVER_NONFINITE`]: the sum
/// overflowed or the overwritten operand held NaN/Inf there (its old value is gone). `o` then
/// holds a partial result: the caller gave it up.
pub fn axpy_over(alpha: f32, over: Over, other: &[f32], o: &mut [f32]) -> Result<()> {
    const OP: &str = "cpu::axpy_over";
    check_len(OP, "other", other.len(), o.len())?;
    check_value(OP, "alpha", alpha as f64, true, "a finite number")?;
    let chunk = |o: &mut [f32], other: &[f32]| axpy_over_chunk(alpha, over == Over::X, other, o);
    let ok = if o.len() < PAR_MIN {
        chunk(o, other)
    } else {
        o.par_chunks_mut(CHUNK)
            .zip(other.par_chunks(CHUNK))
            .map(|(o, other)| chunk(o, other))
            .reduce(|| true, |a, b| a & b)
    };
    if !ok {
        check_finite(OP, if over == Over::X { "y" } else { "x" }, other)?;
        check_finite(OP, OVER_NONFINITE, o)?;
    }
    Ok(())
}

/// The `arg` of [`axpy_over`]'s error for a non-finite result of finite `other`.
pub const OVER_NONFINITE: &str = "result (overflow, or NaN/Inf in the overwritten operand)";

/// `x ← α x`.
///
/// # Errors
/// [`Error::Value`](crate::Error::Value) for a non-finite `α`,
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `x`.
pub fn scale(alpha: f32, x: &mut [f32]) -> Result<()> {
    const OP: &str = "cpu::scale";
    check_value(OP, "alpha", alpha as f64, true, "a finite number")?;
    check_finite(OP, "x", x)?;
    let f = |x: &mut [f32]| scale_chunk(alpha, x);
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

multiversion! {
    /// `y ← y + α x` over one chunk.
    fn axpy_chunk(alpha: f32, x: &[f32], y: &mut [f32]) {
        y.iter_mut().zip(x).for_each(|(y, &x)| *y += alpha * x);
    }
}

multiversion! {
    /// `o ← y + α x` over one chunk; whether every result is finite (a branch-free flag).
    fn axpy_new_chunk(alpha: f32, x: &[f32], y: &[f32], o: &mut [MaybeUninit<f32>]) -> bool {
        let mut ok = true;
        for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
            let v = y + alpha * x;
            o.write(v);
            ok &= v.abs() < f32::INFINITY;
        }
        ok
    }
}

multiversion! {
    /// `o ← other + α o` (`over_x`: `o` held `x`) or `o ← o + α other` over one chunk, the
    /// expression of [`axpy_new_chunk`]; whether every result is finite (a branch-free flag).
    fn axpy_over_chunk(alpha: f32, over_x: bool, other: &[f32], o: &mut [f32]) -> bool {
        let mut ok = true;
        if over_x {
            for (o, &y) in o.iter_mut().zip(other) {
                *o = y + alpha * *o;
                ok &= o.abs() < f32::INFINITY;
            }
        } else {
            for (o, &x) in o.iter_mut().zip(other) {
                *o += alpha * x;
                ok &= o.abs() < f32::INFINITY;
            }
        }
        ok
    }
}

multiversion! {
    /// `x ← α x` over one chunk.
    fn scale_chunk(alpha: f32, x: &mut [f32]) {
        x.iter_mut().for_each(|v| *v *= alpha);
    }
}

multiversion! {
    /// `Σ xᵢ yᵢ` of one chunk in `f64`: [`DOT_LANES`] independent lanes (lane `k` sums the
    /// products at `i ≡ k mod DOT_LANES`), folded pairwise, then the tail. Sixteen lanes fill
    /// two AVX-512 registers, so the loop is not bound by one add chain's latency (with four,
    /// it ran at one element per cycle and the gradient norm cost 8% of an AdamW step).
    /// Also the Kalman backend's inner product ([`crate::cpu::kalman`]).
    pub(crate) fn dot_chunk(x: &[f32], y: &[f32]) -> f64 {
        let mut acc = [0.0f64; DOT_LANES];
        let split = x.len() - x.len() % DOT_LANES;
        for (xs, ys) in x[..split]
            .chunks_exact(DOT_LANES)
            .zip(y[..split].chunks_exact(DOT_LANES))
        {
            for k in 0..DOT_LANES {
                acc[k] += xs[k] as f64 * ys[k] as f64;
            }
        }
        let tail: f64 = x[split..]
            .iter()
            .zip(&y[split..])
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum();
        let mut w = DOT_LANES;
        while w > 1 {
            w /= 2;
            for k in 0..w {
                acc[k] += acc[k + w];
            }
        }
        acc[0] + tail
    }
}

/// The independent `f64` accumulators of [`dot_chunk`].
const DOT_LANES: usize = 16;

/// `Σ xᵢ yᵢ` in `f64` over chunks of [`CHUNK`], chunk sums added in index order.
pub fn dot_f64(x: &[f32], y: &[f32]) -> f64 {
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
    finite_sum(OP, dot_f64(x, y), [("x", x), ("y", y)]).map(|s| s as f32)
}

/// `sum`, an `f64` sum of products of the `f32` `inputs`, checked as it was computed: for finite
/// inputs it is finite (each term is below `f32::MAX² ≈ 1.2e77`, far from `f64::MAX` for any
/// length), so only a NaN/Inf input makes it non-finite, and only then are the inputs scanned,
/// in order, for the first one (the error a check before the sum reports). No pass of its own.
fn finite_sum<const K: usize>(
    op: &'static str,
    sum: f64,
    inputs: [(&'static str, &[f32]); K],
) -> Result<f64> {
    if !sum.is_finite() {
        for (arg, xs) in inputs {
            check_finite(op, arg, xs)?;
        }
    }
    Ok(sum)
}

/// Euclidean norm `‖x‖₂ = √(Σ xᵢ²)`, accumulated like [`dot`] in `f64` (no overflow for any
/// finite `f32` input before the final rounding; a norm above `f32::MAX` rounds to `+∞`).
///
/// # Errors
/// [`Error::NonFinite`](crate::Error::NonFinite) for NaN/Inf in `x`.
pub fn norm2(x: &[f32]) -> Result<f32> {
    finite_sum("cpu::norm2", dot_f64(x, x), [("x", x)]).map(|s| s.sqrt() as f32)
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
    let f = |p: &mut [f32], g: &[f32], b: &mut [f32]| sgd_chunk(c, p, g, b);
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
    let bc = c.bias_corrections();
    let f = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| adamw_chunk(c, bc, p, g, m, v);
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
    let f = |p: &mut [f32], g: &[f32], m: &mut [f32], h: &[f32]| sophia_chunk(c, p, g, m, h);
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
    zip2(h, sampled_grad, |h, g| {
        for (h, &g) in h.iter_mut().zip(g) {
            hessian_ema_elem(beta2, batch, h, g);
        }
    });
    Ok(())
}

// The in-place loops of the single-tensor updates, compiled per instruction-set level like
// the multi-tensor `update_chunk` (same per-element formulas, so the same bits:
// `tests/cpu_simd_levels.rs` checks both).

multiversion! {
    fn sgd_chunk(c: &SgdCoeffs, p: &mut [f32], g: &[f32], b: &mut [f32]) {
        for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
            sgd_elem(c, p, g, b);
        }
    }
}

multiversion! {
    fn adamw_chunk(
        c: &AdamWCoeffs,
        bc: (f32, f32),
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            adamw_elem(c, bc, p, g, m, v);
        }
    }
}

multiversion! {
    fn sophia_chunk(c: &SophiaCoeffs, p: &mut [f32], g: &[f32], m: &mut [f32], h: &[f32]) {
        for (((p, &g), m), &h) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(h) {
            sophia_elem(c, p, g, m, h);
        }
    }
}

// The per-element formulas of the fused updates (shared by the one- and multi-tensor paths;
// the kernels' Ew* functors are their 1:1 transcriptions).

#[inline(always)]
fn sgd_elem(c: &SgdCoeffs, p: &mut f32, g: f32, b: &mut f32) {
    let bi = c.momentum * *b + g;
    *b = bi;
    *p = *p - c.lr * c.weight_decay * *p - c.lr * bi;
}

/// `bc` = [`AdamWCoeffs::bias_corrections`], computed once per call.
#[inline(always)]
fn adamw_elem(c: &AdamWCoeffs, bc: (f32, f32), p: &mut f32, g: f32, m: &mut f32, v: &mut f32) {
    let mi = c.beta1 * *m + (1.0 - c.beta1) * g;
    let vi = c.beta2 * *v + (1.0 - c.beta2) * (g * g);
    *m = mi;
    *v = vi;
    *p = *p - c.lr * c.weight_decay * *p - c.lr * (mi / bc.0) / ((vi / bc.1).sqrt() + c.eps);
}

#[inline(always)]
fn sophia_elem(c: &SophiaCoeffs, p: &mut f32, g: f32, m: &mut f32, h: f32) {
    let mi = c.beta1 * *m + (1.0 - c.beta1) * g;
    *m = mi;
    let ratio = (mi / (c.gamma * h).max(c.eps)).clamp(-1.0, 1.0);
    *p = *p - c.lr * c.weight_decay * *p - c.lr * ratio;
}

#[inline(always)]
fn hessian_ema_elem(beta2: f32, batch: usize, h: &mut f32, g: f32) {
    *h = beta2 * *h + (1.0 - beta2) * (batch as f32 * g * g);
}

/// `Err(Error::Value)` naming the first negative entry of a quantity that must be `≥ 0`.
pub(crate) fn check_nonnegative(op: &'static str, arg: &'static str, xs: &[f32]) -> Result<()> {
    match xs.iter().find(|v| **v < 0.0) {
        None => Ok(()),
        Some(&v) => check_value(op, arg, v as f64, false, "every entry >= 0"),
    }
}

/// The host arrays of one multi-tensor update (layout [`MultiLayout`]): per tensor its
/// params, gradient and (Sophia refresh) Hessian sample; the flat state arrays `s0` and
/// (two-state updates) `s1`; the outputs `po` (per tensor), `o0` and, when the update writes
/// `s1`, `o1` (flat, same layout).
pub(crate) struct MultiHost<'a> {
    pub params: Vec<&'a [f32]>,
    pub grads: Vec<&'a [f32]>,
    pub sampled: Option<Vec<&'a [f32]>>,
    pub s0: &'a [f32],
    pub s1: Option<&'a [f32]>,
    pub po: Vec<&'a mut [f32]>,
    pub o0: &'a mut [f32],
    pub o1: Option<&'a mut [f32]>,
}

/// The first `(flat position, value)` over all tensors where `bad` holds, tensor `t` read
/// from `array(t)`.
fn first_where<'a>(
    layout: &MultiLayout,
    array: impl Fn(usize) -> &'a [f32],
    bad: impl Fn(f32) -> bool,
) -> Option<(usize, f32)> {
    (0..layout.lens().len()).find_map(|t| {
        let xs = array(t);
        xs.iter()
            .position(|&v| bad(v))
            .map(|i| (layout.first(t) + i, xs[i]))
    })
}

/// The segments of `buf` (a flat state array of `layout`) as disjoint mutable slices.
fn segments_mut<'a>(layout: &MultiLayout, mut buf: &'a mut [f32]) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(layout.lens().len());
    let mut at = 0;
    for t in 0..layout.lens().len() {
        let seg = layout.segment(t);
        let (_, rest) = std::mem::take(&mut buf).split_at_mut(seg.start - at);
        let (mine, rest) = rest.split_at_mut(seg.len());
        out.push(mine);
        buf = rest;
        at = seg.end;
    }
    out
}

/// One multi-tensor update on the host, the CPU twin of the `elementwise_multi_*` kernels:
/// one pass computes every element into the outputs (rayon over chunks of [`CHUNK`] of all
/// tensors) and flags, as it streams, any bad input or non-finite result; only a flagged call
/// scans again, for the first bad value in the kernels' status-slot order
/// ([`MultiUpdate::error`]: inputs before results). The inputs are never written; on error the
/// outputs hold garbage the caller does not commit.
pub(crate) fn multi_update(
    op: &'static str,
    layout: &MultiLayout,
    upd: &MultiUpdate,
    io: MultiHost<'_>,
) -> Result<()> {
    let MultiHost {
        params,
        grads,
        sampled,
        s0,
        s1,
        mut po,
        o0,
        o1,
    } = io;
    let mut o0s = segments_mut(layout, o0);
    let mut o1s = o1.map(|o1| segments_mut(layout, o1));
    let o1t: Vec<Option<&mut [f32]>> = match o1s.as_mut() {
        Some(o1s) => o1s.iter_mut().map(|s| Some(&mut **s)).collect(),
        None => po.iter().map(|_| None).collect(),
    };
    let items = chunk_items(
        po.iter_mut()
            .zip(o0s.iter_mut())
            .zip(o1t)
            .map(|((p, o), o1)| (&mut **p, &mut **o, o1)),
    );
    let run = |(t, i0, pc, oc, o1c): ChunkItem<'_>| {
        let base = layout.segment(t).start + i0;
        let n = pc.len();
        let ins = ChunkIn {
            p: &params[t][i0..i0 + n],
            g: &grads[t][i0..i0 + n],
            s0: &s0[base..base + n],
            s1: s1.map_or(&[][..], |s1| &s1[base..base + n]),
            gh: sampled.as_ref().map_or(&[][..], |gh| &gh[t][i0..i0 + n]),
        };
        update_chunk(upd, ins, (pc, oc, o1c.unwrap_or(&mut [])))
    };
    if map_items(layout.total(), items, run)
        .into_iter()
        .all(|clean| clean)
    {
        return Ok(());
    }
    // Error path only: find the first bad value in the kernels' status-slot order (inputs
    // before results), exactly what a check-before-compute scan would have reported.
    let nonfinite = |v: f32| !v.is_finite();
    let found = [
        first_where(layout, |t| params[t], nonfinite),
        first_where(layout, |t| grads[t], nonfinite),
        first_where(layout, |t| &s0[layout.segment(t)], nonfinite),
        s1.and_then(|s1| first_where(layout, |t| &s1[layout.segment(t)], nonfinite)),
        sampled
            .as_ref()
            .and_then(|gh| first_where(layout, |t| gh[t], nonfinite)),
        s1.and_then(|s1| first_where(layout, |t| &s1[layout.segment(t)], |v| v < 0.0)),
        first_where(layout, |t| &*po[t], nonfinite),
        first_where(layout, |t| &*o0s[t], nonfinite),
        o1s.as_ref()
            .and_then(|o1s| first_where(layout, |t| &*o1s[t], nonfinite)),
    ];
    // The flags test exactly these predicates, so a flagged call finds its bad value here.
    match found
        .into_iter()
        .enumerate()
        .find_map(|(k, f)| f.map(|f| (k, f)))
    {
        Some((slot, (pos, value))) => Err(upd.error(op, layout, slot, pos, value)),
        None => Ok(()),
    }
}

/// One work item of a multi-tensor pass: the tensor, the chunk's first index in it, and the
/// chunk of each array the pass writes (the third where it writes one).
type ChunkItem<'a> = (
    usize,
    usize,
    &'a mut [f32],
    &'a mut [f32],
    Option<&'a mut [f32]>,
);

/// The work items of a multi-tensor pass that writes per-tensor arrays `(a, b, c)`, each of
/// its tensor's length: one per [`CHUNK`] of every tensor, in order.
fn chunk_items<'a>(
    arrays: impl IntoIterator<Item = (&'a mut [f32], &'a mut [f32], Option<&'a mut [f32]>)>,
) -> Vec<ChunkItem<'a>> {
    let mut items = Vec::new();
    for (t, (a, b, c)) in arrays.into_iter().enumerate() {
        let mut cc = c.map(|c| c.chunks_mut(CHUNK));
        for (k, (ac, bc)) in a.chunks_mut(CHUNK).zip(b.chunks_mut(CHUNK)).enumerate() {
            items.push((t, k * CHUNK, ac, bc, cc.as_mut().and_then(Iterator::next)));
        }
    }
    items
}

/// `f` of every item, in order: on rayon's pool when the pass covers `total ≥` [`PAR_MIN`]
/// elements, else on the calling thread.
fn map_items<I: Send, R: Send>(
    total: usize,
    items: Vec<I>,
    f: impl Fn(I) -> R + Sync + Send,
) -> Vec<R> {
    if total < PAR_MIN {
        items.into_iter().map(f).collect()
    } else {
        items.into_par_iter().map(f).collect()
    }
}

/// What [`multi_scan`] read.
pub(crate) struct MultiScan {
    /// `Σ gᵢ²` over every gradient, each [`CHUNK`] by [`dot_chunk`] and the chunk sums added
    /// in order: for one tensor [`dot_f64`]'s value bit for bit.
    pub grad_sq: f64,
    /// The largest magnitudes read, when every value was finite (and `s1 ≥ 0`); the state's
    /// entries are 0 when no state was given.
    pub bounds: Option<InputBounds>,
}

/// The read-only pass of a CPU multi-tensor update before it writes in place: per chunk of
/// every tensor the gradient's squares and the largest `|p|`, `|g|` and `|ĝ|`, and, where
/// `state` is given (its bounds no longer known from the last update), the largest `|s0|` and
/// `|s1|` over the flat state arrays. A non-finite value (or `s1 < 0`) gives no bounds: the
/// update then takes the checked route, which reports it.
pub(crate) fn multi_scan(
    params: &[&[f32]],
    grads: &[&[f32]],
    sampled: Option<&[&[f32]]>,
    state: Option<(&[f32], Option<&[f32]>)>,
) -> MultiScan {
    let items: Vec<(usize, usize)> = grads
        .iter()
        .enumerate()
        .flat_map(|(t, g)| (0..g.len()).step_by(CHUNK).map(move |i0| (t, i0)))
        .collect();
    let run = |(t, i0): (usize, usize)| {
        let n = CHUNK.min(grads[t].len() - i0);
        let g = &grads[t][i0..i0 + n];
        let gh = sampled.map_or(Magnitude::ZERO, |gh| magnitude(&gh[t][i0..i0 + n]));
        (
            dot_chunk(g, g),
            [magnitude(&params[t][i0..i0 + n]), magnitude(g), gh],
        )
    };
    let total = grads.iter().map(|g| g.len()).sum();
    let chunks = map_items(total, items, run);
    // Chunk sums in index order: `dot_f64`'s sum, bit for bit, for one tensor.
    let grad_sq = chunks.iter().map(|c| c.0).sum();
    let [p, g, gh] = chunks.iter().fold([Magnitude::ZERO; 3], |a, c| {
        [a[0].max(c.1[0]), a[1].max(c.1[1]), a[2].max(c.1[2])]
    });
    let state = state.map(|(s0, s1)| (magnitude(s0), s1.map_or(Magnitude::ZERO, magnitude)));
    let bounds = InputBounds {
        p: p.max,
        g: g.max,
        gh: gh.max,
        s0: state.map_or(0.0, |s| s.0.max),
        s1: state.map_or(0.0, |s| s.1.max),
    };
    let state_ok = state.is_none_or(|(s0, s1)| s0.finite && s1.finite && s1.nonneg);
    MultiScan {
        grad_sq,
        bounds: (p.finite && g.finite && gh.finite && state_ok).then_some(bounds),
    }
}

/// The host arrays of a multi-tensor update that writes in place ([`multi_update_in_place`]):
/// per tensor its params and gradient (and Hessian sample), and the flat state arrays.
pub(crate) struct MultiInPlace<'a> {
    pub params: Vec<&'a mut [f32]>,
    pub grads: Vec<&'a [f32]>,
    pub sampled: Option<Vec<&'a [f32]>>,
    pub s0: &'a mut [f32],
    pub s1: Option<&'a mut [f32]>,
}

/// Elements per block of [`multi_update_in_place`]: three blocks of results (12 KiB) stay in
/// L1 between being computed and copied over their inputs.
const IN_PLACE_BLOCK: usize = 1024;

/// A multi-tensor update written over its inputs, for a step [`MultiUpdate::cannot_overflow`]
/// has proven clean on inputs [`multi_scan`] found finite. The per-element code is
/// [`multi_update`]'s (so are the bits): each block of [`IN_PLACE_BLOCK`] is computed into a
/// buffer and copied over its parameters and state, whose lines are then in cache. Writing over
/// the inputs saves the reads that writing other arrays costs (a line is fetched before it is
/// overwritten) and keeps one copy of the state in cache instead of two.
///
/// Returns the largest `|s0|` and `|s1|` written (`s1`: 0 when the update does not write it).
pub(crate) fn multi_update_in_place(
    layout: &MultiLayout,
    upd: &MultiUpdate,
    io: MultiInPlace<'_>,
) -> [f32; 2] {
    let MultiInPlace {
        params,
        grads,
        sampled,
        s0,
        s1,
    } = io;
    let writes1 = upd.writes1();
    let s0s = segments_mut(layout, s0);
    let s1s: Vec<Option<&mut [f32]>> = match s1 {
        Some(s1) => segments_mut(layout, s1).into_iter().map(Some).collect(),
        None => params.iter().map(|_| None).collect(),
    };
    let items = chunk_items(
        params
            .into_iter()
            .zip(s0s)
            .zip(s1s)
            .map(|((p, s0), s1)| (p, s0, s1)),
    );
    let run = |(t, i0, pc, s0c, mut s1c): ChunkItem<'_>| {
        let mut out = [[0.0f32; IN_PLACE_BLOCK]; 3];
        let mut written = [Magnitude::ZERO; 2];
        for j in (0..pc.len()).step_by(IN_PLACE_BLOCK) {
            let n = IN_PLACE_BLOCK.min(pc.len() - j);
            let [op, o0, o1] = &mut out;
            let (op, o0) = (&mut op[..n], &mut o0[..n]);
            let o1 = if writes1 { &mut o1[..n] } else { &mut o1[..0] };
            let (a, b) = (i0 + j, i0 + j + n);
            let ins = ChunkIn {
                p: &pc[j..j + n],
                g: &grads[t][a..b],
                s0: &s0c[j..j + n],
                s1: s1c.as_deref().map_or(&[][..], |s1| &s1[j..j + n]),
                gh: sampled.as_ref().map_or(&[][..], |gh| &gh[t][a..b]),
            };
            let clean = update_chunk(upd, ins, (&mut *op, &mut *o0, &mut *o1));
            debug_assert!(clean, "an update proven clean wrote a non-finite value");
            pc[j..j + n].copy_from_slice(op);
            s0c[j..j + n].copy_from_slice(o0);
            written[0] = written[0].max(magnitude(o0));
            if let (true, Some(s1)) = (writes1, s1c.as_deref_mut()) {
                s1[j..j + n].copy_from_slice(o1);
                written[1] = written[1].max(magnitude(o1));
            }
        }
        written
    };
    let written = map_items(layout.total(), items, run);
    let [m0, m1] = written.iter().fold([Magnitude::ZERO; 2], |a, w| {
        [a[0].max(w[0]), a[1].max(w[1])]
    });
    [m0.max, m1.max]
}

/// The largest `|x|` of a run of values, whether all are finite and whether all are `≥ 0`.
#[derive(Clone, Copy, Debug)]
struct Magnitude {
    max: f32,
    finite: bool,
    nonneg: bool,
}

impl Magnitude {
    /// Of no values.
    const ZERO: Magnitude = Magnitude {
        max: 0.0,
        finite: true,
        nonneg: true,
    };

    fn max(self, o: Magnitude) -> Magnitude {
        Magnitude {
            max: self.max.max(o.max),
            finite: self.finite & o.finite,
            nonneg: self.nonneg & o.nonneg,
        }
    }
}

multiversion! {
    /// [`Magnitude`] of `xs`, from the bit patterns: `|x|`'s bits order like `|x|` itself, with
    /// ∞ and NaN above every finite value, and a sign-bit pattern above `0x8000_0000` is a
    /// number below zero (`−0` is `0x8000_0000`). Integer maxima are associative, so the
    /// plain loop vectorizes (a float maximum would have to keep its order and NaN rules).
    fn magnitude(xs: &[f32]) -> Magnitude {
        let (mut abs, mut raw) = (0u32, 0u32);
        for &x in xs {
            abs = abs.max(x.to_bits() & 0x7fff_ffff);
            raw = raw.max(x.to_bits());
        }
        Magnitude {
            max: f32::from_bits(abs),
            finite: abs < f32::INFINITY.to_bits(),
            nonneg: raw <= 0x8000_0000,
        }
    }
}

multiversion! {
    /// One chunk of a multi-tensor update (see [`fused_chunk`]): whether every value read
    /// and written is finite.
    fn update_chunk(
        upd: &MultiUpdate,
        ins: ChunkIn<'_>,
        outs: (&mut [f32], &mut [f32], &mut [f32]),
    ) -> bool {
        match *upd {
            MultiUpdate::Sgd(c) => {
                fused_chunk::<false, false, false>(ins, outs, |p, g, b, _, _| {
                    let (mut p, mut b) = (p, b);
                    sgd_elem(&c, &mut p, g, &mut b);
                    (p, b, 0.0)
                })
            }
            MultiUpdate::AdamW(c) => {
                let bc = c.bias_corrections();
                fused_chunk::<true, false, true>(ins, outs, |p, g, m, v, _| {
                    let (mut p, mut m, mut v) = (p, m, v);
                    adamw_elem(&c, bc, &mut p, g, &mut m, &mut v);
                    (p, m, v)
                })
            }
            MultiUpdate::Sophia(c, None) => {
                fused_chunk::<true, false, false>(ins, outs, |p, g, m, h, _| {
                    let (mut p, mut m) = (p, m);
                    sophia_elem(&c, &mut p, g, &mut m, h);
                    (p, m, h)
                })
            }
            MultiUpdate::Sophia(c, Some((beta2, batch))) => {
                fused_chunk::<true, true, true>(ins, outs, |p, g, m, h, gh| {
                    let (mut p, mut m, mut h) = (p, m, h);
                    hessian_ema_elem(beta2, batch, &mut h, gh);
                    sophia_elem(&c, &mut p, g, &mut m, h);
                    (p, m, h)
                })
            }
        }
    }
}

/// The inputs of one chunk of a multi-tensor update, all of one length (`s1`, `gh` empty when
/// the update has none).
struct ChunkIn<'a> {
    p: &'a [f32],
    g: &'a [f32],
    s0: &'a [f32],
    s1: &'a [f32],
    gh: &'a [f32],
}

/// `(p', s0', s1') = step(p, g, s0, s1, ĝ)` over one chunk, writing `po`, `o0` and (`O1`) `o1`;
/// `S1`/`GH`: the update reads `s1`/`ĝ`. Returns whether every value read is finite (`s1` also
/// `≥ 0`) and every value written is finite: the check rides along the update's single pass
/// (the flags are plain `&`s, so the loop stays branch-free and vectorizes) instead of
/// separate scans before and after it. The results on a `false` chunk are discarded.
#[inline(always)]
fn fused_chunk<const S1: bool, const GH: bool, const O1: bool>(
    ins: ChunkIn<'_>,
    (po, o0, o1): (&mut [f32], &mut [f32], &mut [f32]),
    step: impl Fn(f32, f32, f32, f32, f32) -> (f32, f32, f32),
) -> bool {
    let n = po.len();
    let (p, g, s0, o0) = (&ins.p[..n], &ins.g[..n], &ins.s0[..n], &mut o0[..n]);
    let (s1, gh) = (
        if S1 { &ins.s1[..n] } else { ins.s1 },
        if GH { &ins.gh[..n] } else { ins.gh },
    );
    let o1 = if O1 { &mut o1[..n] } else { o1 };
    let fin = |v: f32| v.abs() < f32::INFINITY;
    let mut ok = true;
    for j in 0..n {
        let s1v = if S1 { s1[j] } else { 0.0 };
        let ghv = if GH { gh[j] } else { 0.0 };
        let (pn, a, b) = step(p[j], g[j], s0[j], s1v, ghv);
        po[j] = pn;
        o0[j] = a;
        if O1 {
            o1[j] = b;
        }
        ok &= fin(p[j]) & fin(g[j]) & fin(s0[j]) & fin(pn) & fin(a);
        if S1 {
            ok &= fin(s1v) & (s1v >= 0.0);
        }
        if GH {
            ok &= fin(ghv);
        }
        if O1 {
            ok &= fin(b);
        }
    }
    ok
}
