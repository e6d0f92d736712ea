//! The R-Kalman kernels (`kernels/kalman.cu`: Gram partials + reduction, single-block
//! solve, fused update) on `Device::Emulated` (and CUDA when present) against the CPU step
//! `grng::cpu::kalman::kalman_step`: ragged n (1, 31, 32, 33, 1000, ~20000; on CUDA also up
//! to 2e6), d_o 1..=12 (and the register buckets' edges up to 64, and the wide path's ragged
//! d_o in 65..=256), H in f32 and in bf16, fresh random inputs, NaN-poisoned outputs, the
//! jitter escalation path, every error path, and the state-unchanged discipline of
//! `Device::kalman_step` (scratch reused across steps).
//!
//! Tolerances. Both backends form P = H diag(σ⁻) Hᵀ with f32 products summed in f32 over
//! at most 64 terms (CPU: 8 lanes of a 256-column chunk; GPU: a lane of a chunk) and in f64
//! above, so |P_gpu − P_cpu| ≤ 2·66·2⁻²⁴·G with G = Σ σ⁻|h_j||h_k| (≈ 8e-6·G). The inputs
//! keep S well conditioned (H scaled by 1/√max(n, d_o), R ⪰ 0.05 I, so λ(S) ≥ λ_lo = β·0.05/(1+ρ)
//! and λ_max ≲ 2): κ(S) ≤ 100, so w = S⁻¹v and z = L⁻¹h carry a relative error η ≤ κ·8e-6
//! ≤ 1e-3. Hence |Δμ_i| ≤ η·σ⁻_i‖h_i‖‖v‖/λ_lo and |Δσ_i| ≤ η·σ⁻_i²‖h_i‖²/λ_lo, plus the
//! f32 roundings of the update itself (2⁻²¹ relative); R_out differs by (1−β)ΔP plus one
//! f32 rounding each (2⁻²³|r|).
//!
//! A bf16 H: the case rounds H to bf16 first and the CPU oracle runs on those values in f32,
//! so both sides see the same H exactly (widening bf16 is exact) and the only difference is
//! the f32 accumulation above: the same bounds apply unchanged. At d_o > 88 the Gram lanes
//! sum a whole 64-column chunk (64 terms, still within the 66 above); the wide update sums
//! z_r over ≤ 256 f32 terms (≤ 256·2u ≈ 3e-5 relative), inside η.

use grng::cpu::kalman::{kalman_step as cpu_step, KalmanIo};
use grng::cuda::kalman::{
    kalman_step as gpu_step, KalmanBuffers, KalmanScratch, FAST_D_O, MAX_D_O,
};
use grng::ops::kalman::{KalmanInfo, KalmanOptions, KalmanState, RForm};
use grng::{Device, Error, MatRef, Matrix};
use half::bf16;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use common::devices;
use grng_testkit as common;

/// One step's inputs (host). With `bf16`, `h` holds bf16-representable values and the
/// devices get it as a bf16 matrix.
#[derive(Clone, Debug)]
struct Case {
    bf16: bool,
    d_o: usize,
    n: usize,
    h: Vec<f32>,
    mu: Vec<f32>,
    sigma: Vec<f32>,
    r: Vec<f32>,
    v: Vec<f32>,
}

