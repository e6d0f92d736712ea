//! The Kronecker-factor kernels of `kernels/syrk.cu` (SYRK with EMA epilogue, fp32 and bf16
//! tensor-core paths) and the batch gradient, run by the emulator through the same launch
//! code as on a GPU (and on CUDA too when a GPU and the kernels are present), against the
//! CPU backend on random ragged shapes. Outputs are poisoned with NaN before each launch.

use grng::cuda::syrk::{syrk_ema_f32, syrk_ema_tc};
use grng::{Device, Element, Error, Matrix, Trans};
use half::bf16;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use common::{devices, vals, U32};
use grng_testkit as common;

/// Sizes around the 64-wide output tiles and the 16/32-deep sample slices: 1, small,
/// tile edges ±1, and anything up to just past two tiles.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        1 => 1usize..=3,
        1 => prop::sample::select(vec![15usize, 16, 17, 31, 32, 33]),
        2 => prop::sample::select(vec![63usize, 64, 65, 127, 128, 129]),
        2 => 1usize..=140,
    ]
}

fn eps_strategy() -> impl Strategy<Value = f32> {
    prop_oneof![1 => Just(0.0f32), 2 => 0.0f32..0.99]
}

/// The old factor: a random lower triangle and a *different* random upper triangle, so a
/// kernel that reads the upper half (the oracle reads only the lower one) is caught.
fn old_factor(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    vals(rng, n * n)
}

/// Checks `got` (n x n) against the CPU result elementwise and exact symmetry.
///
/// Tolerance: both sides sum the same m exact products (bf16 products are exact in f32;
/// f32 products round once) in f32 in different orders, so each is within
/// (m + 2)·u·(α·Σ_s |a_si a_sj|) of the exact value, plus u·ε|Λ_ij| for the EMA term and the
/// final scaling; the difference of the two is bounded by twice that, taken as
/// 2·(m + 4)·u·(α·Σ|a a| + ε|Λ|).
fn check_factor(
    got: &[f32],
    want: &[f32],
    a: &[f32],
    (m, n): (usize, usize),
    eps: f32,
    old: &[f32],
) -> Result<(), TestCaseError> {
    let alpha = (1.0 - eps as f64) / m as f64;
    let mut scale = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let mut s = 0.0f64;
            for r in 0..m {
                s += (a[r * n + i] as f64 * a[r * n + j] as f64).abs();
            }
            let ema = if eps > 0.0 {
                eps as f64 * (old[i * n + j] as f64).abs()
            } else {
                0.0
            };
            scale[i * n + j] = alpha * s + ema;
        }
    }
    check_factor_scaled(got, want, &scale, (m, n))
}

/// [`check_factor`] given the scale `α·Σ|a a| + ε|Λ|` of the lower triangle.
fn check_factor_scaled(
    got: &[f32],
    want: &[f32],
    scale: &[f64],
    (m, n): (usize, usize),
) -> Result<(), TestCaseError> {
    for i in 0..n {
        for j in 0..=i {
            let tol = 2.0 * (m as f64 + 4.0) * U32 * scale[i * n + j] + 1e-30;
            let (g, w) = (got[i * n + j], want[i * n + j]);
            prop_assert!(
                ((g - w) as f64).abs() <= tol,
                "({}, {}) of {}x{} (m {}): got {} want {} tol {:e}",
                i,
                j,
                n,
                n,
                m,
                g,
                w,
                tol
            );
            prop_assert_eq!(
                got[i * n + j].to_bits(),
                got[j * n + i].to_bits(),
                "not symmetric at ({}, {})",
                i,
                j
            );
        }
    }
    Ok(())
}

/// CPU oracle result for `A` (`f32` or `bf16`) and an old factor.
fn cpu_factor<T: Element>(a: &[T], (m, n): (usize, usize), eps: f32, old: &[f32]) -> Vec<f32> {
    let cpu = Device::Cpu;
    let am = cpu.upload(m, n, a).unwrap();
    let mut f = cpu.upload(n, n, old).unwrap();
    cpu.syrk_ema(&am, eps, &mut f).unwrap();
    f.to_vec().unwrap()
}

