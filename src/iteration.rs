//! The Newton inversion's iteration control and the power iteration, written once over the
//! primitives of a backend (the traits [`NewtonBackend`] and [`PowerStep`]): the CPU oracle
//! ([`crate::cpu::newton`], [`crate::cpu::norm`]) and the device kernels
//! ([`crate::cuda::newton`]) implement the primitives, this module decides what runs. The
//! rules themselves are documented in [`crate::cpu::newton`]. It sits below both backends
//! (they call it with their primitives; it names neither), beside [`crate::params`].

use crate::error::{check_shape, DivergenceReason, Error, Result};
use crate::params::newton::{InitialGuess, NewtonInfo, NewtonOptions, NewtonOrder, Precision};
use crate::params::power::{PowerInfo, PowerOptions};

/// Below this best residual the iteration is in its fast-convergence regime, where a residual
/// that stops falling means the rounding floor.
pub const ARMED: f32 = 0.5;

/// Relative growth per step tolerated above [`ARMED`] (rounding noise on a residual near 1,
/// which is far larger in `Bf16` mode) before it counts as divergence.
pub const GROWTH_SLACK: f32 = 1e-2;

/// Above this residual the `F32` iteration may compute the powers of `E` as
/// symmetric-result products (then never again).
pub const SYM_SWITCH: f32 = 0.1;

/// Relative asymmetry accepted in `a`: `|a_ij − a_ji| ≤ SYM_TOL · max|a|` (a warm start is
/// only a hint: its symmetric part is used unchecked).
pub const SYM_TOL: f32 = 1e-5;

/// Safety factor on `λ_max` in the scaled identity: on the power-iteration estimate (a lower
/// bound of `λ_max`) it guards against a slightly unconverged estimate, on the guaranteed
/// bounds against equality (a diagonal `A` has `‖A‖∞ = λ_max`, where `c·λ_max = 2` would
/// stall that eigencomponent). Either way `|1 − cλ_max| ≤ 2/1.1 − 1 ≈ 0.82`.
const LAMBDA_MARGIN: f32 = 1.1;

/// One power-iteration step on a backend's matrix `A` (`n x n`).
pub(crate) trait PowerStep {
    /// `v ← v0` (`n` values of unit norm).
    fn start(&mut self, v0: &[f64]) -> Result<()>;
    /// `w = A v`; returns `(vᵀw, ‖w‖)` (summed in `f64`) and sets `v ← w/‖w‖` when `‖w‖ > 0`.
    fn step(&mut self) -> Result<(f64, f64)>;
}

/// Largest eigenvalue of a symmetric PSD `n x n` matrix (`n ≥ 1`) by power iteration from
/// the normalized all-ones vector plus a fixed aperiodic perturbation (so a top eigenvector
/// orthogonal to all-ones is still found, and runs are deterministic); stops when the
/// Rayleigh quotient changes by at most `opts.tol` relative to its value.
pub(crate) fn power_iteration(
    p: &mut impl PowerStep,
    n: usize,
    opts: &PowerOptions,
) -> Result<PowerInfo> {
    // Golden-ratio fractional parts: deterministic, never periodic in i.
    let v0: Vec<f64> = (0..n)
        .map(|i| 1.0 + 0.5 * ((i as f64 * 0.618_033_988_749_895).fract() - 0.5))
        .collect();
    p.start(&unit(v0))?;
    let mut prev: Option<f64> = None;
    for it in 1..=opts.max_iter {
        let (rq, wn) = p.step()?;
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
    }
    Ok(PowerInfo {
        value: prev.unwrap_or(0.0) as f32,
        iterations: opts.max_iter,
        converged: false,
    })
}

/// Rayleigh quotient after `steps` power steps from a fixed pseudo-random start (a second
/// start beside [`power_iteration`]'s smooth one, so that one start nearly orthogonal to the
/// top eigenvector does not decide `λ_hi`).
fn rayleigh_pseudo_random(p: &mut impl PowerStep, n: usize, steps: usize) -> Result<f32> {
    p.start(&unit(pseudo_random_start(n)))?;
    let mut theta = 0.0;
    for _ in 0..steps {
        let (rq, wn) = p.step()?;
        if wn == 0.0 {
            return Ok(0.0);
        }
        theta = rq;
    }
    Ok(theta as f32)
}

