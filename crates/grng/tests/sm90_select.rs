//! The sm_90a GEMM path (`kernels/gemm/wgmma_sm90.cuh`, `grng::cuda::sm90`): its selection,
//! first-use self-check and counted fallback, and, on a compute capability 9.0 GPU, its
//! products against the CPU.
//!
//! The emulator models sm_80 primitives, so the selection logic is tested on
//! `Device::Emulated` through `inject_sm90` (a "capable" device whose sm_90a kernels are their
//! sm_80 twins, or one whose self-check product comes back wrong) and `inject_ptx_reject` (an
//! sm_90a module the driver rejects). The injections are process-wide, so those scenarios run
//! in a child process, which also lets the parent count the stderr lines.

use grng_testkit as common;

use grng::cuda::check_sm90;
use grng::cuda::gemm::{gemm3, gemm_tc};
use grng::cuda::newton::{product_f32, product_tc, Epilogue, Planes, Unused};
use grng::cuda::sm90::{fallbacks, inject_sm90, Sm90Injection};
use grng::cuda::syrk::syrk_ema_tc;
use grng::hooks::{inject_ptx_reject, record_launches, take_launches};
use grng::mat::Trans;
use grng::{Device, Error, Matrix};
use half::bf16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// `len` bf16 values drawn from [-1, 1), and their f64 widening (exact).
fn bf16_vals(rng: &mut ChaCha8Rng, len: usize) -> (Vec<bf16>, Vec<f64>) {
    let v: Vec<bf16> = common::vals(rng, len)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let w = v.iter().map(|x| f64::from(x.to_f32())).collect();
    (v, w)
}

/// Checks `got` (f32, n x n row-major) against α·Σ_k x(i, k)·y(k, j) in f64. Tolerance: the
/// bf16 products are exact in f32 and each of the k f32 additions errs by at most one ulp
/// (2^-23 relative to the running |sum| ≤ Σ|x||y|, any order, round-to-nearest or truncating
/// accumulator), and α's rounding adds 2^-24: |err| ≤ (k + 1)·2^-23·α·Σ|x||y|; 2x margin.
fn check_product(
    what: &str,
    got: &[f32],
    n: usize,
    k: usize,
    alpha: f64,
    x: impl Fn(usize, usize) -> f64,
    y: impl Fn(usize, usize) -> f64,
) {
    for i in 0..n {
        for j in 0..n {
            let (mut s, mut abs) = (0.0, 0.0);
            for p in 0..k {
                s += x(i, p) * y(p, j);
                abs += (x(i, p) * y(p, j)).abs();
            }
            let tol = 2.0 * (k as f64 + 1.0) * f64::powi(2.0, -23) * alpha * abs;
            let g = f64::from(got[i * n + j]);
            assert!(
                (g - alpha * s).abs() <= tol,
                "{what}: ({i}, {j}) = {g}, want {} ± {tol:e}",
                alpha * s
            );
        }
    }
}

/// One Newton product C = A·B on `dev` (ragged n), checked against f64; returns the launches.
fn product(dev: &Device, rng: &mut ChaCha8Rng, n: usize) -> grng::Result<Vec<&'static str>> {
    let (a, aw) = bf16_vals(rng, n * n);
    let (b, bw) = bf16_vals(rng, n * n);
    let (am, bm) = (dev.upload(n, n, &a)?, dev.upload(n, n, &b)?);
    let mut out: Matrix = dev.zeros(n, n)?;
    let mut unused = Unused::new(dev)?;
    take_launches();
    let epi = Epilogue {
        out: Some(&mut out),
        ..Epilogue::new()
    };
    product_tc(dev, &am, &bm, epi, &mut unused)?;
    let launched = take_launches();
    let got = out.to_vec()?;
    check_product(
        "A·B",
        &got,
        n,
        n,
        1.0,
        |i, p| aw[i * n + p],
        |p, j| bw[p * n + j],
    );
    Ok(launched)
}

/// One SYRK Λ = (1/m)·SᵀS (ε = 0) on `dev`, checked against f64; returns the launches.
fn syrk(dev: &Device, rng: &mut ChaCha8Rng, m: usize, n: usize) -> grng::Result<Vec<&'static str>> {
    let (s, sw) = bf16_vals(rng, m * n);
    let sm = dev.upload(m, n, &s)?;
    let mut l: Matrix = dev.zeros(n, n)?;
    take_launches();
    syrk_ema_tc(dev, &sm, 0.0, &mut l)?;
    let launched = take_launches();
    let got = l.to_vec()?;
    let alpha = 1.0 / m as f64;
    check_product(
        "SᵀS/m",
        &got,
        n,
        m,
        alpha,
        |i, p| sw[p * n + i],
        |p, j| sw[p * n + j],
    );
    Ok(launched)
}

