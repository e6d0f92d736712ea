//! The GEMM plan (`grng::cuda::gemm_plan`): which of grng's kernels and cuBLAS runs a
//! product. On the emulator (no vendor library) `Device::gemm` must run the engine — the
//! same bits as the engine's launcher — count each product in `vendor_absent`, and refuse
//! `GRNG_GEMM=vendor` with a typed error. On a GPU (`GRNG_REQUIRE_CUDA=1` in the bundle):
//! cuBLAS through the plan's row-major mapping against an f64 reference, every transpose
//! case and both operand types, and the trial's recorded choice within its bound.

use grng::cuda::gemm_plan::Product;
use grng::cuda::{gemm, gemm_plan, gemm_vendor};
use grng::ops::newton::{NewtonOptions, NewtonOrder, Precision};
use grng::{Device, Error, MatMul, Matrix, Trans};
use half::bf16;
use rand::Rng;

use grng_testkit as common;

const CASES: [(Trans, Trans); 4] = [
    (Trans::No, Trans::No),
    (Trans::No, Trans::Yes),
    (Trans::Yes, Trans::No),
    (Trans::Yes, Trans::Yes),
];

/// The GPU of the CUDA arms where cuBLAS loads (`GRNG_REQUIRE_CUDA=1` makes its absence a
/// failure, as a missing GPU's).
fn gpu_with_cublas() -> Option<Device> {
    let dev = common::cuda()?;
    let required = std::env::var("GRNG_REQUIRE_CUDA").is_ok_and(|v| v == "1");
    assert!(
        gemm_vendor::available() || !required,
        "GRNG_REQUIRE_CUDA=1 but libcublas does not load"
    );
    gemm_vendor::available().then_some(dev)
}

/// A random product of `dims` in transpose case `case` with its operands and `C` on `dev`,
/// and random `α`, `β` in [-2, 2).
fn uploaded(
    dev: &Device,
    rng: &mut impl Rng,
    (ta, tb): (Trans, Trans),
    dims: (usize, usize, usize),
) -> (common::GemmCase, [Matrix; 3], (f32, f32)) {
    let o = common::gemm_case(rng.random(), dims, ta, tb);
    let m = [
        dev.upload(o.a_shape.0, o.a_shape.1, &o.a).unwrap(),
        dev.upload(o.b_shape.0, o.b_shape.1, &o.b).unwrap(),
        dev.upload(dims.0, dims.1, &o.c0).unwrap(),
    ];
    let ab = (
        rng.random_range(-2.0f32..2.0),
        rng.random_range(-2.0f32..2.0),
    );
    (o, m, ab)
}

