//! The Newton inversion's iteration control and the power iteration, written once over the
//! primitives of a backend (the traits [`NewtonBackend`] and [`PowerStep`]): the CPU oracle
//! ([`crate::cpu::newton`], [`crate::cpu::norm`]) and the device kernels
//! ([`crate::cuda::newton`]) implement the primitives, this module decides what runs. The
//! rules themselves are documented in [`crate::cpu::newton`]. It sits below both backends
//! (they call it with their primitives; it names neither), beside [`crate::params`].

use crate::error::{DivergenceReason, Error, Result};
use crate::params::newton::{
    InitialGuess, NewtonInfo, NewtonOptions, NewtonOrder, NewtonStop, Precision,
};
use crate::params::norm::{PowerInfo, PowerOptions};

/// Below this best residual the iteration is in its fast-convergence regime, where a residual
/// that stops falling means the rounding floor.
pub const ARMED: f32 = 0.5;

/// How far a residual must exceed the exact-arithmetic bound from the previous one to count
/// as the rounding floor ([`NewtonStop::Floor`]): rounding then makes at least half of it.
pub const ROUNDING_MARGIN: f64 = 2.0;

/// Relative growth per step tolerated above [`ARMED`] (rounding noise on a residual near 1,
/// which is far larger in `Bf16` mode) before it counts as divergence.
pub const GROWTH_SLACK: f32 = 1e-2;

/// Above this residual the `F32` iteration may compute the powers of `E` as
/// symmetric-result products (then never again).
pub const SYM_SWITCH: f32 = 0.1;

/// Relative asymmetry accepted in `a`: `|a_ij − a_ji| ≤ SYM_TOL · max|a|` (a warm start is
/// only a hint: its symmetric part is used unchecked).
pub const SYM_TOL: f32 = 1e-5;

/// Safety factor on `λ_max` in the scaled identity: on a caller's estimate
/// ([`NewtonOptions::lambda_high`], e.g. a power iteration's Rayleigh quotient, a lower bound
/// of `λ_max`) it guards against a slightly unconverged estimate, on the guaranteed bound
/// against equality (a diagonal `A` has `‖A‖∞ = λ_max`, where `c·λ_max = 2` would stall that
/// eigencomponent). Either way `|1 − cλ_max| ≤ 2/1.1 − 1 ≈ 0.82`; it costs `log_p 1.1 ≈ 0.09`
/// iterations.
const LAMBDA_MARGIN: f32 = 1.1;

/// Relative slack on the spread `s²` of the Wolkowicz–Styan bound ([`lambda_max_bound`]): the
/// sums it is formed from carry relative errors of `f32` partials (`≤ 1e-7` each), which the
/// cancellation in `‖A‖_F²/n − (tr A/n)²` would otherwise turn into an underestimate.
const SPREAD_SLACK: f64 = 1e-6;

/// The norms of `A` one streaming pass yields (summed in `f64`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ANorms {
    /// `‖A‖∞` (largest absolute row sum).
    pub inf: f64,
    /// `‖A‖₁` (largest absolute column sum).
    pub one: f64,
    /// `‖A‖_F`.
    pub fro: f64,
    /// `tr A`.
    pub trace: f64,
}

/// A guaranteed upper bound on `λ_max` of a symmetric `n x n` `A` from one pass over it:
/// `min(‖A‖∞, m + s·√(n − 1))` with `m = tr A/n`, `s² = ‖A‖_F²/n − m²` (Wolkowicz & Styan
/// 1980, valid for every symmetric matrix; by Cauchy–Schwarz never above `‖A‖_F`, and exact
/// for a spike on a flat spectrum: `A = σvvᵀ + μI`). It replaces the power iteration that cost
/// ~44 launch pairs and a read-back each; what an overestimate `h = s_h·λ_max` costs Newton is
/// stated at [`scaled_identity`].
pub(crate) fn lambda_max_bound(n: usize, a: &ANorms) -> f64 {
    let nf = n as f64;
    let m = a.trace / nf;
    let mean_sq = a.fro * a.fro / nf;
    let spread = ((mean_sq - m * m).max(0.0) + SPREAD_SLACK * mean_sq).sqrt();
    a.inf.min(m + spread * (nf - 1.0).sqrt())
}