/// Checks `got` (f32, m x n row-major) against Σ_k x(i, k)·y(k, j) in f64 within the split3
/// products' bound `(k + 8)·2⁻²⁴·Σ|x||y|` (`cuda::gemm::gemm3`), 2x margin.
fn check_split3(
    what: &str,
    got: &[f32],
    (m, n, k): (usize, usize, usize),
    x: impl Fn(usize, usize) -> f64,
    y: impl Fn(usize, usize) -> f64,
) {
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut abs) = (0.0f64, 0.0f64);
            for p in 0..k {
                s += x(i, p) * y(p, j);
                abs += (x(i, p) * y(p, j)).abs();
            }
            let tol = 2.0 * (k as f64 + 8.0) * f64::powi(2.0, -24) * abs;
            let g = f64::from(got[i * n + j]);
            assert!(
                (g - s).abs() <= tol,
                "{what}: ({i}, {j}) = {g}, want {s} ± {tol:e}"
            );
        }
    }
}

/// One split3 (f32-accurate) product C = op(A)·op(B) on `dev` through
/// `cuda::gemm::gemm3`, `op(A)` m x k transposed, checked against f64 ([`check_split3`]);
/// returns the launches.
fn split_product(
    dev: &Device,
    rng: &mut ChaCha8Rng,
    m: usize,
    n: usize,
    k: usize,
) -> grng::Result<Vec<&'static str>> {
    let (a, b) = (common::vals(rng, k * m), common::vals(rng, k * n));
    let (am, bm) = (dev.upload(k, m, &a)?, dev.upload(k, n, &b)?);
    let mut c: Matrix = dev.zeros(m, n)?;
    take_launches();
    gemm3(
        dev,
        grng::MatMul::new(Trans::Yes, Trans::No, 1.0, &am, &bm),
        0.0,
        &mut c,
    )?;
    let launched = take_launches();
    let x = |i: usize, p: usize| f64::from(a[p * m + i]);
    let y = |p: usize, j: usize| f64::from(b[p * n + j]);
    check_split3("AᵀB split3", &c.to_vec()?, (m, n, k), x, y);
    Ok(launched)
}

/// One plain bf16 product C = α·Aᵀ·B on `dev` through `cuda::gemm::gemm_tc` (`Device::gemm`
/// on bf16), A k x n, B k x n, checked against f64 ([`check_product`]); returns the launches.
fn bf16_product(
    dev: &Device,
    rng: &mut ChaCha8Rng,
    n: usize,
    k: usize,
) -> grng::Result<Vec<&'static str>> {
    let ((a, aw), (b, bw)) = (bf16_vals(rng, k * n), bf16_vals(rng, k * n));
    let (am, bm) = (dev.upload(k, n, &a)?, dev.upload(k, n, &b)?);
    let mut c: Matrix = dev.zeros(n, n)?;
    let alpha = 0.5f32;
    take_launches();
    gemm_tc(
        dev,
        grng::MatMul::new(Trans::Yes, Trans::No, alpha, &am, &bm),
        0.0,
        &mut c,
    )?;
    let launched = take_launches();
    let x = |i: usize, p: usize| aw[p * n + i];
    let y = |p: usize, j: usize| bw[p * n + j];
    check_product("α·AᵀB bf16", &c.to_vec()?, n, k, f64::from(alpha), x, y);
    Ok(launched)
}

/// One Newton split3 product C = A·B (f32, n x n) on `dev` through
/// `cuda::newton::product_f32`, checked against f64 ([`check_split3`]); returns the launches.
fn newton_f32_product(
    dev: &Device,
    rng: &mut ChaCha8Rng,
    n: usize,
) -> grng::Result<Vec<&'static str>> {
    let (a, b) = (common::vals(rng, n * n), common::vals(rng, n * n));
    let (am, bm) = (dev.upload(n, n, &a)?, dev.upload(n, n, &b)?);
    let mut out: Matrix = dev.zeros(n, n)?;
    let mut planes = Planes::new(n);
    let mut unused = Unused::new(dev)?;
    take_launches();
    let epi = Epilogue {
        out: Some(&mut out),
        ..Epilogue::new()
    };
    product_f32(
        dev,
        (&am).into(),
        (&bm).into(),
        &mut planes,
        epi,
        &mut unused,
    )?;
    let launched = take_launches();
    let x = |i: usize, p: usize| f64::from(a[i * n + p]);
    let y = |p: usize, j: usize| f64::from(b[p * n + j]);
    check_split3("A·B split3", &out.to_vec()?, (n, n, n), x, y);
    Ok(launched)
}