fn bits(x: &Matrix) -> Vec<u32> {
    x.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn emulated_products_run_the_engine_and_count_the_missing_vendor() {
    let dev = Device::Emulated;
    let mut rng = common::seeded_rng();
    for (case, dims) in
        CASES
            .into_iter()
            .zip([(37, 29, 53), (1, 70, 17), (65, 3, 129), (16, 33, 1)])
    {
        let (ta, tb) = case;
        let o = common::gemm_case(rng.random(), dims, ta, tb);
        let (alpha, beta) = (
            rng.random_range(-2.0f32..2.0),
            rng.random_range(-2.0f32..2.0),
        );
        let (a, b) = (
            dev.upload(o.a_shape.0, o.a_shape.1, &o.a).unwrap(),
            dev.upload(o.b_shape.0, o.b_shape.1, &o.b).unwrap(),
        );
        let (a16, b16) = (
            dev.upload(
                o.a_shape.0,
                o.a_shape.1,
                &o.a.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
            )
            .unwrap(),
            dev.upload(
                o.b_shape.0,
                o.b_shape.1,
                &o.b.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
            )
            .unwrap(),
        );
        let c0 = dev.upload(dims.0, dims.1, &o.c0).unwrap();

        let before = gemm_plan::vendor_absent();
        let (mut planned, mut direct) = (c0.try_clone().unwrap(), c0.try_clone().unwrap());
        dev.gemm(ta, tb, alpha, &a, &b, beta, &mut planned).unwrap();
        gemm::gemm(&dev, MatMul::new(ta, tb, alpha, &a, &b), beta, &mut direct).unwrap();
        assert_eq!(bits(&planned), bits(&direct), "f32 {case:?} {dims:?}");

        let (mut planned, mut direct) = (c0.try_clone().unwrap(), c0.try_clone().unwrap());
        dev.gemm(ta, tb, alpha, &a16, &b16, beta, &mut planned)
            .unwrap();
        gemm::gemm_tc(
            &dev,
            MatMul::new(ta, tb, alpha, &a16, &b16),
            beta,
            &mut direct,
        )
        .unwrap();
        assert_eq!(bits(&planned), bits(&direct), "bf16 {case:?} {dims:?}");
        // Other tests of this binary may count too: at least these two products.
        assert!(gemm_plan::vendor_absent() >= before + 2);
    }
}

/// The Kronecker factors' SYRK through the plan: on the emulator the engine's launchers, bit
/// for bit, for both operand types and `ε = 0` (the old factor never read) or not.
#[test]
fn emulated_syrk_runs_the_engine() {
    let dev = Device::Emulated;
    let mut rng = common::seeded_rng();
    for (m, n, eps) in [(5, 37, 0.0f32), (70, 129, 0.9), (1, 3, 0.5)] {
        let a = common::vals(&mut rng, m * n);
        let f0 = common::gram64(&common::vals(&mut rng, n * n), n, n);
        let f0: Vec<f32> = f0.iter().map(|&v| v as f32).collect();
        let before = gemm_plan::vendor_absent();
        let a32 = dev.upload(m, n, &a).unwrap();
        let (mut planned, mut direct) = (
            dev.upload(n, n, &f0).unwrap(),
            dev.upload(n, n, &f0).unwrap(),
        );
        dev.syrk_ema(&a32, eps, &mut planned).unwrap();
        grng::cuda::syrk::syrk_ema_f32(&dev, &a32, eps, &mut direct).unwrap();
        assert_eq!(bits(&planned), bits(&direct), "f32 {m}x{n} ε {eps}");
        let a16 = dev
            .upload(
                m,
                n,
                &a.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
            )
            .unwrap();
        let (mut planned, mut direct) = (
            dev.upload(n, n, &f0).unwrap(),
            dev.upload(n, n, &f0).unwrap(),
        );
        dev.syrk_ema(&a16, eps, &mut planned).unwrap();
        grng::cuda::syrk::syrk_ema_tc(&dev, &a16, eps, &mut direct).unwrap();
        assert_eq!(bits(&planned), bits(&direct), "bf16 {m}x{n} ε {eps}");
        assert!(gemm_plan::vendor_absent() >= before + 2);
    }
}

/// The f32-accurate products through the plan (`gemm_plan::gemm3`, the damped-inverse update,
/// the preconditioning): on the emulator the engine's launchers, bit for bit, each counted.
#[test]
fn emulated_accurate_products_run_the_engine() {
    let dev = Device::Emulated;
    let mut rng = common::seeded_rng();
    for (case, dims) in CASES
        .into_iter()
        .zip([(33, 17, 70), (1, 40, 9), (66, 5, 131), (8, 8, 1)])
    {
        let (ta, tb) = case;
        let (_, [a, b, c0], (alpha, beta)) = uploaded(&dev, &mut rng, case, dims);
        let before = gemm_plan::vendor_absent();
        let p = MatMul::new(ta, tb, alpha, &a, &b);
        let (mut planned, mut direct) = (c0.try_clone().unwrap(), c0.try_clone().unwrap());
        gemm_plan::gemm3(&dev, p, beta, &mut planned).unwrap();
        gemm::gemm3(&dev, p, beta, &mut direct).unwrap();
        assert_eq!(bits(&planned), bits(&direct), "gemm3 {case:?} {dims:?}");
        assert!(gemm_plan::vendor_absent() > before);
    }
    for n in [1usize, 37, 130] {
        let x0 = dev.upload(n, n, &common::vals(&mut rng, n * n)).unwrap();
        // |dλ| ≥ 0.05: far from a no-op, so the update shows in every element's bits.
        let dl = rng.random_range(0.05f32..0.5) * if rng.random() { 1.0 } else { -1.0 };
        let (mut planned, mut direct) = (x0.try_clone().unwrap(), x0.try_clone().unwrap());
        gemm_plan::damped_inverse_update(&dev, &mut planned, dl).unwrap();
        gemm::damped_inverse_update(&dev, &mut direct, dl).unwrap();
        assert_eq!(bits(&planned), bits(&direct), "damped update n = {n}");
        assert_ne!(bits(&planned), bits(&x0), "n = {n}: the update ran");
    }
}

/// On a GPU: cuBLAS's SYRK-EMA (`Ssyrk` for f32, `GemmEx` for bf16) and the mirror, as the
/// plan runs them, against the f64 `ε·Λ + (1−ε)/m·AᵀA` read from `Λ`'s lower triangle (the
/// upper one is poisoned with NaN, which must not be read), each element within
/// `(m + 2)·2⁻²⁴·((1−ε)/m·|A|ᵀ|A| + ε|Λ|)`, and exactly symmetric.
#[test]
fn the_vendor_syrk_matches_f64_and_is_symmetric_on_a_gpu() {
    let Some(dev) = gpu_with_cublas() else { return };
    let mut rng = common::seeded_rng();
    for (m, n, eps) in [(37, 200, 0.0f32), (300, 129, 0.95), (1, 65, 0.5)] {
        for bf in [false, true] {
            let mut a = common::vals(&mut rng, m * n);
            if bf {
                a.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32());
            }
            let mut f0 = common::vals(&mut rng, n * n);
            for i in 0..n {
                for j in i + 1..n {
                    f0[i * n + j] = f32::NAN;
                }
            }
            let mut f = dev.upload(n, n, &f0).unwrap();
            if bf {
                let a16 = dev
                    .upload(
                        m,
                        n,
                        &a.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
                    )
                    .unwrap();
                gemm_vendor::syrk_ema(&dev, &a16, eps, &mut f).unwrap();
            } else {
                gemm_vendor::syrk_ema(&dev, &dev.upload(m, n, &a).unwrap(), eps, &mut f).unwrap();
            }
            grng::cuda::cholesky::mirror_lower(&dev, &mut f).unwrap();
            let got = f.to_vec().unwrap();
            common::assert_symmetric(&got, n);
            let w = f64::from((1.0 - eps) / m as f32);
            for i in 0..n {
                for j in 0..=i {
                    let (mut dot, mut abs) = (0.0f64, 0.0f64);
                    for r in 0..m {
                        let p = f64::from(a[r * n + i]) * f64::from(a[r * n + j]);
                        dot += p;
                        abs += p.abs();
                    }
                    let old = f64::from(f0[i * n + j]);
                    let want = f64::from(eps) * old + w * dot;
                    let tol =
                        (m as f64 + 2.0) * common::U32 * (w * abs + f64::from(eps) * old.abs());
                    let err = (f64::from(got[i * n + j]) - want).abs();
                    assert!(
                        err <= tol,
                        "bf16={bf} {m}x{n} ε {eps} ({i},{j}): {err:e} > {tol:e}"
                    );
                }
            }
        }
    }
}