/// Power-iteration steps on a backend's matrix `A` (`n x n`).
pub(crate) trait PowerStep {
    /// `v ← v0` (`n` values of unit norm).
    fn start(&mut self, v0: &[f64]) -> Result<()>;
    /// `v ←` the warm start the backend was given (a unit vector: the last iterate of an
    /// earlier iteration on a nearby matrix) and `true`; `false`, `v` untouched, without one.
    fn start_warm(&mut self) -> Result<bool>;
    /// `k ≥ 1` steps, each `w = A v`, then `v ← w/‖w‖` when `‖w‖ > 0`; returns each step's
    /// `(vᵀw, ‖w‖)` (summed in `f64`) in order. A backend that reads results back from a
    /// device reads the `k` pairs at once.
    fn steps(&mut self, k: usize) -> Result<Vec<(f64, f64)>>;
    /// The largest finite diagonal element `(k, A_kk)`, the first `k` on ties; `None` when
    /// there is none.
    fn top_diagonal(&mut self) -> Result<Option<(usize, f64)>>;
}

/// Largest eigenvalue of a symmetric PSD `n x n` matrix (`n ≥ 1`) by power iteration from
/// the backend's warm start ([`PowerStep::start_warm`]) or, without one, from the normalized
/// all-ones vector plus a fixed aperiodic perturbation (so a top eigenvector orthogonal to
/// all-ones is still found, and runs are deterministic); stops when the Rayleigh quotient
/// changes by at most `opts.tol` relative to its value.
///
/// A warm start changes how soon that stop comes, not what it means: the quotient's error at
/// the stop is about `tol/(1 − (λ₂/λ₁)²)` relative from any start, and a start near the top
/// eigenvector (the previous refresh's: consecutive refreshes' factors are close) reaches it
/// in a few steps instead of tens.
///
/// That stop can fire near a smaller eigenvalue when the start is nearly orthogonal to the
/// top eigenvector (the quotient is stationary there). Every diagonal element is a Rayleigh
/// quotient (`A_kk = e_kᵀAe_k`), so `λ_max ≥ max_k A_kk`: a value below it is such a stall,
/// and the iteration restarts from `e_k` (whose quotient is `A_kk` already, and for PSD `A`
/// the quotient only grows) with the steps left of `opts.max_iter`. The value returned is
/// thus never below the largest diagonal element when steps remain, and a 2 x 2 stall at
/// `λ₂ < (λ₁ + λ₂)/2 ≤ max_k A_kk` is always caught.
///
/// Steps run in batches of up to `opts.max_batch` ([`power_run`]); the result does not depend
/// on it.
pub(crate) fn power_iteration(
    p: &mut impl PowerStep,
    n: usize,
    opts: &PowerOptions,
) -> Result<PowerInfo> {
    let run = |p: &mut _, v0: Option<&[f64]>, max_iter| {
        power_run(p, v0, opts.tol, max_iter, opts.max_batch)
    };
    let cold = if p.start_warm()? {
        None
    } else {
        Some(start_vector(n))
    };
    let (value, iterations, converged) = run(p, cold.as_deref(), opts.max_iter)?;
    let info = |value: f64, iterations, converged| PowerInfo {
        value: value as f32,
        iterations,
        converged,
    };
    match p.top_diagonal()? {
        Some((k, d)) if value < d && iterations < opts.max_iter => {
            let mut e = vec![0.0; n];
            e[k] = 1.0;
            let (v2, it2, conv2) = run(p, Some(&e), opts.max_iter - iterations)?;
            Ok(info(v2.max(value), iterations + it2, conv2))
        }
        _ => Ok(info(value, iterations, converged)),
    }
}

/// The unit start of [`power_iteration`]: all-ones plus golden-ratio fractional parts
/// (deterministic, never periodic in `i`).
pub(crate) fn start_vector(n: usize) -> Vec<f64> {
    unit(
        (0..n)
            .map(|i| 1.0 + 0.5 * ((i as f64 * 0.618_033_988_749_895).fract() - 0.5))
            .collect(),
    )
}

