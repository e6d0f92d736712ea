//! Newton–Schulz inversion of an SPD matrix on the host (SPEC §2).
//!
//! With `T = AX` and `E = I − T`, one step maps `E ↦ E^p`: quadratic `X(2I − T)`, cubic
//! `X(3I − 3T + T²)`, quartic `X(4I − T(6I − T(4I − T)))`. They are evaluated as
//! `X ← X + X·F` with `F = E`, `E + E²`, `E + E² + E³` (the same polynomials): the correction
//! `F` is small near convergence, so forming it, rather than `p(T) ≈ I`, keeps its digits —
//! which matters most in `Bf16` mode, where `p(T)` rounded to bf16 would lose them. Every
//! step first forms `T = AX` (always a full product), whose residual `‖I − T‖_F/√n` drives
//! the stop test. All products go through [`crate::cpu::gemm`].
//!
//! **Symmetry, and why so little of it.** From the paper's and the scaled-identity starts `X`
//! is a polynomial in `A`, so `AX`, `E` and its powers are symmetric, and so is `X + X·F`.
//! Computing such a product as its upper block triangle and mirroring it saves up to half of
//! it (about 55–75% of a full product from n = 512 up) — but in floating point `X` is a
//! polynomial in `A` only up to rounding, and mirroring discards exactly the part of a product
//! that Newton's self-correction acts on. Measured (`f32`, this module's tests' generator):
//! - mirroring `T = AX` diverges outright: the error mode that makes `X` non-polynomial grows
//!   by about `κ/2` per step (f32 "floor" 2.3e-2 at κ = 1e3);
//! - mirroring `X·F` is stable near convergence but raises the `f32` floor by about
//!   `κ/(2 ln κ)` (2.4e-4 instead of 5e-6 at κ = 1e3, n = 24), and during the early steps of
//!   the paper's start (κ² effective) it let that error mode grow visibly (the residual left
//!   the exact-arithmetic cubic envelope, in ~1 of 1000 random matrices);
//! - mirroring the powers `E², E³` while the residual is above [`SYM_SWITCH`]: no measurable
//!   effect (3000 random matrices, all orders and both starts, within the envelope).
//!
//! So only the last is done: `F32` mode, polynomial starts, residual above [`SYM_SWITCH`],
//! and the phase ends for good at the first step that does not improve. `T = AX` and `X·F`
//! are always full products; `Bf16` (whose noise is 2¹⁵ times larger) and the warm start (not
//! a polynomial in `A`) use full products throughout. The returned `X` is symmetric only to
//! rounding; symmetrizing it would raise its residual as mirroring `X·F` does.
//!
//! **Stopping.** The iteration returns as soon as the residual is `≤ tol`. In exact arithmetic
//! the residual never grows from any of the three starts, so a residual that stops falling
//! means either the rounding floor was reached or the iteration diverges:
//! - non-finite residual → [`DivergenceReason::NonFinite`] (`Bf16` past its floor: best
//!   iterate returned);
//! - during the mirrored phase, no improvement ends that phase (full products from then on);
//! - once the best residual is below [`ARMED`], no improvement means the floor: `F32` mode
//!   errs ([`DivergenceReason::NotConverged`], or [`DivergenceReason::Growing`] for a jump
//!   above twice the best); `Bf16` mode returns its best iterate;
//! - above [`ARMED`] (the first steps from the paper's start sit near 1) only a clear growth,
//!   more than [`GROWTH_SLACK`] relative per step, is divergence ([`DivergenceReason::Growing`]);
//! - `max_iter` exhausted → [`DivergenceReason::NotConverged`] (both modes).
//!
//! **Residual floors** `‖I − AX‖_F/√n` of the returned `X`, measured in `f64` (generator of
//! `tests/cpu_newton.rs`: `A = QDQᵀ`, `Q` three random Householder reflectors, eigenvalues
//! log-spaced over `[1/κ, 1]`; cubic from the scaled identity; 3 matrices each at
//! n = 24, 64, 200, 256, 512; the smaller n give the upper ends of the ranges):
//!
//! | κ | `F32` floor | `Bf16` best iterate | `Bf16` + polish | `Bf16` steps |
//! |---|---|---|---|---|
//! | 10 | 5.7e-8 – 1.1e-7 | 2.6e-3 – 4.6e-3 | 9.4e-6 – 3.0e-5 | 3–7 |
//! | 33 | 1.3e-7 – 2.8e-7 | 3.3e-3 – 1.0e-2 | 1.4e-5 – 1.5e-4 | 4–6 |
//! | 100 | 3.8e-7 – 6.8e-7 | 5.6e-3 – 2.7e-2 | 3.5e-5 – 6.7e-4 | 5–7 |
//! | 1000 | 4.0e-6 – 5.6e-6 | 3.3e-2 – 1.2e-1 | 9.8e-4 – 2.2e-2 | 6–7 |
//!
//! The `f32` floor grows about linearly, `≈ 5e-9·κ`, so the default `tol = 1e-4` holds to
//! κ ≈ 1e4. The `bf16` floor, `≲ 4e-3·κ^0.55` for n ≥ 24 (the bound `tests/cpu_newton.rs`
//! checks; n = 16 reached 0.17 at κ = 836), is set by the rounding of `A` itself. At
//! n = 256–512 it is below SPEC's numpy figures (4.5e-3, 9e-3, 1.7e-2, 0.14 at κ = 10, 33,
//! 100, 1000); rounding the small correction `F` rather than `p(T) ≈ I` to bf16 is the likely
//! difference. The polish step squares the floor.

