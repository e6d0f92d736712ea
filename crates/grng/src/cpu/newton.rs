//! Newton–Schulz inversion of an SPD matrix on the host (docs/math.md §2).
//!
//! With `T = AX` and `E = I − T`, one step maps `E ↦ E^p`: quadratic `X(2I − T)`, cubic
//! `X(3I − 3T + T²)`, quartic `X(4I − T(6I − T(4I − T)))`. They are evaluated as
//! `X ← X + X·F` with `F = E`, `E + E²`, `E + E² + E³` (the same polynomials): the correction
//! `F` is small near convergence, so forming it, rather than `p(T) ≈ I`, keeps its digits —
//! which matters most in `Bf16` mode, where `p(T)` rounded to bf16 would lose them. Every
//! step first forms `T = AX` (always a full product), whose residual `‖I − T‖_F/√n` drives
//! the stop test. All products go through [`crate::cpu::gemm()`].
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
//! **Stopping.** With [`NewtonStop::Tol`] (and in `Bf16` mode) the iteration returns as soon
//! as the residual is `≤ tol`. With [`NewtonStop::Floor`], the `F32` default, it goes on past
//! `tol` to the rounding floor and returns its best iterate, once the residual `r ≤ tol`
//! either did not fall or fell to more than [`ROUNDING_MARGIN`] times the exact-arithmetic
//! bound `(√n·r_prev)^(p−1)·r_prev` (then rounding, not convergence, set it: the next step
//! would find the floor, not go below it); `tol` bounds the floor accepted. The budget running
//! out below `tol` returns the best iterate too. In exact arithmetic
//! the residual never grows from any of the three starts, so a residual that stops falling
//! means either the rounding floor was reached or the iteration diverges:
//! - non-finite residual → [`DivergenceReason::NonFinite`](crate::error::DivergenceReason::NonFinite) (`Bf16` past its floor: best
//!   iterate returned);
//! - during the mirrored phase, no improvement ends that phase (full products from then on);
//! - once the best residual is below [`ARMED`], no improvement means the floor: `F32` mode
//!   returns its best iterate if that is `≤ tol` ([`NewtonStop::Floor`]) and errs otherwise
//!   ([`DivergenceReason::NotConverged`](crate::error::DivergenceReason::NotConverged), or [`DivergenceReason::Growing`](crate::error::DivergenceReason::Growing) for a jump
//!   above twice the best); `Bf16` mode returns its best iterate;
//! - above [`ARMED`] (the first steps from the paper's start sit near 1) only a clear growth,
//!   more than [`GROWTH_SLACK`] relative per step, is divergence ([`DivergenceReason::Growing`](crate::error::DivergenceReason::Growing));
//! - `max_iter` exhausted → [`DivergenceReason::NotConverged`](crate::error::DivergenceReason::NotConverged) (both modes).
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
//! κ ≈ 1e4; [`NewtonStop::Floor`] returns it, where [`NewtonStop::Tol`] stopped anywhere below
//! `1e-4` (what that costs in steps: docs/math.md §2). The `bf16` floor, `≲ 4e-3·κ^0.55` for n ≥ 48 (the bound `tests/cpu_newton.rs`
//! checks; n = 16 reached 0.17 at κ = 836, n = 25 1.02x the bound at κ = 790), is set by the rounding of `A` itself. At
//! n = 256–512 it is below docs/math.md §2's numpy figures (4.5e-3, 9e-3, 1.7e-2, 0.14 at κ = 10, 33,
//! 100, 1000); rounding the small correction `F` rather than `p(T) ≈ I` to bf16 is the likely
//! difference. The polish step squares the floor.

use rayon::prelude::*;

use super::check_finite_view;
use super::gemm::gemm;
use crate::error::{try_collect, try_vec, Result};
use crate::iteration::{self as driver, check_symmetric, ANorms, NewtonBackend, Start};
pub use crate::iteration::{ARMED, GROWTH_SLACK, ROUNDING_MARGIN, SYM_SWITCH, SYM_TOL};
use crate::mat::{Mat, MatMut, MatRef, Trans};
use crate::params::newton::{
    InitialGuess, NewtonInfo, NewtonOptions, NewtonOrder, NewtonStop, Precision,
};
use crate::shape::check_square;
use crate::shape::MatMul;

