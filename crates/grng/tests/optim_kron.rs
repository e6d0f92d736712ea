//! RING / RENG / NGD (`grng::optim::kron`) on `Device::Cpu`: preconditioning against a dense
//! `f64` Kronecker solve, the quadratic model, lazy Fisher, the first-order inverse update,
//! the Levenberg–Marquardt rule, fallbacks, state snapshots, bad input, and training an MLP.

use grng_testkit as common;

use grng::hooks::{record_launches, take_launches};
use grng::ops::newton::{InitialGuess, NewtonOptions};
use grng::optim::kron::{
    levenberg_marquardt, InverseMethod, KronConfig, KronCounters, KronFactorState, KronGrad,
    KronOptimizer, KronState, KronVariant,
};
use grng::optim::KronStats;
use grng::{Device, Error, Mat, Matrix, Trans};
use grng_train::data::synthetic_classification;
use grng_train::mlp::{Activation, FisherMode, Loss, Mlp, MlpConfig, Targets};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DEV: Device = Device::Cpu;

fn rand_mat(rng: &mut ChaCha8Rng, r: usize, c: usize) -> Matrix {
    DEV.upload(r, c, &common::vals(rng, r * c)).unwrap()
}

fn host(m: &Matrix) -> Vec<f32> {
    m.to_vec().unwrap()
}

/// Everything in a state as host numbers (matrices by name, then scalars by name), for
/// exact before/after comparisons.
type Snapshot = (Vec<(String, Vec<f32>)>, Vec<(String, u64)>);

fn snapshot(opt: &KronOptimizer) -> Snapshot {
    let st = opt.state().unwrap();
    let ms = st
        .matrices()
        .into_iter()
        .map(|(n, m)| (n, host(m)))
        .collect();
    let ss = st
        .scalars()
        .into_iter()
        .map(|(n, v)| (n, v.to_bits()))
        .collect();
    (ms, ss)
}

// ---------- dense f64 references ----------

/// Largest eigenvalue of a symmetric matrix (f64).
fn max_eig64(a: &[f64], n: usize) -> f64 {
    common::eigs64(a, n)[0]
}

/// Solves `K x = b` (dense, f64) by Gaussian elimination with partial pivoting.
fn solve64(mut k: Vec<f64>, mut b: Vec<f64>) -> Vec<f64> {
    let n = b.len();
    for c in 0..n {
        let p = (c..n)
            .max_by(|&i, &j| k[i * n + c].abs().total_cmp(&k[j * n + c].abs()))
            .unwrap();
        for j in 0..n {
            k.swap(c * n + j, p * n + j);
        }
        b.swap(c, p);
        for r in c + 1..n {
            let f = k[r * n + c] / k[c * n + c];
            for j in c..n {
                k[r * n + j] -= f * k[c * n + j];
            }
            b[r] -= f * b[c];
        }
    }
    for c in (0..n).rev() {
        let s: f64 = (c + 1..n).map(|j| k[c * n + j] * b[j]).sum();
        b[c] = (b[c] - s) / k[c * n + c];
    }
    b
}

/// `P` (`d_out x d_in`, row-major) solving `(Λ̃ ⊗ Γ̃) vec(P) = vec(G)` with column-major
/// `vec`, by forming the Kronecker product densely.
fn kron_solve64(lt: &[f64], gt: &[f64], g: &[f32], d_out: usize, d_in: usize) -> Vec<f64> {
    let n = d_out * d_in;
    // vec index of (r, c) is c * d_out + r; (A ⊗ B)[(c, r), (c', r')] = A[c, c'] B[r, r'].
    let mut k = vec![0.0; n * n];
    for c in 0..d_in {
        for r in 0..d_out {
            for c2 in 0..d_in {
                for r2 in 0..d_out {
                    k[(c * d_out + r) * n + c2 * d_out + r2] =
                        lt[c * d_in + c2] * gt[r * d_out + r2];
                }
            }
        }
    }
    let mut b = vec![0.0; n];
    for r in 0..d_out {
        for c in 0..d_in {
            b[c * d_out + r] = g[r * d_in + c] as f64;
        }
    }
    let x = solve64(k, b);
    let mut p = vec![0.0; n];
    for r in 0..d_out {
        for c in 0..d_in {
            p[r * d_in + c] = x[c * d_out + r];
        }
    }
    p
}

fn add_diag(a: &[f64], n: usize, l: f64) -> Vec<f64> {
    let mut a = a.to_vec();
    (0..n).for_each(|i| a[i * n + i] += l);
    a
}

fn frob(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

// ---------- preconditioning and the quadratic model vs dense f64 ----------

proptest! {
    #![proptest_config(common::proptest_config(48))]

    /// `P = Γ̃⁻¹GΛ̃⁻¹` equals `(Λ̃⊗Γ̃)⁻¹vec(G)` solved densely in f64, the dampings follow the
    /// variant's rule (f64 spectral norms / traces), and the stored predicted change equals
    /// the f64 quadratic model — for `G` given densely, and by its batch factors `m3` rows
    /// few enough that the factored route runs (its model then takes the curvature by the
    /// identity `FX = I − λX` where `factored.rs` allows: the CPU's Cholesky inverses, RING's
    /// and NGD's condition bounds here at most ~1e3, so its error `≲ 2⁻²⁴·κ` of the linear
    /// term stays far inside the tolerance below).
    #[test]
    fn precondition_matches_dense_kronecker_solve(
        seed in any::<u64>(),
        d_out in 1usize..=5,
        d_in in 1usize..=6,
        m in 1usize..=8,
        m2 in 1usize..=8,
        variant in prop_oneof![Just(KronVariant::Ring), Just(KronVariant::Reng), Just(KronVariant::Ngd)],
        log_rho in -3.0f64..-1.0,
        newton in any::<bool>(),
        m3 in prop_oneof![Just(0usize), 1usize..=3],
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let rho = 10f64.powf(log_rho) as f32;
        let mut cfg = common::variant_config(variant);
        cfg.rho = rho;
        cfg.lr = 0.7;
        cfg.power.tol = 1e-7;
        cfg.power.max_iter = 2000;
        cfg.inverse = if newton {
            InverseMethod::Newton(NewtonOptions { tol: 1e-6, ..NewtonOptions::default() })
        } else {
            InverseMethod::Cholesky
        };
        let a = rand_mat(&mut rng, m, d_in);
        let e = rand_mat(&mut rng, m2, d_out);
        // `m3 = 0`: `G` dense; else `G = (1/m3)·EgᵀAg` in f64, rounded once (the reference's G).
        let (ag, eg) = (rand_mat(&mut rng, m3.max(1), d_in), rand_mat(&mut rng, m3.max(1), d_out));
        let g = if m3 == 0 {
            rand_mat(&mut rng, d_out, d_in)
        } else {
            let g64 = common::matmul64(&transpose64(&f64s(&eg), m3, d_out), &f64s(&ag), d_out, m3, d_in);
            let gh: Vec<f32> = g64.iter().map(|v| (v / m3 as f64) as f32).collect();
            DEV.upload(d_out, d_in, &gh).unwrap()
        };
        let grads = if m3 == 0 {
            vec![KronGrad::Dense(&g)]
        } else {
            vec![KronGrad::Factored { e: &eg, a: &ag }]
        };
        let w0 = common::vals(&mut rng, d_out * d_in);
        let mut params = vec![DEV.upload(d_out, d_in, &w0).unwrap()];
        let mut opt = KronOptimizer::new(&DEV, &[(d_out, d_in)], cfg).unwrap();
        let stats = [KronStats { a: &a, e: &e }];
        let info = opt.step_grads(&mut params, &grads, Some(&stats)).unwrap();
        let st = opt.state().unwrap();
        let (sl, sg) = (&st.layers[0].lambda, &st.layers[0].gamma);

        // Dampings against the rule in f64 (unless a Newton fallback changed them).
        let lam = common::gram64(&host(&a), m, d_in);
        let gam = common::gram64(&host(&e), m2, d_out);
        let s = (rho as f64).sqrt();
        let (dl, dg) = match variant {
            KronVariant::Ring => (s * max_eig64(&lam, d_in), s * max_eig64(&gam, d_out)),
            KronVariant::Reng => (s, s),
            KronVariant::Ngd => {
                let tl: f64 = (0..d_in).map(|i| lam[i * d_in + i]).sum::<f64>() / d_in as f64;
                let tg: f64 = (0..d_out).map(|i| gam[i * d_out + i]).sum::<f64>() / d_out as f64;
                let pi = (tl / tg).sqrt();
                (pi * s, s / pi)
            }
        };
        let (dl, dg) = (dl.max(1e-6), dg.max(1e-6));
        // RING's norms come from power iterations that stop once the Rayleigh quotient moves
        // by ≤ `tol` of itself in a step; the quotient's error shrinks by `r² = (λ₂/λ₁)²` a
        // step, so it is then about `tol/(1 − r²)` relative, twice that allowed: a nearly
        // double top eigenvalue (it failed at `r = 0.995`) loosens the check, a clear gap not.
        let power = |f: &[f64], n: usize| match variant {
            KronVariant::Ring => {
                let ev = common::eigs64(f, n);
                let r = if n > 1 && ev[0] > 0.0 { ev[1] / ev[0] } else { 0.0 };
                2.0 * cfg.power.tol as f64 / (1.0 - r * r).max(1e-12)
            }
            _ => 0.0,
        };
        if opt.counters().fallbacks() == 0 {
            // f32 factors (relative rounding ~ m·2⁻²⁴) and the power iterations' stopping error.
            let (tl, tg) = (1e-5 + power(&lam, d_in), 1e-5 + power(&gam, d_out));
            prop_assert!((sl.damping as f64 - dl).abs() <= tl * dl, "{} vs {}", sl.damping, dl);
            prop_assert!((sg.damping as f64 - dg).abs() <= tg * dg, "{} vs {}", sg.damping, dg);
        }

        // P from the returned step: W1 = W0 − ηP.
        let eta = info.lr as f64;
        let w1 = host(&params[0]);
        let lt = add_diag(&lam, d_in, sl.damping as f64);
        let gt = add_diag(&gam, d_out, sg.damping as f64);
        let gh = host(&g);
        let p_ref = kron_solve64(&lt, &gt, &gh, d_out, d_in);
        let p: Vec<f64> = w0.iter().zip(&w1).map(|(a, b)| (*a as f64 - *b as f64) / eta).collect();
        // Error scale: ‖G‖/(λ_min(Λ̃)λ_min(Γ̃)) bounds ‖P‖; perturbations of relative size ε
        // in a damped factor move P by ≤ κ·ε of that scale. ε: f32 factor and GEMM rounding
        // (≲ 16·2⁻²⁴ here) plus, for Newton, the residual tolerance 1e-6; the update W0 − ηP
        // adds rounding of ‖W‖·2⁻²⁴/η.
        let kl = (max_eig64(&lam, d_in) + sl.damping as f64) / sl.damping as f64;
        let kg = (max_eig64(&gam, d_out) + sg.damping as f64) / sg.damping as f64;
        let scale = frob(&gh.iter().map(|&v| v as f64).collect::<Vec<_>>())
            / (sl.damping as f64 * sg.damping as f64);
        let eps = if newton { 4e-6 } else { 1e-6 };
        let w_round = 2.0 * 6e-8 * w1.iter().map(|v| v.abs() as f64).fold(1.0, f64::max) / eta
            * ((d_out * d_in) as f64).sqrt();
        let err = frob(&p.iter().zip(&p_ref).map(|(a, b)| a - b).collect::<Vec<_>>());
        let tol = eps * (kl + kg) * scale + w_round;
        prop_assert!(err <= tol, "err {err:e} > tol {tol:e} (scale {scale:e}, kl {kl}, kg {kg})");

        // The preconditioner alone gives the same P as the step (same state → same ops).
        let mut opt2 = KronOptimizer::new(&DEV, &[(d_out, d_in)], cfg).unwrap();
        let p2 = opt2.precondition_grads(&grads, Some(&stats)).unwrap();
        let p2h = host(&p2[0]);
        for (x, y) in p2h.iter().zip(&p) {
            prop_assert!((*x as f64 - y).abs() <= tol + 1e-6 * x.abs() as f64);
        }

        // Quadratic model: q = −η⟨G,P⟩ + ½η²(⟨P, ΓPΛ⟩ + λ_Λλ_Γ‖P‖²), f64 from the f32 P.
        let pf: Vec<f64> = p2h.iter().map(|&v| v as f64).collect();
        let lin: f64 = pf.iter().zip(&gh).map(|(a, b)| a * *b as f64).sum();
        let mut curv = 0.0;
        for r in 0..d_out {
            for c in 0..d_in {
                let mut v = 0.0;
                for r2 in 0..d_out {
                    for c2 in 0..d_in {
                        v += gam[r * d_out + r2] * pf[r2 * d_in + c2] * lam[c2 * d_in + c];
                    }
                }
                curv += pf[r * d_in + c] * v;
            }
        }
        let sq: f64 = pf.iter().map(|v| v * v).sum();
        let lambda = sl.damping as f64 * sg.damping as f64;
        let q = -eta * lin + 0.5 * eta * eta * (curv + lambda * sq);
        // Each term is a chain of f32 products (≈ 2⁻²⁴ relative per factor, summed in f64)
        // whose error is relative to the same chain on absolute values: |G| (or |Eg|ᵀ|Ag|/m3,
        // the factored route's own products), |P| ≤ |Γ̃⁻¹||G||Λ̃⁻¹|, and |Γ|, |Λ|.
        let gabs: Vec<f64> = if m3 == 0 {
            gh.iter().map(|v| v.abs() as f64).collect()
        } else {
            let (ea, aa) = (abs64(&eg), abs64(&ag));
            common::matmul64(&transpose64(&ea, m3, d_out), &aa, d_out, m3, d_in)
                .iter()
                .map(|v| v / m3 as f64)
                .collect()
        };
        let pabs = common::matmul64(
            &common::matmul64(&abs64(&sg.inverse), &gabs, d_out, d_out, d_in),
            &abs64(&sl.inverse),
            d_out,
            d_in,
            d_in,
        );
        let (gam_a, lam_a): (Vec<f64>, Vec<f64>) =
            (gam.iter().map(|v| v.abs()).collect(), lam.iter().map(|v| v.abs()).collect());
        let qmag = model_on_chains((eta, lambda), &gabs, &pabs, &gam_a, &lam_a, (d_out, d_in));
        prop_assert!((info.predicted_change.unwrap() as f64 - q).abs() <= 1e-5 * qmag + 1e-30,
            "q {} vs {q}", info.predicted_change.unwrap());
        prop_assert!(info.predicted_change.unwrap() < 0.0 || lin == 0.0);
    }
}

// ---------- factored gradients ----------

fn abs64(m: &Matrix) -> Vec<f64> {
    host(m).iter().map(|v| v.abs() as f64).collect()
}

fn transpose64(x: &[f64], r: usize, c: usize) -> Vec<f64> {
    (0..c * r).map(|k| x[(k % r) * c + k / r]).collect()
}

fn dot64(x: &[f64], y: &[f64]) -> f64 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
}

/// `G = (1/m) EᵀA` of `e` (`m x d_out`) and `a` (`m x d_in`) in f64, and rounded once onto
/// `dev`: the dense route's input for the factored gradient `(e, a)`.
fn batch_grad(dev: &Device, e: &Matrix, a: &Matrix) -> (Matrix, Vec<f64>) {
    let (m, d_out, d_in) = (e.rows(), e.cols(), a.cols());
    let g64: Vec<f64> =
        common::matmul64(&transpose64(&f64s(e), m, d_out), &f64s(a), d_out, m, d_in)
            .iter()
            .map(|v| v / m as f64)
            .collect();
    let gh: Vec<f32> = g64.iter().map(|&v| v as f32).collect();
    (dev.upload(d_out, d_in, &gh).unwrap(), g64)
}