/// Random well-conditioned inputs: H uniform in ±1/√max(n, d_o), σ in [0.04, 0.2],
/// R = 0.1·AAᵀ/d_o + 0.05 I (symmetric PD), v uniform in ±1/√max(1, d_o/12). The scales keep
/// ‖HHᵀ‖ ≤ 4/3 (Marchenko–Pastur edge (1 + 1)²/3) also for n ≪ d_o, and ‖v‖² ≲ 4 as at
/// d_o ≤ 12, so λ_max(S) ≲ 2, κ(S) ≤ 100 as the header needs, and ρ‖R‖ < 1 (the Neumann
/// form stays PSD) up to d_o = 256.
fn case(d_o: usize, n: usize, seed: u64) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let s = 1.0 / (n.max(d_o) as f32).sqrt();
    let h = (0..d_o * n).map(|_| rng.random_range(-s..s)).collect();
    let mu = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let sigma = (0..n).map(|_| rng.random_range(0.04f32..0.2)).collect();
    let a: Vec<f32> = (0..d_o * d_o)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let mut r = vec![0.0f32; d_o * d_o];
    for i in 0..d_o {
        for j in 0..d_o {
            let dot: f32 = (0..d_o).map(|k| a[i * d_o + k] * a[j * d_o + k]).sum();
            r[i * d_o + j] = 0.1 * dot / d_o as f32 + if i == j { 0.05 } else { 0.0 };
        }
    }
    let sv = 1.0 / (d_o as f32 / 12.0).max(1.0).sqrt();
    let v = (0..d_o).map(|_| rng.random_range(-sv..sv)).collect();
    Case {
        bf16: false,
        d_o,
        n,
        h,
        mu,
        sigma,
        r,
        v,
    }
}

/// The posterior of one backend.
struct Out {
    res: Result<KalmanInfo, Error>,
    mu: Vec<f32>,
    sigma: Vec<f32>,
    r: Vec<f32>,
}

fn run_cpu(c: &Case, o: &KalmanOptions) -> Out {
    let (mut mu, mut sigma, mut r) = (vec![0.0; c.n], vec![0.0; c.n], vec![0.0; c.d_o * c.d_o]);
    let io = KalmanIo {
        mu: &c.mu,
        sigma: &c.sigma,
        r: &c.r,
        mu_out: &mut mu,
        sigma_out: &mut sigma,
        r_out: &mut r,
    };
    let res = cpu_step(io, MatRef::new(&c.h, c.d_o, c.n).unwrap(), &c.v, o);
    Out { res, mu, sigma, r }
}

/// `c` with H rounded to bf16 (read by the devices as bf16).
fn to_bf16(mut c: Case) -> Case {
    c.bf16 = true;
    c.h = c.h.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
    c
}

/// The kernels, every output poisoned with NaN first.
fn run_dev(dev: &Device, c: &Case, o: &KalmanOptions) -> Out {
    let up = |rows: usize, cols: usize, v: &[f32]| dev.upload(rows, cols, v).unwrap();
    let (mu, sigma, r, v) = (
        up(c.n, 1, &c.mu),
        up(c.n, 1, &c.sigma),
        up(c.d_o, c.d_o, &c.r),
        up(c.d_o, 1, &c.v),
    );
    let mut mu_out = up(c.n, 1, &vec![f32::NAN; c.n]);
    let mut sigma_out = up(c.n, 1, &vec![f32::NAN; c.n]);
    let mut r_out = up(c.d_o, c.d_o, &vec![f32::NAN; c.d_o * c.d_o]);
    let mut scratch = KalmanScratch::new(dev, c.d_o, c.n).unwrap();
    let io = KalmanBuffers {
        mu: &mu,
        sigma: &sigma,
        r: &r,
        mu_out: &mut mu_out,
        sigma_out: &mut sigma_out,
        r_out: &mut r_out,
        scratch: &mut scratch,
    };
    let res = if c.bf16 {
        let hb: Vec<bf16> = c.h.iter().map(|&x| bf16::from_f32(x)).collect();
        gpu_step(dev, io, &dev.upload(c.d_o, c.n, &hb).unwrap(), &v, o)
    } else {
        gpu_step(dev, io, &up(c.d_o, c.n, &c.h), &v, o)
    };
    let dl = |m: &Matrix| m.to_vec().unwrap();
    Out {
        res,
        mu: dl(&mu_out),
        sigma: dl(&sigma_out),
        r: dl(&r_out),
    }
}