/// A variant: its sm_80 kernel, its sm_90a kernel, and the split3 launches before each of its
/// products (2 for the split3 products, 0 for the bf16 ones).
type Variant = (&'static str, &'static str, usize);
const NEWTON_BF16: Variant = ("newton_gemm_tc", "newton_gemm_wg_tc", 0);
const SYRK: Variant = ("syrk_ema_tc", "syrk_ema_wg_tc", 0);
const GEMM3: Variant = ("gemm3_tc", "gemm3_wg_tc", 2);
const NEWTON3: Variant = ("newton_gemm3_tc", "newton_gemm3_wg_tc", 2);
const GEMM_BF16: Variant = ("gemm_tc", "gemm_wg_tc", 0);

/// The launches of a variant's first product on the injected device: the caller's operand
/// splits, the self-check (its product on sm_80, then on sm_90a, each after the splits of its
/// own operands), then the caller's product on sm_90a when `kept`, else on sm_80.
fn first(v: Variant, kept: bool) -> Vec<&'static str> {
    let (sm80, sm90, splits) = v;
    let s = vec!["gemm_split3"; splits];
    let ran = if kept { sm90 } else { sm80 };
    [&s[..], &s, &[sm80], &s, &[sm90], &[ran]].concat()
}

/// Set in the child process that runs the emulated scenarios.
const CHILD: &str = "GRNG_SM90_SELECT_CHILD";
/// The start of the line a fallback prints.
const FALLBACK_LINE: &str = "grng: the sm_90a GEMM kernel ";

#[test]
fn selection_self_check_and_counted_fallback() {
    if std::env::var_os(CHILD).is_none() {
        let seed = common::master_seed().to_string();
        let stderr = common::run_child(
            "selection_self_check_and_counted_fallback",
            &[(CHILD, Some("1")), ("GRNG_TEST_SEED", Some(&seed))],
        );
        // Exactly one line per fallback (seven below), each naming its variant and why.
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with(FALLBACK_LINE))
            .collect();
        let want = [
            ("newton_gemm_wg_tc", "element 0"),
            ("syrk_ema_wg_tc", "element 0"),
            ("gemm3_wg_tc", "element 0"),
            ("gemm_wg_tc", "element 0"),
            ("newton_gemm3_wg_tc", "element 0"),
            ("syrk_ema_wg_tc", "rejected the PTX"),
            ("gemm3_wg_tc", "rejected the PTX"),
        ];
        assert_eq!(lines.len(), want.len(), "{stderr}");
        for (line, (name, why)) in lines.iter().zip(want) {
            let kernel = format!("{FALLBACK_LINE}{name} failed");
            assert!(line.starts_with(&kernel) && line.contains(why), "{line}");
        }
        return;
    }

    let dev = Device::Emulated;
    let mut rng = common::seeded_rng();
    // Two tile rows or columns, the second partial; K spans a partial slice.
    let ragged = |rng: &mut ChaCha8Rng| rng.random_range(129..=200usize);
    record_launches(true);

    // No injection: the emulator is no sm_90 device; nothing is checked or counted.
    let n = ragged(&mut rng);
    assert_eq!(product(&dev, &mut rng, n).unwrap(), ["newton_gemm_tc"]);
    assert!(!check_sm90(&dev).unwrap());
    assert_eq!(fallbacks(), 0);

    // A capable device: the first launch of each variant runs that variant's self-check,
    // then the sm_90a kernel, for good.
    inject_sm90(Some(Sm90Injection::Capable));
    let n = ragged(&mut rng);
    assert_eq!(
        product(&dev, &mut rng, n).unwrap(),
        first(NEWTON_BF16, true)
    );
    let (m, n) = (ragged(&mut rng), ragged(&mut rng));
    assert_eq!(syrk(&dev, &mut rng, m, n).unwrap(), first(SYRK, true));
    assert_eq!(product(&dev, &mut rng, n).unwrap(), ["newton_gemm_wg_tc"]);
    assert_eq!(syrk(&dev, &mut rng, m, n).unwrap(), ["syrk_ema_wg_tc"]);
    let k = rng.random_range(1..=70usize);
    // The caller's operands are split before its product's launch runs the self-check.
    assert_eq!(
        split_product(&dev, &mut rng, m, n, k).unwrap(),
        first(GEMM3, true)
    );
    assert_eq!(
        newton_f32_product(&dev, &mut rng, n).unwrap(),
        first(NEWTON3, true)
    );
    assert_eq!(
        bf16_product(&dev, &mut rng, n, k).unwrap(),
        first(GEMM_BF16, true)
    );
    assert_eq!(bf16_product(&dev, &mut rng, n, k).unwrap(), ["gemm_wg_tc"]);
    assert!(check_sm90(&dev).unwrap());
    assert_eq!(fallbacks(), 0);

    // An sm_80 failure during a self-check (its reference side) is the caller's error and
    // decides nothing: the next launch checks again.
    inject_sm90(Some(Sm90Injection::Capable));
    inject_ptx_reject(Some("NEWTON"));
    let n = ragged(&mut rng);
    match product(&dev, &mut rng, n) {
        Err(Error::DeviceUnavailable(msg)) => assert!(msg.contains("kernel file NEWTON:"), "{msg}"),
        other => panic!("expected DeviceUnavailable, got {other:?}"),
    }
    inject_ptx_reject(None);
    assert_eq!(fallbacks(), 0);
    assert_eq!(
        product(&dev, &mut rng, n).unwrap(),
        first(NEWTON_BF16, true)
    );

    // Every self-check's sm_90a product is wrong: each variant falls back at its first launch,
    // counted, and stays on sm_80; the product the caller gets is right (checked in `product`).
    inject_sm90(Some(Sm90Injection::Mismatch));
    let n = ragged(&mut rng);
    assert_eq!(
        product(&dev, &mut rng, n).unwrap(),
        first(NEWTON_BF16, false)
    );
    assert_eq!(fallbacks(), 1);
    let (m, n) = (ragged(&mut rng), ragged(&mut rng));
    assert_eq!(syrk(&dev, &mut rng, m, n).unwrap(), first(SYRK, false));
    assert_eq!(fallbacks(), 2);
    assert_eq!(syrk(&dev, &mut rng, m, n).unwrap(), ["syrk_ema_tc"]);
    // The three variants not yet launched are decided (and fall back) here.
    assert!(!check_sm90(&dev).unwrap());
    assert_eq!(fallbacks(), 5);
    assert!(!check_sm90(&dev).unwrap());
    assert_eq!(fallbacks(), 5);

    // The driver rejects the sm_90a module of syrk.cu: only the SYRK falls back.
    inject_sm90(Some(Sm90Injection::Capable));
    inject_ptx_reject(Some("SYRK_SM90A"));
    let (m, n) = (ragged(&mut rng), ragged(&mut rng));
    assert_eq!(syrk(&dev, &mut rng, m, n).unwrap(), first(SYRK, false));
    inject_ptx_reject(None);
    assert_eq!(fallbacks(), 6);
    assert_eq!(
        product(&dev, &mut rng, n).unwrap(),
        first(NEWTON_BF16, true)
    );

    // The driver rejects the sm_90a module of gemm.cu: fall back at the split3 check.
    inject_sm90(Some(Sm90Injection::Capable));
    inject_ptx_reject(Some("GEMM_SM90A"));
    let (m, n) = (ragged(&mut rng), ragged(&mut rng));
    assert_eq!(
        split_product(&dev, &mut rng, m, n, 33).unwrap(),
        first(GEMM3, false)
    );
    inject_ptx_reject(None);
    assert_eq!(fallbacks(), 7);

    inject_sm90(None);
    record_launches(false);
}