use rayon::prelude::*;

use super::check_finite_view;
use super::gemm::gemm;
use crate::error::{check_shape, DivergenceReason, Error, Result};
use crate::mat::{Mat, MatMut, MatRef, Trans};
use crate::ops::newton::{InitialGuess, NewtonInfo, NewtonOptions, NewtonOrder, Precision};
use crate::ops::norm::PowerOptions;

/// Below this best residual the iteration is in its fast-convergence regime, where a residual
/// that stops falling means the rounding floor.
pub const ARMED: f32 = 0.5;

/// Relative growth per step tolerated above [`ARMED`] (rounding noise on a residual near 1,
/// which is far larger in `Bf16` mode) before it counts as divergence.
pub const GROWTH_SLACK: f32 = 1e-2;

/// Above this residual the `F32` iteration computes the powers of `E` as symmetric-result
/// products (then never again).
pub const SYM_SWITCH: f32 = 0.1;

/// Relative asymmetry accepted in `a` and `warm`: `|a_ij − a_ji| ≤ SYM_TOL · max|a|`.
pub const SYM_TOL: f32 = 1e-5;

/// Safety factor on `λ_max` in the scaled identity: on the power-iteration estimate (a lower
/// bound of `λ_max`) it guards against a slightly unconverged estimate, on the guaranteed
/// bounds against equality (a diagonal `A` has `‖A‖∞ = λ_max`, where `c·λ_max = 2` would
/// stall that eigencomponent). Either way `|1 − cλ_max| ≤ 2/1.1 − 1 ≈ 0.82`.
const LAMBDA_MARGIN: f32 = 1.1;