/// `GRNG_GEMM` is read once per process: the forced-vendor case runs in a child.
#[test]
fn forced_vendor_without_a_vendor_is_a_typed_error() {
    if std::env::var("GRNG_GEMM").as_deref() != Ok("vendor") {
        common::run_child(
            "forced_vendor_without_a_vendor_is_a_typed_error",
            &[("GRNG_GEMM", Some("vendor"))],
        );
        return;
    }
    let dev = Device::Emulated;
    let a = dev.upload(3, 4, &[1.0; 12]).unwrap();
    let b = dev.upload(4, 2, &[1.0; 8]).unwrap();
    let mut c = dev.upload(3, 2, &[7.0; 6]).unwrap();
    let e = dev
        .gemm(Trans::No, Trans::No, 1.0, &a, &b, 1.0, &mut c)
        .unwrap_err();
    assert!(
        matches!(e, Error::DeviceUnavailable(ref s) if s.contains("GRNG_GEMM=vendor")),
        "{e}"
    );
    assert_eq!(c.to_vec().unwrap(), vec![7.0; 6], "c unchanged");
    // α = 0 never reads A and B: the engine scales C, vendor or not.
    dev.gemm(Trans::No, Trans::No, 0.0, &a, &b, 0.5, &mut c)
        .unwrap();
    assert_eq!(c.to_vec().unwrap(), vec![3.5; 6]);
    // Newton's products are the plan's too.
    let spd = dev.upload(2, 2, &[2.0, 0.5, 0.5, 1.0]).unwrap();
    let e = dev
        .newton_inverse(&spd, None, &NewtonOptions::default())
        .unwrap_err();
    assert!(
        matches!(e, Error::DeviceUnavailable(ref s) if s.contains("GRNG_GEMM=vendor")),
        "{e}"
    );
}