/// Inverse of the symmetric positive definite `n x n` matrix `a` by Newton iteration; see the
/// module docs for the arithmetic and the stopping rules, and
/// [`crate::Device::newton_inverse`] for the contract. `warm` is used only with
/// [`InitialGuess::Warm`]: a hint, of which the symmetric part is used (no symmetry check).
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) (not square, `n = 0`, `warm` not `n x n`),
/// [`Error::NonFinite`](crate::Error::NonFinite), [`Error::Value`](crate::Error::Value) (bad
/// options; `a` asymmetric beyond [`SYM_TOL`]; `a = 0`; no positive eigenvalue found for the
/// scaled identity), [`Error::Diverged`](crate::Error::Diverged).
pub fn newton_inverse(
    a: MatRef<'_, f32>,
    warm: Option<MatRef<'_, f32>>,
    opts: &NewtonOptions,
) -> Result<(Mat, NewtonInfo)> {
    const OP: &str = Iteration::OP;
    opts.validate(OP)?;
    let n = check_square(OP, a.shape())?;
    check_finite_view(OP, "a", a)?;
    let (a_sym, max_asym, max_abs) = symmetric_part(a)?;
    check_symmetric(OP, "a", max_asym, max_abs)?;
    let warm_sym = match (opts.init, warm) {
        (InitialGuess::Warm, Some(w)) => {
            crate::error::check_shape(OP, "warm", w.shape(), (n, n))?;
            check_finite_view(OP, "warm", w)?;
            Some(symmetric_part(w)?.0)
        }
        _ => None,
    };
    let has_warm = warm_sym.is_some();
    let bf16 = opts.precision == Precision::Bf16;
    // Both modes that run to a floor return their best iterate, so keep it.
    let keep_best = bf16 || opts.stop == NewtonStop::Floor;
    let it = Iteration::new(a_sym, warm_sym, n, bf16, keep_best)?;
    driver::newton_inverse(it, has_warm, opts)
}

/// The iteration's buffers (all `n x n`, row-major).
struct Iteration {
    n: usize,
    /// Products with `bf16`-rounded operands now.
    bf16: bool,
    /// The best iterate is kept in `best` (`Bf16` mode, [`NewtonStop::Floor`]).
    keep_best: bool,
    /// `A` (symmetric part), `f32`.
    a: Vec<f32>,
    /// `A` rounded to `bf16` (empty in `F32` mode).
    a_bf: Vec<f32>,
    /// The iterate.
    x: Vec<f32>,
    /// `T = AX`.
    t: Vec<f32>,
    /// The best iterate so far (when `keep_best`).
    best: Vec<f32>,
    /// Scratch: `T²`, `U`, the polynomial, the new iterate, rounded operands.
    w1: Vec<f32>,
    w2: Vec<f32>,
    w3: Vec<f32>,
    r1: Vec<f32>,
    r2: Vec<f32>,
}

impl Iteration {
    fn new(
        a: Vec<f32>,
        warm: Option<Vec<f32>>,
        n: usize,
        bf16: bool,
        keep_best: bool,
    ) -> Result<Self> {
        let mut a_bf = Vec::new();
        if bf16 {
            a_bf = try_vec(n, n, 0.0)?;
            round_bf16(&a, &mut a_bf);
        }
        let z = || try_vec(n, n, 0.0f32);
        Ok(Self {
            n,
            bf16,
            keep_best,
            a,
            a_bf,
            x: warm.unwrap_or_default(),
            t: z()?,
            best: Vec::new(),
            w1: z()?,
            w2: z()?,
            w3: z()?,
            r1: z()?,
            r2: z()?,
        })
    }
}

impl NewtonBackend for Iteration {
    const OP: &'static str = "cpu::newton_inverse";
    type Out = Mat;

    fn n(&self) -> usize {
        self.n
    }

    fn a_norms(&mut self) -> Result<ANorms> {
        let (a, n) = (&self.a, self.n);
        let inf = a
            .chunks(n)
            .map(|r| r.iter().map(|v| v.abs() as f64).sum::<f64>())
            .fold(0.0, f64::max);
        let one = (0..n)
            .map(|j| (0..n).map(|i| a[i * n + j].abs() as f64).sum::<f64>())
            .fold(0.0, f64::max);
        let fro = a.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
        let trace = (0..n).map(|i| a[i * n + i] as f64).sum();
        Ok(ANorms {
            inf,
            one,
            fro,
            trace,
        })
    }