/// Inverse of the symmetric positive definite `n x n` matrix `a` by Newton iteration; see the
/// module docs for the arithmetic and the stopping rules, and
/// [`crate::Device::newton_inverse`] for the contract. `warm` is used only with
/// [`InitialGuess::Warm`].
///
/// # Errors
/// [`Error::Shape`] (not square, `n = 0`, `warm` not `n x n`), [`Error::NonFinite`],
/// [`Error::Value`] (bad options; `a` or `warm` asymmetric beyond [`SYM_TOL`]; `a = 0`; no
/// positive eigenvalue found for the scaled identity), [`Error::Diverged`].
pub fn newton_inverse(
    a: MatRef<'_, f32>,
    warm: Option<MatRef<'_, f32>>,
    opts: &NewtonOptions,
) -> Result<(Mat, NewtonInfo)> {
    const OP: &str = "cpu::newton_inverse";
    opts.validate(OP)?;
    let n = a.rows();
    check_shape(OP, "a", a.shape(), (n, n))?;
    if n == 0 {
        return Err(Error::Shape {
            op: OP,
            arg: "a",
            expected: "n x n with n >= 1".into(),
            got: "0x0".into(),
        });
    }
    check_finite_view(OP, "a", a)?;
    let a_sym = symmetric_part(OP, "a", a)?;
    let warm_sym = match (opts.init, warm) {
        (InitialGuess::Warm, Some(w)) => {
            check_shape(OP, "warm", w.shape(), (n, n))?;
            check_finite_view(OP, "warm", w)?;
            Some(symmetric_part(OP, "warm", w)?)
        }
        _ => None,
    };
    let bf16 = opts.precision == Precision::Bf16;
    let mut it = Iteration::new(a_sym, n, bf16);

    // X₀, and whether X stays a polynomial in A (then the powers of E are symmetric).
    let (init_used, commuting) = match (opts.init, warm_sym) {
        (InitialGuess::Paper, _) => {
            it.x = paper_start(&it.a, n)?;
            (InitialGuess::Paper, true)
        }
        (InitialGuess::Warm, Some(w)) => {
            it.x = w;
            it.product_t()?;
            if warm_acceptable(&it.t, n) {
                (InitialGuess::Warm, false)
            } else {
                it.x = scaled_identity(&it.a, n, opts.lambda_low, Bound::Estimated)?;
                (InitialGuess::ScaledIdentity, true)
            }
        }
        (InitialGuess::ScaledIdentity | InitialGuess::Warm, _) => {
            it.x = scaled_identity(&it.a, n, opts.lambda_low, Bound::Estimated)?;
            (InitialGuess::ScaledIdentity, true)
        }
    };
    if init_used != InitialGuess::Warm {
        it.product_t()?;
    }

    // The scaled identity's λ_hi comes from power iterations, which can underestimate λ_max
    // (a start vector nearly orthogonal to the top eigenvector); then c·λ_max > 2 and the
    // iteration diverges. Retry once from a guaranteed bound before calling it divergence;
    // the history then holds both runs and `iterations` counts the first run's steps too.
    let mut history = Vec::new();
    let (best_r, best_iter) = match iterate(&mut it, opts, commuting, &mut history) {
        Err(Error::Diverged { iterations, .. }) if init_used == InitialGuess::ScaledIdentity => {
            it.x = scaled_identity(&it.a, n, opts.lambda_low, Bound::Guaranteed)?;
            it.product_t()?;
            let (r, k) = iterate(&mut it, opts, true, &mut history)?;
            (r, iterations + k)
        }
        other => other?,
    };

    if !bf16 {
        let info = NewtonInfo {
            residual: best_r,
            iterations: best_iter,
            init_used,
            residual_history: history,
            polished: false,
        };
        return Ok((Mat::from_vec(it.x, n, n)?, info));
    }
    // Bf16: the honest residual of the best iterate, in f32, then the optional polish.
    it.bf16 = false;
    it.x = std::mem::take(&mut it.best);
    it.product_t()?;
    let r_best = residual(&it.t, n);
    let mut out = NewtonInfo {
        residual: r_best,
        iterations: best_iter,
        init_used,
        residual_history: history,
        polished: false,
    };
    if opts.polish {
        let x_best = it.x.clone();
        it.step(NewtonOrder::Quadratic, false)?;
        it.product_t()?;
        let r_pol = residual(&it.t, n);
        if r_pol < r_best {
            out.residual = r_pol;
            out.polished = true;
        } else {
            it.x = x_best;
        }
    }
    if !out.residual.is_finite() {
        return Err(Error::Diverged {
            op: OP,
            reason: DivergenceReason::NonFinite,
            iterations: best_iter,
            residual: out.residual as f64,
        });
    }
    Ok((Mat::from_vec(it.x, n, n)?, out))
}