/// Power steps from the unit `v0` (`None`: from the iterate the backend holds, its warm
/// start) until the Rayleigh quotient changes by at most `tol` relative to its value, at most
/// `max_iter` steps: `(quotient, steps, converged)`.
///
/// The steps run in batches of 2, 4, 8, … up to `max_batch` (`1`: one at a time), and the
/// stop test goes over each batch's results in order: the first step that passes it decides,
/// exactly as if every step had been tested before the next ran, and the batch's later steps
/// are discarded (nothing reads the iterate after a stop but a restart, which starts anew).
/// A backend that reads each batch back once thus needs `⌈log₂(t/2 + 1)⌉` reads for a stop
/// at step `t ≤ 2·max_batch − 2` (`max_batch` a power of two), one per `max_batch` steps
/// beyond.
pub(crate) fn power_run(
    p: &mut impl PowerStep,
    v0: Option<&[f64]>,
    tol: f32,
    max_iter: usize,
    max_batch: usize,
) -> Result<(f64, usize, bool)> {
    if let Some(v0) = v0 {
        p.start(v0)?;
    }
    let mut prev: Option<f64> = None;
    let mut done = 0;
    let cap = max_batch.max(1);
    // The stop test needs two quotients: the first batch holds two steps when it may.
    let mut batch = cap.min(2);
    while done < max_iter {
        let k = batch.min(max_iter - done);
        for (i, (rq, wn)) in p.steps(k)?.into_iter().enumerate() {
            let it = done + i + 1;
            if wn == 0.0 {
                // A v = 0: v lies in the null space (a nonzero diagonal restarts the caller).
                return Ok((0.0, it, true));
            }
            if let Some(p) = prev {
                if (rq - p).abs() <= tol as f64 * rq.abs() {
                    return Ok((rq, it, true));
                }
            }
            prev = Some(rq);
        }
        done += k;
        batch = (2 * batch).min(cap);
    }
    Ok((prev.unwrap_or(0.0), max_iter, false))
}

/// `v/‖v‖` (a zero `v` cannot come from the start above: it is nonzero for `n ≥ 1`).
pub(crate) fn unit(mut v: Vec<f64>) -> Vec<f64> {
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

/// The starting iterate a backend writes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Start {
    /// `X = f32(α·A)` (the paper's start, `A` symmetric so `Aᵀ = A`).
    ScaledA(f64),
    /// `X = c·I`.
    Identity(f32),
}

/// The primitives of one Newton inversion of an `n x n` SPD `A` (its symmetric part, and
/// the warm start when given, loaded by the backend's constructor into the iterate `X`).
pub(crate) trait NewtonBackend {
    /// The op named in errors.
    const OP: &'static str;
    /// The iterate returned.
    type Out;

    fn n(&self) -> usize;
    /// The norms of `A`, in `f64`.
    fn a_norms(&mut self) -> Result<ANorms>;
    /// Writes `X₀`.
    fn set_x(&mut self, start: Start) -> Result<()>;
    /// `T = A X` (with `E = I − T` where the backend keeps it) and its residual
    /// `‖I − T‖_F/√n`.
    fn product_t(&mut self) -> Result<f32>;
    /// [`NewtonBackend::product_t`], with `(‖E‖∞, ‖E‖₁)` of its `E = I − AX` in `f64` (a
    /// device backend reads them back with the residual, at once).
    fn product_t_and_e_norms(&mut self) -> Result<(f32, (f64, f64))>;
    /// `X ← X + X·F` for `order` from the last `T`; `sym`: the powers of `E` may be computed
    /// as symmetric-result products. Must not overwrite the kept best iterate.
    fn step(&mut self, order: NewtonOrder, sym: bool) -> Result<()>;
    /// Keeps the current iterate as the best one (`Bf16` mode needs it back).
    fn mark_best(&mut self);
    /// Forgets the best iterate (a restart).
    fn clear_best(&mut self);
    /// Makes the best iterate current.
    fn use_best(&mut self);
    /// From now on products in `f32` (the `Bf16` run's final check and polish).
    fn products_f32(&mut self);
    /// The current iterate.
    fn into_x(self) -> Result<Self::Out>;
}