/// The quadratic model `η⟨G, P⟩ + ½η²(⟨P, ΓPΛ⟩ + λ‖P‖²)` on absolute values (`gabs`, `pabs`
/// `d_out x d_in`, `gam` and `lam` the factors' absolute values), `(η, λ)` given: the scale
/// against which the model's f32 rounding is bounded.
fn model_on_chains(
    (eta, lambda): (f64, f64),
    gabs: &[f64],
    pabs: &[f64],
    gam: &[f64],
    lam: &[f64],
    (d_out, d_in): (usize, usize),
) -> f64 {
    let gpl = common::matmul64(
        &common::matmul64(gam, pabs, d_out, d_out, d_in),
        lam,
        d_out,
        d_in,
        d_in,
    );
    eta * dot64(pabs, gabs) + 0.5 * eta * eta * (dot64(pabs, &gpl) + lambda * dot64(pabs, pabs))
}

/// The factored route's absolute chains for the batch factors `e` (`m x d_out`), `a`
/// (`m x d_in`) and the inverses' absolute values (or bounds) `xg`, `xl`: `(|X_Γ||E|ᵀ|A||X_Λ|/m,
/// |E|ᵀ|A|/m)`, both `d_out x d_in`.
fn factored_chains(xg: &[f64], xl: &[f64], e: &Matrix, a: &Matrix) -> (Vec<f64>, Vec<f64>) {
    let (m, d_out, d_in) = (e.rows(), e.cols(), a.cols());
    let ea = transpose64(&abs64(e), m, d_out);
    let aa = abs64(a);
    let u = common::matmul64(xg, &ea, d_out, d_out, m);
    let w = common::matmul64(&aa, xl, m, d_in, d_in);
    let per_m = |x: Vec<f64>| x.iter().map(|v| v / m as f64).collect::<Vec<_>>();
    (
        per_m(common::matmul64(&u, &w, d_out, m, d_in)),
        per_m(common::matmul64(&ea, &aa, d_out, m, d_in)),
    )
}

/// The two routes' `−ηP` (or `P`, `eta = 1`) entry by entry within `eta·unit` of `chain`, and
/// their predicted changes within `2·unit` of the model on chains (`λ` of its `‖P‖²` term,
/// `gabs`, `chain`, the factors' absolute values `fg`, `fl`).
#[allow(clippy::too_many_arguments)]
fn routes_agree(
    what: &str,
    (pf, pd): (&[f32], &[f32]),
    (qf, qd): (Option<f32>, Option<f32>),
    (eta, lambda, unit): (f64, f64, f64),
    (gabs, chain): (&[f64], &[f64]),
    (fg, fl): (&[f64], &[f64]),
    (d_out, d_in): (usize, usize),
) -> Result<(), TestCaseError> {
    for (idx, ((x, y), c)) in pf.iter().zip(pd).zip(chain).enumerate() {
        let tol = eta * unit * c + f32::MIN_POSITIVE as f64;
        prop_assert!(
            (*x as f64 - *y as f64).abs() <= tol,
            "{what} [{idx}]: factored {x} vs dense {y}, tol {tol:e}"
        );
    }
    if let (Some(a), Some(b)) = (qf, qd) {
        // |lin| ≤ ⟨|G|, |P|⟩ chains; |curv| ≤ ⟨|P|, |Γ||P||Λ|⟩; ‖P‖² ≤ ‖chain‖².
        let qmag = model_on_chains((eta, lambda), gabs, chain, fg, fl, (d_out, d_in));
        let (a, b) = (a as f64, b as f64);
        prop_assert!(
            (a - b).abs() <= 2.0 * unit * qmag + 1e-30,
            "{what} q: factored {a} vs dense {b}, magnitude {qmag:e}"
        );
    }
    Ok(())
}

/// `KronGrad::Factored { e, a }` (`G = (1/m) EᵀA`) gives the `P` and the predicted change of
/// the dense route on `G`, on optimizers in the same state, on `dev`. Sizes span both routes
/// (the optimizer takes the factored one only where it is cheaper: small `m`, wide layers).
/// Bounds: each route is a chain of f32 products whose inner dimensions sum to
/// `k = m + d_out + d_in` (plus the `m x m` products of the model terms), each within
/// `(k + 8)·2⁻²⁴` of the exact value relative to the same chain on absolute values (the
/// `+ 8` covers the kernel devices' split3 tensor-core preconditioning) — for `P`:
/// `|Γ̃⁻¹||E|ᵀ|A||Λ̃⁻¹|/m`; for the terms: the same inner products of those absolute chains.
/// Two routes, a factor 2 margin: `4(k + 8)·2⁻²⁴` times the absolute chain.
#[allow(clippy::too_many_arguments)]
fn factored_matches_dense_on(
    dev: &Device,
    seed: u64,
    d_out: usize,
    d_in: usize,
    m: usize,
    m2: usize,
    variant: KronVariant,
) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut cfg = common::variant_config(variant);
    cfg.inverse = InverseMethod::Cholesky;
    cfg.lr = 0.7;
    // One lazy step after the refresh, at a damping moved by the model (below).
    (cfg.skip, cfg.phi) = (2, 0.8);
    let up = |rng: &mut ChaCha8Rng, r: usize, c: usize| {
        dev.upload(r, c, &common::vals(rng, r * c)).unwrap()
    };
    let (sa, se) = (up(&mut rng, m2, d_in), up(&mut rng, m2, d_out));
    let stats = [KronStats { a: &sa, e: &se }];
    let (a, e) = (up(&mut rng, m, d_in), up(&mut rng, m, d_out));
    let (g, _) = batch_grad(dev, &e, &a);
    let factored = [KronGrad::Factored { e: &e, a: &a }];
    let shapes = [(d_out, d_in)];

    let mut opt_f = KronOptimizer::new(dev, &shapes, cfg).unwrap();
    let mut opt_d = KronOptimizer::new(dev, &shapes, cfg).unwrap();
    // On the kernel devices every product of the step runs the split3 tensor-core GEMM
    // (`product_valid_inputs`, the preconditioning; its sm_90a variant on a compute capability
    // 9.0 GPU), never the SIMT one. Only this test of the
    // file launches kernels, so the process-wide record holds its own launches.
    record_launches(true);
    let pf = host(&opt_f.precondition_grads(&factored, Some(&stats)).unwrap()[0]);
    let launched = take_launches();
    record_launches(false);
    let gemms: Vec<_> = launched.iter().filter(|n| common::is_product(n)).collect();
    prop_assert!(
        gemms
            .iter()
            .all(|n| matches!(**n, "gemm3_tc" | "gemm3_wg_tc"))
            && (matches!(dev, Device::Cpu) || !gemms.is_empty()),
        "{dev:?}: {launched:?}"
    );
    let pd = host(&opt_d.precondition(&[&g], Some(&stats)).unwrap()[0]);

    // The absolute chains, from the state's inverses and factors.
    let st = opt_f.state().unwrap();
    let l = &st.layers[0];
    let (fg, fl) = (abs64(&l.gamma.factor), abs64(&l.lambda.factor));
    let (chain, gabs) =
        factored_chains(&abs64(&l.gamma.inverse), &abs64(&l.lambda.inverse), &e, &a);
    let k = (m + d_out + d_in + 8) as f64;
    let unit = 4.0 * k * f32::EPSILON as f64 / 2.0;
    let (sh, fac) = ((d_out, d_in), (&fg[..], &fl[..]));
    let chains = (&gabs[..], &chain[..]);
    routes_agree(
        &format!("{dev:?} P"),
        (&pf, &pd),
        (None, None),
        (1.0, 0.0, unit),
        chains,
        fac,
        sh,
    )?;

    // The predicted change of a step from the same state on each route.
    let w0 = common::vals(&mut rng, d_out * d_in);
    let mut wf = vec![dev.upload(d_out, d_in, &w0).unwrap()];
    let mut wd = vec![dev.upload(d_out, d_in, &w0).unwrap()];
    let mut opt_f = KronOptimizer::new(dev, &shapes, cfg).unwrap();
    let mut opt_d = KronOptimizer::new(dev, &shapes, cfg).unwrap();
    let qf = opt_f.step_grads(&mut wf, &factored, Some(&stats)).unwrap();
    let qd = opt_d.step(&mut wd, &[&g], Some(&stats)).unwrap();
    prop_assert_eq!(qf.lr, qd.lr);
    let lambda = l.lambda.damping as f64 * l.gamma.damping as f64;
    routes_agree(
        &format!("{dev:?} step"),
        (&[], &[]),
        (qf.predicted_change, qd.predicted_change),
        (qf.lr as f64, lambda, unit),
        chains,
        fac,
        sh,
    )?;
    // The same step handed the factors' Gram matrices (`KronGrad::FactoredWithGrams`): only
    // the CPU's rows' route reads them, for factors wider than 64 (`tests/cpu_woodbury.rs`),
    // so at these widths they change nothing: the same weights and predicted change, bit for
    // bit, on every device.
    let gram = |x: &Matrix| {
        let mut c = dev.zeros(m, m).unwrap();
        dev.gemm(Trans::No, Trans::Yes, 1.0 / m as f32, x, x, 0.0, &mut c)
            .unwrap();
        c
    };
    let (ee, aa) = (gram(&e), gram(&a));
    let with_grams = [KronGrad::FactoredWithGrams {
        e: &e,
        a: &a,
        ee: &ee,
        aa: &aa,
    }];
    let mut wg = vec![dev.upload(d_out, d_in, &w0).unwrap()];
    let mut opt_g = KronOptimizer::new(dev, &shapes, cfg).unwrap();
    let qg = opt_g
        .step_grads(&mut wg, &with_grams, Some(&stats))
        .unwrap();
    prop_assert_eq!(host(&wg[0]), host(&wf[0]));
    prop_assert_eq!(
        qg.predicted_change.map(f32::to_bits),
        qf.predicted_change.map(f32::to_bits)
    );

    // A lazy step at a moved damping (a good model lowers ρ by φ = 0.8 on both): the dense
    // route applies the first-order inverses `X₀ − d·X₀²` as formed (with `S₀`), the factored
    // one, where it runs with the model on the CPU, by products with `X₀`
    // (`Retarget::ByProducts`, `lazy_factored_step_applies_the_first_order_inverse_by_products`).
    // Same bounds on the chains of `A = |X₀| + |d|·|X₀|²` per factor, whose products add
    // `d_out + d_in` to the inner dimensions (`S₀`, or `X₀U₀` and `W₀X₀`).
    for opt in [&mut opt_f, &mut opt_d] {
        opt.observe_loss(1.0, 1.0 + qf.predicted_change.unwrap())
            .unwrap();
    }
    let (a2, e2) = (up(&mut rng, m, d_in), up(&mut rng, m, d_out));
    let (g2, _) = batch_grad(dev, &e2, &a2);
    let mut wf = vec![dev.zeros(d_out, d_in).unwrap()];
    let mut wd = vec![dev.zeros(d_out, d_in).unwrap()];
    let factored = [KronGrad::Factored { e: &e2, a: &a2 }];
    let lf = opt_f.step_grads(&mut wf, &factored, None).unwrap();
    let ld = opt_d.step(&mut wd, &[&g2], None).unwrap();
    prop_assert!(!lf.refreshed && (lf.rho, lf.lr) == (ld.rho, ld.lr));
    prop_assert_eq!((lf.first_order_updates, ld.first_order_updates), (2, 2));
    let st = opt_f.state().unwrap();
    let l = &st.layers[0];
    // RING's and NGD's dampings scale by √(ρ/ρ₀) = √0.8 (or stay at the floor): `λ₀·√0.8`
    // bounds the drift `|d|`, and `λ₀` the damping of the `‖P‖²` term, from above.
    let bound = |s: &KronFactorState| common::first_order_scale64(s, s.damping * 0.8f32.sqrt());
    let (chain, gabs) = factored_chains(&bound(&l.gamma), &bound(&l.lambda), &e2, &a2);
    let unit = 4.0 * (k + (d_out + d_in) as f64) * f32::EPSILON as f64 / 2.0;
    let lambda = l.lambda.damping as f64 * l.gamma.damping as f64;
    routes_agree(
        &format!("{dev:?} lazy −ηP"),
        (&host(&wf[0]), &host(&wd[0])),
        (lf.predicted_change, ld.predicted_change),
        (lf.lr as f64, lambda, unit),
        (&gabs, &chain),
        fac,
        sh,
    )
}

proptest! {
    #![proptest_config(common::proptest_config(64))]

    /// [`factored_matches_dense_on`] on every device (the CPU, the emulated kernels, CUDA
    /// when present): the factored products run the device's GEMM, the dense route its
    /// preconditioning.
    #[test]
    fn factored_gradient_matches_dense(
        seed in any::<u64>(),
        d_out in 1usize..=40,
        d_in in 1usize..=40,
        m in 1usize..=24,
        m2 in 1usize..=24,
        variant in prop_oneof![Just(KronVariant::Ring), Just(KronVariant::Ngd)],
    ) {
        for dev in std::iter::once(Device::Cpu).chain(common::devices()) {
            factored_matches_dense_on(&dev, seed, d_out, d_in, m, m2, variant)?;
        }
    }
}

/// A factored gradient with NaN in `e`, with `e` and `a` of different row counts, or with
/// Gram matrices of the wrong shape or not finite, is a typed error naming it, and the
/// optimizer is unchanged.
#[test]
fn bad_factored_gradient_is_rejected_and_changes_nothing() {
    let mut rng = common::seeded_rng();
    let (d_out, d_in, m) = (7, 9, 5);
    let (sa, se) = (rand_mat(&mut rng, m, d_in), rand_mat(&mut rng, m, d_out));
    let stats = [KronStats { a: &sa, e: &se }];
    let mut opt = KronOptimizer::new(&DEV, &[(d_out, d_in)], KronConfig::ring()).unwrap();
    let mut w = vec![rand_mat(&mut rng, d_out, d_in)];
    let (a, e) = (rand_mat(&mut rng, m, d_in), rand_mat(&mut rng, m, d_out));
    opt.step_grads(&mut w, &[KronGrad::Factored { e: &e, a: &a }], Some(&stats))
        .unwrap();
    let before = (snapshot(&opt), host(&w[0]));
    let nan = with_value(&e, 3, f32::NAN);
    let err = opt
        .step_grads(
            &mut w,
            &[KronGrad::Factored { e: &nan, a: &a }],
            Some(&stats),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::NonFinite {
                arg: "grads.e",
                index: 3,
                ..
            }
        ),
        "{err:?}"
    );
    let short = rand_mat(&mut rng, m - 1, d_in);
    let err = opt
        .step_grads(
            &mut w,
            &[KronGrad::Factored { e: &e, a: &short }],
            Some(&stats),
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::Shape { arg: "grads.a", .. }),
        "{err:?}"
    );
    // The Gram matrices of `KronGrad::FactoredWithGrams`: `m x m` and finite.
    let (ee, aa) = (rand_mat(&mut rng, m, m), rand_mat(&mut rng, m, m));
    let wide = rand_mat(&mut rng, m, m + 1);
    let nan_aa = with_value(&aa, 4, f32::NAN);
    for (ee, aa, arg) in [
        (&wide, &aa, "grads.ee"),
        (&ee, &wide, "grads.aa"),
        (&ee, &nan_aa, "grads.aa"),
    ] {
        let g = [KronGrad::FactoredWithGrams {
            e: &e,
            a: &a,
            ee,
            aa,
        }];
        let err = opt.step_grads(&mut w, &g, Some(&stats)).unwrap_err();
        let named = match err {
            Error::Shape { arg, .. } => arg,
            Error::NonFinite { arg, index: 4, .. } => arg,
            _ => "",
        };
        assert_eq!(named, arg, "{err:?}");
    }
    assert_eq!((snapshot(&opt), host(&w[0])), before);
}