/// Checks a successful device step against the CPU's within the header's bounds.
fn compare(c: &Case, o: &KalmanOptions, want: &Out, got: &Out) -> Result<(), TestCaseError> {
    let (wi, gi) = (want.res.as_ref().unwrap(), got.res.as_ref().unwrap());
    prop_assert_eq!(wi.jitter_escalations, gi.jitter_escalations);
    prop_assert!(
        (wi.jitter - gi.jitter).abs() <= 1e-4 * wi.jitter,
        "δ {} vs {}",
        gi.jitter,
        wi.jitter
    );
    prop_assert!(
        (wi.nis - gi.nis).abs() <= 1e-3 * wi.nis.abs() + 1e-6,
        "nis {} vs {}",
        gi.nis,
        wi.nis
    );
    let eta = 1e-3f64;
    let lam_lo = o.beta as f64 * 0.05 / (1.0 + o.rho as f64);
    let vn = c.v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let eps = 2f64.powi(-21);
    let mut floored_diff = 0usize;
    for i in 0..c.n {
        let sp = (c.sigma[i] + o.process_noise) as f64;
        let hn2: f64 = (0..c.d_o).map(|j| (c.h[j * c.n + i] as f64).powi(2)).sum();
        let tol_mu = eta * sp * hn2.sqrt() * vn / lam_lo + eps * (want.mu[i].abs() as f64 + 1e-30);
        prop_assert!(
            ((got.mu[i] - want.mu[i]) as f64).abs() <= tol_mu,
            "mu[{}] {} vs {} (tol {})",
            i,
            got.mu[i],
            want.mu[i],
            tol_mu
        );
        let tol_s = eta * sp * sp * hn2 / lam_lo + eps * sp;
        let ds = ((got.sigma[i] - want.sigma[i]) as f64).abs();
        prop_assert!(
            ds <= tol_s,
            "sigma[{}] {} vs {} (tol {})",
            i,
            got.sigma[i],
            want.sigma[i],
            tol_s
        );
        floored_diff += usize::from(
            (got.sigma[i] == o.sigma_floor.min(sp as f32))
                != (want.sigma[i] == o.sigma_floor.min(sp as f32)),
        );
    }
    prop_assert!(gi.sigma_floored.abs_diff(wi.sigma_floored) <= floored_diff);
    let d = c.d_o;
    for j in 0..d {
        for k in 0..d {
            let g: f64 = (0..c.n)
                .map(|i| {
                    (c.sigma[i] + o.process_noise) as f64
                        * (c.h[j * c.n + i] * c.h[k * c.n + i]).abs() as f64
                })
                .sum();
            let w = want.r[j * d + k];
            let tol = (1.0 - o.beta as f64) * 1e-5 * g + 2f64.powi(-23) * w.abs() as f64 + 1e-30;
            prop_assert!(
                ((got.r[j * d + k] - w) as f64).abs() <= tol,
                "r[{}][{}] {} vs {}",
                j,
                k,
                got.r[j * d + k],
                w
            );
            // Exactly symmetric, as on the CPU.
            prop_assert_eq!(got.r[j * d + k].to_bits(), got.r[k * d + j].to_bits());
        }
    }
    Ok(())
}

/// What identifies an error across backends (op names differ; the NotSpd pivot is f64
/// arithmetic on slightly different P, so only its index and sign are compared).
fn key(e: &Error) -> String {
    match e {
        Error::NonFinite { arg, index, .. } => format!("NonFinite({arg}, {index})"),
        Error::Value { arg, value, .. } => format!("Value({arg}, {value})"),
        Error::Shape { arg, .. } => format!("Shape({arg})"),
        Error::NotSpd { index, pivot, .. } => format!("NotSpd({index}, {})", *pivot > 0.0),
        other => format!("{other:?}"),
    }
}

fn n_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(1usize),
        Just(31),
        Just(32),
        Just(33),
        Just(1000),
        2usize..300,
        19_990usize..20_010,
    ]
}

fn opts_strategy() -> impl Strategy<Value = KalmanOptions> {
    (
        prop_oneof![Just(0.97f32), 0.5f32..1.0],
        prop_oneof![Just(0.0f32), Just(1e-4), Just(0.1)],
        prop_oneof![Just(0.0f32), Just(1e-3)],
        any::<bool>(),
    )
        .prop_map(|(beta, rho, q, neumann)| KalmanOptions {
            beta,
            rho,
            process_noise: q,
            r_form: if neumann {
                RForm::Neumann
            } else {
                RForm::Exact
            },
            ..KalmanOptions::default()
        })
}

