//! The diagonal R-Kalman step against a dense `f64` Kalman filter written here (full `n x n`
//! covariance, explicit gain), on random small problems, through the device entry point.

use grng_testkit as common;

use grng::ops::kalman::{KalmanInfo, KalmanOptions, KalmanState, RForm};
use grng::{Device, Error, Matrix};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Inverse of a small nonsingular matrix (Gauss–Jordan with partial pivoting, `f64`).
fn inverse(a: &[f64], n: usize) -> Vec<f64> {
    let mut m = a.to_vec();
    let mut inv = vec![0.0; n * n];
    (0..n).for_each(|i| inv[i * n + i] = 1.0);
    for c in 0..n {
        let p = (c..n)
            .max_by(|&i, &j| m[i * n + c].abs().total_cmp(&m[j * n + c].abs()))
            .unwrap();
        for k in 0..n {
            m.swap(c * n + k, p * n + k);
            inv.swap(c * n + k, p * n + k);
        }
        let d = m[c * n + c];
        assert!(d != 0.0, "singular test matrix");
        for k in 0..n {
            m[c * n + k] /= d;
            inv[c * n + k] /= d;
        }
        for i in 0..n {
            if i != c {
                let f = m[i * n + c];
                for k in 0..n {
                    m[i * n + k] -= f * m[c * n + k];
                    inv[i * n + k] -= f * inv[c * n + k];
                }
            }
        }
    }
    inv
}

fn transpose(a: &[f64], m: usize, n: usize) -> Vec<f64> {
    let mut t = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            t[j * m + i] = a[i * n + j];
        }
    }
    t
}

/// A dense `f64` Kalman filter with a full covariance.
#[derive(Clone)]
struct Dense {
    n: usize,
    d_o: usize,
    mu: Vec<f64>,
    /// `n x n`.
    cov: Vec<f64>,
    /// `d_o x d_o`.
    r: Vec<f64>,
}

impl Dense {
    /// The textbook update with docs/math.md §3's `R` EMA and `R̃`: `K = Σ⁻Hᵀ(HΣ⁻Hᵀ + R̃)⁻¹`,
    /// `μ ← μ + K v`, `Σ ← Σ⁻ − K H Σ⁻`.
    fn step(&mut self, h: &[f64], v: &[f64], o: &KalmanOptions) {
        let (n, d) = (self.n, self.d_o);
        let q = o.process_noise as f64;
        (0..n).for_each(|i| self.cov[i * n + i] += q);
        let ht = transpose(h, d, n);
        let cov_ht = common::matmul64(&self.cov, &ht, n, n, d);
        let p = common::matmul64(h, &cov_ht, d, n, d);
        let beta = o.beta as f64;
        for j in 0..d {
            for k in 0..d {
                self.r[j * d + k] =
                    beta * self.r[j * d + k] + (1.0 - beta) * (v[j] * v[k] + p[j * d + k]);
            }
        }
        let rho = o.rho as f64;
        let rr = common::matmul64(&self.r, &self.r, d, d, d);
        let r_tilde: Vec<f64> = match o.r_form {
            RForm::Exact => {
                let mut m: Vec<f64> = self.r.iter().map(|x| rho * x).collect();
                (0..d).for_each(|j| m[j * d + j] += 1.0);
                common::matmul64(&self.r, &inverse(&m, d), d, d, d)
            }
            RForm::Neumann => self.r.iter().zip(&rr).map(|(a, b)| a - rho * b).collect(),
        };
        let s: Vec<f64> = p.iter().zip(&r_tilde).map(|(a, b)| a + b).collect();
        let k = common::matmul64(&cov_ht, &inverse(&s, d), n, d, d);
        let kv = common::matmul64(&k, v, n, d, 1);
        self.mu.iter_mut().zip(&kv).for_each(|(m, x)| *m += x);
        let hc = common::matmul64(h, &self.cov, d, n, n);
        let khc = common::matmul64(&k, &hc, n, d, n);
        self.cov.iter_mut().zip(&khc).for_each(|(c, x)| *c -= x);
    }