/// The old factor as the kernel sees it: for ε = 0 all NaN (it must not be read), else the
/// given values with NaN above the diagonal when `nan_upper` (only the lower half is read).
fn poisoned_old(old: &[f32], n: usize, eps: f32, nan_upper: bool) -> Vec<f32> {
    let mut v = old.to_vec();
    for i in 0..n {
        for j in 0..n {
            if eps == 0.0 || (nan_upper && j > i) {
                v[i * n + j] = f32::NAN;
            }
        }
    }
    v
}

/// SYRK-EMA of `a` (`m x n`, `a32` its values in f32) on every kernel device against the CPU
/// SYRK: through `Device::syrk_ema`, where ε = 0 gets an all-NaN factor and ε > 0 a
/// finite one (the op checks it), and through `launcher` with NaN above the diagonal as well.
fn syrk_matches_cpu<T: Element>(
    a: &[T],
    a32: &[f32],
    (m, n): (usize, usize),
    eps: f32,
    old: &[f32],
    launcher: fn(&Device, &Matrix<T>, f32, &mut Matrix) -> grng::Result<()>,
) -> Result<(), TestCaseError> {
    let want = cpu_factor(a, (m, n), eps, old);
    for dev in devices() {
        let am = dev.upload(m, n, a).unwrap();
        let mut f = dev.upload(n, n, &poisoned_old(old, n, eps, false)).unwrap();
        dev.syrk_ema(&am, eps, &mut f).unwrap();
        check_factor(&f.to_vec().unwrap(), &want, a32, (m, n), eps, old)?;
        let mut f = dev.upload(n, n, &poisoned_old(old, n, eps, true)).unwrap();
        launcher(&dev, &am, eps, &mut f).unwrap();
        check_factor(&f.to_vec().unwrap(), &want, a32, (m, n), eps, old)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(40))]

    /// fp32 SYRK-EMA through `Device::syrk_ema` (f32 `A`) and through the launcher
    /// with NaN in every element it must not read.
    #[test]
    fn syrk_ema_f32_matches_cpu(m in dim(), n in dim(), eps in eps_strategy(), seed in any::<u64>()) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let a = vals(&mut rng, m * n);
        let old = old_factor(&mut rng, n);
        syrk_matches_cpu(&a, &a, (m, n), eps, &old, syrk_ema_f32)?;
    }

    /// bf16 tensor-core SYRK-EMA against the CPU SYRK on the same bf16 inputs: products are
    /// exact in f32 on both sides, so only the f32 accumulation order differs (see
    /// `check_factor`).
    #[test]
    fn syrk_ema_tc_matches_cpu_bf16(m in dim(), n in dim(), eps in eps_strategy(), seed in any::<u64>()) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let a: Vec<bf16> = vals(&mut rng, m * n).into_iter().map(bf16::from_f32).collect();
        let a32: Vec<f32> = a.iter().map(|v| v.to_f32()).collect();
        let old = old_factor(&mut rng, n);
        syrk_matches_cpu(&a, &a32, (m, n), eps, &old, syrk_ema_tc)?;
    }

    /// G = (1/m) Eᵀ A through the GEMM kernel, G poisoned. Tolerance 2·(m + 4)·u·Σ|e a|/m
    /// (two f32 sums of m rounded products in different orders, then one scaling).
    #[test]
    fn batch_gradient_matches_cpu(m in dim(), d_out in dim(), d_in in dim(), seed in any::<u64>()) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let e = vals(&mut rng, m * d_out);
        let a = vals(&mut rng, m * d_in);
        let cpu = Device::Cpu;
        let mut gw = cpu.zeros(d_out, d_in).unwrap();
        cpu.batch_gradient(&cpu.upload(m, d_out, &e).unwrap(), &cpu.upload(m, d_in, &a).unwrap(), &mut gw)
            .unwrap();
        let want = gw.to_vec().unwrap();
        for dev in devices() {
            let mut g = dev.upload(d_out, d_in, &vec![f32::NAN; d_out * d_in]).unwrap();
            dev.batch_gradient(&dev.upload(m, d_out, &e).unwrap(), &dev.upload(m, d_in, &a).unwrap(), &mut g)
                .unwrap();
            let got = g.to_vec().unwrap();
            for i in 0..d_out {
                for j in 0..d_in {
                    let s: f64 = (0..m).map(|r| (e[r * d_out + i] as f64 * a[r * d_in + j] as f64).abs()).sum();
                    let tol = 2.0 * (m as f64 + 4.0) * U32 * s / m as f64 + 1e-30;
                    let (x, w) = (got[i * d_in + j], want[i * d_in + j]);
                    prop_assert!(((x - w) as f64).abs() <= tol, "({}, {}): got {} want {}", i, j, x, w);
                }
            }
        }
    }
}