/// The options of the Newton runs below: `order`, `precision`, the rest default.
fn newton_options(order: NewtonOrder, precision: Precision) -> NewtonOptions {
    NewtonOptions {
        order,
        precision,
        ..NewtonOptions::default()
    }
}

/// Newton's products through the plan on the emulator: the engine runs each (the inversion's
/// results against the CPU are `tests/emu_newton.rs`'), each counted as run without a vendor.
#[test]
fn emulated_newton_products_run_the_engine() {
    let dev = Device::Emulated;
    let mut rng = common::seeded_rng();
    let n = 37;
    let (a, _) = common::spd(&mut rng, n, 50.0);
    let da = dev.upload(n, n, &a).unwrap();
    for precision in [Precision::F32, Precision::Bf16] {
        let before = gemm_plan::vendor_absent();
        let opts = newton_options(NewtonOrder::Cubic, precision);
        let (x, info) = dev.newton_inverse(&da, None, &opts).unwrap();
        assert!(info.iterations >= 1, "{info:?}");
        // Per iteration the T-product, F and the update; other tests may count too.
        let products = 3 * info.iterations as u64;
        assert!(
            gemm_plan::vendor_absent() >= before + products,
            "{precision:?}"
        );
        let res = common::residual64(&a, &x.to_vec().unwrap(), n);
        assert!(res <= 1e-2, "{precision:?}: residual {res:e}");
    }
}

/// On a GPU: Newton's inversion through the plan (a trial on the first product of each
/// Newton key, `GRNG_GEMM=auto`) in every order and both precisions converges as without it,
/// and each Newton trial found the engine's fused product, cuBLAS + `newton_epilogue` and, for
/// f32 operands, bf16x3 + `newton_epilogue` within the trial's bound. The vendor candidate alone against f64 is
/// `tests/emu_newton.rs`' `cuda_large_products`.
#[test]
fn newton_through_the_plan_on_a_gpu() {
    let Some(dev) = gpu_with_cublas() else { return };
    let mut rng = common::seeded_rng();
    let n = 300;
    let (a, _) = common::spd(&mut rng, n, 100.0);
    let da = dev.upload(n, n, &a).unwrap();
    for order in [
        NewtonOrder::Quadratic,
        NewtonOrder::Cubic,
        NewtonOrder::Quartic,
    ] {
        for precision in [Precision::F32, Precision::Bf16] {
            let opts = newton_options(order, precision);
            let (x, info) = dev.newton_inverse(&da, None, &opts).unwrap();
            let res = common::residual64(&a, &x.to_vec().unwrap(), n);
            assert!(
                res <= 1e-3,
                "{order:?} {precision:?}: residual {res:e} ({info:?})"
            );
        }
    }
    let newton: Vec<_> = gemm_plan::choices()
        .into_iter()
        .filter(|c| matches!(c.plan.product, Product::Newton { .. }))
        .collect();
    assert!(
        !newton.is_empty(),
        "no Newton product went through the plan"
    );
    for choice in newton {
        let Some(t) = choice.trial else { continue };
        for c in gemm_plan::Candidate::ALL {
            if t.secs(c).is_some() {
                assert!(t.agrees(c), "{c:?}: {choice:?}");
            }
        }
        let vendor = t.secs(gemm_plan::Candidate::Vendor);
        assert!(vendor.is_some(), "cuBLAS failed: {choice:?}");
        // The f32 products also try bf16x3 (the concatenated product, then the epilogue).
        let bf16x3 = t.secs(gemm_plan::Candidate::Bf16x3);
        let f32_accurate = choice.plan.format == gemm_plan::Format::F32Accurate;
        assert_eq!(bf16x3.is_some(), f32_accurate, "bf16x3: {choice:?}");
    }
}