/// Iterates from the `X₀` in `it.x` (with `T = AX₀` in `it.t`) under the stopping rules of
/// the module docs, appending each residual to `history`. Returns the best residual and the
/// step that reached it; the iterate is left in `it.x` (`F32`) or `it.best` (`Bf16`).
fn iterate(
    it: &mut Iteration,
    opts: &NewtonOptions,
    commuting: bool,
    history: &mut Vec<f32>,
) -> Result<(f32, usize)> {
    const OP: &str = "cpu::newton_inverse";
    let n = it.n;
    let bf16 = it.bf16;
    let mut iterations = 0;
    let mut best_r = f32::INFINITY;
    let mut best_iter = 0;
    let mut prev_r = f32::INFINITY;
    let mut sym_phase = !bf16;
    let diverged = |reason, iterations, residual: f32| Error::Diverged {
        op: OP,
        reason,
        iterations,
        residual: residual as f64,
    };
    loop {
        let r = residual(&it.t, n);
        history.push(r);
        if !r.is_finite() {
            if bf16 && best_r < ARMED {
                break;
            }
            return Err(diverged(DivergenceReason::NonFinite, iterations, r));
        }
        if r <= opts.tol {
            best_r = r;
            best_iter = iterations;
            if bf16 {
                it.best.clone_from(&it.x);
            }
            break;
        }
        if r < best_r {
            best_r = r;
            best_iter = iterations;
            if bf16 {
                it.best.clone_from(&it.x);
            }
        } else if sym_phase {
            // The noise of the mirrored products (see the module docs) stalled the early
            // phase: go on with full products, which correct it.
            sym_phase = false;
        } else if best_r < ARMED {
            if bf16 {
                break;
            }
            let reason = if r > 2.0 * best_r {
                DivergenceReason::Growing
            } else {
                DivergenceReason::NotConverged
            };
            return Err(diverged(reason, iterations, best_r));
        } else if r > prev_r * (1.0 + GROWTH_SLACK) {
            return Err(diverged(DivergenceReason::Growing, iterations, r));
        }
        if iterations == opts.max_iter {
            return Err(diverged(DivergenceReason::NotConverged, iterations, r));
        }
        // Symmetric-result products only in the early f32 phase (see the module docs): the
        // last steps must be full products for Newton's self-correction to hold.
        if r <= SYM_SWITCH {
            sym_phase = false;
        }
        prev_r = r;
        it.step(opts.order, sym_phase && commuting)?;
        iterations += 1;
        it.product_t()?;
    }

    Ok((best_r, best_iter))
}

/// The iteration's buffers (all `n x n`, row-major).
struct Iteration {
    n: usize,
    bf16: bool,
    /// `A` (symmetric part), `f32`.
    a: Vec<f32>,
    /// `A` rounded to `bf16` (empty in `F32` mode).
    a_bf: Vec<f32>,
    /// The iterate.
    x: Vec<f32>,
    /// `T = AX`.
    t: Vec<f32>,
    /// The best iterate so far (`Bf16` mode).
    best: Vec<f32>,
    /// Scratch: `T²`, `U`, the polynomial, the new iterate, rounded operands.
    w1: Vec<f32>,
    w2: Vec<f32>,
    w3: Vec<f32>,
    r1: Vec<f32>,
    r2: Vec<f32>,
}

impl Iteration {
    fn new(a: Vec<f32>, n: usize, bf16: bool) -> Self {
        let mut a_bf = Vec::new();
        if bf16 {
            a_bf = vec![0.0; n * n];
            round_bf16(&a, &mut a_bf);
        }
        let z = || vec![0.0f32; n * n];
        Self {
            n,
            bf16,
            a,
            a_bf,
            x: Vec::new(),
            t: z(),
            best: Vec::new(),
            w1: z(),
            w2: z(),
            w3: z(),
            r1: z(),
            r2: z(),
        }
    }

    /// `T ← A X`, always a full product: its deviation from symmetry is the first-order
    /// information that makes the iteration self-correcting (mirroring it is unstable).
    fn product_t(&mut self) -> Result<()> {
        let a = if self.bf16 { &self.a_bf } else { &self.a };
        let x = operand(&self.x, &mut self.r1, self.bf16);
        product(a, x, &mut self.t, self.n, false)
    }

    /// `X ← X p(T)` for the given order. `sym_e`: compute the powers of `E` as
    /// symmetric-result products (valid when X commutes with A; see the module docs).
    fn step(&mut self, order: NewtonOrder, sym_e: bool) -> Result<()> {
        let n = self.n;
        let bf = self.bf16;
        // E = I − T; the step is X ← X + X·F with F = E, E + E², E + E² + E³
        // (= X p(T) for the three orders). Forming the small correction F and adding X in
        // f32 keeps E's digits: rounding T ≈ I or p(T) ≈ I to bf16 would lose them.
        affine_identity(&mut self.w1, &self.t, -1.0, 1.0, n);
        let f: &[f32] = match order {
            NewtonOrder::Quadratic => &self.w1,
            NewtonOrder::Cubic | NewtonOrder::Quartic => {
                let sym = sym_e;
                let er = operand(&self.w1, &mut self.r1, bf);
                product(er, er, &mut self.w2, n, sym)?;
                if order == NewtonOrder::Quartic {
                    let e2r = operand(&self.w2, &mut self.r2, bf);
                    product(e2r, er, &mut self.w3, n, sym)?;
                    add_assign(&mut self.w2, &self.w3);
                }
                add_assign(&mut self.w2, &self.w1);
                &self.w2
            }
        };
        let fr = operand(f, &mut self.r2, bf);
        let xr = operand(&self.x, &mut self.r1, bf);
        product(xr, fr, &mut self.w3, n, false)?;
        add_assign(&mut self.w3, &self.x);
        std::mem::swap(&mut self.x, &mut self.w3);
        Ok(())
    }
}