/// Larger factors (several tile rows, both kernels, the bf16 vector-load path with n % 8 = 0
/// and the element path without), one case each.
#[test]
fn larger_factors_match_cpu() {
    let mut rng = common::seeded_rng();
    for &(m, n, eps) in &[
        (150usize, 200usize, 0.95f32),
        (97, 256, 0.0),
        (33, 195, 0.5),
    ] {
        let a = vals(&mut rng, m * n);
        let ab: Vec<bf16> = a.iter().copied().map(bf16::from_f32).collect();
        let ab32: Vec<f32> = ab.iter().map(|v| v.to_f32()).collect();
        let old = old_factor(&mut rng, n);
        let want = cpu_factor(&a, (m, n), eps, &old);
        let want_b = cpu_factor(&ab, (m, n), eps, &old);
        for dev in devices() {
            let mut f = dev.upload(n, n, &poisoned_old(&old, n, eps, true)).unwrap();
            syrk_ema_f32(&dev, &dev.upload(m, n, &a).unwrap(), eps, &mut f).unwrap();
            check_factor(&f.to_vec().unwrap(), &want, &a, (m, n), eps, &old).unwrap();
            let mut f = dev.upload(n, n, &poisoned_old(&old, n, eps, true)).unwrap();
            syrk_ema_tc(&dev, &dev.upload(m, n, &ab).unwrap(), eps, &mut f).unwrap();
            check_factor(&f.to_vec().unwrap(), &want_b, &ab32, (m, n), eps, &old).unwrap();
        }
    }
}