    /// Keeps only the diagonal (the "diagonal EKF": the dense update restricted to a
    /// diagonal covariance after every step).
    fn project_diagonal(&mut self) {
        let n = self.n;
        for i in 0..n {
            for j in 0..n {
                if i != j {
                    self.cov[i * n + j] = 0.0;
                }
            }
        }
    }

    fn diag(&self) -> Vec<f64> {
        (0..self.n).map(|i| self.cov[i * self.n + i]).collect()
    }
}

struct Problem {
    h: Vec<f32>,
    v: Vec<f32>,
}

fn uniform(rng: &mut ChaCha8Rng, len: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(lo..hi)).collect()
}

fn random_problem(rng: &mut ChaCha8Rng, d_o: usize, n: usize) -> Problem {
    Problem {
        h: uniform(rng, d_o * n, -1.0, 1.0),
        v: uniform(rng, d_o, -1.0, 1.0),
    }
}

/// A random SPD `d x d` matrix `BBᵀ/d + 0.1 I` (well conditioned, so `S` is too).
fn random_spd(rng: &mut ChaCha8Rng, d: usize) -> Vec<f32> {
    let b = uniform(rng, d * d, -1.0, 1.0);
    let mut r = vec![0.0f32; d * d];
    for i in 0..d {
        for j in 0..d {
            let s: f32 = (0..d).map(|k| b[i * d + k] * b[j * d + k]).sum();
            r[i * d + j] = s / d as f32 + if i == j { 0.1 } else { 0.0 };
        }
    }
    r
}

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn dense_from(state: &KalmanState) -> Dense {
    let (n, d_o) = (state.n(), state.d_o());
    let sigma = state.sigma.to_vec().unwrap();
    let mut cov = vec![0.0; n * n];
    (0..n).for_each(|i| cov[i * n + i] = sigma[i] as f64);
    Dense {
        n,
        d_o,
        mu: to64(&state.mu.to_vec().unwrap()),
        cov,
        r: to64(&state.r.to_vec().unwrap()),
    }
}

fn upload(rows: usize, cols: usize, x: &[f32]) -> Matrix {
    Device::Cpu.upload(rows, cols, x).unwrap()
}

fn step(state: &mut KalmanState, p: &Problem, o: &KalmanOptions) -> grng::Result<KalmanInfo> {
    let (n, d_o) = (state.n(), state.d_o());
    Device::Cpu.kalman_step(state, &upload(d_o, n, &p.h), &upload(d_o, 1, &p.v), o)
}

/// Compares the filter with the dense reference. Tolerances from the `f32` arithmetic:
/// `Δμ_i = σ⁻_i h_iᵀ S⁻¹v` is a `d_o`-term `f32` dot with `S⁻¹v` from an `f64` solve of an `S`
/// whose `P` part was formed from `f32` products `√σ⁻ ⊙ h` (relative error ≲ 2u ≈ 1.2e-7,
/// times κ(S) ≲ 50 here), so `|Δμ error| ≤ 1e-4 · σ⁻_i Σ_j |h_ji (S⁻¹v)_j|` plus the rounding of μ
/// itself; `σ_i⁺ = σ⁻_i(1 − σ⁻_i‖z_i‖²)` with `σ⁻_i‖z_i‖² ≤ 1`, so its error is
/// `≤ 1e-4 · σ⁻_i`; `R` is computed in `f64` and rounded: `1e-6` relative.
fn assert_matches(state: &KalmanState, dense: &Dense, prior: &Dense, p: &Problem, what: &str) {
    let (n, d) = (dense.n, dense.d_o);
    let mu = state.mu.to_vec().unwrap();
    let sigma = state.sigma.to_vec().unwrap();
    let r = state.r.to_vec().unwrap();
    // |h_i|ᵀ |S⁻¹v| scale, from the reference's own gain: Δμ_ref = K v.
    let sig_prior = prior.diag();
    for i in 0..n {
        let scale: f64 = (0..d).map(|j| (p.h[j * n + i] as f64).abs()).sum::<f64>()
            * sig_prior[i]
            * dense.r.iter().map(|x| x.abs()).fold(1.0, f64::max);
        let dmu_ref = dense.mu[i] - prior.mu[i];
        let dmu = mu[i] as f64 - prior.mu[i];
        let tol = 1e-4 * (scale + dmu_ref.abs()) + 2e-7 * dense.mu[i].abs();
        assert!(
            (dmu - dmu_ref).abs() <= tol,
            "{what}: Δμ[{i}] {dmu:e} vs {dmu_ref:e} (tol {tol:e})"
        );
        let s_ref = dense.cov[i * n + i];
        assert!(
            (sigma[i] as f64 - s_ref).abs() <= 1e-4 * sig_prior[i],
            "{what}: σ[{i}] {} vs {s_ref:e}",
            sigma[i]
        );
    }
    for (k, (&got, &want)) in r.iter().zip(&dense.r).enumerate() {
        assert!(
            (got as f64 - want).abs() <= 1e-6 * want.abs() + 1e-7,
            "{what}: R[{k}] {got} vs {want}"
        );
    }
}