/// `dst ← dst + src`.
fn add_assign(dst: &mut [f32], src: &[f32]) {
    dst.par_chunks_mut(4096)
        .zip(src.par_chunks(4096))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| *d += s));
}

/// `dst ← s·src + d·I`.
fn affine_identity(dst: &mut [f32], src: &[f32], s: f32, d: f32, n: usize) {
    dst.par_chunks_mut(n)
        .zip(src.par_chunks(n))
        .enumerate()
        .for_each(|(i, (o, x))| {
            o.iter_mut().zip(x).for_each(|(o, &x)| *o = s * x);
            o[i] += d;
        });
}

/// The product operand for `src`: itself in `f32` mode, its `bf16` rounding (in `buf`) else.
fn operand<'a>(src: &'a [f32], buf: &'a mut [f32], bf16: bool) -> &'a [f32] {
    if bf16 {
        round_bf16(src, buf);
        buf
    } else {
        src
    }
}

/// `dst ← bf16(src)` widened back to `f32` (exact), round-to-nearest-even.
fn round_bf16(src: &[f32], dst: &mut [f32]) {
    dst.par_chunks_mut(4096)
        .zip(src.par_chunks(4096))
        .for_each(|(d, s)| {
            d.iter_mut()
                .zip(s)
                .for_each(|(d, &s)| *d = half::bf16::from_f32(s).to_f32());
        });
}

/// `C ← A B` (`n x n`). With `sym` the result is known to be symmetric: only the block rows'
/// upper parts (`C[r0.., r0..]`) are computed, in a few GEMMs, and mirrored.
fn product(a: &[f32], b: &[f32], c: &mut [f32], n: usize, sym: bool) -> Result<()> {
    let blocks = if sym { (n / 256).clamp(1, 8) } else { 1 };
    let nb = n.div_ceil(blocks);
    let mut r0 = 0;
    while r0 < n {
        let rows = nb.min(n - r0);
        // Column offset: the upper part only when the result is symmetric.
        let c0 = if sym { r0 } else { 0 };
        gemm(
            Trans::No,
            Trans::No,
            1.0,
            MatRef::with_ld(&a[r0 * n..], rows, n, n)?,
            MatRef::with_ld(&b[c0..], n, n - c0, n)?,
            0.0,
            MatMut::with_ld(&mut c[r0 * n + c0..], rows, n - c0, n)?,
        )?;
        r0 += rows;
    }
    if sym {
        mirror_upper(c, n);
    }
    Ok(())
}

/// `c_ij ← c_ji` for `i > j`, in cache-sized tiles.
fn mirror_upper(c: &mut [f32], n: usize) {
    const TILE: usize = 64;
    for bi in (0..n).step_by(TILE) {
        for bj in (0..=bi).step_by(TILE) {
            for i in bi..(bi + TILE).min(n) {
                for j in bj..(bj + TILE).min(i) {
                    c[i * n + j] = c[j * n + i];
                }
            }
        }
    }
}

/// `‖I − T‖_F / √n`, summed in `f64`.
fn residual(t: &[f32], n: usize) -> f32 {
    let s: f64 = t
        .par_chunks(n)
        .enumerate()
        .map(|(i, row)| {
            row.iter()
                .enumerate()
                .map(|(j, &v)| {
                    let e = if i == j { 1.0 - v as f64 } else { -(v as f64) };
                    e * e
                })
                .sum::<f64>()
        })
        .sum();
    (s / n as f64).sqrt() as f32
}