/// `1e20·(1 + |x|)` entry by entry: finite batch factors whose step overflows.
fn huge(x: &Matrix) -> Matrix {
    let v: Vec<f32> = host(x).iter().map(|&t| 1e20 * (1.0 + t.abs())).collect();
    DEV.upload(x.rows(), x.cols(), &v).unwrap()
}

/// A factored step whose `P` overflows although every input is finite (`E` and `A` of size
/// 1e20: `P = Γ̃⁻¹EᵀAΛ̃⁻¹/m` ~ 1e40) is a typed `NonFinite` error and changes nothing — on the
/// CPU's rows' route, where the update (`Device::axpy_over`) is what checks `P`, and on the
/// dense-inverse route (a layer too small for the rows), at RING's `ε = 0` with the factors
/// left to their rows.
#[test]
fn overflowing_factored_step_is_rejected_and_changes_nothing() {
    let mut rng = common::seeded_rng();
    for (shape, m_s) in [((72usize, 100usize), 24usize), ((7, 9), 5)] {
        let (d_out, d_in) = shape;
        let cfg = KronConfig {
            ema: 0.0,
            skip: 4,
            inverse: InverseMethod::Cholesky,
            // No model on the second step: the update alone meets the overflow.
            damping_interval: 5,
            ..KronConfig::ring()
        };
        let mut opt = KronOptimizer::new(&DEV, &[shape], cfg).unwrap();
        let (sa, se) = (
            rand_mat(&mut rng, m_s, d_in),
            rand_mat(&mut rng, m_s, d_out),
        );
        let stats = [KronStats { a: &sa, e: &se }];
        let mut w = vec![rand_mat(&mut rng, d_out, d_in)];
        let m = 16;
        let (a, e) = (rand_mat(&mut rng, m, d_in), rand_mat(&mut rng, m, d_out));
        opt.step_grads(&mut w, &[KronGrad::Factored { e: &e, a: &a }], Some(&stats))
            .unwrap();
        let before = (snapshot(&opt), host(&w[0]));
        let (ah, eh) = (huge(&a), huge(&e));
        // A lazy step: no statistics.
        let err = opt
            .step_grads(&mut w, &[KronGrad::Factored { e: &eh, a: &ah }], None)
            .unwrap_err();
        assert!(matches!(err, Error::NonFinite { .. }), "{shape:?}: {err:?}");
        assert!(
            !opt.adapts_damping(),
            "{shape:?}: the failed step formed no model"
        );
        assert!(
            (snapshot(&opt), host(&w[0])) == before,
            "{shape:?}: the failed step changed the optimizer or the weights"
        );
        assert_eq!(
            opt.counters().low_rank_inversions > 0,
            d_in > 64,
            "{shape:?}"
        );
    }
}

/// On a pool worker the CPU step runs its layers, and the two factors of a layer, as parallel
/// tasks (`optim/kron/tasks.rs`); called from a plain thread it runs them one after another.
/// Both must give the same bits (weights, state, counters, predicted changes) over refreshes
/// and lazy steps with and without the model, on the rows' route (`72 x 100` at `m = 24`) and
/// the dense one, and the same error when several tasks fail: the first in layer order, the
/// `Γ` side before the `Λ` side.
#[test]
fn steps_on_a_pool_worker_match_the_calling_thread() {
    let mut rng = common::seeded_rng();
    let shapes = [(72usize, 100usize), (7, 9), (5, 72)];
    let (m_s, m, steps) = (24, 16, 7);
    let cfg = KronConfig {
        ema: 0.0,
        skip: 3,
        inverse: InverseMethod::Cholesky,
        damping_interval: 2,
        ..KronConfig::ring()
    };
    // Per layer a `rows x d_in` (`inputs`) or `rows x d_out` matrix.
    let mats = |rng: &mut ChaCha8Rng, rows: usize, inputs: bool| {
        shapes
            .iter()
            .map(|&(o, i)| rand_mat(rng, rows, if inputs { i } else { o }))
            .collect::<Vec<_>>()
    };
    let (d_in, d_out) = (true, false);
    // Statistics rows `≥ 0`, so that the failing step below overflows where it is meant to.
    let abs = |x: &Matrix| {
        let v: Vec<f32> = host(x).iter().map(|t| t.abs()).collect();
        DEV.upload(x.rows(), x.cols(), &v).unwrap()
    };
    let batches: Vec<[Vec<Matrix>; 4]> = (0..steps)
        .map(|_| {
            [
                mats(&mut rng, m, d_in),
                mats(&mut rng, m, d_out),
                mats(&mut rng, m_s, d_in).iter().map(abs).collect(),
                mats(&mut rng, m_s, d_out).iter().map(abs).collect(),
            ]
        })
        .collect();
    let w0: Vec<Matrix> = shapes
        .iter()
        .map(|&(o, i)| rand_mat(&mut rng, o, i))
        .collect();
    // Steps 0..steps, then one whose products overflow inside the tasks, in layers 0 and 2
    // on both sides (the rows are `≥ 0`, the huge values `1e38`): `R_Γ·Eᵀ` from its first
    // element on (every row of `E` huge; layer 0's `Γ` is on the rows' route), `R_Λ·Aᵀ` only
    // in its last column (the last row of `A`), so the two sides' errors differ.
    let copy = |x: &Matrix| DEV.upload(x.rows(), x.cols(), &host(x)).unwrap();
    let huge_from = |x: &Matrix, row: usize| {
        let mut v = host(x);
        v[row * x.cols()..].iter_mut().for_each(|t| *t = 1e38);
        DEV.upload(x.rows(), x.cols(), &v).unwrap()
    };
    let bad: Vec<(Matrix, Matrix)> = batches[0][0]
        .iter()
        .zip(&batches[0][1])
        .enumerate()
        .map(|(l, (a, e))| match l {
            1 => (copy(a), copy(e)),
            _ => (huge_from(a, m - 1), huge_from(e, 0)),
        })
        .collect();
    type Trace = (
        Vec<(Vec<Vec<f32>>, Option<u32>)>,
        Snapshot,
        KronCounters,
        String,
    );
    let run = || -> Trace {
        let mut opt = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
        let mut w: Vec<Matrix> = w0.iter().map(copy).collect();
        let mut trace = vec![];
        for [a, e, sa, se] in &batches {
            let grads: Vec<KronGrad<'_>> = a
                .iter()
                .zip(e)
                .map(|(a, e)| KronGrad::Factored { e, a })
                .collect();
            let st: Vec<KronStats<'_>> =
                sa.iter().zip(se).map(|(a, e)| KronStats { a, e }).collect();
            let stats = opt.needs_stats().then_some(&st[..]);
            let info = opt.step_grads(&mut w, &grads, stats).unwrap();
            let q = info.predicted_change;
            if let Some(q) = q {
                opt.observe_loss(1.0, 1.0 + 0.5 * q).unwrap();
            }
            trace.push((w.iter().map(host).collect(), q.map(f32::to_bits)));
        }
        let grads: Vec<KronGrad<'_>> = bad
            .iter()
            .map(|(a, e)| KronGrad::Factored { e, a })
            .collect();
        let err = opt.step_grads(&mut w, &grads, None).unwrap_err();
        (trace, snapshot(&opt), *opt.counters(), format!("{err:?}"))
    };
    let here = run();
    assert_eq!(
        rayon::current_thread_index(),
        None,
        "the test thread is no pool worker"
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let on_worker = pool.install(run);
    assert!(here.0 == on_worker.0, "weights or predicted changes differ");
    assert!(here.1 == on_worker.1, "states differ");
    assert_eq!(here.2, on_worker.2);
    assert!(here.2.low_rank_inversions > 0, "the rows' route was taken");
    assert_eq!(here.3, on_worker.3, "a different error");
    // Layer 0's `Γ` side: its first element.
    assert!(
        here.3.contains("NonFinite") && here.3.contains("index: 0,"),
        "{}",
        here.3
    );
}

/// The weights a step replaces are the buffers the next step writes `P` (and `W − ηP`) over:
/// the same bits as fresh matrices. Each step is taken twice from one state, by the optimizer
/// that holds the last step's weights and by a fresh one restored from its state (which holds
/// none); weights and states must agree bit for bit, on refresh and lazy steps alike.
#[test]
fn steps_over_recycled_buffers_match_fresh_ones() {
    let mut rng = common::seeded_rng();
    // Few samples on wide layers: the factored route, which writes `P` over the buffer.
    let shapes = [(40usize, 50usize), (30, 40)];
    let m = 6;
    let cfg = KronConfig {
        ema: 0.5,
        skip: 3,
        ..KronConfig::ring()
    };
    let mut opt = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
    let mut w: Vec<Matrix> = shapes
        .iter()
        .map(|&(o, i)| rand_mat(&mut rng, o, i))
        .collect();
    for k in 0..7 {
        let (es, as_): (Vec<Matrix>, Vec<Matrix>) = shapes
            .iter()
            .map(|&(o, i)| (rand_mat(&mut rng, m, o), rand_mat(&mut rng, m, i)))
            .unzip();
        let grads: Vec<KronGrad<'_>> = es
            .iter()
            .zip(&as_)
            .map(|(e, a)| KronGrad::Factored { e, a })
            .collect();
        let stats: Vec<KronStats<'_>> = es
            .iter()
            .zip(&as_)
            .map(|(e, a)| KronStats { a, e })
            .collect();
        let stats = opt.needs_stats().then_some(&stats[..]);
        let mut fresh = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
        fresh.restore(opt.state().unwrap()).unwrap();
        let mut w_fresh: Vec<Matrix> = w
            .iter()
            .map(|x| DEV.upload(x.rows(), x.cols(), &host(x)).unwrap())
            .collect();
        let info = opt.step_grads(&mut w, &grads, stats).unwrap();
        let info_fresh = fresh.step_grads(&mut w_fresh, &grads, stats).unwrap();
        assert_eq!(info, info_fresh, "step {k}");
        for (a, b) in w.iter().zip(&w_fresh) {
            assert!(host(a) == host(b), "step {k}: the weights differ");
        }
        assert!(
            snapshot(&opt) == snapshot(&fresh),
            "step {k}: the states differ"
        );
        if info.predicted_change.is_some() {
            opt.observe_loss(1.0, 0.5).unwrap();
        }
    }
}

// ---------- lazy Fisher ----------

/// A 2-layer problem: per step a fresh gradient and fresh statistics.
struct Problem {
    shapes: Vec<(usize, usize)>,
    grads: Vec<Vec<Matrix>>,
    a: Vec<Vec<Matrix>>,
    e: Vec<Vec<Matrix>>,
}

fn problem(seed: u64, steps: usize) -> Problem {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let shapes = vec![(5, 7), (3, 6)];
    let mut p = Problem {
        shapes: shapes.clone(),
        grads: vec![],
        a: vec![],
        e: vec![],
    };
    for _ in 0..steps {
        p.grads.push(
            shapes
                .iter()
                .map(|&(o, i)| rand_mat(&mut rng, o, i))
                .collect(),
        );
        p.a.push(
            shapes
                .iter()
                .map(|&(_, i)| rand_mat(&mut rng, 9, i))
                .collect(),
        );
        p.e.push(
            shapes
                .iter()
                .map(|&(o, _)| rand_mat(&mut rng, 9, o))
                .collect(),
        );
    }
    p
}

fn stats_of<'a>(p: &'a Problem, k: usize) -> Vec<KronStats<'a>> {
    p.a[k]
        .iter()
        .zip(&p.e[k])
        .map(|(a, e)| KronStats { a, e })
        .collect()
}

/// Runs `steps` steps, feeding a loss pair that alternates good and bad model agreement so
/// that ρ moves every step; returns the parameters after each step.
fn run(p: &Problem, cfg: KronConfig, fresh_each_step: bool) -> Vec<Vec<Vec<f32>>> {
    let mut params: Vec<Matrix> = p
        .shapes
        .iter()
        .map(|&(o, i)| DEV.zeros(o, i).unwrap())
        .collect();
    let mut opt = KronOptimizer::new(&DEV, &p.shapes, cfg).unwrap();
    let mut out = vec![];
    for k in 0..p.grads.len() {
        if fresh_each_step {
            // The non-lazy reference: nothing is carried over but ρ.
            let c = KronConfig {
                rho: opt.rho(),
                ..cfg
            };
            let pending = opt.state().unwrap().predicted;
            opt = KronOptimizer::new(&DEV, &p.shapes, c).unwrap();
            assert!(pending.is_none());
        }
        let grads: Vec<&Matrix> = p.grads[k].iter().collect();
        let st = stats_of(p, k);
        let stats = opt.needs_stats().then_some(&st[..]);
        let info = opt.step(&mut params, &grads, stats).unwrap();
        let q = info.predicted_change.unwrap();
        let r = if k % 3 == 2 { 0.0 } else { 1.0 };
        opt.observe_loss(1.0, 1.0 + r * q).unwrap();
        out.push(params.iter().map(host).collect());
    }
    out
}

/// With S = 1 every step refreshes, so the lazy optimizer performs exactly the operations
/// of a non-lazy one built afresh each step with the current ρ: bitwise equal with Cholesky
/// (no state enters the inversion) for RENG and NGD, and for RING to its power iteration's
/// tolerance (which warm-starts from the previous refresh's iterate); equal to the Newton
/// tolerance when Newton warm-starts from the previous inverse while the fresh one starts
/// from the scaled identity.
#[test]
fn lazy_with_skip_one_equals_non_lazy() {
    let p = problem(11, 8);
    for variant in [KronVariant::Ring, KronVariant::Reng, KronVariant::Ngd] {
        let mut cfg = common::variant_config(variant);
        cfg.skip = 1;
        cfg.phi = 0.8;
        cfg.rho = 4e-3;
        cfg.inverse = InverseMethod::Cholesky;
        let lazy = run(&p, cfg, false);
        let fresh = run(&p, cfg, true);
        if variant == KronVariant::Ring {
            // RING's power iteration starts from the last refresh's iterate, the fresh one
            // from the fixed start: each stops once a step moves the estimate by at most
            // `tol`, so the two norms (and dampings) differ by a couple of such moves, `4·tol`
            // relative; each step's `P` by twice that (two factors), and the weights, sums
            // of the steps' `ηP` from zero, by about as much where the steps do not cancel
            // (2e-5 measured here on 2026-11-28, 40x inside the bound).
            let gap = rel_gap(&lazy, &fresh);
            let bound = 8.0 * cfg.power.tol as f64;
            assert!(gap <= bound, "Ring: Cholesky, S = 1: {gap:e} > {bound:e}");
        } else {
            assert_eq!(lazy, fresh, "{variant:?}: Cholesky, S = 1");
        }

        cfg.inverse = KronConfig::ring().inverse;
        let lazy = run(&p, cfg, false);
        let fresh = run(&p, cfg, true);
        let worst = rel_gap(&lazy, &fresh);
        // Both inverses meet ‖I − AX‖_F/√n ≤ 1e-4, so each differs from the exact one by
        // ≲ 1e-4·√n relative; two factors, ≤ 7 accumulated steps.
        assert!(
            worst < 2e-2,
            "{variant:?}: Newton, S = 1: relative difference {worst:e}"
        );
    }
}