/// The state's bits (so that a NaN compares equal to itself).
fn snapshot(s: &KalmanState) -> Vec<u32> {
    [&s.mu, &s.sigma, &s.r]
        .iter()
        .flat_map(|m| m.to_vec().unwrap())
        .map(f32::to_bits)
        .collect()
}

proptest! {
    #![proptest_config(common::proptest_config(32))]

    /// One step, ρ = 0 (the plain diagonal EKF) and ρ > 0 in both forms, against the dense
    /// f64 update: the posterior mean, the diagonal of the posterior covariance and R.
    #[test]
    fn one_step_matches_dense_kalman(
        d_o in 1usize..=8,
        n in 1usize..=300,
        rho_on: bool,
        neumann: bool,
        zero_r: bool,
        q_on: bool,
        seed: u64,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mu0 = uniform(&mut rng, n, -1.0, 1.0);
        let mut state = KalmanState::new(&Device::Cpu, &mu0, 0.1, d_o).unwrap();
        // Per-parameter σ in the paper's range.
        state.sigma = upload(n, 1, &uniform(&mut rng, n, 0.04, 0.2));
        // A zero R (the initial state) leaves S = P + (1−β)(vvᵀ + P): nonsingular only when
        // P is, which needs n ≥ d_o columns; use a random SPD R otherwise.
        if !(zero_r && n >= 4 * d_o) {
            state.r = upload(d_o, d_o, &random_spd(&mut rng, d_o));
        }
        let opts = KalmanOptions {
            beta: rng.random_range(0.9..1.0),
            rho: if rho_on { rng.random_range(0.0..0.3) } else { 0.0 },
            process_noise: if q_on { 0.01 } else { 0.0 },
            r_form: if neumann { RForm::Neumann } else { RForm::Exact },
            ..KalmanOptions::default()
        };
        let p = random_problem(&mut rng, d_o, n);
        let prior = dense_from(&state);
        let mut dense = prior.clone();
        dense.step(&to64(&p.h), &to64(&p.v), &opts);
        let info = step(&mut state, &p, &opts).unwrap();
        prop_assert_eq!(info.jitter_escalations, 0);
        let mut prior_q = prior.clone();
        (0..n).for_each(|i| prior_q.cov[i * n + i] += opts.process_noise as f64);
        assert_matches(&state, &dense, &prior_q, &p, "one step");
    }

    /// Several steps against the dense filter restricted to a diagonal covariance after each
    /// step (exactly what the diagonal R-Kalman computes), with fresh H and v every step.
    #[test]
    fn steps_match_diagonal_ekf(d_o in 1usize..=5, n in 1usize..=120, steps in 2usize..=6, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mu0 = uniform(&mut rng, n, -1.0, 1.0);
        let mut state = KalmanState::new(&Device::Cpu, &mu0, 0.1, d_o).unwrap();
        state.r = upload(d_o, d_o, &random_spd(&mut rng, d_o));
        let opts = KalmanOptions { rho: 0.0, beta: 0.97, ..KalmanOptions::default() };
        let mut dense = dense_from(&state);
        for k in 0..steps {
            let p = random_problem(&mut rng, d_o, n);
            let prior = dense.clone();
            dense.step(&to64(&p.h), &to64(&p.v), &opts);
            dense.project_diagonal();
            step(&mut state, &p, &opts).unwrap();
            assert_matches(&state, &dense, &prior, &p, &format!("step {k}"));
            // Re-sync the reference to the filter so errors do not compound across steps.
            dense = dense_from(&state);
        }
    }

    /// With q = 0, no σ_i ever grows and all stay > 0, even when an observation pins a
    /// parameter down completely (huge h_i drives σ_i to the floor).
    #[test]
    fn sigma_never_increases_and_stays_positive(
        d_o in 1usize..=6,
        n in 1usize..=200,
        steps in 1usize..=8,
        rho in 0.0f32..0.5,
        neumann: bool,
        seed: u64,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut state = KalmanState::new(&Device::Cpu, &uniform(&mut rng, n, -1.0, 1.0), 0.2, d_o).unwrap();
        let opts = KalmanOptions {
            rho,
            r_form: if neumann { RForm::Neumann } else { RForm::Exact },
            ..KalmanOptions::default()
        };
        for _ in 0..steps {
            let mut p = random_problem(&mut rng, d_o, n);
            // Up to three distinct columns 1e3 times larger: those parameters are all but
            // determined. (Larger scales, e.g. 1e9, make R's f32 storage round its small
            // eigenvalues to ±1e9·6e-8, and I + ρR can then be indefinite: a typed NotSpd.)
            let mut cols: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                cols.swap(i, rng.random_range(0..=i));
            }
            for &c in cols.iter().take(3) {
                (0..d_o).for_each(|j| p.h[j * n + c] *= 1e3);
            }
            let before = state.sigma.to_vec().unwrap();
            match step(&mut state, &p, &opts) {
                Ok(_) => {}
                // Neumann with ρ‖R‖ near 1 may make S indefinite beyond every jitter: a typed
                // error, state untouched.
                Err(Error::NotSpd { .. }) if neumann => {
                    prop_assert_eq!(state.sigma.to_vec().unwrap(), before);
                    continue;
                }
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            }
            let after = state.sigma.to_vec().unwrap();
            for (a, b) in after.iter().zip(&before) {
                prop_assert!(*a <= *b, "σ grew: {b} -> {a}");
                prop_assert!(*a > 0.0);
            }
        }
    }

    /// Exact and Neumann R̃ agree to O(ρ²): halving ρ quarters their difference.
    ///
    /// Per eigenvalue λ of R, exact − Neumann = ρ²λ³/(1 + ρλ), so the ratio of the gaps at
    /// ρ = 0.08 and 0.04 is 4(1 + 0.04λ)/(1 + 0.08λ) ∈ [3.70, 4] for λ ≤ 2.2, and the O(ρ²λ²)
    /// ≤ 0.031 nonlinearity of S⁻¹ in R̃ (R̃ ≈ λ, so relative ≈ ρ²λ² per power) moves it by
    /// ~10% at most (1500 cases gave 4.08..4.37). The regime keeps
    /// the gaps far above f32 noise: R's spectrum is drawn in [0.5, 2] (the EMA adds at most
    /// 0.03(‖v‖² + ‖P‖) ≤ 0.2), H is scaled by 1/√n so P ≈ 0.03 I does not swamp R̃, and μ₀ = 0
    /// makes μ the update itself, whose rounding is relative to it. The gap is then
    /// ≳ ρ²λ² ≥ 4e-4 of ‖Δμ‖ while the rounding the two forms do not share is a few ulps times
    /// cond(S) ≤ 5, ≈ 1e-6 of ‖Δμ‖: noise moves the ratio < 1%, far inside [3, 5].
    #[test]
    fn exact_and_neumann_agree_to_second_order(d_o in 2usize..=6, n in 16usize..=150, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mu0 = vec![0.0; n];
        let spectrum: Vec<f64> = (0..d_o).map(|_| rng.random_range(0.5..2.0)).collect();
        let r0 = common::with_spectrum(&mut rng, &spectrum);
        let mut p = random_problem(&mut rng, d_o, n);
        let scale = 1.0 / (n as f32).sqrt();
        p.h.iter_mut().for_each(|h| *h *= scale);
        let run = |rho: f32, form: RForm| {
            let mut s = KalmanState::new(&Device::Cpu, &mu0, 0.1, d_o).unwrap();
            s.r = upload(d_o, d_o, &r0);
            let o = KalmanOptions { rho, r_form: form, ..KalmanOptions::default() };
            step(&mut s, &p, &o).unwrap();
            to64(&s.mu.to_vec().unwrap())
        };
        let gap = |rho: f32| {
            let (e, nm) = (run(rho, RForm::Exact), run(rho, RForm::Neumann));
            e.iter().zip(&nm).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt()
        };
        let (g1, g2) = (gap(0.08), gap(0.04));
        let ratio = g1 / g2;
        prop_assert!((3.0..5.0).contains(&ratio), "gap {g1:e} / {g2:e} = {ratio}");
        // And ρ = 0 makes both forms the same computation.
        prop_assert_eq!(run(0.0, RForm::Exact), run(0.0, RForm::Neumann));
    }
}