/// One drawn case (`H` in `bf16` when `half`) on every device against the CPU step.
fn cpu_vs_devices(
    d_o: usize,
    n: usize,
    seed: u64,
    o: &KalmanOptions,
    half: bool,
) -> Result<(), TestCaseError> {
    let c = case(d_o, n, seed);
    let c = if half { to_bf16(c) } else { c };
    let want = run_cpu(&c, o);
    for dev in devices() {
        compare(&c, o, &want, &run_dev(&dev, &c, o))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(48))]

    /// Kernels vs CPU over ragged n and d_o 1..=12, every option combination, H in f32 or
    /// bf16.
    #[test]
    fn step_matches_cpu(n in n_strategy(), d_o in 1usize..=12, seed in any::<u64>(), o in opts_strategy(), half in any::<bool>()) {
        cpu_vs_devices(d_o, n, seed, &o, half)?;
    }

    /// The jitter escalation path: with R = −c·I (β = 1, ρ = 0) and n < d_o, S + δI is
    /// indefinite until δ > c, which takes exactly `need` escalations; with fewer allowed
    /// the step fails with NotSpd at the same index on both backends.
    #[test]
    fn jitter_escalation_matches_cpu(d_o in 3usize..=12, seed in any::<u64>(), allowed in 0usize..5) {
        let n = 1 + (seed as usize % (d_o - 1));
        let mut c = case(d_o, n, seed);
        let pdiag = (0..d_o)
            .map(|j| (0..n).map(|i| c.sigma[i] as f64 * (c.h[j * n + i] as f64).powi(2)).sum::<f64>())
            .sum::<f64>() / d_o as f64;
        // δ₀ = 1e-3·mean diag S ≈ 1e-3·0.97·pdiag; c = 0.03·pdiag needs δ₀·10² (2 escalations).
        let cneg = (0.03 * pdiag) as f32;
        c.r = (0..d_o * d_o).map(|e| if e % (d_o + 1) == 0 { -cneg } else { 0.0 }).collect();
        let o = KalmanOptions { beta: 1.0, rho: 0.0, jitter: 1e-3, max_jitter_escalations: allowed, ..KalmanOptions::default() };
        let want = run_cpu(&c, &o);
        for dev in devices() {
            let got = run_dev(&dev, &c, &o);
            match (&want.res, &got.res) {
                (Ok(w), Ok(g)) => {
                    prop_assert_eq!(w.jitter_escalations, 2);
                    prop_assert_eq!(g.jitter_escalations, 2);
                    prop_assert!((w.jitter - g.jitter).abs() <= 1e-4 * w.jitter);
                    prop_assert_eq!(&got.r, &c.r);  // β = 1 keeps R (exactly representable)
                }
                (Err(w), Err(g)) => {
                    prop_assert!(allowed < 2);
                    prop_assert_eq!(key(w), key(g));
                }
                (w, g) => prop_assert!(false, "cpu {:?} vs device {:?}", w, g),
            }
        }
    }

    /// A NaN/Inf or non-positive σ planted in any input, a huge H (P overflows f64 is out
    /// of reach in f32, so a NaN instead), or I + ρR not SPD: the same error as the CPU.
    #[test]
    fn errors_match_cpu(n in n_strategy(), d_o in 1usize..=6, seed in any::<u64>(), which in 0usize..7, at in any::<usize>(), nan in any::<bool>(), half in any::<bool>()) {
        let mut c = case(d_o, n, seed);
        if half {
            c = to_bf16(c);
        }
        let bad = if nan { f32::NAN } else { f32::INFINITY };
        let mut o = KalmanOptions::default();
        match which {
            0 => c.mu[at % n] = bad,
            1 => c.sigma[at % n] = bad,
            2 => c.r[at % (d_o * d_o)] = bad,
            3 => c.v[at % d_o] = bad,
            4 => c.sigma[at % n] = if nan { 0.0 } else { -0.5 },
            5 => c.h[at % (d_o * n)] = bad,
            _ => {
                // I + ρR with R = −20 I, ρ = 0.1, β = 1: not SPD at index 0.
                c.r = (0..d_o * d_o).map(|e| if e % (d_o + 1) == 0 { -20.0 } else { 0.0 }).collect();
                o = KalmanOptions { beta: 1.0, rho: 0.1, ..o };
            }
        }
        let want = run_cpu(&c, &o);
        let w = want.res.as_ref().expect_err("the CPU rejects the planted value");
        for dev in devices() {
            let got = run_dev(&dev, &c, &o);
            let g = got.res.as_ref().expect_err("the device rejects it too");
            prop_assert_eq!(key(w), key(g));
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(6))]

    /// The wide path (d_o > 64: the solve's workspace in global memory, the update with H
    /// staged in shared memory, several Gram tile groups above 88) vs CPU: ragged d_o up to
    /// MAX_D_O, ragged n (fewer columns than outputs included: a rank-deficient P), H in f32
    /// or bf16, options drawn.
    #[test]
    fn wide_d_o_matches_cpu(d_o in (FAST_D_O + 1)..=MAX_D_O, n in prop_oneof![Just(1usize), 2usize..200, Just(257)], seed in any::<u64>(), o in opts_strategy(), half in any::<bool>()) {
        cpu_vs_devices(d_o, n, seed, &o, half)?;
    }
}