/// With S = 4 and φ = 1 (ρ frozen) the lazy steps reuse the refreshed inverses untouched.
#[test]
fn lazy_steps_reuse_inverses_when_damping_is_fixed() {
    let p = problem(12, 5);
    let mut cfg = KronConfig::ring();
    cfg.phi = 1.0;
    cfg.inverse = InverseMethod::Cholesky;
    let mut opt = KronOptimizer::new(&DEV, &p.shapes, cfg).unwrap();
    let mut params: Vec<Matrix> = p
        .shapes
        .iter()
        .map(|&(o, i)| DEV.zeros(o, i).unwrap())
        .collect();
    let mut refreshed = vec![];
    let mut first = None;
    for k in 0..5 {
        let st = stats_of(&p, k);
        let need = opt.needs_stats();
        let grads: Vec<&Matrix> = p.grads[k].iter().collect();
        let info = opt
            .step(&mut params, &grads, need.then_some(&st[..]))
            .unwrap();
        refreshed.push(info.refreshed);
        opt.observe_loss(1.0, 1.0 + info.predicted_change.unwrap())
            .unwrap();
        let snap = snapshot(&opt).0;
        match (k, &first) {
            (0, _) => first = Some(snap),
            (1..=3, Some(f)) => assert_eq!(&snap, f, "step {k} changed the factors"),
            _ => assert_ne!(Some(&snap), first.as_ref(), "step 4 must refresh"),
        }
    }
    assert_eq!(refreshed, [true, false, false, false, true]);
    assert_eq!(opt.counters().refreshes, 2);
    assert_eq!(opt.counters().first_order_updates, 0);
}

// ---------- first-order inverse update ----------

/// `(F + λI)⁻¹` via the optimizer's own Cholesky inverse of the stored factor.
fn exact_inverse(f: &Matrix, lambda: f32) -> Vec<f32> {
    let mut d = f.try_clone().unwrap();
    DEV.add_diagonal(&mut d, lambda).unwrap();
    host(&DEV.cholesky_inverse(&d).unwrap())
}

/// RENG's damping for `ρ` (both factors), as the optimizer forms it: `√ρ` in f64, at least
/// the default floor, rounded to f32.
fn reng_damping(rho: f32) -> f32 {
    (rho as f64)
        .sqrt()
        .max(KronConfig::reng().damping_floor as f64) as f32
}

fn f64s(m: &Matrix) -> Vec<f64> {
    host(m).iter().map(|&v| v as f64).collect()
}

/// `(F + λI)⁻¹` in f64, column by column by [`solve64`].
fn inverse64(f: &[f64], n: usize, lambda: f64) -> Vec<f64> {
    let a = add_diag(f, n, lambda);
    let mut x = vec![0.0; n * n];
    for j in 0..n {
        let mut e = vec![0.0; n];
        e[j] = 1.0;
        for (i, v) in solve64(a.clone(), e).into_iter().enumerate() {
            x[i * n + j] = v;
        }
    }
    x
}

/// The inverse a lazy step with the damping target `lambda` takes for the factor `s` (the
/// state after that step), rebuilt in f64 from the state's `X₀` and `λ₀` alone: `X₀` when
/// `λ = λ₀`, else `X₀ − (λ − λ₀)·X₀X₀` with the square formed here (not the cached one).
/// `Δ = λ − λ₀` is the optimizer's f32 difference.
fn first_order64(s: &KronFactorState, lambda: f32) -> Vec<f64> {
    let n = s.inverse.rows();
    let x0 = f64s(&s.inverse);
    let d = (lambda - s.damping) as f64;
    if d == 0.0 {
        return x0;
    }
    let sq = common::matmul64(&x0, &x0, n, n, n);
    x0.iter().zip(&sq).map(|(x, s)| x - d * s).collect()
}

/// Checks that the first-order inverse `X(λ) = X₀ − Δ·X₀²` (`Δ = λ − λ₀`, [`first_order64`])
/// is within the stated first-order error of the exact `(F + λI)⁻¹` (f64, from the state's
/// f32 factor), and returns `t = |Δ|·‖E₀‖₂`. With `E₀ = (F + λ₀I)⁻¹` and `δ = X₀ − E₀` (the
/// f32 inverse's own error): `(F + λI)⁻¹ − X(λ) = Δ²E₀³(I + ΔE₀)⁻¹ − δ + Δ(E₀δ + δE₀ + δ²)`
/// (the first-order inverse falls short by a PSD remainder).
/// The first term is PSD with norm exactly `Δ²e³/(1 + Δe)`, `e = ‖E₀‖₂` (increasing in each
/// eigenvalue); the rest is at most `(1 + 2t + |Δ|‖δ‖)‖δ‖ ≤ 2.1‖δ‖_F` for `t ≤ 1/2`. So the
/// top eigenvalue of the (symmetrized) shortfall is `Δ²e³/(1 + Δe)` within `2.1‖δ‖_F`, the bottom
/// one `≥ −2.1‖δ‖_F`, and `Δ²e³/(1 + Δe) ≤ t²/(1 − t)·e`, the bound of the module docs.
fn check_first_order_error(s: &KronFactorState, lambda: f32) -> f64 {
    let n = s.inverse.rows();
    let f = f64s(&s.factor);
    let e0 = inverse64(&f, n, s.damping as f64);
    let exact = inverse64(&f, n, lambda as f64);
    let x0 = f64s(&s.inverse);
    let delta = frob(&x0.iter().zip(&e0).map(|(a, b)| a - b).collect::<Vec<_>>());
    let d = (lambda - s.damping) as f64;
    let e = max_eig64(&e0, n);
    let t = d.abs() * e;
    assert!(t <= 0.5, "a first-order step past the guard: t = {t}");
    let predicted = d * d * e.powi(3) / (1.0 + d * e);
    assert!(predicted <= t * t / (1.0 - t) * e * (1.0 + 1e-12));
    let x = first_order64(s, lambda);
    let err: Vec<f64> = (0..n * n)
        .map(|k| {
            let (i, j) = (k / n, k % n);
            0.5 * ((exact[k] - x[k]) + (exact[j * n + i] - x[j * n + i]))
        })
        .collect();
    let top = max_eig64(&err, n);
    let bottom = -max_eig64(&err.iter().map(|v| -v).collect::<Vec<_>>(), n);
    // f64 solves and Jacobi sweeps: ≲ 1e-12 of e here (κ ≤ 1e3).
    let slack = 2.1 * delta + 1e-10 * e;
    assert!(
        (top - predicted).abs() <= slack && bottom >= -slack,
        "error eigenvalues [{bottom:e}, {top:e}], first-order prediction {predicted:e} ± {slack:e} (t = {t})"
    );
    t
}

/// One refresh at ρ₀, an LM move of ρ (a good step: ρ₀ → φρ₀; a bad one with `grow`:
/// ρ₀ → ρ₀/φ), one lazy step: returns the Frobenius distance between the inverse of Λ̃ that
/// lazy step took ([`first_order64`] of the state after it) and the recomputed one,
/// `|λ − λ₀|·‖X₀‖₂`, and the optimizer.
fn lazy_error_moving(phi: f32, grow: bool) -> (f64, f64, KronOptimizer) {
    let mut rng = common::seeded_rng();
    let (d_out, d_in, m) = (5, 7, 4);
    let mut cfg = KronConfig::reng();
    cfg.rho = 1e-2;
    cfg.phi = phi;
    cfg.skip = 1000;
    cfg.inverse = InverseMethod::Cholesky;
    let mut opt = KronOptimizer::new(&DEV, &[(d_out, d_in)], cfg).unwrap();
    let a = rand_mat(&mut rng, m, d_in);
    let e = rand_mat(&mut rng, m, d_out);
    let g = rand_mat(&mut rng, d_out, d_in);
    let mut w = vec![DEV.zeros(d_out, d_in).unwrap()];
    let info = opt
        .step(&mut w, &[&g], Some(&[KronStats { a: &a, e: &e }]))
        .unwrap();
    // r = 1 ⇒ ρ ← φρ; r = 0 ⇒ ρ ← ρ/φ.
    let after = if grow {
        1.0
    } else {
        1.0 + info.predicted_change.unwrap()
    };
    opt.observe_loss(1.0, after).unwrap();
    let x0 = opt.state().unwrap().layers[0].lambda.inverse_norm as f64;
    let info = opt.step(&mut w, &[&g], None).unwrap();
    assert!(!info.refreshed);
    let lambda = reng_damping(info.rho);
    let st = opt.state().unwrap();
    let s = &st.layers[0].lambda;
    let dl = (lambda as f64) - 0.1; // λ₀ = √ρ₀ = 0.1
    let exact = exact_inverse(&s.factor, lambda);
    let err = frob(
        &first_order64(s, lambda)
            .iter()
            .zip(&exact)
            .map(|(a, b)| a - *b as f64)
            .collect::<Vec<_>>(),
    );
    (err, dl.abs() * x0, opt)
}

fn lazy_error(phi: f32) -> (f64, f64, KronOptimizer) {
    lazy_error_moving(phi, false)
}

/// The first-order inverse `X₀ − dλ·X₀X₀` has error `O(dλ²)`: halving dλ divides the error
/// by about 4 (exactly `dλ²X₀³(I + dλX₀)⁻¹`, so the ratio is a little below ¼ for dλ < 0).
#[test]
fn first_order_inverse_update_is_second_order_accurate() {
    // √φ = 1 − 0.2, 1 − 0.1, 1 − 0.05: dλ = −0.02, −0.01, −0.005 at λ₀ = 0.1.
    let phis = [0.8f32 * 0.8, 0.9 * 0.9, 0.95 * 0.95];
    let mut errs = vec![];
    for phi in phis {
        let (err, t, opt) = lazy_error(phi);
        assert!(
            t <= 0.5,
            "test set-up must stay on the first-order path ({t})"
        );
        assert_eq!(
            opt.counters().first_order_updates,
            2,
            "both factors updated"
        );
        assert_eq!(opt.counters().lazy_recomputes, 0);
        errs.push(err);
    }
    let ratios = [errs[1] / errs[0], errs[2] / errs[1]];
    eprintln!("first-order update: errors {errs:?}, ratios {ratios:?} (expect ≈ 1/4)");
    for r in ratios {
        assert!((0.18..=0.3).contains(&r), "ratio {r}, errors {errs:?}");
    }
    // ‖X‖ ≈ 1/λ ≈ 10: the error ≈ dλ²‖X‖³ is far above f32 rounding (~1e-5 here).
    assert!(errs[2] > 1e-3);
}

/// A fresh inverse's norm is the bound `1/λ` (no power iteration on `X`): `F` is PSD, so
/// `‖(F + λI)⁻¹‖₂ ≤ 1/λ`, here for full-rank factors (`m > n`, where it is not attained), by
/// Cholesky and by Newton (RING's seeded with `‖F‖₂ + λ`).
#[test]
fn inverse_norm_is_the_damping_bound() {
    let mut rng = common::seeded_rng();
    let (d_out, d_in, m) = (5, 7, 12);
    let a = rand_mat(&mut rng, m, d_in);
    let e = rand_mat(&mut rng, m, d_out);
    let g = rand_mat(&mut rng, d_out, d_in);
    let newton = NewtonOptions::default();
    for base in [KronConfig::ring(), KronConfig::reng(), KronConfig::ngd()] {
        for inverse in [InverseMethod::Cholesky, InverseMethod::Newton(newton)] {
            let cfg = KronConfig { inverse, ..base };
            let mut opt = KronOptimizer::new(&DEV, &[(d_out, d_in)], cfg).unwrap();
            let mut w = vec![DEV.zeros(d_out, d_in).unwrap()];
            opt.step(&mut w, &[&g], Some(&[KronStats { a: &a, e: &e }]))
                .unwrap();
            let st = opt.state().unwrap();
            for (s, n) in [(&st.layers[0].lambda, d_in), (&st.layers[0].gamma, d_out)] {
                assert_eq!(s.inverse_norm, 1.0 / s.damping);
                // ‖X‖₂ ≤ ‖A⁻¹‖₂·‖AX‖₂ ≤ (1/λ)(1 + √n·r): Newton's residual r ≤ 1e-4; Cholesky's
                // f32 rounding is below 1e-5 at these sizes and dampings.
                let x: Vec<f64> = host(&s.inverse).iter().map(|&v| v as f64).collect();
                let top = max_eig64(&x, n);
                let slack = 1.0 + (n as f64).sqrt() * newton.tol as f64 + 1e-5;
                assert!(
                    top <= s.inverse_norm as f64 * slack,
                    "{:?} {inverse:?}: ‖X‖₂ {top} > 1/λ {}",
                    base.variant,
                    s.inverse_norm
                );
            }
        }
    }
}

/// A damping jump with `|λ − λ₀|·‖X₀‖₂ > 1/2` recomputes the inverse instead (counted): the
/// state then holds the new formation, the exact inverse at the new damping (so the inverse
/// the step took matches it to the bit), with no square yet.
#[test]
fn large_damping_change_recomputes_the_inverse() {
    let (err, t, opt) = lazy_error(0.1);
    assert!(t > 0.5);
    assert_eq!(opt.counters().lazy_recomputes, 2);
    assert_eq!(opt.counters().first_order_updates, 0);
    // Same Cholesky on the same matrix: identical.
    assert_eq!(err, 0.0);
    let st = opt.state().unwrap();
    for s in [&st.layers[0].lambda, &st.layers[0].gamma] {
        assert!(s.square().is_none());
        assert_eq!(s.inverse_norm, 1.0 / s.damping);
    }
}

/// Random `(A m x d_in, E m x d_out)` statistics and one gradient per step for `shapes`.
fn lazy_problem(
    rng: &mut ChaCha8Rng,
    shapes: &[(usize, usize)],
    m: usize,
    steps: usize,
) -> (Vec<(Matrix, Matrix)>, Vec<Vec<Matrix>>) {
    let stats = shapes
        .iter()
        .map(|&(o, i)| (rand_mat(rng, m, i), rand_mat(rng, m, o)))
        .collect();
    let grads = (0..steps)
        .map(|_| shapes.iter().map(|&(o, i)| rand_mat(rng, o, i)).collect())
        .collect();
    (stats, grads)
}

/// REnG with Cholesky inverses, `ρ = 1e-2` down to `1e-8`, drift limit `phi` and no refresh
/// for 1000 steps: the lazy first-order inverse steps' setting.
fn lazy_cholesky_config(phi: f32) -> KronConfig {
    KronConfig {
        rho: 1e-2,
        rho_min: 1e-8,
        phi,
        skip: 1000,
        inverse: InverseMethod::Cholesky,
        ..KronConfig::reng()
    }
}

fn zeros(shapes: &[(usize, usize)]) -> Vec<Matrix> {
    shapes
        .iter()
        .map(|&(o, i)| DEV.zeros(o, i).unwrap())
        .collect()
}