/// H with exactly one non-zero per column and per row (n ≤ d_o), β = 1 and a diagonal R:
/// then S is diagonal and the dense filter's covariance stays diagonal through every step, so
/// the full (unprojected) textbook filter must be matched.
#[test]
fn decoupled_problem_matches_full_kalman_over_many_steps() {
    let mut rng = common::seeded_rng();
    for case in 0..20 {
        let d_o = rng.random_range(1..=12usize);
        let n = rng.random_range(1..=d_o);
        let mut rows: Vec<usize> = (0..d_o).collect();
        for i in (1..d_o).rev() {
            rows.swap(i, rng.random_range(0..=i));
        }
        let mut state =
            KalmanState::new(&Device::Cpu, &uniform(&mut rng, n, -1.0, 1.0), 0.1, d_o).unwrap();
        let r_diag = uniform(&mut rng, d_o, 0.05, 0.5);
        let mut r0 = vec![0.0f32; d_o * d_o];
        (0..d_o).for_each(|j| r0[j * d_o + j] = r_diag[j]);
        state.r = upload(d_o, d_o, &r0);
        let opts = KalmanOptions {
            beta: 1.0,
            rho: 0.0,
            ..KalmanOptions::default()
        };
        let mut dense = dense_from(&state);
        for k in 0..8 {
            let mut h = vec![0.0f32; d_o * n];
            for (i, &row) in rows.iter().take(n).enumerate() {
                h[row * n + i] =
                    rng.random_range(0.5..2.0) * if rng.random_bool(0.5) { 1.0 } else { -1.0 };
            }
            let p = Problem {
                h,
                v: uniform(&mut rng, d_o, -1.0, 1.0),
            };
            let prior = dense.clone();
            dense.step(&to64(&p.h), &to64(&p.v), &opts);
            for i in 0..n {
                for j in 0..n {
                    if i != j {
                        assert!(
                            dense.cov[i * n + j].abs() < 1e-15,
                            "dense covariance coupled"
                        );
                    }
                }
            }
            step(&mut state, &p, &opts).unwrap();
            assert_matches(&state, &dense, &prior, &p, &format!("case {case} step {k}"));
        }
    }
}