/// [`Error::Value`] unless `max_asym ≤ SYM_TOL · max_abs` (the symmetry check of `a`).
pub(crate) fn check_symmetric(
    op: &'static str,
    arg: &'static str,
    max_asym: f32,
    max_abs: f32,
) -> Result<()> {
    if max_asym > SYM_TOL * max_abs {
        return Err(Error::Value {
            op,
            arg,
            value: (max_asym / max_abs) as f64,
            expected: "a symmetric matrix (max |a_ij - a_ji| / max |a| <= 1e-5)",
        });
    }
    Ok(())
}

/// The inversion of `b`'s `A`, `warm`: whether `b`'s iterate holds a warm start (used with
/// [`InitialGuess::Warm`]). See [`crate::cpu::newton`] for the rules.
///
/// # Errors
/// [`Error::Value`] (`A = 0`, no positive eigenvalue), [`Error::Diverged`], backend errors.
pub(crate) fn newton_inverse<B: NewtonBackend>(
    mut b: B,
    warm: bool,
    opts: &NewtonOptions,
) -> Result<(B::Out, NewtonInfo)> {
    let n = b.n();
    let bf16 = opts.precision == Precision::Bf16;

    // X₀, and whether X stays a polynomial in A (then the powers of E are symmetric).
    let mut r0 = None;
    let (init_used, commuting) = match (opts.init, warm) {
        (InitialGuess::Paper, _) => {
            let norms = b.a_norms()?;
            let prod = norms.inf * norms.one;
            if prod == 0.0 {
                return Err(zero_matrix(B::OP));
            }
            b.set_x(Start::ScaledA(1.0 / prod))?;
            (InitialGuess::Paper, true)
        }
        (InitialGuess::Warm, true) => {
            // ‖I − AX‖₂ < 1 through the upper bounds ‖·‖_F and √(‖·‖₁‖·‖∞).
            let (r, (inf, one)) = b.product_t_and_e_norms()?;
            let fro = r as f64 * (n as f64).sqrt();
            if fro.min((inf * one).sqrt()) < 1.0 {
                r0 = Some(r);
                (InitialGuess::Warm, false)
            } else {
                scaled_identity(&mut b, opts, opts.lambda_high)?;
                (InitialGuess::ScaledIdentity, true)
            }
        }
        (InitialGuess::ScaledIdentity | InitialGuess::Warm, _) => {
            scaled_identity(&mut b, opts, opts.lambda_high)?;
            (InitialGuess::ScaledIdentity, true)
        }
    };
    let r = match r0 {
        Some(r) => r,
        None => b.product_t()?,
    };

    // A caller's λ_max estimate (`lambda_high`) can underestimate λ_max (an unconverged power
    // iteration); then c·λ_max > 2 and the iteration diverges. Retry once from the guaranteed
    // bound before calling it divergence; the history then holds both runs and `iterations`
    // counts the first run's steps too. Without an estimate the start is already the bound.
    let mut history = Vec::new();
    let (best_r, best_iter) = match iterate(&mut b, opts, bf16, commuting, r, &mut history) {
        Err(Error::Diverged { iterations, .. })
            if init_used == InitialGuess::ScaledIdentity && opts.lambda_high.is_some() =>
        {
            b.clear_best();
            scaled_identity(&mut b, opts, None)?;
            let r = b.product_t()?;
            let (r, k) = iterate(&mut b, opts, bf16, true, r, &mut history)?;
            (r, iterations + k)
        }
        other => other?,
    };

    let mut info = NewtonInfo {
        residual: best_r,
        iterations: best_iter,
        init_used,
        residual_history: history,
        polished: false,
    };
    if bf16 {
        // The honest residual of the best iterate from an f32 product, then the polish.
        b.products_f32();
        b.use_best();
        let r_best = b.product_t()?;
        info.residual = r_best;
        if opts.polish {
            b.mark_best();
            b.step(NewtonOrder::Quadratic, false)?;
            let r_pol = b.product_t()?;
            if r_pol < r_best {
                info.residual = r_pol;
                info.polished = true;
            } else {
                b.use_best();
            }
        }
        if !info.residual.is_finite() {
            return Err(Error::Diverged {
                op: B::OP,
                reason: DivergenceReason::NonFinite,
                iterations: best_iter,
                residual: info.residual as f64,
            });
        }
    }
    Ok((b.into_x()?, info))
}