/// The CUDA arm at the GPU's sizes: m = 4096 samples (the batch), n up to 4096
/// ragged, both SYRK kernels through `Device::syrk_ema` (ε = 0 with an all-NaN
/// factor, ε > 0 with NaN above the diagonal through the launchers), `check_factor`'s bound
/// with its scale from [`common::abs_gemm`]; the batch gradient at those sizes.
#[test]
fn cuda_large_factors_match_cpu() {
    let Some(dev) = common::cuda() else {
        return;
    };
    let mut rng = common::seeded_rng();
    let m = 4096;
    for eps in [0.0f32, rng.random_range(0.01..0.99)] {
        let n = common::large_dim(&mut rng);
        let a = vals(&mut rng, m * n);
        let ab: Vec<bf16> = a.iter().copied().map(bf16::from_f32).collect();
        let ab32: Vec<f32> = ab.iter().map(|v| v.to_f32()).collect();
        let old = old_factor(&mut rng, n);
        let tn = (Trans::Yes, Trans::No);
        let alpha = (1.0 - eps) / m as f32;
        for bf in [false, true] {
            let (a32, want) = if bf {
                (&ab32, cpu_factor(&ab, (m, n), eps, &old))
            } else {
                (&a, cpu_factor(&a, (m, n), eps, &old))
            };
            let scale = common::abs_gemm(tn, (n, n, m), alpha, a32, a32, eps, &old);
            for nan_upper in [false, true] {
                let mut f = dev
                    .upload(n, n, &poisoned_old(&old, n, eps, nan_upper))
                    .unwrap();
                match (bf, nan_upper) {
                    (false, false) => dev.syrk_ema(&dev.upload(m, n, &a).unwrap(), eps, &mut f),
                    (true, false) => dev.syrk_ema(&dev.upload(m, n, &ab).unwrap(), eps, &mut f),
                    (false, true) => {
                        syrk_ema_f32(&dev, &dev.upload(m, n, &a).unwrap(), eps, &mut f)
                    }
                    (true, true) => syrk_ema_tc(&dev, &dev.upload(m, n, &ab).unwrap(), eps, &mut f),
                }
                .unwrap();
                check_factor_scaled(&f.to_vec().unwrap(), &want, &scale, (m, n)).unwrap();
            }
        }
    }

    // G = (1/m) Eᵀ A, G poisoned; tolerance as in `batch_gradient_matches_cpu`.
    let (d_out, d_in) = (common::large_dim(&mut rng), common::large_dim(&mut rng));
    let e = vals(&mut rng, m * d_out);
    let a = vals(&mut rng, m * d_in);
    let cpu = Device::Cpu;
    let mut gw = cpu.zeros(d_out, d_in).unwrap();
    cpu.batch_gradient(
        &cpu.upload(m, d_out, &e).unwrap(),
        &cpu.upload(m, d_in, &a).unwrap(),
        &mut gw,
    )
    .unwrap();
    let zeros = vec![0.0; d_out * d_in];
    let tn = (Trans::Yes, Trans::No);
    let scale = common::abs_gemm(tn, (d_out, d_in, m), 1.0 / m as f32, &e, &a, 0.0, &zeros);
    let mut g = dev
        .upload(d_out, d_in, &vec![f32::NAN; d_out * d_in])
        .unwrap();
    dev.batch_gradient(
        &dev.upload(m, d_out, &e).unwrap(),
        &dev.upload(m, d_in, &a).unwrap(),
        &mut g,
    )
    .unwrap();
    for (i, (x, w)) in g
        .to_vec()
        .unwrap()
        .iter()
        .zip(gw.to_vec().unwrap())
        .enumerate()
    {
        let tol = 2.0 * (m as f64 + 4.0) * U32 * scale[i] + 1e-30;
        assert!(
            ((x - w) as f64).abs() <= tol,
            "element {i}: got {x} want {w}"
        );
    }
}

/// ε = 0 replaces the factor even when the old one is all NaN (it is never read); ε > 0 with
/// NaN in the lower triangle propagates to exactly those elements (it is read there).
#[test]
fn eps_zero_ignores_nan_factor() {
    let (m, n) = (9, 70);
    let mut rng = common::seeded_rng();
    let a = vals(&mut rng, m * n);
    let want = cpu_factor(&a, (m, n), 0.0, &vec![0.0; n * n]);
    let dev = Device::Emulated;
    let am = dev.upload(m, n, &a).unwrap();
    let mut f = dev.upload(n, n, &vec![f32::NAN; n * n]).unwrap();
    dev.syrk_ema(&am, 0.0, &mut f).unwrap();
    let got = f.to_vec().unwrap();
    assert!(got.iter().all(|v| v.is_finite()));
    check_factor(&got, &want, &a, (m, n), 0.0, &[]).unwrap();

    let mut old = vec![0.25f32; n * n];
    old[67 * n + 3] = f32::NAN;
    let mut f = dev.upload(n, n, &old).unwrap();
    syrk_ema_f32(&dev, &am, 0.5, &mut f).unwrap();
    let got = f.to_vec().unwrap();
    for i in 0..n {
        for j in 0..n {
            let hit = (i, j) == (67, 3) || (i, j) == (3, 67);
            assert_eq!(got[i * n + j].is_nan(), hit, "({i}, {j})");
        }
    }
}

