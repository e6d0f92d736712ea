//! The low-rank (Woodbury) damped inverse `(XᵀX/m + λI)⁻¹` on the CPU
//! (`grng::cpu::low_rank_damped_inverse`) against an `f64` Cholesky reference, its `bf16`
//! input, its typed errors, and its use by `KronOptimizer` at a refresh.
//!
//! # Tolerance
//! The result is rounded once from `f64`: `2⁻²⁴·|Z_ij| ≤ 2⁻²⁴/λ` per entry. Before that, the
//! `f64` Woodbury path is exact for a perturbed `XXᵀ + mλI + E` with `‖E‖ ≲ (m + n)·ε_f64·
//! ‖|X||X|ᵀ‖` (Gram, Cholesky and triangular solve are backward stable; the absolute values
//! because the Gram sums signed products), which moves `Z` by `≲ (m + n)·ε_f64·κ/λ` with
//! `κ = (λ + ‖X‖_F²/m)/λ ≥ (λ + ‖|X||X|ᵀ‖₂/m)/λ` (the `f64` reference's own error is of the
//! same form). The bound below takes four times that constant and twice the sum, so it does
//! not fail by chance: worst-case rounding bounds are far from the typical `√n`-sized errors.

use grng_testkit as common;

use grng::ops::newton::Precision;
use grng::optim::kron::{InverseMethod, KronConfig, KronGrad, KronOptimizer, KronState};
use grng::optim::KronStats;
use grng::{Device, Error, MatRef, Matrix, Trans};
use half::bf16;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DEV: Device = Device::Cpu;
const U64: f64 = f64::EPSILON / 2.0;

/// `(XᵀX/m + λI)⁻¹` in f64 for row-major `m x n` `x`.
fn reference(x: &[f32], m: usize, n: usize, lambda: f32) -> Vec<f64> {
    let mut a = common::gram64(x, m, n);
    (0..n).for_each(|i| a[i * n + i] += lambda as f64);
    common::spd_inverse64(&a, n)
}

/// The per-entry error bound of the module docs for `x` (`m x n`) and `λ`.
fn tolerance(x: &[f32], m: usize, n: usize, lambda: f32) -> f64 {
    let l = lambda as f64;
    let trace = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / m as f64;
    let kappa = (l + trace) / l;
    2.0 * (common::U32 + 4.0 * (m + n) as f64 * U64 * kappa) / l
}

/// Largest `|Z_ij − R_ij| / tol`; also asserts `Z` is exactly symmetric.
fn worst_ratio(z: &[f32], r: &[f64], n: usize, tol: f64) -> f64 {
    common::assert_symmetric(z, n);
    z.iter()
        .zip(r)
        .map(|(a, b)| (*a as f64 - b).abs() / tol)
        .fold(0.0, f64::max)
}