/// Iterates from the current `X₀` (whose residual is `r`) under the stopping rules of
/// [`crate::cpu::newton`], appending each residual to `history`. Returns the best residual
/// and the step that reached it; the iterate is left current (`F32`: the best one) or kept as
/// the best (`Bf16`).
fn iterate<B: NewtonBackend>(
    b: &mut B,
    opts: &NewtonOptions,
    bf16: bool,
    commuting: bool,
    mut r: f32,
    history: &mut Vec<f32>,
) -> Result<(f32, usize)> {
    let mut iterations = 0;
    let mut best_r = f32::INFINITY;
    let mut best_iter = 0;
    let mut prev_r = f32::INFINITY;
    let mut sym_phase = !bf16;
    // F32 to its rounding floor: `tol` only bounds what is accepted (NewtonStop::Floor).
    let to_floor = !bf16 && opts.stop == NewtonStop::Floor;
    let p = match opts.order {
        NewtonOrder::Quadratic => 2,
        NewtonOrder::Cubic => 3,
        NewtonOrder::Quartic => 4,
    };
    let diverged = |reason, iterations, residual: f32| Error::Diverged {
        op: B::OP,
        reason,
        iterations,
        residual: residual as f64,
    };
    loop {
        history.push(r);
        if !r.is_finite() {
            if bf16 && best_r < ARMED {
                break;
            }
            return Err(diverged(DivergenceReason::NonFinite, iterations, r));
        }
        if r <= opts.tol && !to_floor {
            best_r = r;
            best_iter = iterations;
            b.mark_best();
            break;
        }
        if r < best_r {
            best_r = r;
            best_iter = iterations;
            b.mark_best();
            if to_floor && r <= opts.tol && at_floor(r, prev_r, b.n(), p) {
                break;
            }
        } else if sym_phase {
            // The noise of the mirrored products stalled the early phase: go on with full
            // products, which correct it.
            sym_phase = false;
        } else if best_r < ARMED {
            if bf16 || (to_floor && best_r <= opts.tol) {
                // The floor, reached by the best iterate.
                b.use_best();
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
            if to_floor && best_r <= opts.tol {
                // Still falling below `tol`: acceptable, if short of the floor.
                b.use_best();
                break;
            }
            return Err(diverged(DivergenceReason::NotConverged, iterations, r));
        }
        // Symmetric-result products only in the early f32 phase: the last steps must be full
        // products for Newton's self-correction to hold.
        if r <= SYM_SWITCH {
            sym_phase = false;
        }
        prev_r = r;
        b.step(opts.order, sym_phase && commuting)?;
        iterations += 1;
        r = b.product_t()?;
    }
    Ok((best_r, best_iter))
}

/// Whether the residual `r`, just lowered from `prev`, is the rounding floor: in exact
/// arithmetic `E ↦ E^p` and `‖E^p‖_F ≤ ‖E‖₂^(p−1)‖E‖_F ≤ (√n·‖E‖_F)^(p−1)‖E‖_F` give
/// `r ≤ (√n·prev)^(p−1)·prev` (tight when one eigencomponent dominates, so a slow component
/// never looks like the floor); more than [`ROUNDING_MARGIN`] times that means rounding set
/// `r`, and the next step, made of the same roundings, cannot go clearly lower. `r = 0`
/// cannot go lower either. Saves the step that would find no improvement.
fn at_floor(r: f32, prev: f32, n: usize, p: i32) -> bool {
    let prev = prev as f64;
    let exact = ((n as f64).sqrt() * prev).powi(p - 1) * prev;
    r == 0.0 || r as f64 > ROUNDING_MARGIN * exact
}

/// `X₀ = c I`, `c = 2/(λ_hi + min(λ_low, λ_hi))` with `λ_hi = 1.1·min(λ_est, bound)`:
/// `bound` from [`lambda_max_bound`] (guaranteed), `λ_est` the caller's estimate when given
/// (tighter, but a lower estimate can miss `λ_max`: the caller's restart covers it).
///
/// What an overestimate costs: with `h = λ_hi ≥ λ_max` and `l = λ_low ≤ λ_min`, the
/// eigenvalues of `E₀ = I − cA` lie in `[1 − 2λ_max/(h + l), 1 − 2λ_min/(h + l)]`, so
/// `‖E₀‖₂ ≤ max(2/1.1 − 1, 1 − 2/(κ_h + 1))` with `κ_h = h/λ_min`, and an order-`p` iteration
/// (`E_{k+1} = E_k^p`) reaches a residual `r` after `k ≈ log_p(ln(1/r)·(κ_h + 1)/2)` steps.
/// Overestimating `λ_max` by a factor `s_h` adds `log_p s_h` steps: the bound is exact for a
/// spike on a flat spectrum (K-FAC factors' usual shape: one dominant mean direction),
/// within `√2` for a few dominant directions, and at worst `√n` (a flat spectrum, where
/// `κ` is small anyway) — cubic: `+0.3` steps at `s_h = √2`, `+3.8` at `√4096`.
fn scaled_identity<B: NewtonBackend>(
    b: &mut B,
    opts: &NewtonOptions,
    estimate: Option<f32>,
) -> Result<()> {
    let norms = b.a_norms()?;
    if norms.inf == 0.0 {
        return Err(zero_matrix(B::OP));
    }
    let bound = lambda_max_bound(b.n(), &norms);
    if bound <= 0.0 {
        return Err(Error::Value {
            op: B::OP,
            arg: "a",
            value: bound,
            expected: "a positive definite matrix (no positive eigenvalue: lambda_max bound <= 0)",
        });
    }
    let hi = LAMBDA_MARGIN * estimate.map_or(bound as f32, |e| e.min(bound as f32));
    let c = 2.0 / (hi + opts.lambda_low.min(hi));
    b.set_x(Start::Identity(c))
}

fn zero_matrix(op: &'static str) -> Error {
    Error::Value {
        op,
        arg: "a",
        value: 0.0,
        expected: "a nonzero (positive definite) matrix",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norms(a: &[f64], n: usize) -> ANorms {
        ANorms {
            inf: (0..n)
                .map(|i| (0..n).map(|j| a[i * n + j].abs()).sum::<f64>())
                .fold(0.0, f64::max),
            one: 0.0,
            fro: a.iter().map(|v| v * v).sum::<f64>().sqrt(),
            trace: (0..n).map(|i| a[i * n + i]).sum(),
        }
    }

    /// `σvvᵀ + μI` (a spike on a flat spectrum, `v` dense so `‖A‖∞` is loose): the bound is
    /// `σ + μ` (Wolkowicz–Styan is exact there) plus the rounding slack, at most
    /// `√(1e-6·‖A‖_F²/n)·√(n − 1) ≤ 1e-3·‖A‖_F`, and never below it; a diagonal `A` is
    /// bounded by its `‖A‖∞ = λ_max` exactly.
    #[test]
    fn lambda_max_bound_is_tight_on_a_spike() {
        for n in [2usize, 7, 64, 301] {
            let v: Vec<f64> = (0..n).map(|i| 1.0 + (i % 5) as f64).collect();
            let vn = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            let (sigma, mu) = (3.0, 0.25);
            let a: Vec<f64> = (0..n * n)
                .map(|k| {
                    let (i, j) = (k / n, k % n);
                    sigma * v[i] * v[j] / (vn * vn) + if i == j { mu } else { 0.0 }
                })
                .collect();
            let b = lambda_max_bound(n, &norms(&a, n));
            let exact = sigma + mu;
            assert!(b >= exact * (1.0 - 1e-12), "n {n}: {b} < {exact}");
            let fro = norms(&a, n).fro;
            assert!(b <= exact + 1e-3 * fro, "n {n}: {b} > {exact} + 1e-3·{fro}");
            let d: Vec<f64> = (0..n * n)
                .map(|k| {
                    if k % (n + 1) == 0 {
                        1.0 + (k % 7) as f64
                    } else {
                        0.0
                    }
                })
                .collect();
            let top = (0..n).map(|i| d[i * n + i]).fold(0.0, f64::max);
            assert_eq!(lambda_max_bound(n, &norms(&d, n)), top);
        }
    }
}