/// Bad inputs are typed errors on the emulated device, and leave the factor unchanged.
#[test]
fn bad_inputs_are_errors() {
    let dev = Device::Emulated;
    let a = dev.upload(4, 3, &[0.5f32; 12]).unwrap();
    let ab = dev.upload(4, 3, &[bf16::from_f32(0.5); 12]).unwrap();
    let fill = vec![2.0f32; 9];
    let mut f = dev.upload(3, 3, &fill).unwrap();
    let unchanged = |f: &Matrix| assert_eq!(f.to_vec().unwrap(), fill);

    // ε and m ≥ 1 are validated once, by the op; the launchers check only the shapes their
    // kernels' memory safety rests on (the factor below).
    for eps in [-0.1f32, 1.0, f32::NAN, f32::INFINITY] {
        let r = dev.syrk_ema(&a, eps, &mut f);
        assert!(matches!(r, Err(Error::Value { arg: "eps", .. })), "{r:?}");
    }
    let empty = dev.zeros::<f32>(0, 3).unwrap();
    assert!(matches!(
        dev.syrk_ema(&empty, 0.0, &mut f),
        Err(Error::Shape { .. })
    ));
    let mut wrong = dev.upload(4, 4, &[0.0f32; 16]).unwrap();
    assert!(matches!(
        dev.syrk_ema(&a, 0.0, &mut wrong),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        syrk_ema_tc(&dev, &ab, 0.0, &mut wrong),
        Err(Error::Shape { .. })
    ));

    let mut bad = vec![0.5f32; 12];
    bad[7] = f32::INFINITY;
    let r = dev.syrk_ema(&dev.upload(4, 3, &bad).unwrap(), 0.0, &mut f);
    assert!(matches!(r, Err(Error::NonFinite { index: 7, .. })), "{r:?}");
    let mut nan_f = fill.clone();
    nan_f[5] = f32::NAN;
    let mut fnan = dev.upload(3, 3, &nan_f).unwrap();
    let r = dev.syrk_ema(&a, 0.5, &mut fnan);
    assert!(
        matches!(
            r,
            Err(Error::NonFinite {
                arg: "factor",
                index: 5,
                ..
            })
        ),
        "{r:?}"
    );
    unchanged(&f);

    let mut g = dev.upload(3, 3, &fill).unwrap();
    let e = dev.upload(4, 3, &[1.0f32; 12]).unwrap();
    let a5 = dev.upload(5, 3, &[1.0f32; 15]).unwrap();
    assert!(matches!(
        dev.batch_gradient(&e, &a5, &mut g),
        Err(Error::Shape { arg: "a", .. })
    ));
    let e0 = dev.zeros::<f32>(0, 3).unwrap();
    let a0 = dev.zeros::<f32>(0, 3).unwrap();
    assert!(matches!(
        dev.batch_gradient(&e0, &a0, &mut g),
        Err(Error::Shape { .. })
    ));
    let mut e_bad = vec![1.0f32; 12];
    e_bad[2] = f32::NAN;
    let r = dev.batch_gradient(&dev.upload(4, 3, &e_bad).unwrap(), &a, &mut g);
    assert!(
        matches!(
            r,
            Err(Error::NonFinite {
                arg: "e",
                index: 2,
                ..
            })
        ),
        "{r:?}"
    );
    unchanged(&g);

    // A CPU device cannot launch kernels.
    let cpu = Device::Cpu;
    let mut fc = cpu.upload(3, 3, &fill).unwrap();
    let r = syrk_ema_f32(
        &cpu,
        &cpu.upload(4, 3, &[0.5f32; 12]).unwrap(),
        0.0,
        &mut fc,
    );
    assert!(matches!(r, Err(Error::DeviceUnavailable(_))), "{r:?}");
    unchanged(&fc);
}