/// The CUDA arm at the GPU's sizes: n ragged in 1e5..=2e6 with d_o = 10 (H in f32 and bf16),
/// the fast path's largest d_o and one drawn up to `MAX_D_O` (n in 5e3..=2e4 above 64),
/// options drawn as in `step_matches_cpu`, outputs NaN-poisoned, `compare`'s bounds
/// (independent of n: sums of at most 64 f32 terms, f64 above).
#[test]
fn cuda_large_steps_match_cpu() {
    let Some(dev) = common::cuda() else {
        return;
    };
    let mut rng = common::seeded_rng();
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::new(common::proptest_config(1));
    let drawn = rng.random_range(1..=MAX_D_O);
    for (d_o, half) in [
        (10, false),
        (10, true),
        (FAST_D_O, rng.random()),
        (drawn, rng.random()),
    ] {
        // compare's R bound costs d_o²·n: fewer columns on the wide path.
        let n = if d_o > FAST_D_O {
            rng.random_range(5_000..=20_000)
        } else {
            rng.random_range(100_000..=2_000_000)
        };
        let c = case(d_o, n, rng.random());
        let c = if half { to_bf16(c) } else { c };
        let o = opts_strategy().new_tree(&mut runner).unwrap().current();
        let want = run_cpu(&c, &o);
        compare(&c, &o, &want, &run_dev(&dev, &c, &o)).unwrap();
    }
}

/// The register buckets' edges (d_o = 8, 9, 16, 17, 32, 33, 64), the wide path's first
/// d_o (65), the Gram pass's tile-group edge (88: 253 tiles in one group; 89: 276 in two) and
/// MAX_D_O against the CPU, H in f32 and bf16.
#[test]
fn bucket_edges_match_cpu() {
    let o = KalmanOptions::default();
    let seed = common::seed();
    let edges = [
        8usize,
        9,
        16,
        17,
        32,
        33,
        FAST_D_O,
        FAST_D_O + 1,
        88,
        89,
        MAX_D_O,
    ];
    for (k, d_o) in edges.into_iter().enumerate() {
        let c = case(d_o, 257, seed.wrapping_add(k as u64));
        for c in [c.clone(), to_bf16(c)] {
            let want = run_cpu(&c, &o);
            for dev in devices() {
                compare(&c, &o, &want, &run_dev(&dev, &c, &o)).unwrap();
            }
        }
    }
}