/// Lazy steps take the first-order inverse relative to the FORMATION (docs/math.md §2): over lazy
/// steps whose RING damping drifts down and up (LM moves of ρ by φ = 0.8 each way), the state
/// keeps `X₀`, `λ₀` from the refresh bit for bit and caches `S₀ = X₀·X₀` (the bits of
/// `Device::gemm`) from the first drift on; the preconditioned gradient each step applied
/// equals `X_Γ(λ_Γ)·G·X_Λ(λ_Λ)` with `X(λ) = X₀ − (λ − λ₀)·X₀²` rebuilt in f64 from `X₀`, `λ₀`
/// and the step's ρ; and `X(λ)` is within the first-order error of `(F + λI)⁻¹`
/// ([`check_first_order_error`]).
///
/// Tolerance of `P` (per entry, `A = |X₀| + |Δ||X₀|²` per factor, [`common::first_order_scale64`]):
/// the square's GEMM (`γ_n`), the axpy (two roundings) give `|X̂ − X| ≤ (n + 4)u·A`; the two
/// preconditioning products add `(d_in + d_out)u·A_Γ|G|A_Λ`, the update `W = 0 − ηP` one more
/// `u`: in all `(2(d_in + d_out) + 9)u·A_Γ|G|A_Λ`; allowed `(2(d_in + d_out) + 16)·2u` of it.
/// Taking `X₀` unchanged, or compounding per-step updates (`X ← X − dλ·X·X`, the former rule),
/// misses by `≳ 1e-2` of `A_Γ|G|A_Λ` here (`t` up to 0.25), far above that ~1e-5.
#[test]
fn lazy_steps_use_the_first_order_inverse_of_the_formation() {
    let mut rng = common::seeded_rng();
    let shapes = [(5usize, 7usize), (3, 6)];
    // m < d: singular factors, so ‖E₀‖₂ = 1/λ₀ and the first-order error is largest.
    let (stats, grads) = lazy_problem(&mut rng, &shapes, 4, 8);
    let cfg = common::drifting_config(KronConfig::ring());
    let mut opt = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
    let ks: Vec<KronStats<'_>> = stats.iter().map(|(a, e)| KronStats { a, e }).collect();
    let g: Vec<&Matrix> = grads[0].iter().collect();
    let mut w = zeros(&shapes);
    let info = opt.step(&mut w, &g, Some(&ks)).unwrap();
    assert!(info.refreshed);
    let formed = opt.state().unwrap();
    assert!(formed
        .matrices()
        .iter()
        .all(|(n, _)| !n.ends_with("square")));
    // r = 1 lowers ρ by φ, r = 0 raises it by 1/φ: λ/λ₀ = √(ρ/ρ₀) runs 0.89, 0.8, 0.89, 1,
    // 1.12, 1.25, 1.12 over the lazy steps.
    let moves = [1.0f32, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0];
    opt.observe_loss(1.0, 1.0 + moves[0] * info.predicted_change.unwrap())
        .unwrap();
    let (mut worst, mut drifted, mut t_max) = (0.0f64, 0, 0.0f64);
    for (k, &r) in moves[1..].iter().enumerate() {
        let g: Vec<&Matrix> = grads[k + 1].iter().collect();
        let mut w = zeros(&shapes);
        let info = opt.step(&mut w, &g, None).unwrap();
        assert!(!info.refreshed);
        assert_eq!(
            info.lazy_recomputes, 0,
            "step {k}: t ≤ 0.25 stays first-order"
        );
        let st = opt.state().unwrap();
        let target = |s: &KronFactorState| {
            ((info.rho as f64).sqrt() * s.norm as f64).max(cfg.damping_floor as f64) as f32
        };
        let mut moved = 0;
        for (l, &(o, i)) in shapes.iter().enumerate() {
            let (sl, sg) = (&st.layers[l].lambda, &st.layers[l].gamma);
            let (fl, fg) = (&formed.layers[l].lambda, &formed.layers[l].gamma);
            for (s, f) in [(sl, fl), (sg, fg)] {
                assert_eq!(host(&s.inverse), host(&f.inverse), "X₀ must stay as formed");
                assert_eq!(s.damping, f.damping, "λ₀ must stay as formed");
                let t = target(s);
                if t != s.damping {
                    moved += 1;
                    let n = s.inverse.rows();
                    let mut sq = DEV.zeros(n, n).unwrap();
                    DEV.gemm(
                        Trans::No,
                        Trans::No,
                        1.0,
                        &s.inverse,
                        &s.inverse,
                        0.0,
                        &mut sq,
                    )
                    .unwrap();
                    let cached = s.square().expect("S₀ cached from the first drift on");
                    assert_eq!(host(cached), host(&sq));
                }
                t_max = t_max.max(check_first_order_error(s, t));
            }
            let (tl, tg) = (target(sl), target(sg));
            let gh = f64s(g[l]);
            let p_ref = common::matmul64(
                &common::matmul64(&first_order64(sg, tg), &gh, o, o, i),
                &first_order64(sl, tl),
                o,
                i,
                i,
            );
            let ga: Vec<f64> = gh.iter().map(|v| v.abs()).collect();
            let scale = common::matmul64(
                &common::matmul64(&common::first_order_scale64(sg, tg), &ga, o, o, i),
                &common::first_order_scale64(sl, tl),
                o,
                i,
                i,
            );
            let c = (2 * (o + i) + 16) as f64 * 2.0 * common::U32;
            for (j, wv) in host(&w[l]).iter().enumerate() {
                let p = -(*wv as f64) / info.lr as f64;
                let ratio = (p - p_ref[j]).abs() / (c * scale[j]);
                worst = worst.max(ratio);
                assert!(
                    ratio <= 1.0,
                    "step {k} layer {l} entry {j}: P {p} vs first-order reference {} (scale {})",
                    p_ref[j],
                    scale[j]
                );
            }
        }
        assert_eq!(info.first_order_updates, moved, "step {k}");
        drifted += moved;
        opt.observe_loss(1.0, 1.0 + r * info.predicted_change.unwrap())
            .unwrap();
    }
    eprintln!("first-order P: worst error / tolerance {worst:.3}; largest t {t_max:.3}");
    assert!(
        drifted >= 16,
        "the damping must drift on most steps ({drifted})"
    );
    assert!(
        t_max > 0.15,
        "the drift must be large enough to matter ({t_max})"
    );
    assert_eq!(opt.counters().first_order_updates, drifted as u64);
}

/// Statistics rows `s_k·e_{j_k}` (`m2` distinct coordinates of `n`, `s_k` in `[0.5, 2)`):
/// their factor `(1/m2)·Σ s_k²·e_{j_k}e_{j_k}ᵀ` is diagonal, with `n − m2` zeros.
fn diagonal_stats(rng: &mut ChaCha8Rng, m2: usize, n: usize) -> Matrix {
    let mut x = vec![0.0f32; m2 * n];
    let mut cols: Vec<usize> = (0..n).collect();
    for k in 0..m2 {
        let j = rng.random_range(k..n);
        cols.swap(k, j);
        x[k * n + cols[k]] = rng.random_range(0.5f32..2.0);
    }
    DEV.upload(m2, n, &x).unwrap()
}

/// `Σ_k |x_ik|·|y_jk|` (`x` `r x k`, `y` `c x k`, both row-major): the absolute chain of
/// `x·yᵀ`.
fn abs_xyt(x: &[f64], y: &[f64], (r, k, c): (usize, usize, usize)) -> Vec<f64> {
    let xa: Vec<f64> = x.iter().map(|v| v.abs()).collect();
    let yt: Vec<f64> = transpose64(&y.iter().map(|v| v.abs()).collect::<Vec<_>>(), c, k);
    common::matmul64(&xa, &yt, r, k, c)
}

/// A lazy RING step on the CPU with factored gradients and the model, at a damping the model
/// moved: the factored route applies the first-order inverses `X = X₀ − d·X₀²` by products
/// with `X₀` (`Retarget::ByProducts`: no `S₀` cached, where a dense gradient's step caches
/// it), and takes the curvature by `X₀`'s identity: `UᵀΓU = EU − λ₀·Uᵀ(U + (d/λ₀)·U₀)`,
/// `VΛVᵀ = AVᵀ − λ₀·V(V + (d/λ₀)·V₀)ᵀ` (`U = XEᵀ`, `U₀ = X₀Eᵀ`, `V = AX`, `V₀ = AX₀`). Its
/// `P` must equal `X_Γ·G·X_Λ` and its predicted change the f64 model on that `P` and the
/// state's factors.
///
/// A step whose products overflow before it is a typed error and changes nothing.
///
/// Diagonal factors (half of each null) make the absolute chains tight: `|X₀|` is `X₀`, so
/// the bounds below lose no cancellation inside the inverses, and the null directions, where
/// `EU` and `λ₀UᵀU` cancel, are where the drift term matters. Bounds, `c = (2(d_in + d_out +
/// m) + 16)·2u` (every chain's roundings, 2x margin): `P` within `c·A_Γ(|E|ᵀ|A|/m)A_Λ`
/// (`A = |X₀| + |d|·|X₀|²`, [`common::first_order_scale64`]); `q` within `c` times the
/// model on chains: `η⟨|E||U|, |A||V|ᵀ⟩/m² + ½η²(⟨M_Γ, M_Λ⟩ + λ‖|U||V|‖²/m²)`, with `M_Γ =
/// (|E||U| + λ₀|U|ᵀ|U| + |d||U|ᵀ|U₀|)/m` (and `M_Λ` alike) bounding each identity's terms.
/// `ρ = 0.1`, `φ = 0.5`: the damping falls by `√0.5` (drift `t = 0.29`, first-order), and is
/// comparable to the factors' nonzero eigenvalues, where the drift term weighs most. Measured
/// over seeds: errors ≤ 1e-3 of that bound; a 10% error in the `d/λ₀` term misses by 15–30x
/// the bound, dropping it by 2.5–80x.
#[test]
fn lazy_factored_step_applies_the_first_order_inverse_by_products() {
    let mut rng = common::seeded_rng();
    // n ≤ 64 keeps the rows' route off; m = 3 makes the factored route the cheaper one.
    let (o, i, m) = (48usize, 33usize, 3usize);
    let cfg = KronConfig {
        inverse: InverseMethod::Cholesky,
        rho: 0.1,
        phi: 0.5,
        ..KronConfig::ring()
    };
    let shapes = [(o, i)];
    let (sa, se) = (
        diagonal_stats(&mut rng, i / 2, i),
        diagonal_stats(&mut rng, o / 2, o),
    );
    let stats = [KronStats { a: &sa, e: &se }];
    let (a, e) = (rand_mat(&mut rng, m, i), rand_mat(&mut rng, m, o));
    let mut opt = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
    let mut dense_opt = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
    let mut w = zeros(&shapes);
    let (g, _) = batch_grad(&DEV, &e, &a);
    let first = opt
        .step_grads(&mut w, &[KronGrad::Factored { e: &e, a: &a }], Some(&stats))
        .unwrap();
    dense_opt
        .step(&mut zeros(&shapes), &[&g], Some(&stats))
        .unwrap();
    for o in [&mut opt, &mut dense_opt] {
        o.observe_loss(1.0, 1.0 + first.predicted_change.unwrap())
            .unwrap();
    }

    let (a, e) = (rand_mat(&mut rng, m, i), rand_mat(&mut rng, m, o));
    let mut w = zeros(&shapes);
    // Finite batch factors whose step overflows (`P` ~ 1e40 through `X₀U₀`): a typed error
    // that leaves the optimizer as it was, so the step below must still match the reference.
    let before = snapshot(&opt);
    let err = opt
        .step_grads(
            &mut w,
            &[KronGrad::Factored {
                e: &huge(&e),
                a: &huge(&a),
            }],
            None,
        )
        .unwrap_err();
    assert!(matches!(err, Error::NonFinite { .. }), "{err:?}");
    assert!(snapshot(&opt) == before && host(&w[0]).iter().all(|&v| v == 0.0));
    let info = opt
        .step_grads(&mut w, &[KronGrad::Factored { e: &e, a: &a }], None)
        .unwrap();
    assert!(!info.refreshed);
    assert_eq!((info.first_order_updates, info.lazy_recomputes), (2, 0));
    let (g, g64) = batch_grad(&DEV, &e, &a);
    dense_opt.step(&mut zeros(&shapes), &[&g], None).unwrap();
    let (st, dense_st) = (opt.state().unwrap(), dense_opt.state().unwrap());
    let (l, dl) = (&st.layers[0], &dense_st.layers[0]);
    assert!(l.lambda.square().is_none() && l.gamma.square().is_none());
    assert!(dl.lambda.square().is_some() && dl.gamma.square().is_some());

    let target = |s: &KronFactorState| {
        ((info.rho as f64).sqrt() * s.norm as f64).max(cfg.damping_floor as f64) as f32
    };
    let (tl, tg) = (target(&l.lambda), target(&l.gamma));
    assert!(
        tl != l.lambda.damping && tg != l.gamma.damping,
        "the damping must move"
    );
    let (xg, xl) = (first_order64(&l.gamma, tg), first_order64(&l.lambda, tl));
    let p_ref = common::matmul64(&common::matmul64(&xg, &g64, o, o, i), &xl, o, i, i);
    let (e64, a64) = (f64s(&e), f64s(&a));
    let ea = abs_xyt(
        &transpose64(&e64, m, o),
        &transpose64(&a64, m, i),
        (o, m, i),
    );
    let ga: Vec<f64> = ea.iter().map(|v| v / m as f64).collect();
    let (ag, al) = (
        common::first_order_scale64(&l.gamma, tg),
        common::first_order_scale64(&l.lambda, tl),
    );
    let scale = common::matmul64(&common::matmul64(&ag, &ga, o, o, i), &al, o, i, i);
    let c = (2 * (o + i + m) + 16) as f64 * 2.0 * common::U32;
    let eta = info.lr as f64;
    for (j, wv) in host(&w[0]).iter().enumerate() {
        let p = -(*wv as f64) / eta;
        assert!(
            (p - p_ref[j]).abs() <= c * scale[j],
            "entry {j}: P {p} vs first-order reference {} (scale {})",
            p_ref[j],
            scale[j]
        );
    }

    // The f64 model on the reference P, and its bound on chains.
    let (fg, fl) = (f64s(&l.gamma.factor), f64s(&l.lambda.factor));
    let gpl = common::matmul64(&common::matmul64(&fg, &p_ref, o, o, i), &fl, o, i, i);
    let lambda = tl as f64 * tg as f64;
    let q_ref = -eta * dot64(&g64, &p_ref)
        + 0.5 * eta * eta * (dot64(&p_ref, &gpl) + lambda * dot64(&p_ref, &p_ref));
    // `Uᵀ = E·X` (m x d_out) and `V = A·X` (m x d_in), with `X₀` and with `X`.
    let (ut, ut0) = (
        common::matmul64(&e64, &xg, m, o, o),
        common::matmul64(&e64, &f64s(&l.gamma.inverse), m, o, o),
    );
    let (v, v0) = (
        common::matmul64(&a64, &xl, m, i, i),
        common::matmul64(&a64, &f64s(&l.lambda.inverse), m, i, i),
    );
    let side = |x: &[f64], y: &[f64], y0: &[f64], n: usize, s: &KronFactorState, t: f32| {
        let (l0, dd) = (s.damping as f64, (t - s.damping).abs() as f64);
        let (lin, yy, yy0) = (
            abs_xyt(x, y, (m, n, m)),
            abs_xyt(y, y, (m, n, m)),
            abs_xyt(y, y0, (m, n, m)),
        );
        let mm: Vec<f64> = (0..m * m)
            .map(|k| (lin[k] + l0 * yy[k] + dd * yy0[k]) / m as f64)
            .collect();
        (lin, mm)
    };
    let (lin_g, mg) = side(&e64, &ut, &ut0, o, &l.gamma, tg);
    let (lin_l, ml) = side(&a64, &v, &v0, i, &l.lambda, tl);
    let p_abs = abs_xyt(&transpose64(&ut, m, o), &transpose64(&v, m, i), (o, m, i));
    let mf = m as f64;
    let q_abs = eta * dot64(&lin_g, &lin_l) / (mf * mf)
        + 0.5 * eta * eta * (dot64(&mg, &ml) + lambda * dot64(&p_abs, &p_abs) / (mf * mf));
    let q = info.predicted_change.unwrap() as f64;
    let tol = c * q_abs;
    assert!(
        (q - q_ref).abs() <= tol,
        "q {q} vs f64 model {q_ref}, tol {tol:e}"
    );
}