    fn set_x(&mut self, start: Start) -> Result<()> {
        let n = self.n;
        self.x = match start {
            Start::ScaledA(alpha) => {
                try_collect(self.a.iter().map(|&v| (v as f64 * alpha) as f32))?
            }
            Start::Identity(c) => {
                let mut x = try_vec(n, n, 0.0f32)?;
                (0..n).for_each(|i| x[i * n + i] = c);
                x
            }
        };
        Ok(())
    }

    /// `T ← A X`, always a full product: its deviation from symmetry is the first-order
    /// information that makes the iteration self-correcting (mirroring it is unstable).
    fn product_t(&mut self) -> Result<f32> {
        let a = if self.bf16 { &self.a_bf } else { &self.a };
        let x = operand(&self.x, &mut self.r1, self.bf16);
        product(a, x, &mut self.t, self.n, false)?;
        Ok(residual(&self.t, self.n))
    }

    fn product_t_and_e_norms(&mut self) -> Result<(f32, (f64, f64))> {
        let r = self.product_t()?;
        let (t, n) = (&self.t, self.n);
        let e = |i: usize, j: usize| {
            let v = t[i * n + j] as f64;
            if i == j {
                1.0 - v
            } else {
                -v
            }
        };
        let inf = (0..n)
            .map(|i| (0..n).map(|j| e(i, j).abs()).sum::<f64>())
            .fold(0.0, f64::max);
        let one = (0..n)
            .map(|j| (0..n).map(|i| e(i, j).abs()).sum::<f64>())
            .fold(0.0, f64::max);
        Ok((r, (inf, one)))
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

    fn mark_best(&mut self) {
        if self.keep_best {
            self.best.clone_from(&self.x);
        }
    }

    fn clear_best(&mut self) {
        self.best.clear();
    }

    fn use_best(&mut self) {
        self.x.clone_from(&self.best);
    }

    fn products_f32(&mut self) {
        self.bf16 = false;
    }

    fn into_x(self) -> Result<Mat> {
        Mat::from_vec(self.x, self.n, self.n)
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
            MatMul::new(
                Trans::No,
                Trans::No,
                1.0,
                MatRef::with_ld(&a[r0 * n..], rows, n, n)?,
                MatRef::with_ld(&b[c0..], n, n - c0, n)?,
            ),
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

/// The symmetric part of a square view, with `max |a_ij − a_ji|` and `max |a_ij|`.
fn symmetric_part(a: MatRef<'_, f32>) -> Result<(Vec<f32>, f32, f32)> {
    let n = a.rows();
    let max = (0..n)
        .flat_map(|i| a.row(i).iter())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    let mut worst = 0.0f32;
    let mut s = try_vec(n, n, 0.0f32)?;
    for i in 0..n {
        for j in 0..n {
            let (x, y) = (a.at(i, j), a.at(j, i));
            worst = worst.max((x - y).abs());
            s[i * n + j] = 0.5 * (x + y);
        }
    }
    Ok((s, worst, max))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A caller's `lambda_high` below `λ_max` (an unconverged power iteration): `c·λ_max > 2`,
    /// the first run diverges and the restart from the guaranteed bound converges.
    #[test]
    fn underestimated_lambda_high_restarts() {
        let n = 40;
        // A = diag(0.6, …, 0.6, 0.9) with the estimate 0.4: c = 2/(1.1·0.4 + 0.44) ≈ 2.27, so
        // E₀ has the eigenvalue 1 − 2.27·0.9 ≈ −1.05, which the cubic steps grow.
        let mut a = vec![0.0f32; n * n];
        for i in 0..n {
            a[i * n + i] = if i == n - 1 { 0.9 } else { 0.6 };
        }
        let opts = NewtonOptions {
            lambda_low: 0.6,
            lambda_high: Some(0.4),
            ..NewtonOptions::default()
        };
        let (x, info) = newton_inverse(MatRef::new(&a, n, n).unwrap(), None, &opts).unwrap();
        // The first run diverged, the second converged: two X₀ entries.
        assert_eq!(info.residual_history.len(), info.iterations + 2);
        assert_eq!(info.init_used, InitialGuess::ScaledIdentity);
        assert!(info.residual <= 1e-4);
        assert_eq!(x.shape(), (n, n));
        // Without the estimate the guaranteed bound converges in one run.
        let (_, plain) = newton_inverse(
            MatRef::new(&a, n, n).unwrap(),
            None,
            &NewtonOptions {
                lambda_high: None,
                ..opts
            },
        )
        .unwrap();
        assert_eq!(plain.residual_history.len(), plain.iterations + 1);
    }
}