/// The CPU backend reads a bf16 H exactly as the f32 H of the same values: bit-identical
/// posterior and report through `Device::kalman_step` (widening is exact and the arithmetic
/// after it is the same), over ragged shapes.
#[test]
fn cpu_bf16_h_is_f32_h_of_the_same_values() {
    let mut rng = common::seeded_rng();
    let o = KalmanOptions::default();
    for _ in 0..8 {
        let c = to_bf16(case(
            rng.random_range(1..=40),
            rng.random_range(1..=600),
            rng.random(),
        ));
        let cpu = Device::Cpu;
        let hb: Vec<bf16> = c.h.iter().map(|&x| bf16::from_f32(x)).collect();
        let h32 = cpu.upload(c.d_o, c.n, &c.h).unwrap();
        let h16 = cpu.upload(c.d_o, c.n, &hb).unwrap();
        let v = cpu.upload(c.d_o, 1, &c.v).unwrap();
        let mut a = KalmanState::new(&cpu, &c.mu, 0.1, c.d_o).unwrap();
        let mut b = KalmanState::new(&cpu, &c.mu, 0.1, c.d_o).unwrap();
        for _ in 0..2 {
            let ia = cpu.kalman_step(&mut a, &h32, &v, &o).unwrap();
            let ib = cpu.kalman_step(&mut b, &h16, &v, &o).unwrap();
            assert_eq!(ia, ib);
        }
        for (x, y) in [(&a.mu, &b.mu), (&a.sigma, &b.sigma), (&a.r, &b.r)] {
            let (x, y) = (x.to_vec().unwrap(), y.to_vec().unwrap());
            assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()));
        }
    }
}

/// Through `Device::kalman_step`: a failed step leaves the state bit-for-bit unchanged, a
/// good one commits the posterior; d_o above the limit is a Shape error.
#[test]
fn device_step_commits_only_on_success() {
    let c = case(5, 333, common::seed());
    let o = KalmanOptions::default();
    for dev in devices() {
        let mut st = KalmanState::new(&dev, &c.mu, 0.1, c.d_o).unwrap();
        let r0 = dev.upload(c.d_o, c.d_o, &c.r).unwrap();
        dev.copy(&r0, &mut st.r).unwrap();
        let h = dev.upload(c.d_o, c.n, &c.h).unwrap();
        let mut hbad = c.h.clone();
        hbad[c.n + 3] = f32::NAN;
        let hbad = dev.upload(c.d_o, c.n, &hbad).unwrap();
        let v = dev.upload(c.d_o, 1, &c.v).unwrap();
        let snap = |s: &KalmanState| [&s.mu, &s.sigma, &s.r].map(|m| m.to_vec().unwrap());
        let before = snap(&st);
        let e = dev.kalman_step(&mut st, &hbad, &v, &o).unwrap_err();
        assert_eq!(key(&e), format!("NonFinite(h, {})", c.n + 3));
        assert_eq!(snap(&st), before);
        // Two good steps (the second reuses the spare buffers) match the CPU state.
        let mut cpu = KalmanState::new(&Device::Cpu, &c.mu, 0.1, c.d_o).unwrap();
        cpu.r = Device::Cpu.upload(c.d_o, c.d_o, &c.r).unwrap();
        let hc = Device::Cpu.upload(c.d_o, c.n, &c.h).unwrap();
        let vc = Device::Cpu.upload(c.d_o, 1, &c.v).unwrap();
        for _ in 0..2 {
            dev.kalman_step(&mut st, &h, &v, &o).unwrap();
            Device::Cpu.kalman_step(&mut cpu, &hc, &vc, &o).unwrap();
        }
        for (g, w) in snap(&st).iter().zip(snap(&cpu).iter()) {
            for (a, b) in g.iter().zip(w) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
        assert_ne!(snap(&st), before);
        // d_o above the single-block solve's limit.
        let d_big = MAX_D_O + 1;
        let mut big = KalmanState::new(&dev, &[0.5; 3], 0.1, d_big).unwrap();
        let hb = dev.upload(d_big, 3, &vec![0.1; 3 * d_big]).unwrap();
        let vb = dev.upload(d_big, 1, &vec![0.1; d_big]).unwrap();
        assert!(matches!(
            dev.kalman_step(&mut big, &hb, &vb, &o),
            Err(Error::Shape { .. })
        ));
    }
}