/// The guard is on the drift since the formation, not on one step's move: with ρ falling by
/// φ = 0.81 per step, RENG's λ = √ρ falls by 10 % per step and `t = |λ − λ₀|·‖X₀‖₂ =
/// 1 − 0.9ᵏ` passes 1/2 between the 6th lazy step (0.469) and the 7th (0.522). The 7th
/// recomputes both inverses — a new formation: the exact inverse at its damping, the square
/// dropped — and the 8th is first-order again, from there (`t` = 0.1).
#[test]
fn drift_since_the_formation_beyond_the_limit_recomputes() {
    let mut rng = common::seeded_rng();
    let shapes = [(5usize, 7usize)];
    let (stats, grads) = lazy_problem(&mut rng, &shapes, 4, 1);
    let cfg = lazy_cholesky_config(0.81);
    let mut opt = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
    let ks: Vec<KronStats<'_>> = stats.iter().map(|(a, e)| KronStats { a, e }).collect();
    let g: Vec<&Matrix> = grads[0].iter().collect();
    let mut w = zeros(&shapes);
    let info = opt.step(&mut w, &g, Some(&ks)).unwrap();
    opt.observe_loss(1.0, 1.0 + info.predicted_change.unwrap())
        .unwrap();
    let lambda0 = opt.state().unwrap().layers[0].lambda.damping;
    for k in 1..=8 {
        let info = opt.step(&mut w, &g, None).unwrap();
        let lambda = reng_damping(info.rho);
        let st = opt.state().unwrap();
        let t = ((lambda - lambda0) / lambda0).abs();
        match k {
            1..=6 => {
                assert!(t <= 0.48, "set-up: step {k}, t = {t}");
                assert_eq!((info.first_order_updates, info.lazy_recomputes), (2, 0));
                for s in [&st.layers[0].lambda, &st.layers[0].gamma] {
                    assert_eq!(s.damping, lambda0);
                    assert!(s.square().is_some());
                    check_first_order_error(s, lambda);
                }
            }
            7 => {
                assert!(t >= 0.51, "set-up: step {k}, t = {t}");
                assert_eq!((info.first_order_updates, info.lazy_recomputes), (0, 2));
                for s in [&st.layers[0].lambda, &st.layers[0].gamma] {
                    assert_eq!(s.damping, lambda);
                    assert_eq!(s.inverse_norm, 1.0 / lambda);
                    assert_eq!(host(&s.inverse), exact_inverse(&s.factor, lambda));
                    assert!(s.square().is_none());
                }
            }
            _ => {
                assert_eq!((info.first_order_updates, info.lazy_recomputes), (2, 0));
                for s in [&st.layers[0].lambda, &st.layers[0].gamma] {
                    assert!(s.damping < lambda0 * 0.6, "the formation of step 7");
                    assert!(s.square().is_some());
                    let t = check_first_order_error(s, lambda);
                    assert!((0.05..0.15).contains(&t), "t = {t} from the new formation");
                }
            }
        }
        opt.observe_loss(1.0, 1.0 + info.predicted_change.unwrap())
            .unwrap();
    }
    assert_eq!(opt.counters().lazy_recomputes, 2);
    assert_eq!(opt.counters().first_order_updates, 14);
}

/// A lazy step that fails after its plan (a gradient whose preconditioned value overflows)
/// leaves the state bit for bit as it was — no square cached by a failed first-order step,
/// the cached one kept, no new formation from a failed recompute, counters unchanged — and
/// the parameters too; the next good step then does what the failed one planned.
#[test]
fn failed_lazy_step_leaves_inverse_square_and_counters_untouched() {
    let mut rng = common::seeded_rng();
    let shapes = [(5usize, 7usize), (3, 6)];
    let (stats, grads) = lazy_problem(&mut rng, &shapes, 4, 1);
    let cfg = lazy_cholesky_config(0.64);
    let mut opt = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
    let ks: Vec<KronStats<'_>> = stats.iter().map(|(a, e)| KronStats { a, e }).collect();
    let g: Vec<&Matrix> = grads[0].iter().collect();
    let huge: Vec<Matrix> = grads[0].iter().map(|m| with_value(m, 3, 3e38)).collect();
    let huge: Vec<&Matrix> = huge.iter().collect();
    let mut w: Vec<Matrix> = shapes
        .iter()
        .map(|&(o, i)| rand_mat(&mut rng, o, i))
        .collect();
    let info = opt.step(&mut w, &g, Some(&ks)).unwrap();
    opt.observe_loss(1.0, 1.0 + info.predicted_change.unwrap())
        .unwrap(); // λ → 0.8λ₀
    let fails = |opt: &mut KronOptimizer, w: &mut Vec<Matrix>, what: &str| {
        let before = snapshot(opt);
        let w_before: Vec<Vec<f32>> = w.iter().map(host).collect();
        match opt.step(w, &huge, None) {
            Err(Error::NonFinite { .. }) => {}
            other => panic!("{what}: expected NonFinite, got {other:?}"),
        }
        assert!(snapshot(opt) == before, "{what}: state changed on error");
        assert_eq!(w.iter().map(host).collect::<Vec<_>>(), w_before, "{what}");
    };
    let squares = |opt: &KronOptimizer| {
        let st = opt.state().unwrap();
        st.layers
            .iter()
            .flat_map(|l| [l.lambda.square().is_some(), l.gamma.square().is_some()])
            .collect::<Vec<_>>()
    };
    // 1. The first drift would form S₀.
    fails(&mut opt, &mut w, "first-order step forming S₀");
    assert_eq!(squares(&opt), [false; 4]);
    let info = opt.step(&mut w, &g, None).unwrap();
    assert_eq!(info.first_order_updates, 4);
    assert_eq!(squares(&opt), [true; 4]);
    opt.observe_loss(1.0, 1.0 + info.predicted_change.unwrap())
        .unwrap(); // λ → 0.64λ₀
                   // 2. S₀ cached: the failed step must keep it.
    fails(&mut opt, &mut w, "first-order step with S₀ cached");
    // 3. Five rejections: λ → 0.64λ₀/0.8⁵ ≈ 1.95λ₀, past the guard: the step would
    // recompute.
    for _ in 0..5 {
        opt.reject_step();
    }
    fails(&mut opt, &mut w, "recomputing step");
    let info = opt.step(&mut w, &g, None).unwrap();
    assert_eq!((info.first_order_updates, info.lazy_recomputes), (0, 4));
    assert_eq!(squares(&opt), [false; 4]);
}

// ---------- Levenberg–Marquardt ----------

#[test]
fn levenberg_marquardt_moves_rho_in_the_right_direction() {
    let mut cfg = KronConfig::ring();
    cfg.phi = 0.9;
    cfg.rho_min = 1e-4;
    cfg.rho_max = 1e-2;
    let rho = 1e-3f32;
    assert!(levenberg_marquardt(&cfg, rho, 0.9) < rho);
    assert!(levenberg_marquardt(&cfg, rho, 0.1) > rho);
    assert!(levenberg_marquardt(&cfg, rho, -5.0) > rho);
    assert!(levenberg_marquardt(&cfg, rho, f32::NAN) > rho);
    assert_eq!(levenberg_marquardt(&cfg, rho, 0.5), rho);
    assert_eq!(levenberg_marquardt(&cfg, 1e-4, 1.0), 1e-4, "clamped below");
    assert_eq!(levenberg_marquardt(&cfg, 1e-2, 0.0), 1e-2, "clamped above");

    // Through the optimizer: r from observed losses and the stored prediction.
    let p = problem(3, 40);
    cfg.rho = 1e-3;
    let mut opt = KronOptimizer::new(&DEV, &p.shapes, cfg).unwrap();
    let mut w = zeros(&p.shapes);
    let mut k = 0;
    let q = lm_step(&p, &mut k, &mut opt, &mut w);
    assert!(q < 0.0);
    let r0 = opt.rho();
    opt.observe_loss(2.0, 2.0 + 0.9 * q).unwrap(); // r = 0.9
    assert!((opt.rho() - 0.9 * r0).abs() <= 1e-6 * r0);
    assert!((opt.last_ratio().unwrap() - 0.9).abs() < 1e-5);
    let r1 = opt.rho();
    let q = lm_step(&p, &mut k, &mut opt, &mut w);
    opt.observe_loss(2.0, 2.0 + 0.1 * q).unwrap(); // r = 0.1
    assert!((opt.rho() - r1 / 0.9).abs() <= 1e-6 * r1);
    let r2 = opt.rho();
    let q = lm_step(&p, &mut k, &mut opt, &mut w);
    opt.observe_loss(2.0, 2.0 + 0.5 * q).unwrap(); // r = 0.5
    assert_eq!(opt.rho(), r2);
    lm_step(&p, &mut k, &mut opt, &mut w);
    opt.observe_loss(2.0, f32::NAN).unwrap(); // blown-up step: more damping
    assert!(opt.rho() > r2);
    assert_eq!(opt.counters().nonfinite_losses, 1);
    // Repeated good steps clamp at rho_min (≈ 23 steps of ×0.9 from ~1.1e-3 to 1e-4).
    for _ in 0..30 {
        let q = lm_step(&p, &mut k, &mut opt, &mut w);
        opt.observe_loss(1.0, 1.0 + q).unwrap();
    }
    assert_eq!(opt.rho(), cfg.rho_min);
    // Repeated bad ones clamp at rho_max (5e-3 / 0.9¹⁰ > 1e-2).
    cfg.rho = 5e-3;
    let mut opt = KronOptimizer::new(&DEV, &p.shapes, cfg).unwrap();
    k = 0;
    for _ in 0..10 {
        lm_step(&p, &mut k, &mut opt, &mut w);
        opt.observe_loss(1.0, 1.5).unwrap(); // the loss went up: r < 0
    }
    assert_eq!(opt.rho(), cfg.rho_max);
    assert_eq!(opt.counters().lm_updates, 10);
}

/// With a Levenberg–Marquardt interval `T`, only steps `k ≡ 0 (mod T)` form the model; a
/// step that forms none updates exactly as one that does (the model never enters the
/// update), a loss after it is refused and changes nothing, and each adaptation moves ρ by
/// `φᵀ`: the run equals a `T = 1` optimizer with `φᵀ` observed on the same steps, bit for bit
/// (φ = 1/2, so `φᵀ` is exact in `f32` as well), for every variant and `S ∈ {1, 2, 3}`.
#[test]
fn damping_interval_forms_the_model_every_t_steps() {
    let p = problem(21, 13);
    let zeros = || -> Vec<Matrix> {
        p.shapes
            .iter()
            .map(|&(o, i)| DEV.zeros(o, i).unwrap())
            .collect()
    };
    for variant in [KronVariant::Ring, KronVariant::Reng, KronVariant::Ngd] {
        for (t, skip) in [(2usize, 1usize), (3, 2), (4, 3)] {
            let base = KronConfig {
                phi: 0.5,
                rho_min: 1e-9,
                skip,
                inverse: InverseMethod::Cholesky,
                ..common::variant_config(variant)
            };
            let cfg = KronConfig {
                damping_interval: t,
                ..base
            };
            let reference = KronConfig {
                phi: 0.5f32.powi(t as i32),
                ..base
            };
            let mut opt = KronOptimizer::new(&DEV, &p.shapes, cfg).unwrap();
            let mut refo = KronOptimizer::new(&DEV, &p.shapes, reference).unwrap();
            let (mut w, mut wr) = (zeros(), zeros());
            for k in 0..p.grads.len() {
                let adapts = k % t == 0;
                assert_eq!(
                    opt.adapts_damping(),
                    adapts,
                    "{variant:?} T = {t}, step {k}"
                );
                let grads: Vec<&Matrix> = p.grads[k].iter().collect();
                let st = stats_of(&p, k);
                let stats = opt.needs_stats().then_some(&st[..]);
                let info = opt.step(&mut w, &grads, stats).unwrap();
                let ir = refo.step(&mut wr, &grads, stats).unwrap();
                let ctx = format!("{variant:?} T = {t}, S = {skip}, step {k}");
                assert_eq!(
                    w.iter().map(host).collect::<Vec<_>>(),
                    wr.iter().map(host).collect::<Vec<_>>(),
                    "{ctx}"
                );
                assert_eq!(info.predicted_change.is_some(), adapts, "{ctx}");
                assert_eq!(opt.pending_prediction(), info.predicted_change, "{ctx}");
                // Alternate good and poor agreement so that ρ moves both ways.
                let r = if k % (2 * t) == 0 { 1.0 } else { 0.0 };
                if let Some(q) = info.predicted_change {
                    assert_eq!(q, ir.predicted_change.unwrap(), "{ctx}");
                    opt.observe_loss(1.0, 1.0 + r * q).unwrap();
                    refo.observe_loss(1.0, 1.0 + r * q).unwrap();
                } else {
                    let before = snapshot(&opt);
                    let err = opt.observe_loss(1.0, 0.5).unwrap_err();
                    assert!(
                        matches!(
                            err,
                            Error::Value {
                                arg: "predicted change",
                                ..
                            }
                        ),
                        "{ctx}: {err}"
                    );
                    assert_eq!(snapshot(&opt), before, "{ctx}");
                }
                assert_eq!(opt.rho().to_bits(), refo.rho().to_bits(), "{ctx}");
            }
            assert_eq!(
                opt.counters().lm_updates,
                p.grads.len().div_ceil(t) as u64,
                "{variant:?} T = {t}"
            );
        }
    }
}

/// One step on problem step `k` (statistics when needed); returns the predicted change.
fn lm_step(p: &Problem, k: &mut usize, opt: &mut KronOptimizer, w: &mut [Matrix]) -> f32 {
    let st = stats_of(p, *k);
    let grads: Vec<&Matrix> = p.grads[*k].iter().collect();
    let need = opt.needs_stats();
    *k += 1;
    opt.step(w, &grads, need.then_some(&st[..]))
        .unwrap()
        .predicted_change
        .unwrap()
}

// ---------- fallbacks ----------

/// A Newton budget too small to converge makes every inversion diverge: the retry with more
/// damping fails too and Cholesky takes over; both are counted, and the step still equals the
/// Cholesky optimizer's.
#[test]
fn newton_failure_falls_back_to_cholesky_and_is_counted() {
    let p = problem(8, 1);
    let mut cfg = KronConfig::reng();
    cfg.inverse = InverseMethod::Newton(NewtonOptions {
        max_iter: 1,
        tol: 1e-7,
        ..NewtonOptions::default()
    });
    let grads: Vec<&Matrix> = p.grads[0].iter().collect();
    let st = stats_of(&p, 0);
    let mut opt = KronOptimizer::new(&DEV, &p.shapes, cfg).unwrap();
    let pn = opt.precondition(&grads, Some(&st)).unwrap();
    let c = *opt.counters();
    assert_eq!(c.newton_divergences, 4, "{c:?}");
    assert_eq!(c.cholesky_fallbacks, 4);
    assert_eq!(c.fallbacks(), 4);
    cfg.inverse = InverseMethod::Cholesky;
    let mut chol = KronOptimizer::new(&DEV, &p.shapes, cfg).unwrap();
    let pc = chol.precondition(&grads, Some(&st)).unwrap();
    for (a, b) in pn.iter().zip(&pc) {
        assert_eq!(host(a), host(b));
    }
}

// ---------- bad input ----------