/// CUDA arm: on a compute capability 9.0 GPU the sm_90a kernels pass their self-check and
/// their products match the CPU (ragged sizes: partial tiles and K slices; n % 8 != 0 for the
/// element-wise loads, n % 8 == 0 for cp.async). Skipped elsewhere.
#[test]
fn sm90a_products_match_f64_on_a_cc90_gpu() {
    let Some(dev) = common::cuda() else { return };
    let Device::Cuda(d) = &dev else {
        unreachable!()
    };
    if d.context().compute_capability().ok() != Some((9, 0)) {
        eprintln!("note: sm_90a arm skipped (the GPU is not compute capability 9.0)");
        return;
    }
    let mut rng = common::seeded_rng();
    // The self-check passes on a working GPU (else a fallback line says why).
    assert!(check_sm90(&dev).unwrap());
    record_launches(true);
    for n in [136usize, 131, 257, 520] {
        let launched = product(&dev, &mut rng, n).unwrap();
        assert_eq!(launched, ["newton_gemm_wg_tc"]);
        let m = rng.random_range(1..=600usize);
        let launched = syrk(&dev, &mut rng, m, n).unwrap();
        assert_eq!(launched, ["syrk_ema_wg_tc"]);
        let k = rng.random_range(1..=300usize);
        let launched = split_product(&dev, &mut rng, m, n, k).unwrap();
        assert_eq!(launched[2], "gemm3_wg_tc");
        let launched = newton_f32_product(&dev, &mut rng, n).unwrap();
        assert_eq!(launched[2], "newton_gemm3_wg_tc");
        let launched = bf16_product(&dev, &mut rng, n, k).unwrap();
        assert_eq!(launched, ["gemm_wg_tc"]);
    }
    record_launches(false);
    assert_eq!(fallbacks(), 0);
}