#[test]
fn jitter_escalates_and_is_reported() {
    // β = 1 keeps R = I; Neumann with ρ = 1.05 gives R̃ = −0.05 I and (H = 0) S = −0.05 I:
    // δ starts at jitter = 1e-7 (S's diagonal is not positive) and needs six ×10 escalations
    // to reach 0.1 > 0.05.
    let (n, d_o) = (30, 3);
    let mut state = KalmanState::new(&Device::Cpu, &vec![0.5; n], 0.1, d_o).unwrap();
    let mut eye = vec![0.0f32; d_o * d_o];
    (0..d_o).for_each(|j| eye[j * d_o + j] = 1.0);
    state.r = upload(d_o, d_o, &eye);
    let p = Problem {
        h: vec![0.0; d_o * n],
        v: vec![0.0; d_o],
    };
    let opts = KalmanOptions {
        beta: 1.0,
        rho: 1.05,
        r_form: RForm::Neumann,
        ..KalmanOptions::default()
    };
    let info = step(&mut state, &p, &opts).unwrap();
    assert_eq!(info.jitter_escalations, 6);
    assert!((info.jitter - 0.1).abs() < 1e-6);
    // With one escalation fewer allowed it fails, leaving the state unchanged.
    let before = snapshot(&state);
    let strict = KalmanOptions {
        max_jitter_escalations: 5,
        ..opts
    };
    assert!(matches!(
        step(&mut state, &p, &strict).unwrap_err(),
        Error::NotSpd { .. }
    ));
    assert_eq!(snapshot(&state), before);
}