proptest! {
    #![proptest_config(common::proptest_config(64))]

    /// Ragged sizes with `m` below and above `n`, entries spanning four decades of scale,
    /// `λ` over six decades relative to it, `f32` rows stored `pad` floats apart: the inverse
    /// matches the f64 reference within the module-docs bound, and `bf16` rows give the
    /// bits of their widened `f32` copy.
    #[test]
    fn matches_f64_reference(
        seed in any::<u64>(),
        n in 1usize..=200,
        m_frac in 0.0f64..1.3,
        log_scale in -2.0f64..2.0,
        log_lambda in -5.0f64..1.0,
        pad in 0usize..3,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let m = ((m_frac * n as f64).round() as usize).max(1);
        let scale = 10f64.powf(log_scale) as f32;
        let x: Vec<f32> = common::vals(&mut rng, m * n).iter().map(|v| v * scale).collect();
        let lambda = (10f64.powf(log_lambda) * (scale as f64).powi(2)) as f32;

        let ld = n + pad;
        let mut padded = vec![f32::NAN; m * ld];
        for i in 0..m {
            padded[i * ld..i * ld + n].copy_from_slice(&x[i * n..(i + 1) * n]);
        }
        let view = MatRef::with_ld(&padded, m, n, ld).unwrap();
        let z = grng::cpu::low_rank_damped_inverse(view, lambda).unwrap();
        prop_assert_eq!(z.shape(), (n, n));
        let r = reference(&x, m, n, lambda);
        let worst = worst_ratio(z.as_slice(), &r, n, tolerance(&x, m, n, lambda));
        prop_assert!(worst <= 1.0, "m {} n {} λ {:e}: error {}x the bound", m, n, lambda, worst);

        let h: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let widened: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        let (hv, wv) = (MatRef::new(&h, m, n).unwrap(), MatRef::new(&widened, m, n).unwrap());
        let zb = grng::cpu::low_rank_damped_inverse(hv, lambda).unwrap();
        let zw = grng::cpu::low_rank_damped_inverse(wv, lambda).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(zb.as_slice()), bits(zw.as_slice()));

        // The optimizer's entry points (`LowRankKernel`: the dense inverse from the kernel's
        // stored Gram matrix, also after a reformation at another damping) give the same bits.
        let kernel = grng::cpu::LowRankKernel::new(view, lambda).unwrap();
        prop_assert_eq!(bits(kernel.inverse(view).unwrap().as_slice()), bits(z.as_slice()));
        let other = lambda * 1.5;
        let zr = kernel.reformed(other).unwrap().inverse(view).unwrap();
        let zo = grng::cpu::low_rank_damped_inverse(view, other).unwrap();
        prop_assert_eq!(bits(zr.as_slice()), bits(zo.as_slice()));
    }
}

/// NaN/Inf in `x` (f32 or bf16) are `NonFinite` at their flat index; `λ` that is not a
/// normal positive number is `Value`; no rows is `Shape` (no columns: the empty inverse); a
/// `K = XXᵀ + mλI` that rounding left singular is `NotSpd`.
#[test]
fn bad_inputs_are_typed_errors() {
    let mut rng = common::seeded_rng();
    let (m, n) = (rng.random_range(1..20), rng.random_range(1..40));
    let x = common::vals(&mut rng, m * n);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let at = rng.random_range(0..m * n);
        let mut y = x.clone();
        y[at] = bad;
        let h: Vec<bf16> = y.iter().map(|&v| bf16::from_f32(v)).collect();
        let errs = [
            grng::cpu::low_rank_damped_inverse(MatRef::new(&y, m, n).unwrap(), 0.1),
            grng::cpu::low_rank_damped_inverse(MatRef::new(&h, m, n).unwrap(), 0.1),
        ];
        for e in errs {
            match e {
                Err(Error::NonFinite {
                    arg, index, value, ..
                }) => {
                    assert_eq!((arg, index), ("x", at));
                    assert_eq!(value.to_bits(), bad.to_bits());
                }
                other => panic!("{bad} at {at}: {other:?}"),
            }
        }
    }
    let good = MatRef::new(&x, m, n).unwrap();
    for lambda in [0.0, -1.0, f32::NAN, f32::INFINITY, f32::MIN_POSITIVE / 2.0] {
        assert!(
            matches!(
                grng::cpu::low_rank_damped_inverse(good, lambda),
                Err(Error::Value { arg: "lambda", .. })
            ),
            "λ = {lambda}"
        );
    }
    // Two equal rows of ones (n = 4): `XXᵀ` is all 4s, and `mλ = 2·f32::MIN_POSITIVE` is far
    // below the f64 rounding of 4, so the second Cholesky pivot is exactly `4 − 2·2 = 0`
    // (every operation exact on these powers of two).
    let ones = [1.0f32; 8];
    assert!(matches!(
        grng::cpu::low_rank_damped_inverse(MatRef::new(&ones, 2, 4).unwrap(), f32::MIN_POSITIVE),
        Err(Error::NotSpd { index: 1, .. })
    ));
    // Rows of no column: the 0 x 0 inverse.
    let empty = grng::cpu::low_rank_damped_inverse(MatRef::<f32>::new(&[], 3, 0).unwrap(), 1.0);
    assert_eq!(empty.unwrap().shape(), (0, 0));
    // Rows other than the kernel's are `Shape` (none at all when m = 1); a reformation at a
    // damping that is not a normal positive number is `Value`.
    let kernel = grng::cpu::LowRankKernel::new(good, 0.1).unwrap();
    for lambda in [0.0, -1.0, f32::NAN, f32::INFINITY, f32::MIN_POSITIVE / 2.0] {
        assert!(
            matches!(
                kernel.reformed(lambda),
                Err(Error::Value { arg: "lambda", .. })
            ),
            "reformed at λ = {lambda}"
        );
    }
    let fewer = MatRef::new(&x[n..], m - 1, n).unwrap();
    assert!(matches!(
        kernel.inverse(fewer),
        Err(Error::Shape { arg: "x", .. })
    ));
    let none: [f32; 0] = [];
    assert!(matches!(
        grng::cpu::low_rank_damped_inverse(MatRef::new(&none, 0, 3).unwrap(), 1.0),
        Err(Error::Shape { arg: "x", .. })
    ));
}