/// Whether `‖I − T‖₂ < 1`, through the upper bounds `‖·‖_F` and `√(‖·‖₁‖·‖∞)`.
fn warm_acceptable(t: &[f32], n: usize) -> bool {
    let e = |i: usize, j: usize| {
        let v = t[i * n + j] as f64;
        if i == j {
            1.0 - v
        } else {
            -v
        }
    };
    let fro = residual(t, n) as f64 * (n as f64).sqrt();
    let inf = (0..n)
        .map(|i| (0..n).map(|j| e(i, j).abs()).sum::<f64>())
        .fold(0.0, f64::max);
    let one = (0..n)
        .map(|j| (0..n).map(|i| e(i, j).abs()).sum::<f64>())
        .fold(0.0, f64::max);
    fro.min((inf * one).sqrt()) < 1.0
}

/// The symmetric part of a square view after checking it is symmetric to [`SYM_TOL`].
fn symmetric_part(op: &'static str, arg: &'static str, a: MatRef<'_, f32>) -> Result<Vec<f32>> {
    let n = a.rows();
    let max = (0..n)
        .flat_map(|i| a.row(i).iter())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    let mut worst = 0.0f32;
    let mut s = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            let (x, y) = (a.at(i, j), a.at(j, i));
            worst = worst.max((x - y).abs());
            s[i * n + j] = 0.5 * (x + y);
        }
    }
    if worst > SYM_TOL * max {
        return Err(Error::Value {
            op,
            arg,
            value: (worst / max) as f64,
            expected: "a symmetric matrix (max |a_ij - a_ji| / max |a| <= 1e-5)",
        });
    }
    Ok(s)
}

/// The paper's `X₀ = Aᵀ / (‖A‖₁ ‖A‖∞)` for a symmetric `A`.
fn paper_start(a: &[f32], n: usize) -> Result<Vec<f32>> {
    let inf = a
        .chunks(n)
        .map(|r| r.iter().map(|v| v.abs() as f64).sum::<f64>())
        .fold(0.0, f64::max);
    let one = (0..n)
        .map(|j| (0..n).map(|i| a[i * n + j].abs() as f64).sum::<f64>())
        .fold(0.0, f64::max);
    let prod = inf * one;
    if prod == 0.0 {
        return Err(zero_matrix());
    }
    let alpha = 1.0 / prod;
    // Symmetric, so Aᵀ = A.
    Ok(a.iter().map(|&v| (v as f64 * alpha) as f32).collect())
}

/// Where the scaled identity's `λ_hi ≥ λ_max` comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Bound {
    /// `1.1·θ`, θ the larger Rayleigh quotient of two power iterations from different
    /// starts (`θ ≤ λ_max ≤ min(‖A‖∞, ‖A‖_F)`): tight, but θ can miss λ_max.
    Estimated,
    /// `1.1·min(‖A‖∞, ‖A‖_F)`: always `> λ_max`, up to `√n` times too large.
    Guaranteed,
}

/// `X₀ = c I`, `c = 2/(λ_hi + min(λ_low, λ_hi))` with `λ_hi` per [`Bound`].
fn scaled_identity(a: &[f32], n: usize, lambda_low: f32, bound: Bound) -> Result<Vec<f32>> {
    let inf = a
        .chunks(n)
        .map(|r| r.iter().map(|v| v.abs() as f64).sum::<f64>())
        .fold(0.0, f64::max);
    let fro = a.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
    if inf == 0.0 {
        return Err(zero_matrix());
    }
    let hi = match bound {
        Bound::Guaranteed => LAMBDA_MARGIN * inf.min(fro) as f32,
        Bound::Estimated => {
            let power = super::norm::spectral_norm(
                MatRef::new(a, n, n)?,
                &PowerOptions {
                    tol: 1e-3,
                    max_iter: 60,
                },
            )?;
            let theta = power.value.max(rayleigh_pseudo_random(a, n, 20));
            if theta <= 0.0 {
                return Err(Error::Value {
                    op: "cpu::newton_inverse",
                    arg: "a",
                    value: theta as f64,
                    expected:
                        "a positive definite matrix (power iterations found no positive eigenvalue)",
                });
            }
            LAMBDA_MARGIN * theta
        }
    };
    let c = 2.0 / (hi + lambda_low.min(hi));
    let mut x = vec![0.0f32; n * n];
    (0..n).for_each(|i| x[i * n + i] = c);
    Ok(x)
}