/// A trained-for-a-few-steps optimizer and a problem to feed it.
fn warmed(seed: u64) -> (KronOptimizer, Problem, Vec<Matrix>) {
    let p = problem(seed, 3);
    let mut cfg = KronConfig::ring();
    cfg.skip = 2;
    let mut opt = KronOptimizer::new(&DEV, &p.shapes, cfg).unwrap();
    let mut w = zeros(&p.shapes);
    for k in 0..3 {
        let st = stats_of(&p, k);
        let grads: Vec<&Matrix> = p.grads[k].iter().collect();
        let need = opt.needs_stats();
        let q = opt
            .step(&mut w, &grads, need.then_some(&st[..]))
            .unwrap()
            .predicted_change
            .unwrap();
        if k < 2 {
            opt.observe_loss(1.0, 1.0 + 0.9 * q).unwrap();
        }
    }
    (opt, p, w)
}

fn with_value(m: &Matrix, idx: usize, v: f32) -> Matrix {
    let mut h = host(m);
    let i = idx % h.len();
    h[i] = v;
    DEV.upload(m.rows(), m.cols(), &h).unwrap()
}

proptest! {
    #![proptest_config(common::proptest_config(40))]

    /// Each kind of bad input gets a typed error; the optimizer state and the parameters are
    /// bit-for-bit unchanged.
    #[test]
    fn bad_input_is_rejected_and_changes_nothing(
        seed in any::<u64>(),
        kind in 0usize..12,
        idx in any::<usize>(),
        layer in 0usize..2,
        bad in prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)],
    ) {
        let (mut opt, p, mut w) = warmed(seed);
        let before = snapshot(&opt);
        let w_before: Vec<Vec<f32>> = w.iter().map(host).collect();
        let grads: Vec<&Matrix> = p.grads[0].iter().collect();
        let st = stats_of(&p, 0);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 1);
        let (o, i) = p.shapes[layer];
        let res: Result<(), Error> = match kind {
            // NaN/Inf in a gradient.
            0 => {
                let g = with_value(grads[layer], idx, bad);
                let mut gs = grads.clone();
                gs[layer] = &g;
                opt.step(&mut w, &gs, Some(&st)).map(|_| ())
            }
            // NaN/Inf in the statistics (a or e).
            1 | 2 => {
                let src = if kind == 1 { &p.a[0][layer] } else { &p.e[0][layer] };
                let bad_m = with_value(src, idx, bad);
                let mut s2 = st.clone();
                if kind == 1 { s2[layer].a = &bad_m } else { s2[layer].e = &bad_m }
                opt.precondition(&grads, Some(&s2)).map(|_| ())
            }
            // Wrong gradient shape.
            3 => {
                let g = rand_mat(&mut rng, o + 1, i);
                let mut gs = grads.clone();
                gs[layer] = &g;
                opt.precondition(&gs, None).map(|_| ())
            }
            // Wrong number of gradients.
            4 => opt.precondition(&grads[..1], Some(&st)).map(|_| ()),
            // Statistics with the wrong width / zero rows.
            5 => {
                let a = rand_mat(&mut rng, 4, i + 1);
                let mut s2 = st.clone();
                s2[layer].a = &a;
                opt.step(&mut w, &grads, Some(&s2)).map(|_| ())
            }
            6 => {
                let e = DEV.zeros::<f32>(0, o).unwrap();
                let mut s2 = st.clone();
                s2[layer].e = &e;
                opt.step(&mut w, &grads, Some(&s2)).map(|_| ())
            }
            // NaN/Inf in the parameters.
            7 => {
                w[layer] = with_value(&w[layer], idx, bad);
                let r = opt.step(&mut w, &grads, None).map(|_| ());
                w[layer] = DEV.upload(o, i, &w_before[layer]).unwrap();
                r
            }
            // Parameters of the wrong shape.
            8 => {
                let mut w2: Vec<Matrix> = w.iter().map(|m| m.try_clone().unwrap()).collect();
                w2[layer] = DEV.zeros(o, i + 2).unwrap();
                opt.step(&mut w2, &grads, None).map(|_| ())
            }
            // A non-finite "before" loss; then a second observe without a step.
            9 => opt.observe_loss(bad, 1.0),
            10 => {
                opt.observe_loss(1.0, 0.9).unwrap();
                let after_ok = snapshot(&opt);
                let r = opt.observe_loss(1.0, 0.9);
                prop_assert_eq!(&snapshot(&opt), &after_ok);
                let is_value = matches!(r, Err(Error::Value { .. }));
                prop_assert!(is_value);
                return Ok(());
            }
            // A state of the wrong shape.
            _ => {
                let mut other = KronOptimizer::new(&DEV, &[(o, i + 1), (2, 2)], *opt.config()).unwrap();
                let a = rand_mat(&mut rng, 3, i + 1);
                let a2 = rand_mat(&mut rng, 3, 2);
                let e = rand_mat(&mut rng, 3, o);
                let e2 = rand_mat(&mut rng, 3, 2);
                let g = rand_mat(&mut rng, o, i + 1);
                let g2 = rand_mat(&mut rng, 2, 2);
                other.precondition(&[&g, &g2], Some(&[KronStats { a: &a, e: &e }, KronStats { a: &a2, e: &e2 }])).unwrap();
                let s: KronState = other.state().unwrap();
                opt.restore(s)
            }
        };
        let err = res.expect_err("bad input must be rejected");
        let typed = matches!(err, Error::Shape { .. } | Error::NonFinite { .. } | Error::Value { .. });
        prop_assert!(typed, "unexpected error {err:?}");
        prop_assert_eq!(snapshot(&opt), before);
        let w_after: Vec<Vec<f32>> = w.iter().map(host).collect();
        prop_assert_eq!(w_after, w_before);
    }
}

#[test]
fn bad_configs_are_rejected() {
    let shapes = [(3, 4)];
    // `base` with one field changed.
    let with = |base: KronConfig, set: fn(&mut KronConfig)| {
        let mut c = base;
        set(&mut c);
        c
    };
    let cases: Vec<(&str, KronConfig)> = vec![
        ("rho", with(KronConfig::ring(), |c| c.rho = 0.0)),
        (
            "damping_interval",
            with(KronConfig::ring(), |c| c.damping_interval = 0),
        ),
        ("rho", with(KronConfig::ring(), |c| c.rho = -1e-3)),
        ("rho", with(KronConfig::ring(), |c| c.rho = 0.5)),
        ("rho_min", with(KronConfig::ring(), |c| c.rho_min = 0.0)),
        ("skip", with(KronConfig::reng(), |c| c.skip = 0)),
        ("phi", with(KronConfig::ngd(), |c| c.phi = 1.5)),
        ("phi", with(KronConfig::ngd(), |c| c.phi = 0.0)),
        ("ema", with(KronConfig::ring(), |c| c.ema = 1.0)),
        ("lr", with(KronConfig::ring(), |c| c.lr = f32::NAN)),
        ("grad_reg", with(KronConfig::reng(), |c| c.grad_reg = -0.1)),
    ];
    for (field, cfg) in cases {
        match KronOptimizer::new(&DEV, &shapes, cfg) {
            Err(Error::Value { arg, .. }) => assert_eq!(arg, field),
            other => panic!("{field}: expected Error::Value, got {other:?}"),
        }
    }
    assert!(matches!(
        KronOptimizer::new(&DEV, &[], KronConfig::ring()),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        KronOptimizer::new(&DEV, &[(0, 3)], KronConfig::ring()),
        Err(Error::Value { .. })
    ));
    // Missing statistics on a refresh step.
    let mut opt = KronOptimizer::new(&DEV, &shapes, KronConfig::ring()).unwrap();
    let g = DEV.zeros(3, 4).unwrap();
    assert!(matches!(
        opt.precondition(&[&g], None),
        Err(Error::Value { arg: "stats", .. })
    ));
    assert_eq!(opt.steps(), 0);
}

/// state() / restore() round-trip: a restored optimizer continues bit for bit.
#[test]
fn state_restore_round_trip() {
    let (mut a, p, mut wa) = warmed(common::seed());
    let saved = a.state().unwrap();
    let mut b = KronOptimizer::new(&DEV, &p.shapes, *a.config()).unwrap();
    b.restore(saved).unwrap();
    let mut wb: Vec<Matrix> = wa.iter().map(|m| m.try_clone().unwrap()).collect();
    let grads: Vec<&Matrix> = p.grads[1].iter().collect();
    let st = stats_of(&p, 1);
    for k in 0..3 {
        let s = a.needs_stats().then_some(&st[..]);
        assert_eq!(s.is_some(), b.needs_stats());
        let ia = a.step(&mut wa, &grads, s).unwrap();
        let ib = b.step(&mut wb, &grads, s).unwrap();
        assert_eq!(ia, ib, "step {k}");
        a.observe_loss(1.0, 1.0 + 0.2 * ia.predicted_change.unwrap())
            .unwrap();
        b.observe_loss(1.0, 1.0 + 0.2 * ib.predicted_change.unwrap())
            .unwrap();
    }
    assert_eq!(snapshot(&a), snapshot(&b));
    assert_eq!(
        wa.iter().map(host).collect::<Vec<_>>(),
        wb.iter().map(host).collect::<Vec<_>>()
    );
}

// ---------- training an MLP ----------

struct Task {
    x: Mat,
    labels: Vec<usize>,
    sizes: Vec<usize>,
}

fn task() -> Task {
    let d = synthetic_classification(512, 8, 20, 7).unwrap();
    Task {
        x: d.x.clone(),
        labels: d.labels.clone(),
        sizes: vec![8, 16, 20],
    }
}

fn mlp(t: &Task) -> Mlp {
    Mlp::new(
        MlpConfig {
            sizes: t.sizes.clone(),
            activation: Activation::Tanh,
            loss: Loss::SoftmaxCrossEntropy,
        },
        3,
    )
    .unwrap()
}

/// Mini-batch `k` (64 samples, cycling through a fixed permutation).
fn batch(t: &Task, k: usize) -> (Mat, Vec<usize>) {
    let n = t.labels.len();
    let bs = 64;
    let idx: Vec<usize> = (0..bs).map(|j| (k * bs + j) * 7919 % n).collect();
    let d = t.x.cols();
    let mut x = Vec::with_capacity(bs * d);
    for &i in &idx {
        x.extend_from_slice(&t.x.as_slice()[i * d..(i + 1) * d]);
    }
    (
        Mat::from_vec(x, bs, d).unwrap(),
        idx.iter().map(|&i| t.labels[i]).collect(),
    )
}

fn accuracy(net: &Mlp, t: &Task) -> f32 {
    let pred = net.predict(t.x.as_ref()).unwrap();
    pred.iter().zip(&t.labels).filter(|(a, b)| a == b).count() as f32 / t.labels.len() as f32
}

fn full_loss(net: &Mlp, t: &Task) -> f32 {
    net.evaluate(t.x.as_ref(), Targets::Classes(&t.labels))
        .unwrap()
}

fn layer_mats(net: &Mlp) -> Vec<Matrix> {
    (0..net.num_layers())
        .map(|l| {
            let (o, i) = net.layer_shape(l).unwrap();
            DEV.upload(o, i, &net.params()[net.layer_range(l).unwrap()])
                .unwrap()
        })
        .collect()
}

fn store(net: &mut Mlp, ws: &[Matrix]) {
    let mut flat = net.params().to_vec();
    for (l, w) in ws.iter().enumerate() {
        flat[net.layer_range(l).unwrap()].copy_from_slice(&host(w));
    }
    net.set_params(&flat).unwrap();
}

const TARGET: f32 = 0.9;
const MAX_STEPS: usize = 300;

/// Trains with a Kronecker optimizer for at most `steps` steps (stopping at TARGET training
/// accuracy when `stop`); returns (steps to reach TARGET, initial and final full-batch loss).
fn train_kron(
    t: &Task,
    cfg: KronConfig,
    fisher: FisherMode,
    steps: usize,
    stop: bool,
) -> (Option<usize>, f32, f32, KronCounters) {
    let mut net = mlp(t);
    let mut rng = common::seeded_rng();
    let shapes = net.layer_shapes();
    let mut opt = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
    let mut ws = layer_mats(&net);
    let l0 = full_loss(&net, t);
    let mut reached = None;
    for k in 0..steps {
        let (x, y) = batch(t, k);
        let targets = Targets::Classes(&y);
        let fwd = net.forward(x.as_ref()).unwrap();
        let (loss, grad) = if cfg.variant == KronVariant::Reng {
            net.regularized_gradient(x.as_ref(), targets, cfg.grad_reg)
                .unwrap()
        } else {
            let b = net.backward(&fwd, targets).unwrap();
            (b.loss, b.grad)
        };
        let grads: Vec<Matrix> = (0..shapes.len())
            .map(|l| {
                let (o, i) = shapes[l];
                DEV.upload(o, i, &grad[net.layer_range(l).unwrap()])
                    .unwrap()
            })
            .collect();
        let gref: Vec<&Matrix> = grads.iter().collect();
        let stats_dev: Option<Vec<(Matrix, Matrix)>> = opt.needs_stats().then(|| {
            net.fisher_stats(&fwd, fisher, targets, &mut rng)
                .unwrap()
                .into_iter()
                .map(|s| {
                    (
                        DEV.upload(s.a.rows(), s.a.cols(), s.a.as_slice()).unwrap(),
                        DEV.upload(s.e.rows(), s.e.cols(), s.e.as_slice()).unwrap(),
                    )
                })
                .collect()
        });
        let stats: Option<Vec<KronStats<'_>>> = stats_dev
            .as_ref()
            .map(|v| v.iter().map(|(a, e)| KronStats { a, e }).collect());
        opt.step(&mut ws, &gref, stats.as_deref()).unwrap();
        store(&mut net, &ws);
        let after = if cfg.variant == KronVariant::Reng {
            net.regularized_gradient(x.as_ref(), targets, cfg.grad_reg)
                .unwrap()
                .0
        } else {
            net.evaluate(x.as_ref(), targets).unwrap()
        };
        opt.observe_loss(loss, after).unwrap();
        if reached.is_none() && accuracy(&net, t) >= TARGET {
            reached = Some(k + 1);
            if stop {
                break;
            }
        }
    }
    assert_eq!(opt.counters().fallbacks(), 0, "{:?}", opt.counters());
    (reached, l0, full_loss(&net, t), *opt.counters())
}

/// SGD with heavy-ball momentum on the same batches, through the device element-wise ops.
fn train_sgd(t: &Task, lr: f32) -> Option<usize> {
    let mut net = mlp(t);
    let n = net.num_params();
    let mut w = DEV.upload(n, 1, net.params()).unwrap();
    let mut buf = DEV.zeros(n, 1).unwrap();
    for k in 0..MAX_STEPS {
        let (x, y) = batch(t, k);
        let fwd = net.forward(x.as_ref()).unwrap();
        let b = net.backward(&fwd, Targets::Classes(&y)).unwrap();
        let g = DEV.upload(n, 1, &b.grad).unwrap();
        DEV.scale(0.9, &mut buf).unwrap();
        DEV.axpy(1.0, &g, &mut buf).unwrap();
        DEV.axpy(-lr, &buf, &mut w).unwrap();
        net.set_params(&host(&w)).unwrap();
        if accuracy(&net, t) >= TARGET {
            return Some(k + 1);
        }
    }
    None
}