#[test]
fn bad_inputs_are_typed_errors_and_leave_the_state_unchanged() {
    let mut rng = common::seeded_rng();
    let (n, d_o) = (50, 4);
    let mut state =
        KalmanState::new(&Device::Cpu, &uniform(&mut rng, n, -1.0, 1.0), 0.1, d_o).unwrap();
    let ok = KalmanOptions::default();
    // A successful step first, so the spare buffers are in play.
    let good = random_problem(&mut rng, d_o, n);
    step(&mut state, &good, &ok).unwrap();
    let before = snapshot(&state);
    let dev = Device::Cpu;
    let h = upload(d_o, n, &good.h);
    let v = upload(d_o, 1, &good.v);
    let unchanged = |s: &KalmanState| assert_eq!(snapshot(s), before);

    let shape = |e: Error| matches!(e, Error::Shape { .. });
    assert!(shape(
        dev.kalman_step(
            &mut state,
            &upload(d_o, n - 1, &good.h[..d_o * (n - 1)]),
            &v,
            &ok
        )
        .unwrap_err()
    ));
    unchanged(&state);
    assert!(shape(
        dev.kalman_step(
            &mut state,
            &upload(d_o + 1, n, &vec![0.0; (d_o + 1) * n]),
            &upload(d_o + 1, 1, &[0.0; 5]),
            &ok
        )
        .unwrap_err()
    ));
    unchanged(&state);
    assert!(shape(
        dev.kalman_step(&mut state, &h, &upload(1, d_o, &good.v), &ok)
            .unwrap_err()
    ));
    unchanged(&state);
    assert!(shape(
        dev.kalman_step(&mut state, &upload(0, 0, &[]), &upload(0, 1, &[]), &ok)
            .unwrap_err()
    ));
    unchanged(&state);

    let mut nan_h = good.h.clone();
    nan_h[7] = f32::NAN;
    assert!(matches!(
        dev.kalman_step(&mut state, &upload(d_o, n, &nan_h), &v, &ok)
            .unwrap_err(),
        Error::NonFinite {
            arg: "h",
            index: 7,
            ..
        }
    ));
    unchanged(&state);
    let mut inf_h = good.h.clone();
    inf_h[3 * n + 2] = f32::INFINITY;
    assert!(matches!(
        dev.kalman_step(&mut state, &upload(d_o, n, &inf_h), &v, &ok)
            .unwrap_err(),
        Error::NonFinite { arg: "h", .. }
    ));
    unchanged(&state);
    assert!(matches!(
        dev.kalman_step(
            &mut state,
            &h,
            &upload(d_o, 1, &[0.0, f32::NAN, 0.0, 0.0]),
            &ok
        )
        .unwrap_err(),
        Error::NonFinite {
            arg: "innovation",
            ..
        }
    ));
    unchanged(&state);
    let value = |e: Error| matches!(e, Error::Value { .. });
    for bad in [
        KalmanOptions { beta: 1.5, ..ok },
        KalmanOptions {
            beta: f32::NAN,
            ..ok
        },
        KalmanOptions { rho: -1.0, ..ok },
        KalmanOptions {
            process_noise: -0.1,
            ..ok
        },
        KalmanOptions {
            sigma_floor: 0.0,
            ..ok
        },
        KalmanOptions { jitter: 0.0, ..ok },
        KalmanOptions {
            max_jitter_escalations: 31,
            ..ok
        },
    ] {
        assert!(value(
            dev.kalman_step(&mut state, &h, &v, &bad).unwrap_err()
        ));
        unchanged(&state);
    }

    // Corrupted state: NaN μ, non-positive σ, an R with I + ρR not SPD (exact form).
    let mut s2 = KalmanState::new(&dev, &vec![0.0; n], 0.1, d_o).unwrap();
    s2.mu = upload(n, 1, &[vec![f32::NAN], vec![0.0; n - 1]].concat());
    let snap2 = snapshot(&s2);
    assert!(matches!(
        dev.kalman_step(&mut s2, &h, &v, &ok).unwrap_err(),
        Error::NonFinite { arg: "mu", .. }
    ));
    assert_eq!(snapshot(&s2), snap2);
    let mut s3 = KalmanState::new(&dev, &vec![0.0; n], 0.1, d_o).unwrap();
    s3.sigma = upload(n, 1, &[vec![0.0], vec![0.1; n - 1]].concat());
    let snap3 = snapshot(&s3);
    assert!(value(dev.kalman_step(&mut s3, &h, &v, &ok).unwrap_err()));
    assert_eq!(snapshot(&s3), snap3);
    let mut s4 = KalmanState::new(&dev, &vec![0.0; n], 0.1, d_o).unwrap();
    let mut neg = vec![0.0f32; d_o * d_o];
    (0..d_o).for_each(|j| neg[j * d_o + j] = -10.0);
    s4.r = upload(d_o, d_o, &neg);
    let snap4 = snapshot(&s4);
    let strong = KalmanOptions {
        rho: 1.0,
        beta: 1.0,
        ..ok
    };
    assert!(matches!(
        dev.kalman_step(&mut s4, &h, &v, &strong).unwrap_err(),
        Error::NotSpd { .. }
    ));
    assert_eq!(snapshot(&s4), snap4);
    // A mis-shaped R in the state.
    let mut s5 = KalmanState::new(&dev, &vec![0.0; n], 0.1, d_o).unwrap();
    s5.r = upload(d_o + 1, d_o + 1, &vec![0.0; (d_o + 1) * (d_o + 1)]);
    assert!(shape(dev.kalman_step(&mut s5, &h, &v, &ok).unwrap_err()));

    // The constructor validates too.
    assert!(shape(KalmanState::new(&dev, &[], 0.1, 2).unwrap_err()));
    assert!(shape(KalmanState::new(&dev, &[1.0], 0.1, 0).unwrap_err()));
    assert!(value(KalmanState::new(&dev, &[1.0], 0.0, 2).unwrap_err()));
    assert!(value(
        KalmanState::new(&dev, &[1.0], f32::NAN, 2).unwrap_err()
    ));
    assert!(matches!(
        KalmanState::new(&dev, &[f32::INFINITY], 0.1, 2).unwrap_err(),
        Error::NonFinite { .. }
    ));
}

#[test]
fn constructor_sets_the_documented_initial_state() {
    let s = KalmanState::new(&Device::Cpu, &[1.0, -2.0, 3.0], 0.05, 2).unwrap();
    assert_eq!((s.n(), s.d_o()), (3, 2));
    assert_eq!(s.mu.to_vec().unwrap(), [1.0, -2.0, 3.0]);
    assert_eq!(s.sigma.to_vec().unwrap(), [0.05; 3]);
    assert_eq!(s.r.to_vec().unwrap(), [0.0; 4]);
}