/// Rayleigh quotient after `steps` power steps from a fixed pseudo-random start (a second
/// start beside [`super::norm::spectral_norm`]'s smooth one, so that one start nearly
/// orthogonal to the top eigenvector does not decide `λ_hi`).
fn rayleigh_pseudo_random(a: &[f32], n: usize, steps: usize) -> f32 {
    let mut v = pseudo_random_start(n);
    let mut theta = 0.0;
    for _ in 0..steps {
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm == 0.0 {
            return 0.0;
        }
        v.iter_mut().for_each(|x| *x /= norm);
        let w: Vec<f64> = a
            .par_chunks(n)
            .map(|row| row.iter().zip(&v).map(|(&r, x)| r as f64 * x).sum())
            .collect();
        theta = v.iter().zip(&w).map(|(x, y)| x * y).sum::<f64>();
        v = w;
    }
    theta as f32
}

/// `n` deterministic values spread over `[-1, 1)` (xorshift64*).
fn pseudo_random_start(n: usize) -> Vec<f64> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

fn zero_matrix() -> Error {
    Error::Value {
        op: "cpu::newton_inverse",
        arg: "a",
        value: 0.0,
        expected: "a nonzero (positive definite) matrix",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matrix whose top eigenvector is orthogonal to both power-iteration starts: the
    /// estimate finds λ₂ = λ₁/1.5, c·λ₁ ≈ 2.7 > 2, the first run diverges and the restart
    /// from the guaranteed bound converges.
    #[test]
    fn underestimated_lambda_max_restarts() {
        let n = 40;
        // The start of `spectral_norm` (norm.rs) and the pseudo-random one used here.
        let golden: Vec<f64> = (0..n)
            .map(|i| 1.0 + 0.5 * ((i as f64 * 0.618_033_988_749_895).fract() - 0.5))
            .collect();
        let starts = [golden, pseudo_random_start(n)];
        // v₁: e₀ − its projection on the two starts (Gram–Schmidt), normalized.
        let mut basis: Vec<Vec<f64>> = Vec::new();
        for s in starts {
            let mut u = s;
            for b in &basis {
                let d: f64 = u.iter().zip(b).map(|(x, y)| x * y).sum();
                u.iter_mut().zip(b).for_each(|(x, y)| *x -= d * y);
            }
            let norm = u.iter().map(|x| x * x).sum::<f64>().sqrt();
            basis.push(u.into_iter().map(|x| x / norm).collect());
        }
        let mut v1: Vec<f64> = (0..n).map(|i| if i == 0 { 1.0 } else { 0.0 }).collect();
        for b in &basis {
            let d: f64 = v1.iter().zip(b).map(|(x, y)| x * y).sum();
            v1.iter_mut().zip(b).for_each(|(x, y)| *x -= d * y);
        }
        let norm = v1.iter().map(|x| x * x).sum::<f64>().sqrt();
        v1.iter_mut().for_each(|x| *x /= norm);
        // A = 0.9·v₁v₁ᵀ + 0.6·(I − v₁v₁ᵀ): both starts lie in the 0.6-eigenspace, so the
        // estimate is 0.6 (f32 rounding leaves v₁-components ~1e-8, which 20 power steps
        // grow by only 1.5²⁰ ≈ 3e3).
        let mut a = vec![0.0f32; n * n];
        for i in 0..n {
            for j in 0..n {
                let id = if i == j { 1.0 } else { 0.0 };
                a[i * n + j] = (0.9 * v1[i] * v1[j] + 0.6 * (id - v1[i] * v1[j])) as f32;
            }
        }
        let (x, info) = newton_inverse(
            MatRef::new(&a, n, n).unwrap(),
            None,
            &NewtonOptions::default(),
        )
        .unwrap();
        // The first run diverged (a residual above 1), the second converged: two X₀ entries.
        assert!(info.residual_history.iter().any(|&r| r > 1.0));
        assert_eq!(info.residual_history.len(), info.iterations + 2);
        assert_eq!(info.init_used, InitialGuess::ScaledIdentity);
        assert!(info.residual <= 1e-4);
        assert_eq!(x.shape(), (n, n));
    }
}