/// On a GPU: cuBLAS through `gemm_vendor::gemm` (f32 SGEMM, bf16 → f32) against the f64
/// product, each element within `(k + 2)·2⁻²⁴·(|α||op(A)||op(B)| + |β||C|)` (f32 sums of
/// exact products, γ_k with margin; bf16 operands are exact in f32); then `Device::gemm`
/// through the plan, whose recorded trial must have found the candidates within its bound.
/// Asserts that `got` is `α·op(A)·op(B) + β·C₀` of the case in f64 within
/// `depth·2⁻²⁴·(|α||op(A)||op(B)| + |β||C₀|)` per element.
fn assert_near_f64(
    o: &common::GemmCase,
    (ta, tb): (Trans, Trans),
    (m, n, k): (usize, usize, usize),
    (alpha, beta): (f32, f32),
    got: &[f32],
    depth: f64,
    what: &str,
) {
    let scale = common::abs_gemm((ta, tb), (m, n, k), alpha, &o.a, &o.b, beta, &o.c0);
    let op = |x: &[f32], cols: usize, t: Trans, i: usize, j: usize| match t {
        Trans::No => f64::from(x[i * cols + j]),
        Trans::Yes => f64::from(x[j * cols + i]),
    };
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k)
                .map(|l| op(&o.a, o.a_shape.1, ta, i, l) * op(&o.b, o.b_shape.1, tb, l, j))
                .sum();
            let want = f64::from(alpha) * dot + f64::from(beta) * f64::from(o.c0[i * n + j]);
            let tol = depth * common::U32 * scale[i * n + j];
            let err = (f64::from(got[i * n + j]) - want).abs();
            assert!(err <= tol, "{what} ({i},{j}): {err:e} > {tol:e}");
        }
    }
}