/// RING, RENG and NGD reach 90 % training accuracy on Gaussian blobs (20 classes in 8
/// dimensions; well conditioned: isotropic unit-scale features) in fewer steps than the best
/// of a learning-rate sweep of SGD with momentum 0.9, and lower the loss on the way.
///
/// Measured with the default Newton inverse (sweep over lr ∈ {0.3, 0.5, 1}, ρ ∈ {3e-3, 1e-2,
/// 3e-2}, S ∈ {1, 4}, ε ∈ {0, 0.95}): RING best 3 steps (lr 1, ρ 3e-2, S 1), RENG 3 (lr 1,
/// ρ 1e-2, S 1), NGD 3 (lr 1, ρ 1e-2, S 1); SGD lr ∈ {0.3, 1, 2, 3, 5, 10} → 20, 10, 8, 6,
/// 5, 6 steps. The paper defaults (lr 1, ρ 1e-3) diverge here for RING and NGD: RING's
/// relative damping √ρ‖Γ‖₂ is tiny once the softmax is confident.
///
/// The Fisher is the exact expectation, not a draw: a step count compared with a threshold
/// must not depend on sampled labels (with them RING took 3–7 steps over 8 seeds, SGD's best
/// is 5). Data and network are fixed (library seeds), so the run is deterministic.
#[test]
fn kron_optimizers_beat_sgd_on_a_well_conditioned_task() {
    let t = task();
    let sgd: Vec<(f32, Option<usize>)> = [0.3f32, 1.0, 2.0, 3.0, 5.0, 10.0]
        .iter()
        .map(|&lr| (lr, train_sgd(&t, lr)))
        .collect();
    let best_sgd = sgd
        .iter()
        .filter_map(|s| s.1)
        .min()
        .unwrap_or(MAX_STEPS + 1);
    eprintln!("SGD (lr, steps to {TARGET}): {sgd:?}");
    let tuned = [
        KronConfig {
            lr: 1.0,
            rho: 3e-2,
            skip: 1,
            ..KronConfig::ring()
        },
        KronConfig {
            lr: 1.0,
            rho: 1e-2,
            skip: 1,
            ..KronConfig::reng()
        },
        KronConfig {
            lr: 1.0,
            rho: 1e-2,
            skip: 1,
            ..KronConfig::ngd()
        },
    ];
    for cfg in tuned {
        let (steps, l0, l1, _) = train_kron(&t, cfg, FisherMode::Exact, MAX_STEPS, true);
        eprintln!(
            "{:?}: steps to {TARGET} = {steps:?}, loss {l0:.4} -> {l1:.4}",
            cfg.variant
        );
        assert!(l1 < 0.5 * l0, "{:?}: loss {l0} -> {l1}", cfg.variant);
        let s = steps.unwrap_or_else(|| panic!("{:?} did not reach {TARGET}", cfg.variant));
        assert!(
            s < best_sgd,
            "{:?}: {s} steps vs SGD {best_sgd}",
            cfg.variant
        );
    }
}

/// With the lazy Fisher (S = 4: first-order inverse updates between refreshes) and the LM
/// controller running, every variant keeps lowering the loss over 40 steps.
#[test]
fn lazy_training_lowers_the_loss() {
    let t = task();
    for base in [KronConfig::ring(), KronConfig::reng(), KronConfig::ngd()] {
        let cfg = KronConfig {
            lr: 0.5,
            rho: 3e-2,
            skip: 4,
            phi: 0.95,
            ..base
        };
        // The exact Fisher: with sampled labels RING ended at 1.09 (threshold 0.91) or
        // diverged (3.0 → 3e4, GRNG_TEST_SEED=2527721849149027881) for ~1 seed in 15.
        let (_, l0, l1, c) = train_kron(&t, cfg, FisherMode::Exact, 40, false);
        eprintln!("{:?} S = 4: loss {l0:.4} -> {l1:.4}, {c:?}", cfg.variant);
        assert_eq!(c.refreshes, 10);
        assert!(c.first_order_updates > 0, "{c:?}");
        // The one power iteration left (RING's ‖F‖₂ per factor and refresh) converges at its
        // tolerance on a trained network's factors (the inverse's, gone, hit its budget).
        assert_eq!(c.power_unconverged, 0, "{c:?}");
        assert!(l1 < 0.3 * l0, "{:?}: loss {l0} -> {l1}", cfg.variant);
    }
}

/// Regression: with S = 1 every step inverts afresh, warm-started from the previous Newton
/// inverse, which is symmetric only to rounding (~1e-5 relative, beyond the 1e-5 tolerance
/// on `a`); the warm start is a hint whose symmetric part is used, so 30 steps run through
/// without an error, a Cholesky fallback or a Newton divergence.
#[test]
fn newton_warm_starts_with_skip_one_train() {
    let t = task();
    for base in [KronConfig::ring(), KronConfig::ngd()] {
        let cfg = KronConfig {
            lr: 0.5,
            rho: 3e-2,
            skip: 1,
            // The GPU default (Auto picks Cholesky on the CPU).
            inverse: InverseMethod::Auto.resolve(&Device::Emulated),
            ..base
        };
        assert!(matches!(cfg.inverse, InverseMethod::Newton(o) if o.init == InitialGuess::Warm));
        let (_, l0, l1, c) = train_kron(&t, cfg, FisherMode::Sampled, 30, false);
        assert_eq!(c.refreshes, 30, "{c:?}");
        assert!(c.newton_inversions > 0, "{c:?}");
        assert_eq!(c.newton_divergences, 0, "{c:?}");
        assert!(l1 < l0, "{:?}: loss {l0} -> {l1}", cfg.variant);
    }
}

/// The default inverse resolves per device: Cholesky (faer, exact) on the CPU, warm Newton on
/// the kernel devices; an explicit method is kept as is. Training with the default on the CPU
/// inverts by Cholesky only, and no inversion is counted as a fallback.
#[test]
fn auto_inverse_is_cholesky_on_cpu_newton_on_gpu() {
    for cfg in [KronConfig::ring(), KronConfig::reng(), KronConfig::ngd()] {
        assert_eq!(cfg.inverse, InverseMethod::Auto);
        assert_eq!(cfg.inverse.resolve(&Device::Cpu), InverseMethod::Cholesky);
        assert!(matches!(
            cfg.inverse.resolve(&Device::Emulated),
            InverseMethod::Newton(o) if o == NewtonOptions { init: InitialGuess::Warm, ..NewtonOptions::default() }
        ));
        assert_eq!(
            InverseMethod::Cholesky.resolve(&Device::Emulated),
            InverseMethod::Cholesky
        );
    }
    let t = task();
    let cfg = KronConfig {
        lr: 0.5,
        rho: 3e-2,
        skip: 1,
        ..KronConfig::ngd()
    };
    let (_, l0, l1, c) = train_kron(&t, cfg, FisherMode::Sampled, 10, false);
    assert_eq!(c.refreshes, 10, "{c:?}");
    assert!(c.cholesky_inversions >= 10, "{c:?}");
    assert_eq!((c.newton_inversions, c.cholesky_fallbacks), (0, 0), "{c:?}");
    assert!(l1 < l0, "loss {l0} -> {l1}");
}

/// An overflowing step (finite but huge gradients) is a `NonFinite` error that changes nothing;
/// `reject_step` then raises ρ as the LM rule does for `r = −∞`, and counts it.
#[test]
fn overflowing_step_is_non_finite_and_reject_step_raises_rho() {
    let (mut opt, p, mut w) = warmed(common::seed());
    let before = snapshot(&opt);
    let w_before: Vec<Vec<f32>> = w.iter().map(host).collect();
    let huge: Vec<Matrix> = p.grads[0].iter().map(|g| with_value(g, 0, 3e38)).collect();
    let grads: Vec<&Matrix> = huge.iter().collect();
    let stats = opt.needs_stats().then(|| stats_of(&p, 0));
    match opt.step(&mut w, &grads, stats.as_deref()) {
        Err(grng::Error::NonFinite { .. }) => {}
        other => panic!("expected NonFinite, got {other:?}"),
    }
    assert!(snapshot(&opt) == before, "state changed on error");
    assert_eq!(w.iter().map(host).collect::<Vec<_>>(), w_before);
    let (rho, rejected) = (opt.rho(), opt.counters().nonfinite_losses);
    opt.reject_step();
    assert!(opt.rho() > rho, "ρ must grow: {} -> {}", rho, opt.rho());
    assert_eq!(opt.counters().nonfinite_losses, rejected + 1);
}

/// The same first-order update when the damping grows (`dλ > 0`, after a bad step): the error
/// still scales as `dλ²` (the sign of `dλ` in `X ← X − dλ·X·X` is right both ways).
#[test]
fn first_order_inverse_update_tracks_a_growing_damping() {
    // 1/√φ − 1 = 0.25, 0.111, 0.0526 of λ₀: dλ > 0.
    let phis = [0.8f32 * 0.8, 0.9 * 0.9, 0.95 * 0.95];
    let runs: Vec<(f64, f64)> = phis
        .iter()
        .map(|&phi| {
            let (err, t, opt) = lazy_error_moving(phi, true);
            assert!(t <= 0.5, "set-up must stay on the first-order path ({t})");
            assert_eq!(opt.counters().first_order_updates, 2);
            (err, t)
        })
        .collect();
    // err ≈ C·dλ² and t ∝ dλ: err/t² is about constant (within the O(dλ³) remainder).
    let c: Vec<f64> = runs.iter().map(|(e, t)| e / (t * t)).collect();
    eprintln!("growing damping: (err, |dλ|·‖X‖) {runs:?}, err/t² {c:?}");
    for w in c.windows(2) {
        assert!(
            (0.6..=1.5).contains(&(w[1] / w[0])),
            "not second order: {c:?}"
        );
    }
    assert!(runs[2].0 > 1e-4, "error far above f32 rounding");
}

proptest! {
    #![proptest_config(common::proptest_config(16))]

    /// `step_grads_with_output_change` gives layer 0's output change on its factored
    /// gradient's batch rows, `ΔZ = A·(W̄' − W̄)ᵀ`, with the weights and step info of
    /// `step_grads` bit for bit. Four steps (refreshes at 0 and 3, first-order lazy steps at a
    /// damping moved by the model between), each from `W̄ = 0` so that `W̄' − W̄ = W̄'`
    /// exactly, on the factored route with dense inverses (widths 24–64, batch ≤ 8) or through
    /// the rows (widths 100–140, `ε = 0`). Against `A·W̄'ᵀ` in f64, entry by entry within
    /// `4·(d_in + 2m + 4)·u·η·(|A||X_Λ||A|ᵀ|E||X_Γ|/m)` plus `2u·(|A||W̄'|ᵀ)`: the f32
    /// roundings of `AVᵀ/m` (inner `d_in`), of `(AVᵀ/m)·Uᵀ` and of `P = UV/m` (inner `m`
    /// each) from the same `U`, `V`, and of `W̄'`; `|X|` the first-order scale
    /// (`common::first_order_scale64`) at a drift of 20% of the formation damping, more than
    /// two moves of `ρ` by 0.8 give. A layer index past the last is a typed error, and a
    /// dense gradient gives no change.
    #[test]
    fn output_change_is_the_step_on_the_batch_rows(
        seed in any::<u64>(),
        (d_out, d_in) in (24usize..=64, 24usize..=64),
        wide in any::<bool>(),
        m in 1usize..=8,
        m_s in 1usize..=12,
        ema in prop_oneof![Just(0.0f32), Just(0.95)],
        variant in prop_oneof![Just(KronVariant::Ring), Just(KronVariant::Ngd)],
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (o, i) = if wide { (d_out + 76, d_in + 76) } else { (d_out, d_in) };
        let mut cfg = common::variant_config(variant);
        (cfg.ema, cfg.skip, cfg.phi, cfg.inverse) = (ema, 3, 0.8, InverseMethod::Cholesky);
        let shapes = [(o, i), (3, o)];
        let mut plain = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
        let mut with = KronOptimizer::new(&DEV, &shapes, cfg).unwrap();
        let zeros = || vec![DEV.zeros(o, i).unwrap(), DEV.zeros(3, o).unwrap()];
        for k in 0..4 {
            let (e, a) = (rand_mat(&mut rng, m, o), rand_mat(&mut rng, m, i));
            let (e2, a2) = (rand_mat(&mut rng, m, 3), rand_mat(&mut rng, m, o));
            let grads = [
                KronGrad::Factored { e: &e, a: &a },
                KronGrad::Factored { e: &e2, a: &a2 },
            ];
            let (sa, se) = (rand_mat(&mut rng, m_s, i), rand_mat(&mut rng, m_s, o));
            let (sa2, se2) = (rand_mat(&mut rng, m_s, o), rand_mat(&mut rng, m_s, 3));
            let stats = [KronStats { a: &sa, e: &se }, KronStats { a: &sa2, e: &se2 }];
            let stats = plain.needs_stats().then_some(&stats[..]);
            let (mut wp, mut ww) = (zeros(), zeros());
            if k == 0 {
                let err = with
                    .step_grads_with_output_change(&mut ww, &grads, stats, 2)
                    .unwrap_err();
                prop_assert!(matches!(err, Error::Value { arg: "layer", .. }), "{err:?}");
            }
            let ip = plain.step_grads(&mut wp, &grads, stats).unwrap();
            let (iw, dz) = with
                .step_grads_with_output_change(&mut ww, &grads, stats, 0)
                .unwrap();
            prop_assert_eq!(ip, iw);
            for (p, w) in wp.iter().zip(&ww) {
                prop_assert_eq!(host(p), host(w));
            }
            let dz = dz.expect("the factored route with the model gives the change");
            prop_assert_eq!(dz.shape(), (m, o));
            let st = plain.state().unwrap();
            let l = &st.layers[0];
            let bound = |s: &KronFactorState| common::first_order_scale64(s, s.damping * 0.8);
            let (chain, _) = factored_chains(&bound(&l.gamma), &bound(&l.lambda), &e, &a);
            let (aabs, w1) = (abs64(&a), host(&wp[0]));
            let scale = common::matmul64(&aabs, &transpose64(&chain, o, i), m, i, o);
            let wabs: Vec<f64> = w1.iter().map(|v| v.abs() as f64).collect();
            let wt = |v: &[f64]| transpose64(v, o, i);
            let w64: Vec<f64> = w1.iter().map(|&v| v as f64).collect();
            let want = common::matmul64(&f64s(&a), &wt(&w64), m, i, o);
            let round = common::matmul64(&aabs, &wt(&wabs), m, i, o);
            let unit = 4.0 * (i + 2 * m + 4) as f64 * common::U32;
            for (idx, (&got, &w)) in host(&dz).iter().zip(&want).enumerate() {
                let tol = unit * iw.lr as f64 * scale[idx] + 2.0 * common::U32 * round[idx]
                    + f32::MIN_POSITIVE as f64;
                prop_assert!(
                    (got as f64 - w).abs() <= tol,
                    "step {k} [{idx}]: ΔZ {got} vs A·W̄'ᵀ {w}, tol {tol:e}"
                );
            }
            // A good model: ρ falls by φ, so the next lazy step retargets its inverses.
            let q = ip.predicted_change.unwrap();
            plain.observe_loss(1.0, 1.0 + q).unwrap();
            with.observe_loss(1.0, 1.0 + q).unwrap();
        }
        // A dense gradient has no factors to give the change by.
        let g = rand_mat(&mut rng, o, i);
        let g2 = rand_mat(&mut rng, 3, o);
        let dense = [KronGrad::Dense(&g), KronGrad::Dense(&g2)];
        let (_, dz) = with
            .step_grads_with_output_change(&mut zeros(), &dense, None, 0)
            .unwrap();
        prop_assert!(dz.is_none());
    }
}

/// The largest relative Frobenius gap between two runs' weights, matrix by matrix.
fn rel_gap(lazy: &[Vec<Vec<f32>>], fresh: &[Vec<Vec<f32>>]) -> f64 {
    let mut worst = 0.0f64;
    for (a, b) in lazy.iter().flatten().zip(fresh.iter().flatten()) {
        let num = frob(
            &a.iter()
                .zip(b)
                .map(|(x, y)| (x - y) as f64)
                .collect::<Vec<_>>(),
        );
        let den = frob(&b.iter().map(|&v| v as f64).collect::<Vec<_>>());
        worst = worst.max(num / den);
    }
    worst
}