// ---------- in the optimizer ----------

/// `(d_out, d_in)` of the one layer: both sides above the low-rank path's `n > 64`.
const SHAPE: (usize, usize) = (72, 100);

struct Problem {
    a: Matrix,
    e: Matrix,
    g: Matrix,
    w0: Vec<f32>,
}

/// A layer of `shape`, with `m_a` and `m_e` rows of statistics.
fn problem(rng: &mut ChaCha8Rng, shape: (usize, usize), m_a: usize, m_e: usize) -> Problem {
    let (o, i) = shape;
    let mut up = |r, c| DEV.upload(r, c, &common::vals(rng, r * c)).unwrap();
    let (a, e, g) = (up(m_a, i), up(m_e, o), up(o, i));
    Problem {
        a,
        e,
        g,
        w0: common::vals(rng, o * i),
    }
}

/// One RENG step (damping `√ρ` on both factors) with `stats`; returns the optimizer and the
/// preconditioned gradient it applied, `(W₀ − W₁)/η`.
fn step(opt: &mut KronOptimizer, p: &Problem, stats: &[KronStats<'_>]) -> Vec<f64> {
    let (o, i) = p.g.shape();
    let mut w = vec![DEV.upload(o, i, &p.w0).unwrap()];
    let info = opt.step(&mut w, &[&p.g], Some(stats)).unwrap();
    let w1 = w[0].to_vec().unwrap();
    p.w0.iter()
        .zip(&w1)
        .map(|(a, b)| (*a as f64 - *b as f64) / info.lr as f64)
        .collect()
}

fn host(m: &Matrix) -> Vec<f32> {
    m.to_vec().unwrap()
}

fn reng(ema: f32) -> KronConfig {
    KronConfig {
        ema,
        skip: 1,
        ..KronConfig::reng()
    }
}

/// Checks the state's inverses against the f64 inverses from the rows `a`, `e` (as the
/// factors read them), within the bound of the module docs, and the applied `P` against
/// `Γ̃⁻¹GΛ̃⁻¹` from those f64 inverses, within the rounding of the f32
/// inverses and of the two preconditioning GEMMs.
fn check_against_rows(st: &KronState, a: &[f32], e: &[f32], p: &Problem, applied: &[f64]) {
    let (o, i) = SHAPE;
    let (sl, sg) = (&st.layers[0].lambda, &st.layers[0].gamma);
    let (ma, me) = (a.len() / i, e.len() / o);
    let zl = reference(a, ma, i, sl.damping);
    let zg = reference(e, me, o, sg.damping);
    let wl = worst_ratio(&host(&sl.inverse), &zl, i, tolerance(a, ma, i, sl.damping));
    let wg = worst_ratio(&host(&sg.inverse), &zg, o, tolerance(e, me, o, sg.damping));
    assert!(
        wl <= 1.0 && wg <= 1.0,
        "inverse errors {wl}x, {wg}x the bound"
    );

    let g: Vec<f64> = host(&p.g).iter().map(|&v| v as f64).collect();
    let want = common::matmul64(&common::matmul64(&zg, &g, o, o, i), &zl, o, i, i);
    // ‖Z‖₂ ≤ 1/λ for both inverses: P's scale, and each f32 rounding (inverse entries, GEMM
    // sums of ≤ 100 terms, the update W₀ − ηP) adds ≲ (o + i + 4)·2⁻²⁴ of it per entry.
    let scale =
        (g.iter().map(|v| v * v).sum::<f64>()).sqrt() / (sl.damping as f64 * sg.damping as f64);
    let w_scale = p.w0.iter().map(|v| v.abs() as f64).fold(1.0, f64::max);
    let tol = 4.0 * (o + i + 4) as f64 * common::U32 * (scale + w_scale);
    for (k, (x, y)) in applied.iter().zip(&want).enumerate() {
        assert!((x - y).abs() <= tol, "P[{k}] = {x} vs {y} (tol {tol:e})");
    }
}

/// With `ε = 0` and `m ≤ n/2` rows for both factors, a refresh inverts both by the low-rank
/// path (counted, no Cholesky), every refresh; the step matches the f64 reference from the
/// rows. `f32` statistics rounded by `stats_precision = Bf16` are inverted as rounded, and
/// `bf16` statistics give the same bits.
#[test]
fn refresh_with_few_rows_uses_the_low_rank_inverse() {
    let mut rng = common::seeded_rng();
    let (o, i) = SHAPE;
    let mut opt = KronOptimizer::new(&DEV, &[SHAPE], reng(0.0)).unwrap();
    for k in 1..=2u64 {
        let p = problem(&mut rng, SHAPE, i / 2, o / 2);
        let applied = step(&mut opt, &p, &[KronStats { a: &p.a, e: &p.e }]);
        let c = *opt.counters();
        assert_eq!((c.low_rank_inversions, c.cholesky_inversions), (2 * k, 0));
        check_against_rows(
            &opt.state().unwrap(),
            &host(&p.a),
            &host(&p.e),
            &p,
            &applied,
        );
    }

    let p = problem(&mut rng, SHAPE, i / 4, o / 3);
    let rounded = |m: &Matrix| -> Vec<f32> {
        host(m)
            .iter()
            .map(|&v| bf16::from_f32(v).to_f32())
            .collect()
    };
    let cfg = KronConfig {
        stats_precision: Precision::Bf16,
        ..reng(0.0)
    };
    let mut opt = KronOptimizer::new(&DEV, &[SHAPE], cfg).unwrap();
    let applied = step(&mut opt, &p, &[KronStats { a: &p.a, e: &p.e }]);
    assert_eq!(opt.counters().low_rank_inversions, 2);
    let st = opt.state().unwrap();
    check_against_rows(&st, &rounded(&p.a), &rounded(&p.e), &p, &applied);

    let to_bf16 = |m: &Matrix| {
        let h: Vec<bf16> = host(m).iter().map(|&v| bf16::from_f32(v)).collect();
        DEV.upload(m.rows(), m.cols(), &h).unwrap()
    };
    let (ab, eb) = (to_bf16(&p.a), to_bf16(&p.e));
    let mut fed = KronOptimizer::new(&DEV, &[SHAPE], reng(0.0)).unwrap();
    assert_eq!(step(&mut fed, &p, &[KronStats { a: &ab, e: &eb }]), applied);
    let st2 = fed.state().unwrap();
    assert_eq!(
        host(&st2.layers[0].lambda.inverse),
        host(&st.layers[0].lambda.inverse)
    );
    assert_eq!(
        host(&st2.layers[0].gamma.inverse),
        host(&st.layers[0].gamma.inverse)
    );
}

/// The low-rank path only replaces a Cholesky inversion of a factor formed from `m ≤ n/2`
/// rows, `n > 64`, that replaced the old one: more rows, smaller factors, an EMA-blended
/// refresh, or a Newton method keep their inversion.
#[test]
fn low_rank_inverse_only_where_it_applies() {
    let mut rng = common::seeded_rng();
    let (o, i) = SHAPE;
    // Λ from i/2 + 1 rows: Cholesky; Γ from o/2: low rank.
    let p = problem(&mut rng, SHAPE, i / 2 + 1, o / 2);
    let mut opt = KronOptimizer::new(&DEV, &[SHAPE], reng(0.0)).unwrap();
    step(&mut opt, &p, &[KronStats { a: &p.a, e: &p.e }]);
    let c = *opt.counters();
    assert_eq!((c.low_rank_inversions, c.cholesky_inversions), (1, 1));

    // n = 64 and 8: below the low-rank path's size, however few the rows.
    let p = problem(&mut rng, (8, 64), 2, 2);
    let mut opt = KronOptimizer::new(&DEV, &[(8, 64)], reng(0.0)).unwrap();
    step(&mut opt, &p, &[KronStats { a: &p.a, e: &p.e }]);
    let c = *opt.counters();
    assert_eq!((c.low_rank_inversions, c.cholesky_inversions), (0, 2));

    // ε > 0: the first refresh replaces (low rank), the second blends (Cholesky).
    let p = problem(&mut rng, SHAPE, 4, 4);
    let mut opt = KronOptimizer::new(&DEV, &[SHAPE], reng(0.5)).unwrap();
    for _ in 0..2 {
        step(&mut opt, &p, &[KronStats { a: &p.a, e: &p.e }]);
    }
    let c = *opt.counters();
    assert_eq!((c.low_rank_inversions, c.cholesky_inversions), (2, 2));

    let cfg = KronConfig {
        inverse: InverseMethod::Newton(Default::default()),
        ..reng(0.0)
    };
    let mut opt = KronOptimizer::new(&DEV, &[SHAPE], cfg).unwrap();
    step(&mut opt, &p, &[KronStats { a: &p.a, e: &p.e }]);
    let c = *opt.counters();
    assert_eq!((c.low_rank_inversions, c.newton_inversions), (0, 2));
}

/// The lazy steps' low-rank route (`optim/kron/low_rank.rs`: the inverse and docs/math.md's
/// first-order update of it applied through the statistics rows, the model's curvature by
/// `m x m` products) against the dense route on the same problem: one optimizer takes the
/// gradients by their batch factors (`E`, `A`: the rows' route), the other the dense
/// `G = EᵀA/m` (the dense inverses, `X₀ − Δ·X₀²` as an axpy), over refreshes and lazy steps
/// while `ρ` moves (every `observe_loss` reports a ratio of 1 or 0, so `ρ` falls and rises).
/// Every third step the first one takes the dense gradient too, switching routes mid-run.
///
/// Tolerance: both routes apply the same operator; each rounds `f32` products of at most
/// `n + m` terms, and the rows' route cancels `g₀·Y` against the correction along `F`'s large
/// eigenvalues, an error `(n + m)·2⁻²⁴·κ` of `‖Y‖/λ` with `κ = (λ + ‖X‖_F²/m)/λ` (module docs
/// of `LowRankKernel`). Per step `P` moves `W` by `η‖P‖ ≤ η‖G‖/(λ_Λλ_Γ)`; the bound takes 8x
/// the constant on both factors' `κ`, summed over the steps. The predicted changes are
/// compared relative to their size with the same constant.
#[test]
fn lazy_steps_through_the_rows_match_the_dense_route() {
    lazy_rows_against_dense(&mut common::seeded_rng(), SHAPE, (20, 24));
}

proptest! {
    #![proptest_config(common::proptest_config(16))]

    /// [`lazy_steps_through_the_rows_match_the_dense_route`] on ragged shapes: both sides
    /// wider than 64 (the rows' route on each), from 1 to 32 statistics rows and 1 to 40
    /// batch rows.
    #[test]
    fn lazy_rows_match_the_dense_route_on_ragged_shapes(
        seed in any::<u64>(),
        o in 65usize..=140,
        i in 65usize..=140,
        m_s in 1usize..=32,
        m_b in 1usize..=40,
    ) {
        lazy_rows_against_dense(&mut ChaCha8Rng::seed_from_u64(seed), (o, i), (m_s, m_b));
    }
}

/// As [`lazy_steps_through_the_rows_match_the_dense_route`] for layers with a side narrower
/// than the batch (8 against 24 rows), which the rows' route takes by 8 rows
/// (`Ẽ = I`, `Ã = (8/24)·EᵀA`, or the mirror image; `factored.rs`, `thin_factors`): a narrow
/// output side (the rows' route on `Λ`) and a narrow input side (on `Γ`).
#[test]
fn narrow_layers_take_the_rows_route_by_fewer_rows() {
    let mut rng = common::seeded_rng();
    lazy_rows_against_dense(&mut rng, (8, 100), (20, 24));
    lazy_rows_against_dense(&mut rng, (100, 8), (20, 24));
}

/// Twelve steps of a `shape` layer from `m_s` statistics rows and `m_b` batch rows on the
/// rows' route (with and without the factors' Gram matrices) against the dense route.
fn lazy_rows_against_dense(
    rng: &mut ChaCha8Rng,
    shape: (usize, usize),
    (m_s, m_b): (usize, usize),
) {
    let (o, i) = shape;
    let cfg = KronConfig {
        ema: 0.0,
        skip: 4,
        inverse: InverseMethod::Cholesky,
        // λ = √ρ near ‖F‖ (κ small, a tight bound) and φ = 0.7: each move of ρ shifts λ by
        // ~16%, so the first-order term is far above the rounding the bound allows.
        rho: 1.0,
        rho_max: 10.0,
        phi: 0.7,
        ..KronConfig::reng()
    };
    let mut rows = KronOptimizer::new(&DEV, &[shape], cfg).unwrap();
    let mut dense = KronOptimizer::new(&DEV, &[shape], cfg).unwrap();
    // The rows' route again, handed the factors' Gram matrices too.
    let mut grams = KronOptimizer::new(&DEV, &[shape], cfg).unwrap();
    let w0 = common::vals(rng, o * i);
    let (mut wr, mut wd, mut wg) = (
        vec![DEV.upload(o, i, &w0).unwrap()],
        vec![DEV.upload(o, i, &w0).unwrap()],
        vec![DEV.upload(o, i, &w0).unwrap()],
    );
    let mut drift = 0.0f64;
    for k in 0..12 {
        let (e, a) = (common::vals(rng, m_b * o), common::vals(rng, m_b * i));
        let (ed, ad) = (
            DEV.upload(m_b, o, &e).unwrap(),
            DEV.upload(m_b, i, &a).unwrap(),
        );
        let g: Vec<f32> = (0..o * i)
            .map(|idx| {
                let (r, c) = (idx / i, idx % i);
                (0..m_b).map(|s| e[s * o + r] * a[s * i + c]).sum::<f32>() / m_b as f32
            })
            .collect();
        let gd = DEV.upload(o, i, &g).unwrap();
        let (sa, se) = (
            DEV.upload(m_s, i, &common::vals(rng, m_s * i)).unwrap(),
            DEV.upload(m_s, o, &common::vals(rng, m_s * o)).unwrap(),
        );
        let stats = [KronStats { a: &sa, e: &se }];
        let stats = rows.needs_stats().then_some(&stats[..]);
        let fact = [KronGrad::Factored { e: &ed, a: &ad }];
        let gram = |x: &Matrix| {
            let mut c = DEV.zeros(m_b, m_b).unwrap();
            DEV.gemm(Trans::No, Trans::Yes, 1.0 / m_b as f32, x, x, 0.0, &mut c)
                .unwrap();
            c
        };
        let (ee, aa) = (gram(&ed), gram(&ad));
        let with_grams = [KronGrad::FactoredWithGrams {
            e: &ed,
            a: &ad,
            ee: &ee,
            aa: &aa,
        }];
        // Every third step hands the rows' optimizers the dense gradient: their state switches
        // routes (the dense inverse formed from the rows on demand, each route's caches).
        let (ir, ig) = if k % 3 == 2 {
            (
                rows.step(&mut wr, &[&gd], stats).unwrap(),
                grams.step(&mut wg, &[&gd], stats).unwrap(),
            )
        } else {
            (
                rows.step_grads(&mut wr, &fact, stats).unwrap(),
                grams.step_grads(&mut wg, &with_grams, stats).unwrap(),
            )
        };
        // The Gram matrices only enter the model's linear term: the same `P`, bit for bit.
        assert_eq!(
            host(&wg[0]),
            host(&wr[0]),
            "step {k}: weights with the Gram matrices"
        );
        let id = dense.step(&mut wd, &[&gd], stats).unwrap();
        assert_eq!(
            (ir.first_order_updates, ir.lazy_recomputes, ir.refreshed),
            (id.first_order_updates, id.lazy_recomputes, id.refreshed),
            "step {k}: the routes plan the same inverses"
        );
        if ir.refreshed {
            // The rows' optimizer forms its dense inverses from the rows on demand (for this
            // copy of its state, or a dense step's view), with the Woodbury inverse's bits;
            // a narrow side has too many rows for that route and keeps its Cholesky inverse.
            let st = rows.state().unwrap();
            for (s, x) in [(&st.layers[0].lambda, &sa), (&st.layers[0].gamma, &se)] {
                if !grng::cpu::low_rank_is_cheaper(x.rows(), x.cols()) {
                    continue;
                }
                let hx = host(x);
                let xv = MatRef::new(&hx, x.rows(), x.cols()).unwrap();
                let want = grng::cpu::low_rank_damped_inverse(xv, s.damping).unwrap();
                assert_eq!(
                    host(&s.inverse),
                    want.as_slice(),
                    "step {k}: state's inverse"
                );
            }
        }
        let st = dense.state().unwrap();
        let (sl, sg) = (&st.layers[0].lambda, &st.layers[0].gamma);
        let kappa = |s: &grng::optim::kron::KronFactorState, x: &Matrix, m: usize| {
            let fro: f64 = host(x).iter().map(|&v| (v as f64).powi(2)).sum();
            (ir.rho.sqrt() as f64 + fro / m as f64) / s.damping.min(ir.rho.sqrt()) as f64
        };
        let (kl, kg) = (kappa(sl, &sa, m_s), kappa(sg, &se, m_s));
        let g_norm = g.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        let lam = (ir.rho.sqrt() as f64).powi(2);
        let constant = 8.0 * (o + i + m_s + m_b) as f64 * common::U32 * (kl + kg);
        drift += constant * ir.lr as f64 * g_norm / lam;
        let w_scale = 8.0 * (o + i) as f64 * common::U32;
        let (hr, hd) = (host(&wr[0]), host(&wd[0]));
        let worst = hr
            .iter()
            .zip(&hd)
            .map(|(x, y)| (*x as f64 - *y as f64).abs())
            .fold(0.0, f64::max);
        assert!(
            worst <= drift + w_scale,
            "step {k}: |ΔW| {worst:e} > {drift:e}"
        );
        if let (Some(qr), Some(qd), Some(qg)) = (
            ir.predicted_change,
            id.predicted_change,
            ig.predicted_change,
        ) {
            let tol = constant * qd.abs() as f64 + 1e-12;
            for (q, route) in [(qr, "rows"), (qg, "rows with the Gram matrices")] {
                assert!(
                    (q as f64 - qd as f64).abs() <= tol,
                    "step {k}: predicted {q} ({route}) vs {qd}"
                );
            }
            // r = 1 (ρ falls) on even steps, r = 0 (ρ rises) on odd ones.
            let after = if k % 2 == 0 { 1.0 + qd } else { 1.0 };
            rows.observe_loss(1.0, after).unwrap();
            dense.observe_loss(1.0, after).unwrap();
            grams.observe_loss(1.0, after).unwrap();
        }
        assert_eq!(rows.rho(), dense.rho());
        assert_eq!(grams.rho(), dense.rho());
    }
    assert!(
        rows.counters().first_order_updates > 0,
        "no first-order step was checked"
    );
}

/// RING at `ε = 0` on the low-rank route leaves each replaced factor to its statistics rows
/// (its norm comes from the rows' Gram matrix; the low-rank kernel keeps the rows) and forms
/// it when something reads it. Exact: whenever it is read — a copy of the state after a
/// refresh, a dense gradient's model terms, a lazy recompute on the dense route (which
/// moves it into the state) — it has the bits of the refresh's SYRK of those rows
/// (`Device::syrk_ema` into zeros, what the formed route computes), for `f32` and
/// for `bf16`-rounded statistics. The run mixes factored and dense gradients while `ρ` only
/// rises, so lazy steps recompute inverses on both routes.
#[test]
fn ring_factor_left_to_its_rows_has_the_syrk_bits() {
    let mut rng = common::seeded_rng();
    let (o, i) = SHAPE;
    let (m_s, m_b) = (o / 3, 24);
    for precision in [Precision::F32, Precision::Bf16] {
        let cfg = KronConfig {
            ema: 0.0,
            skip: 5,
            inverse: InverseMethod::Cholesky,
            stats_precision: precision,
            phi: 0.7,
            ..KronConfig::ring()
        };
        let mut opt = KronOptimizer::new(&DEV, &[SHAPE], cfg).unwrap();
        let mut w = vec![DEV.upload(o, i, &common::vals(&mut rng, o * i)).unwrap()];
        let mut last: Option<(Matrix, Matrix)> = None;
        let mut recomputes = 0;
        for k in 0..14 {
            let (ed, ad) = (
                DEV.upload(m_b, o, &common::vals(&mut rng, m_b * o))
                    .unwrap(),
                DEV.upload(m_b, i, &common::vals(&mut rng, m_b * i))
                    .unwrap(),
            );
            let mut g = DEV.zeros(o, i).unwrap();
            DEV.gemm(
                Trans::Yes,
                Trans::No,
                1.0 / m_b as f32,
                &ed,
                &ad,
                0.0,
                &mut g,
            )
            .unwrap();
            if opt.needs_stats() {
                last = Some((
                    DEV.upload(m_s, i, &common::vals(&mut rng, m_s * i))
                        .unwrap(),
                    DEV.upload(m_s, o, &common::vals(&mut rng, m_s * o))
                        .unwrap(),
                ));
            }
            let (sa, se) = last.as_ref().unwrap();
            let stats = [KronStats { a: sa, e: se }];
            let stats = opt.needs_stats().then_some(&stats[..]);
            let info = if k % 3 == 2 {
                opt.step(&mut w, &[&g], stats).unwrap()
            } else {
                let fact = [KronGrad::Factored { e: &ed, a: &ad }];
                opt.step_grads(&mut w, &fact, stats).unwrap()
            };
            recomputes += info.lazy_recomputes;
            if info.predicted_change.is_some() {
                // r = 0: ρ rises at every step, so the damping drifts past the first-order
                // limit and lazy steps recompute.
                opt.observe_loss(1.0, 1.0).unwrap();
            }
            let st = opt.state().unwrap();
            for (s, x) in [(&st.layers[0].lambda, sa), (&st.layers[0].gamma, se)] {
                let n = x.cols();
                let mut want = DEV.zeros(n, n).unwrap();
                match precision {
                    Precision::F32 => DEV.syrk_ema(x, 0.0, &mut want).unwrap(),
                    Precision::Bf16 => {
                        let xb = DEV.round_to_bf16(x).unwrap();
                        DEV.syrk_ema(&xb, 0.0, &mut want).unwrap()
                    }
                }
                assert!(
                    host(&s.factor) == host(&want),
                    "{precision:?} step {k}: the state's factor is not the SYRK's, bit for bit"
                );
            }
        }
        let c = *opt.counters();
        assert!(
            c.low_rank_inversions > 0,
            "{precision:?}: the rows' route ran"
        );
        assert!(recomputes > 0, "{precision:?}: a lazy step recomputed");
    }
}