/// `v/‖v‖` (a zero `v` cannot come from the starts above: both are nonzero for `n ≥ 1`).
fn unit(mut v: Vec<f64>) -> Vec<f64> {
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

/// `n` deterministic values spread over `[-1, 1)` (xorshift64*).
pub(crate) fn pseudo_random_start(n: usize) -> Vec<f64> {
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
    /// Power steps on `A`.
    type Power<'p>: PowerStep
    where
        Self: 'p;

    fn n(&self) -> usize;
    /// `(‖A‖∞, ‖A‖₁, ‖A‖_F)`, in `f64`.
    fn a_norms(&mut self) -> Result<(f64, f64, f64)>;
    /// Power steps on `A`.
    fn power(&mut self) -> Result<Self::Power<'_>>;
    /// Writes `X₀`.
    fn set_x(&mut self, start: Start) -> Result<()>;
    /// `T = A X` (with `E = I − T` where the backend keeps it) and its residual
    /// `‖I − T‖_F/√n`.
    fn product_t(&mut self) -> Result<f32>;
    /// `(‖E‖∞, ‖E‖₁)` of the last [`NewtonBackend::product_t`]'s `E = I − AX`, in `f64`.
    fn e_norms(&mut self) -> Result<(f64, f64)>;
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

/// `n` of a square `a` with `n ≥ 1`, else [`Error::Shape`].
pub(crate) fn check_square(op: &'static str, shape: (usize, usize)) -> Result<usize> {
    let n = shape.0;
    check_shape(op, "a", shape, (n, n))?;
    if n == 0 {
        return Err(Error::Shape {
            op,
            arg: "a",
            expected: "n x n with n >= 1".into(),
            got: "0x0".into(),
        });
    }
    Ok(n)
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
            let (inf, one, _) = b.a_norms()?;
            let prod = inf * one;
            if prod == 0.0 {
                return Err(zero_matrix(B::OP));
            }
            b.set_x(Start::ScaledA(1.0 / prod))?;
            (InitialGuess::Paper, true)
        }
        (InitialGuess::Warm, true) => {
            let r = b.product_t()?;
            // ‖I − AX‖₂ < 1 through the upper bounds ‖·‖_F and √(‖·‖₁‖·‖∞).
            let (inf, one) = b.e_norms()?;
            let fro = r as f64 * (n as f64).sqrt();
            if fro.min((inf * one).sqrt()) < 1.0 {
                r0 = Some(r);
                (InitialGuess::Warm, false)
            } else {
                scaled_identity(&mut b, opts.lambda_low, true)?;
                (InitialGuess::ScaledIdentity, true)
            }
        }
        (InitialGuess::ScaledIdentity | InitialGuess::Warm, _) => {
            scaled_identity(&mut b, opts.lambda_low, true)?;
            (InitialGuess::ScaledIdentity, true)
        }
    };
    let r = match r0 {
        Some(r) => r,
        None => b.product_t()?,
    };

    // The scaled identity's λ_hi comes from power iterations, which can underestimate λ_max
    // (a start vector nearly orthogonal to the top eigenvector); then c·λ_max > 2 and the
    // iteration diverges. Retry once from a guaranteed bound before calling it divergence;
    // the history then holds both runs and `iterations` counts the first run's steps too.
    let mut history = Vec::new();
    let (best_r, best_iter) = match iterate(&mut b, opts, bf16, commuting, r, &mut history) {
        Err(Error::Diverged { iterations, .. }) if init_used == InitialGuess::ScaledIdentity => {
            b.clear_best();
            scaled_identity(&mut b, opts.lambda_low, false)?;
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
/// and the step that reached it; the iterate is left current (`F32`) or kept as the best
/// (`Bf16`).
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
        if r <= opts.tol {
            best_r = r;
            best_iter = iterations;
            b.mark_best();
            break;
        }
        if r < best_r {
            best_r = r;
            best_iter = iterations;
            b.mark_best();
        } else if sym_phase {
            // The noise of the mirrored products stalled the early phase: go on with full
            // products, which correct it.
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

/// `X₀ = c I`, `c = 2/(λ_hi + min(λ_low, λ_hi))`: `λ_hi = 1.1·θ` (`estimated`: θ the larger
/// Rayleigh quotient of two power iterations from different starts, `θ ≤ λ_max`; tight, but
/// θ can miss `λ_max`), else the guaranteed `1.1·min(‖A‖∞, ‖A‖_F)` (up to `√n` too large).
fn scaled_identity<B: NewtonBackend>(b: &mut B, lambda_low: f32, estimated: bool) -> Result<()> {
    let n = b.n();
    let (inf, _, fro) = b.a_norms()?;
    if inf == 0.0 {
        return Err(zero_matrix(B::OP));
    }
    let hi = if estimated {
        let mut p = b.power()?;
        let opts = PowerOptions {
            tol: 1e-3,
            max_iter: 60,
        };
        let value = power_iteration(&mut p, n, &opts)?.value;
        let theta = value.max(rayleigh_pseudo_random(&mut p, n, 20)?);
        if theta <= 0.0 {
            return Err(Error::Value {
                op: B::OP,
                arg: "a",
                value: theta as f64,
                expected:
                    "a positive definite matrix (power iterations found no positive eigenvalue)",
            });
        }
        LAMBDA_MARGIN * theta
    } else {
        LAMBDA_MARGIN * inf.min(fro) as f32
    };
    let c = 2.0 / (hi + lambda_low.min(hi));
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