#[test]
fn the_vendor_matches_f64_and_the_trial_agrees_on_a_gpu() {
    let Some(dev) = gpu_with_cublas() else { return };
    let mut rng = common::seeded_rng();
    for case in CASES {
        let (ta, tb) = case;
        let dims @ (m, n, k) = (
            rng.random_range(1..300),
            rng.random_range(1..300),
            rng.random_range(1..600),
        );
        let mut o = common::gemm_case(rng.random(), dims, ta, tb);
        for bf in [false, true] {
            if bf {
                for v in o.a.iter_mut().chain(o.b.iter_mut()) {
                    *v = bf16::from_f32(*v).to_f32();
                }
            }
            let (alpha, beta) = (
                rng.random_range(-2.0f32..2.0),
                rng.random_range(-2.0f32..2.0),
            );
            let mut c = dev.upload(m, n, &o.c0).unwrap();
            if bf {
                let up = |(r, cl): (usize, usize), x: &[f32]| {
                    dev.upload(
                        r,
                        cl,
                        &x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
                    )
                    .unwrap()
                };
                let (a, b) = (up(o.a_shape, &o.a), up(o.b_shape, &o.b));
                gemm_vendor::gemm(&dev, MatMul::new(ta, tb, alpha, &a, &b), beta, &mut c).unwrap();
            } else {
                let a = dev.upload(o.a_shape.0, o.a_shape.1, &o.a).unwrap();
                let b = dev.upload(o.b_shape.0, o.b_shape.1, &o.b).unwrap();
                gemm_vendor::gemm(&dev, MatMul::new(ta, tb, alpha, &a, &b), beta, &mut c).unwrap();
                // The plan's dispatcher on the same product (a trial on its first use).
                let mut planned = dev.upload(m, n, &o.c0).unwrap();
                dev.gemm(ta, tb, alpha, &a, &b, beta, &mut planned).unwrap();
            }
            let what = format!("{case:?} bf16={bf} {dims:?}");
            let got = c.to_vec().unwrap();
            assert_near_f64(&o, case, dims, (alpha, beta), &got, k as f64 + 2.0, &what);
        }
    }
    // The f32-accurate plan (SGEMM against the split3 engine) on the damped update: the
    // chosen candidate's damped update equals `X − dλ·X·X` in f64 within
    // (n + 8)·2⁻²⁴·(|dλ||X||X| + |X|) (SGEMM's γ_n; the split3 engine's bound, gemm::gemm3).
    let n = rng.random_range(2..300usize);
    let x: Vec<f32> = common::vals(&mut rng, n * n);
    let dl = rng.random_range(-0.5f32..0.5);
    let mut planned = dev.upload(n, n, &x).unwrap();
    gemm_plan::damped_inverse_update(&dev, &mut planned, dl).unwrap();
    let got = planned.to_vec().unwrap();
    let scale = common::abs_gemm((Trans::No, Trans::No), (n, n, n), -dl, &x, &x, 1.0, &x);
    for i in 0..n {
        for j in 0..n {
            let xx: f64 = (0..n)
                .map(|l| f64::from(x[i * n + l]) * f64::from(x[l * n + j]))
                .sum();
            let want = f64::from(x[i * n + j]) - f64::from(dl) * xx;
            let tol = (n as f64 + 8.0) * common::U32 * scale[i * n + j];
            let err = (f64::from(got[i * n + j]) - want).abs();
            assert!(
                err <= tol,
                "damped update n = {n} ({i},{j}): {err:e} > {tol:e}"
            );
        }
    }
    let trials: Vec<_> = gemm_plan::choices()
        .into_iter()
        .filter_map(|c| c.trial)
        .collect();
    if std::env::var("GRNG_GEMM").is_err() {
        assert!(!trials.is_empty(), "auto ran no trial");
    }
    for t in trials {
        for c in gemm_plan::Candidate::ALL {
            if let Some(secs) = t.secs(c) {
                assert!(t.agrees(c) && secs > 0.0, "{c:?}: {t:?}");
            }
        }
        assert!(t.secs(gemm_plan::Candidate::Engine).is_some(), "{t:?}");
    }
}

/// Candidate bf16x3 (`gemm_plan::gemm3_bf16x3`: split3 planes concatenated along K, one bf16
/// product) on the emulator, where its bf16 product is the engine's `gemm_tc`: with K a
/// multiple of the engine's 32-deep K slice it runs the split3 engine's slices in its order,
/// so it equals `gemm::gemm3` bit for bit (any misplaced plane or block changes the bits);
/// with a ragged K the slices straddle the blocks, and it is within its bound of f64,
/// `2·(6k + 8)·2⁻²⁴·(|α||op(A)||op(B)| + |β||C|)` (6k products in one f32 sum, in any order,
/// the 2 for round-toward-zero accumulators). Every transpose case; m, n not multiples of 8.
#[test]
fn emulated_bf16x3_is_the_split3_engine() {
    let dev = Device::Emulated;
    let mut rng = common::seeded_rng();
    for (case, dims) in CASES
        .into_iter()
        .zip([(33, 17, 64), (5, 40, 96), (66, 9, 32), (7, 70, 64)])
    {
        let (ta, tb) = case;
        let (_, [a, b, c0], (alpha, beta)) = uploaded(&dev, &mut rng, case, dims);
        let p = MatMul::new(ta, tb, alpha, &a, &b);
        let (sa, sb) = (gemm::Split3::new(&a), gemm::Split3::new(&b));
        let (mut cat, mut direct) = (c0.try_clone().unwrap(), c0.try_clone().unwrap());
        gemm_plan::gemm3_bf16x3(&dev, p.with(&sa, &sb), beta, &mut cat).unwrap();
        gemm::gemm3(&dev, p, beta, &mut direct).unwrap();
        assert_eq!(bits(&cat), bits(&direct), "bf16x3 {case:?} {dims:?}");
    }
    bf16x3_against_f64(&dev, &mut rng, (80, 80, 100));
}

/// Candidate bf16x3 in every transpose case at random sizes below `limits` (m, n, k) against
/// f64, within `2·(6k + 8)·2⁻²⁴·(|α||op(A)||op(B)| + |β||C|)` per element.
fn bf16x3_against_f64(dev: &Device, rng: &mut impl Rng, (mm, nm, km): (usize, usize, usize)) {
    for case in CASES {
        let (ta, tb) = case;
        let dims @ (_, _, k) = (
            rng.random_range(1..mm),
            rng.random_range(1..nm),
            rng.random_range(1..km),
        );
        let (o, [a, b, mut c], (alpha, beta)) = uploaded(dev, rng, case, dims);
        let (sa, sb) = (gemm::Split3::new(&a), gemm::Split3::new(&b));
        let p = MatMul::new(ta, tb, alpha, &sa, &sb);
        gemm_plan::gemm3_bf16x3(dev, p, beta, &mut c).unwrap();
        let what = format!("bf16x3 {case:?} {dims:?}");
        let depth = 2.0 * (6.0 * k as f64 + 8.0);
        let got = c.to_vec().unwrap();
        assert_near_f64(&o, case, dims, (alpha, beta), &got, depth, &what);
    }
}

/// On a GPU: candidate bf16x3 with the plan's bf16 product (cuBLAS `GemmEx` or `gemm_tc`,
/// whichever its trial keeps), every transpose case, ragged sizes, against f64 within its
/// bound (`emulated_bf16x3_is_the_split3_engine`).
#[test]
fn bf16x3_matches_f64_on_a_gpu() {
    let Some(dev) = gpu_with_cublas() else { return };
    bf16x3_against_f64(&dev, &mut common::seeded_rng(), (300, 300, 600));
}

/// On a GPU: `GRNG_GEMM_CACHE` carries a trial's decision to the next process (read once per
/// process, so each round is a child): round 1 on an empty file runs a trial and appends its
/// decision; round 2 on the same file takes it from there — the same candidate, no trial.
#[test]
fn the_disk_cache_carries_a_decision_to_the_next_process_on_a_gpu() {
    const NAME: &str = "the_disk_cache_carries_a_decision_to_the_next_process_on_a_gpu";
    let Some(dev) = gpu_with_cublas() else { return };
    let round = std::env::var("GRNG_TEST_CACHE_ROUND").ok();
    let Some(round) = round else {
        let path = std::env::temp_dir().join(format!("grng-plan-{}.tsv", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let file = path.to_str().unwrap();
        for r in ["1", "2"] {
            let env = [
                ("GRNG_GEMM_CACHE", Some(file)),
                ("GRNG_TEST_CACHE_ROUND", Some(r)),
                ("GRNG_GEMM", None),
            ];
            common::run_child(NAME, &env);
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mine = text.lines().filter(|l| l.contains("format: F32,")).count();
        assert_eq!(mine, 1, "the decision written once:\n{text}");
        let _ = std::fs::remove_file(&path);
        return;
    };
    let n = 300;
    let mut rng = common::seeded_rng();
    let a = dev.upload(n, n, &common::vals(&mut rng, n * n)).unwrap();
    let mut c = dev.zeros(n, n).unwrap();
    dev.gemm(Trans::No, Trans::No, 1.0, &a, &a, 0.0, &mut c)
        .unwrap();
    let class = gemm_plan::ShapeClass::of(n, n, n);
    let choice = gemm_plan::choices()
        .into_iter()
        .find(|c| c.class == class && c.plan.format == gemm_plan::Format::F32)
        .expect("the product's decision");
    let path = std::env::var("GRNG_GEMM_CACHE").unwrap();
    let text = std::fs::read_to_string(path).unwrap();
    let kept = format!("\t{:?}", choice.candidate);
    let line = text
        .lines()
        .find(|l| l.contains("format: F32,"))
        .unwrap_or("");
    assert!(line.ends_with(&kept), "{text} vs {choice:?}");
    if round == "1" {
        assert!(choice.trial.is_some() && !choice.cached, "{choice:?}");
    } else {
        assert!(choice.trial.is_none() && choice.cached, "{choice:?}");
    }
}
