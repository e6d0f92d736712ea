//! The element-wise kernels (`kernels/elementwise.cu`) on `Device::Emulated` (and on CUDA
//! when a GPU and the kernels are present) against the CPU backend, through the public
//! `Device` operations: random ragged lengths (1, warp and float4 edges, ~20000; on CUDA
//! also 1e6 to 1.6e7), fresh random values, every error path compared with the CPU's (same
//! variant, argument and index) and the state checked unchanged after an error.
//!
//! Tolerances: the fused updates and axpy/scale/copy compute the CPU's formulas in the same
//! order with correctly rounded f32 operations (`__f*_rn`, no FMA contraction), so they must
//! agree bit for bit. dot/norm2 sum exact f64 products in a different order than the CPU:
//! each f64 sum is within (n−1)·2⁻⁵³·Σ|xᵢyᵢ| of the exact one, and each final f32 rounding
//! adds 2⁻²⁴ relative, so |gpu − cpu| ≤ 2⁻²³|cpu| + n·2⁻⁵²·Σ|xᵢyᵢ| (+ the smallest normal).

use grng::cpu::elementwise::{self as ew, Over};
use grng::ops::elementwise::{AdamWCoeffs, SgdCoeffs, SophiaCoeffs};
use grng::{Device, Error, Matrix};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use common::{devices, uniform as vals};
use grng_testkit as common;

/// Ragged lengths: 1, the warp and float4 edges, a block edge, and ~20000.
fn len() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(1usize),
        Just(31),
        Just(32),
        Just(33),
        1usize..80,
        1020usize..1030,
        Just(1000),
        19_990usize..20_010,
    ]
}

fn up(dev: &Device, v: &[f32]) -> Matrix {
    dev.upload(v.len(), 1, v).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// What identifies an error across backends (the `op` names differ).
fn key(e: &Error) -> String {
    match e {
        Error::NonFinite { arg, index, .. } => format!("NonFinite({arg}, {index})"),
        Error::Value { arg, value, .. } => format!("Value({arg}, {value})"),
        Error::Shape { arg, .. } => format!("Shape({arg})"),
        other => format!("{other:?}"),
    }
}

/// A NaN, +Inf or a negative value planted at `at` of one of the arrays.
fn plant(arrays: &mut [Vec<f32>], which: usize, at: usize, kind: u8) {
    let a = &mut arrays[which % arrays.len()];
    let i = at % a.len();
    a[i] = match kind % 3 {
        0 => f32::NAN,
        1 => f32::INFINITY,
        _ => -1.5,
    };
}

/// axpy, axpy_new, scale and copy are bit-exact (axpy_new equal to axpy on every device);
/// copy's destination starts as NaN.
fn axpy_scale_copy(devs: &[Device], n: usize, seed: u64, alpha: f32) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (x, y) = (
        vals(&mut rng, n, -10.0, 10.0),
        vals(&mut rng, n, -10.0, 10.0),
    );
    let cpu = Device::Cpu;
    let (xc, mut yc) = (up(&cpu, &x), up(&cpu, &y));
    let new_c = cpu.axpy_new(alpha, &xc, &yc).unwrap();
    cpu.axpy(alpha, &xc, &mut yc).unwrap();
    prop_assert_eq!(bits(&new_c.to_vec().unwrap()), bits(&yc.to_vec().unwrap()));
    // axpy_over: the same bits written over either operand.
    for (over, kept, mut o) in [(Over::X, &y, x.clone()), (Over::Y, &x, y.clone())] {
        ew::axpy_over(alpha, over, kept, &mut o).unwrap();
        prop_assert_eq!(bits(&o), bits(&new_c.to_vec().unwrap()));
    }
    cpu.scale(alpha, &mut yc).unwrap();
    for dev in devs {
        let (xd, mut yd) = (up(dev, &x), up(dev, &y));
        let new_d = dev.axpy_new(alpha, &xd, &yd).unwrap();
        prop_assert_eq!(bits(&yd.to_vec().unwrap()), bits(&y));
        prop_assert_eq!(
            bits(&new_d.to_vec().unwrap()),
            bits(&new_c.to_vec().unwrap())
        );
        dev.axpy(alpha, &xd, &mut yd).unwrap();
        dev.scale(alpha, &mut yd).unwrap();
        prop_assert_eq!(bits(&yd.to_vec().unwrap()), bits(&yc.to_vec().unwrap()));
        let mut dst = up(dev, &vec![f32::NAN; n]);
        dev.copy(&xd, &mut dst).unwrap();
        prop_assert_eq!(bits(&dst.to_vec().unwrap()), bits(&x));
    }
    Ok(())
}

/// dot and norm2: deterministic f64 reductions within the bound of the header.
fn dot_norm2(devs: &[Device], n: usize, seed: u64, scale: f32) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<f32> = vals(&mut rng, n, -1.0, 1.0)
        .iter()
        .map(|v| v * scale)
        .collect();
    let y = vals(&mut rng, n, -1.0, 1.0);
    let cpu = Device::Cpu;
    let d_cpu = cpu.dot(&up(&cpu, &x), &up(&cpu, &y)).unwrap();
    let n_cpu = cpu.norm2(&up(&cpu, &x)).unwrap();
    let abs_xy: f64 = x
        .iter()
        .zip(&y)
        .map(|(a, b)| (*a as f64 * *b as f64).abs())
        .sum();
    let xx: f64 = x.iter().map(|a| *a as f64 * *a as f64).sum();
    for dev in devs {
        let (xd, yd) = (up(dev, &x), up(dev, &y));
        let d = dev.dot(&xd, &yd).unwrap();
        let tol = 2f64.powi(-23) * d_cpu.abs() as f64
            + n as f64 * 2f64.powi(-52) * abs_xy
            + f32::MIN_POSITIVE as f64;
        prop_assert!(
            (d as f64 - d_cpu as f64).abs() <= tol,
            "dot {} vs {}",
            d,
            d_cpu
        );
        // Repeated calls give the same bits (the atomic counts blocks; the sum is in block order).
        prop_assert_eq!(dev.dot(&xd, &yd).unwrap().to_bits(), d.to_bits());
        let nm = dev.norm2(&xd).unwrap();
        let tol = 2f64.powi(-23) * n_cpu as f64
            + n as f64 * 2f64.powi(-52) * xx.sqrt()
            + f32::MIN_POSITIVE as f64;
        prop_assert!(
            (nm as f64 - n_cpu as f64).abs() <= tol,
            "norm2 {} vs {}",
            nm,
            n_cpu
        );
    }
    Ok(())
}

/// The fused SGD, AdamW, Sophia and Hessian-EMA updates are bit-exact (several steps).
fn fused_updates(
    devs: &[Device],
    n: usize,
    seed: u64,
    lr: f32,
    wd: f32,
    step: u64,
) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let p = vals(&mut rng, n, -2.0, 2.0);
    let gs: Vec<Vec<f32>> = (0..2).map(|_| vals(&mut rng, n, -3.0, 3.0)).collect();
    let m0 = vals(&mut rng, n, -0.5, 0.5);
    let v0 = vals(&mut rng, n, 0.0, 0.3);
    let h0 = vals(&mut rng, n, 0.0, 2.0);
    let (sgd, adam, soph) = coeffs(lr, wd, step);
    let run = |dev: &Device| -> Vec<Vec<f32>> {
        let (mut ps, mut b) = (up(dev, &p), up(dev, &m0));
        let (mut pa, mut ma, mut va) = (up(dev, &p), up(dev, &m0), up(dev, &v0));
        let (mut po, mut mo, mut ho) = (up(dev, &p), up(dev, &m0), up(dev, &h0));
        for g in &gs {
            let g = up(dev, g);
            dev.sgd_update(&mut ps, &g, &mut b, &sgd).unwrap();
            dev.adamw_update(&mut pa, &g, &mut ma, &mut va, &adam)
                .unwrap();
            dev.sophia_hessian_ema(&mut ho, &g, 0.99, 7).unwrap();
            dev.sophia_update(&mut po, &g, &mut mo, &ho, &soph).unwrap();
        }
        [ps, b, pa, ma, va, po, mo, ho]
            .iter()
            .map(|m| m.to_vec().unwrap())
            .collect()
    };
    let want = run(&Device::Cpu);
    for dev in devs {
        for (k, (g, w)) in run(dev).iter().zip(&want).enumerate() {
            prop_assert_eq!(bits(g), bits(w), "output {}", k);
        }
    }
    Ok(())
}

/// One to three NaN/Inf/negatives planted anywhere (several arrays and indices at once:
/// the fused kernels flag them all in one pass, the first array in the CPU's order and
/// its first index must win): the same error as the CPU (variant, argument, index), and
/// every buffer left bit-for-bit unchanged; dot/norm2 report it too.
fn errors_and_state(
    devs: &[Device],
    n: usize,
    seed: u64,
    plants: &[(usize, usize, u8)],
) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut arrays = vec![
        vals(&mut rng, n, -2.0, 2.0),
        vals(&mut rng, n, -2.0, 2.0),
        vals(&mut rng, n, -0.5, 0.5),
        vals(&mut rng, n, 0.0, 0.5),
    ];
    for &(which, at, kind) in plants {
        plant(&mut arrays, which, at, kind);
    }
    let adam = AdamWCoeffs {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        step: 3,
    };
    let soph = SophiaCoeffs {
        lr: 0.1,
        beta1: 0.9,
        gamma: 0.01,
        eps: 1e-12,
        weight_decay: 0.0,
    };
    let sgd = SgdCoeffs {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    // (result keys, final buffers) of every op on one device.
    let run = |dev: &Device| -> (Vec<String>, Vec<Vec<f32>>) {
        let mut b: Vec<Matrix> = arrays.iter().map(|a| up(dev, a)).collect();
        let mut keys = Vec::new();
        let mut k = |r: grng::Result<()>| keys.push(r.map_or_else(|e| key(&e), |_| "ok".into()));
        let [p, g, m, v] = &mut b[..] else {
            unreachable!()
        };
        k(dev.adamw_update(p, g, m, v, &adam));
        k(dev.sophia_update(p, g, m, v, &soph));
        k(dev.sgd_update(p, g, m, &sgd));
        k(dev.sophia_hessian_ema(v, g, 0.9, 4));
        k(dev.axpy(0.5, g, p));
        k(dev.scale(2.0, m));
        k(dev.dot(p, g).map(|_| ()));
        k(dev.norm2(m).map(|_| ()));
        (keys, b.iter().map(|m| m.to_vec().unwrap()).collect())
    };
    let (want_keys, want_bufs) = run(&Device::Cpu);
    for dev in devs {
        let (keys, bufs) = run(dev);
        prop_assert_eq!(&keys, &want_keys);
        for (g, w) in bufs.iter().zip(&want_bufs) {
            prop_assert_eq!(bits(g), bits(w));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(48))]

    /// [`axpy_scale_copy`] on the emulator (and CUDA) at ragged lengths.
    #[test]
    fn axpy_scale_copy_match_cpu(n in len(), seed in any::<u64>(), alpha in -4f32..4.0) {
        axpy_scale_copy(&devices(), n, seed, alpha)?;
    }

    /// [`dot_norm2`] on the emulator (and CUDA) at ragged lengths.
    #[test]
    fn dot_norm2_match_cpu(n in len(), seed in any::<u64>(), scale in prop_oneof![Just(1f32), Just(1e-20), Just(1e18)]) {
        dot_norm2(&devices(), n, seed, scale)?;
    }

    /// [`fused_updates`] on the emulator (and CUDA) at ragged lengths.
    #[test]
    fn fused_updates_match_cpu(n in len(), seed in any::<u64>(), lr in 1e-4f32..0.5, wd in 0f32..0.1, step in 1u64..50) {
        fused_updates(&devices(), n, seed, lr, wd, step)?;
    }

    /// [`errors_and_state`] on the emulator (and CUDA) at ragged lengths.
    #[test]
    fn errors_match_cpu_and_leave_state(n in len(), seed in any::<u64>(), plants in prop::collection::vec((0usize..4, any::<usize>(), any::<u8>()), 1..4)) {
        errors_and_state(&devices(), n, seed, &plants)?;
    }
}

/// The CPU's parallel path (above `PAR_MIN` = 65536 elements, which the ragged lengths
/// above stay below): axpy_new equal to axpy bit for bit at a few lengths up to 3e5, with
/// NaN planted once to see the flagged path name it.
#[test]
fn cpu_axpy_new_parallel_path() {
    let mut rng = common::seeded_rng();
    for _ in 0..3 {
        let n = rng.random_range(65_536..=300_000);
        axpy_scale_copy(&[], n, rng.random(), rng.random_range(-4.0..4.0)).unwrap();
    }
    let n = 200_003;
    let cpu = Device::Cpu;
    let mut y = vals(&mut rng, n, -1.0, 1.0);
    let at = rng.random_range(0..n);
    y[at] = f32::NAN;
    let x = up(&cpu, &vals(&mut rng, n, -1.0, 1.0));
    let err = cpu.axpy_new(0.5, &x, &up(&cpu, &y)).unwrap_err();
    assert!(
        matches!(err, Error::NonFinite { arg: "y", index, .. } if index == at),
        "{err:?}"
    );
    // axpy_over names the kept operand's NaN, and finds the overwritten one's in the result.
    let x = x.to_vec().unwrap();
    let err = ew::axpy_over(0.5, Over::X, &y, &mut x.clone()).unwrap_err();
    assert!(
        matches!(err, Error::NonFinite { arg: "y", index, .. } if index == at),
        "{err:?}"
    );
    let err = ew::axpy_over(0.5, Over::Y, &x, &mut y.clone()).unwrap_err();
    assert!(
        matches!(err, Error::NonFinite { arg, index, .. } if arg == ew::OVER_NONFINITE && index == at),
        "{err:?}"
    );
    // A finite overflow likewise.
    let mut big = vec![f32::MAX; n];
    let err = ew::axpy_over(1.0, Over::Y, &big.clone(), &mut big).unwrap_err();
    assert!(
        matches!(err, Error::NonFinite { arg, index: 0, .. } if arg == ew::OVER_NONFINITE),
        "{err:?}"
    );
}

/// The CUDA arm at the GPU's sizes: every check above on ragged lengths of 1e6 to 1.6e7
/// (odd: a float4 tail; the copy's destination NaN, bad values planted), a few cases.
#[test]
fn cuda_large_lengths_match_cpu() {
    let Some(dev) = common::cuda() else {
        return;
    };
    let devs = [dev];
    let mut rng = common::seeded_rng();
    for _ in 0..3 {
        let n = rng.random_range(1_000_000..=16_000_000) | 1;
        axpy_scale_copy(&devs, n, rng.random(), rng.random_range(-4.0..4.0)).unwrap();
        dot_norm2(&devs, n, rng.random(), 1.0).unwrap();
        let (lr, wd) = (rng.random_range(1e-4..0.5), rng.random_range(0.0..0.1));
        fused_updates(&devs, n, rng.random(), lr, wd, rng.random_range(1..50)).unwrap();
        let plants: Vec<(usize, usize, u8)> = (0..rng.random_range(1..4))
            .map(|_| {
                (
                    rng.random_range(0..4),
                    rng.random::<u64>() as usize,
                    rng.random(),
                )
            })
            .collect();
        errors_and_state(&devs, n, rng.random(), &plants).unwrap();
    }
}

/// Shape and scalar errors are reported before any launch, as on the CPU.
#[test]
fn bad_arguments_are_errors() {
    for dev in devices() {
        let (x, mut y) = (up(&dev, &[1.0, 2.0, 3.0]), up(&dev, &[1.0, 2.0]));
        assert!(matches!(
            dev.axpy(1.0, &x, &mut y),
            Err(Error::Shape { .. })
        ));
        let mut y3 = up(&dev, &[1.0, 2.0, 3.0]);
        assert!(matches!(
            dev.axpy(f32::NAN, &x, &mut y3),
            Err(Error::Value { .. })
        ));
        assert!(matches!(
            dev.scale(f32::INFINITY, &mut y3),
            Err(Error::Value { .. })
        ));
        assert!(matches!(dev.dot(&x, &y), Err(Error::Shape { .. })));
        let bad = SgdCoeffs {
            lr: 0.1,
            momentum: 1.0,
            weight_decay: 0.0,
        };
        let g = up(&dev, &[0.0; 3]);
        let mut b = up(&dev, &[0.0; 3]);
        assert!(matches!(
            dev.sgd_update(&mut y3, &g, &mut b, &bad),
            Err(Error::Value { .. })
        ));
        let mut h = up(&dev, &[0.0; 3]);
        assert!(matches!(
            dev.sophia_hessian_ema(&mut h, &g, 0.9, 0),
            Err(Error::Value { .. })
        ));
        assert!(matches!(
            dev.sophia_hessian_ema(&mut h, &g, 1.0, 1),
            Err(Error::Value { .. })
        ));
        assert_eq!(y3.to_vec().unwrap(), vec![1.0, 2.0, 3.0]);
        // Empty vectors are fine.
        let (e, mut f) = (dev.zeros(0, 1).unwrap(), dev.zeros(0, 1).unwrap());
        dev.axpy(1.0, &e, &mut f).unwrap();
        assert_eq!(dev.dot(&e, &f).unwrap(), 0.0);
        assert_eq!(dev.norm2(&e).unwrap(), 0.0);
    }
}

// ---- The f64 reductions in the kernels' summation order (dot, norm2, deferred dot) ----

/// Threads per block and grid cap of the reduction kernel (`cuda::elementwise`'s
/// `STREAM_BLOCK`, `REDUCE_BLOCKS`): the grid depends on `n` only.
const RED_BLOCK: usize = 256;
const RED_CAP: usize = 1024;
/// Elements of one block's first sweep (a float4 per thread), and of the capped grid's.
const RED_ONE: usize = 4 * RED_BLOCK;
const RED_FULL: usize = RED_ONE * RED_CAP;

/// Reduction lengths: empty, tiny, a float4 tail, exactly one block (1024), one past it,
/// exactly the block cap (1024 blocks), past the cap (the grid-stride loop wraps), random ones
/// below and around the cap.
fn reduce_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        Just(1),
        Just(3),
        Just(RED_ONE - 1),
        Just(RED_ONE),
        Just(RED_ONE + 1),
        Just(RED_FULL),
        Just(RED_FULL + 5),
        2usize..5000,
        RED_FULL - 3000..RED_FULL + 3000,
    ]
}

/// Sum over a full warp by the kernels' xor butterfly (`v += __shfl_xor_sync(v, o)` for
/// o = 16..1): every lane ends with the same value.
fn butterfly(mut v: [f64; 32]) -> f64 {
    for o in [16, 8, 4, 2, 1] {
        let p = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = p[l] + p[l ^ o];
        }
    }
    v[0]
}

/// `ew_block_sum_f64` over one block's per-thread values: a butterfly per warp, then one over
/// the warp sums padded with zeros.
fn block_sum(t: &[f64]) -> f64 {
    let mut red = [0.0; 32];
    for (w, lanes) in t.chunks_exact(32).enumerate() {
        red[w] = butterfly(lanes.try_into().unwrap());
    }
    butterfly(red)
}

/// The reduction kernel's f64 `Σ xᵢ yᵢ` in its exact order: per thread a grid-stride sum
/// over float4 items (when both buffers are 16-byte aligned) then over the scalar tail,
/// per block a partial ([`block_sum`]), then the partials strided over one block's threads
/// in block order and [`block_sum`] again. Products of f32 are exact in f64, so a fused
/// multiply-add gives the same bits, and so does any device.
fn kernel_sum(x: &[f32], y: &[f32], aligned: bool) -> f64 {
    let n = x.len();
    let blocks = n.div_ceil(RED_ONE).clamp(1, RED_CAP);
    let threads = blocks * RED_BLOCK;
    let p = |i: usize| x[i] as f64 * y[i] as f64;
    let mut acc = vec![0f64; threads];
    let n4 = if aligned { n / 4 } else { 0 };
    for k in 0..n4 {
        for i in 4 * k..4 * k + 4 {
            acc[k % threads] += p(i);
        }
    }
    for i in 4 * n4..n {
        acc[(i - 4 * n4) % threads] += p(i);
    }
    let mut last = vec![0f64; RED_BLOCK];
    for (b, part) in acc.chunks_exact(RED_BLOCK).map(block_sum).enumerate() {
        last[b % RED_BLOCK] += part;
    }
    block_sum(&last)
}

/// Whether every matrix's storage is 16-byte aligned (the kernels' float4 path): always on
/// CUDA, wherever the host allocator put it on the emulator.
fn aligned16(ms: &[&Matrix]) -> bool {
    ms.iter().all(|m| {
        m.host()
            .is_none_or(|h| (h.as_ptr() as usize).is_multiple_of(16))
    })
}

/// dot, norm2 and the deferred dot (`hooks::deferred_dots`: `Device::dots_deferred` in a
/// `Device::deferred` scope, read from its ledger) give exactly the bits of the kernel's
/// summation order ([`kernel_sum`]; so a partial skipped, summed twice or out of order, or a
/// finalize before the last block, fails), the same on every call, within the header's
/// bound of an f64 reference; a clean scope reads back once.
fn reductions_in_kernel_order(devs: &[Device], n: usize, seed: u64) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (x, y) = (vals(&mut rng, n, -1.0, 1.0), vals(&mut rng, n, -1.0, 1.0));
    let z = vals(&mut rng, n, -1.0, 1.0);
    let xy: f64 = x.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
    let abs_xy: f64 = x
        .iter()
        .zip(&y)
        .map(|(a, b)| (*a as f64 * *b as f64).abs())
        .sum();
    let nrm = x.iter().map(|a| *a as f64 * *a as f64).sum::<f64>().sqrt();
    let slack = n as f64 * 2f64.powi(-52);
    for dev in devs {
        let (xd, yd) = (up(dev, &x), up(dev, &y));
        let sum_xy = kernel_sum(&x, &y, aligned16(&[&xd, &yd]));
        let sum_xx = kernel_sum(&x, &x, aligned16(&[&xd]));
        let (dot, norm) = (sum_xy as f32, sum_xx.sqrt() as f32);
        let name = dev.name();
        let got = dev.dot(&xd, &yd).unwrap();
        prop_assert_eq!(
            got.to_bits(),
            dot.to_bits(),
            "{}: dot {} vs {}",
            name,
            got,
            dot
        );
        prop_assert_eq!(dev.dot(&xd, &yd).unwrap().to_bits(), dot.to_bits());
        let got = dev.norm2(&xd).unwrap();
        prop_assert_eq!(
            got.to_bits(),
            norm.to_bits(),
            "{}: norm2 {} vs {}",
            name,
            got,
            norm
        );
        // Four pairs: two chunks (three with their own x each, and the fourth) in one launch.
        let zd = up(dev, &z);
        let reads = grng::hooks::read_backs();
        let pairs = [(&xd, &yd), (&xd, &xd), (&zd, &yd), (&yd, &zd)];
        let got = grng::hooks::deferred_dots(dev, &[&pairs]).unwrap();
        prop_assert_eq!(grng::hooks::read_backs() - reads, u64::from(n > 0));
        let sum_zy = kernel_sum(&z, &y, aligned16(&[&zd, &yd])) as f32;
        prop_assert_eq!(
            bits(&got),
            bits(&[dot, sum_xx as f32, sum_zy, sum_zy]),
            "{}: deferred",
            name
        );
        // The bound of the header against the f64 reference (itself within n·2⁻⁵³Σ|xᵢyᵢ|).
        let tol = 2f64.powi(-23) * xy.abs() + slack * abs_xy + f32::MIN_POSITIVE as f64;
        prop_assert!((dot as f64 - xy).abs() <= tol, "dot {} vs {}", dot, xy);
        let tol = (2f64.powi(-23) + slack) * nrm + f32::MIN_POSITIVE as f64;
        prop_assert!(
            (norm as f64 - nrm).abs() <= tol,
            "norm2 {} vs {}",
            norm,
            nrm
        );
    }
    Ok(())
}

/// A NaN or ±Inf planted at one index of `x` or `y`: dot, norm2 and the deferred dot fail with
/// the CPU's error (variant, argument, index); the deferred one after its scope's failed
/// check ran the body again eagerly (read-backs beyond the scope's one).
fn reduction_errors(
    devs: &[Device],
    n: usize,
    seed: u64,
    (which, at, kind): (usize, usize, u8),
) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut arrays = [vals(&mut rng, n, -1.0, 1.0), vals(&mut rng, n, -1.0, 1.0)];
    plant(&mut arrays, which, at, kind % 2);
    let [x, y] = &arrays;
    let clean = &vals(&mut rng, n, -1.0, 1.0);
    // The three keys, and the read-backs of the deferred call.
    let errs = |dev: &Device| {
        let (xd, yd) = (up(dev, x), up(dev, y));
        let reads = grng::hooks::read_backs();
        let deferred = grng::hooks::deferred_dots(dev, &[&[(&xd, &yd)]]).map(|_| ());
        let reads = grng::hooks::read_backs() - reads;
        // The bad pair between clean ones in one launch: its error, as one dot after the
        // other would meet it.
        let cd = up(dev, clean);
        let middle = grng::hooks::deferred_dots(dev, &[&[(&cd, &cd), (&xd, &yd), (&cd, &xd)]]);
        let keys = [
            dev.dot(&xd, &yd).map(|_| ()),
            dev.norm2(&xd).map(|_| ()),
            deferred,
            middle.map(|_| ()),
        ]
        .map(|r| r.map_or_else(|e| key(&e), |()| "ok".into()));
        (keys, reads)
    };
    let (want, _) = errs(&Device::Cpu);
    prop_assert_eq!(&want[0], &want[2]);
    prop_assert_eq!(&want[0], &want[3]);
    for dev in devs {
        let (keys, reads) = errs(dev);
        prop_assert_eq!(&keys, &want, "{}", dev.name());
        prop_assert!(
            reads > 1,
            "{}: the scope's read only ({})",
            dev.name(),
            reads
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(24))]

    /// [`reductions_in_kernel_order`] on the emulator (and CUDA).
    #[test]
    fn reductions_follow_the_kernel_order(n in reduce_len(), seed in any::<u64>()) {
        reductions_in_kernel_order(&devices(), n, seed)?;
    }

    /// [`reduction_errors`] on the emulator (and CUDA).
    #[test]
    fn reduction_errors_match_cpu(n in reduce_len().prop_map(|n| n.max(1)), seed in any::<u64>(), plant in (0usize..2, any::<usize>(), any::<u8>())) {
        reduction_errors(&devices(), n, seed, plant)?;
    }
}

/// A finite f64 sum beyond `f32::MAX` (`Σ (1e19)² = 8·10³⁸`, `√(4·(3·10³⁸)²)`): the CPU's
/// overflow error from dot, norm2 and the deferred dots (after the scope's failed check),
/// also where a later pair of the same launch has a NaN input.
#[test]
fn reduction_overflow_is_the_cpu_error() {
    let (x, y) = (vec![1e19f32; 8], vec![3e38f32; 4]);
    let nan = vec![f32::NAN; 8];
    let run = |dev: &Device| {
        let (xd, yd, nd) = (up(dev, &x), up(dev, &y), up(dev, &nan));
        [
            dev.dot(&xd, &xd).map(|_| ()),
            dev.norm2(&yd).map(|_| ()),
            grng::hooks::deferred_dots(dev, &[&[(&xd, &xd)]]).map(|_| ()),
            // The overflow comes first, a NaN input after it: the overflow's error.
            grng::hooks::deferred_dots(dev, &[&[(&xd, &xd), (&nd, &xd)]]).map(|_| ()),
        ]
        .map(|r| r.map_or_else(|e| key(&e), |()| "ok".into()))
    };
    let want = run(&Device::Cpu);
    assert!(want.iter().all(|k| k.contains("overflow")), "{want:?}");
    for dev in devices() {
        assert_eq!(run(&dev), want, "{}", dev.name());
    }
}

// ---- Multi-tensor updates (`Device::*_update_many`, one launch over all tensors) ----

/// Ragged tensor lists: 1 to 6 tensors, each empty, tiny, at a float4 or warp edge, or a
/// block edge; `cols` > 1 splits a length into a matrix (any shape of that length is one
/// tensor to the update). One list in four is long (80 to 200 small tensors): more than one
/// launch's table holds (83), so the update takes several launches.
fn shapes() -> impl Strategy<Value = Vec<(usize, usize)>> {
    let one = prop_oneof![
        Just(0usize),
        1usize..9,
        31usize..34,
        1020usize..1030,
        Just(4000)
    ];
    let small = prop_oneof![Just(0usize), 1usize..9, 31usize..34];
    let lists = prop_oneof![
        3 => prop::collection::vec((one, 1usize..4), 1..7),
        1 => prop::collection::vec((small, 1usize..4), 80..=200),
    ];
    lists.prop_map(|v| {
        v.into_iter()
            .map(|(n, c)| if n % c == 0 { (n / c, c) } else { (n, 1) })
            .collect()
    })
}

/// The coefficients of the three updates at learning rate `lr`, weight decay `wd`, AdamW
/// step `step` (the fused one-tensor and the multi-tensor tests alike).
fn coeffs(lr: f32, wd: f32, step: u64) -> (SgdCoeffs, AdamWCoeffs, SophiaCoeffs) {
    (
        SgdCoeffs {
            lr,
            momentum: 0.9,
            weight_decay: wd,
        },
        AdamWCoeffs {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: wd,
            step,
        },
        SophiaCoeffs {
            lr,
            beta1: 0.96,
            gamma: 0.01,
            eps: 1e-12,
            weight_decay: wd,
        },
    )
}

/// The uploads of per-tensor host arrays.
fn ups(dev: &Device, shapes: &[(usize, usize)], vs: &[Vec<f32>]) -> Vec<Matrix> {
    shapes
        .iter()
        .zip(vs)
        .map(|(&(r, c), v)| dev.upload(r, c, v).unwrap())
        .collect()
}

/// Per-tensor random arrays of `shapes` in `[lo, hi)`.
fn per_tensor(rng: &mut ChaCha8Rng, shapes: &[(usize, usize)], lo: f32, hi: f32) -> Vec<Vec<f32>> {
    shapes
        .iter()
        .map(|&(r, c)| vals(rng, r * c, lo, hi))
        .collect()
}

/// The `&mut` list a multi-tensor update takes.
fn refs(ps: &mut [Matrix]) -> Vec<&mut Matrix> {
    ps.iter_mut().collect()
}

/// Concatenation of per-tensor arrays (the state's checkpoint form).
fn concat(vs: &[Vec<f32>]) -> Vec<f32> {
    vs.concat()
}

/// SGD, AdamW and Sophia (refresh, plain, refresh) over a ragged tensor list, three steps:
/// every device's multi-tensor update equals, bit for bit, the one-tensor ops applied to each
/// tensor on the CPU (same formula, same order, correctly rounded: module docs), parameters
/// and state alike.
fn multi_updates(
    devs: &[Device],
    shapes: &[(usize, usize)],
    seed: u64,
    lr: f32,
    wd: f32,
) -> Result<(), TestCaseError> {
    use grng::ops::elementwise::{MultiState, SophiaRefresh};
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let p0 = per_tensor(&mut rng, shapes, -2.0, 2.0);
    let gs: Vec<Vec<Vec<f32>>> = (0..3)
        .map(|_| per_tensor(&mut rng, shapes, -3.0, 3.0))
        .collect();
    let hs: Vec<Vec<Vec<f32>>> = (0..3)
        .map(|_| per_tensor(&mut rng, shapes, -1.0, 1.0))
        .collect();
    let refresh = [true, false, true];
    let (sgd, _, soph) = coeffs(lr, wd, 1);
    // Per tensor: params and states of SGD, AdamW, Sophia after the three steps.
    let reference = || -> Vec<Vec<f32>> {
        let dev = Device::Cpu;
        let mut out = vec![Vec::new(); 7];
        for (t, &(r, c)) in shapes.iter().enumerate() {
            let z = vec![0.0f32; r * c];
            let [mut ps, mut b, mut pa, mut m, mut v, mut po, mut mo, mut h] =
                [&p0[t], &z, &p0[t], &z, &z, &p0[t], &z, &z].map(|x| dev.upload(r, c, x).unwrap());
            for k in 0..3 {
                let g = dev.upload(r, c, &gs[k][t]).unwrap();
                let (_, adam, _) = coeffs(lr, wd, k as u64 + 1);
                dev.sgd_update(&mut ps, &g, &mut b, &sgd).unwrap();
                dev.adamw_update(&mut pa, &g, &mut m, &mut v, &adam)
                    .unwrap();
                if refresh[k] {
                    let gh = dev.upload(r, c, &hs[k][t]).unwrap();
                    dev.sophia_hessian_ema(&mut h, &gh, 0.98, 5).unwrap();
                }
                dev.sophia_update(&mut po, &g, &mut mo, &h, &soph).unwrap();
            }
            for (o, x) in out.iter_mut().zip([&ps, &b, &pa, &m, &v, &po, &h]) {
                o.extend(x.to_vec().unwrap());
            }
        }
        out
    };
    let want = reference();
    let mut all = vec![Device::Cpu];
    all.extend(devs.iter().cloned());
    for dev in &all {
        let [mut s_sgd, mut s_adam, mut s_soph] =
            [1, 2, 2].map(|k| MultiState::new(dev, shapes, k).unwrap());
        let [mut ps, mut pa, mut po] = [0; 3].map(|_| ups(dev, shapes, &p0));
        for k in 0..3 {
            let g = ups(dev, shapes, &gs[k]);
            let g: Vec<&Matrix> = g.iter().collect();
            let gh = ups(dev, shapes, &hs[k]);
            let gh: Vec<&Matrix> = gh.iter().collect();
            let (_, adam, _) = coeffs(lr, wd, k as u64 + 1);
            dev.sgd_update_many(&mut refs(&mut ps), &g, &mut s_sgd, &sgd)
                .unwrap();
            dev.adamw_update_many(&mut refs(&mut pa), &g, &mut s_adam, &adam)
                .unwrap();
            let r = refresh[k].then_some(SophiaRefresh {
                sampled_grads: &gh,
                beta2: 0.98,
                batch: 5,
            });
            dev.sophia_update_many(&mut refs(&mut po), &g, &mut s_soph, r, &soph)
                .unwrap();
        }
        let flat =
            |ps: &[Matrix]| -> Vec<f32> { ps.iter().flat_map(|m| m.to_vec().unwrap()).collect() };
        let got = [
            flat(&ps),
            s_sgd.to_host(0).unwrap(),
            flat(&pa),
            s_adam.to_host(0).unwrap(),
            s_adam.to_host(1).unwrap(),
            flat(&po),
            s_soph.to_host(1).unwrap(),
        ];
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            prop_assert_eq!(bits(g), bits(w), "{}: output {}", dev.name(), k);
        }
        for (m, &s) in ps.iter().zip(shapes) {
            prop_assert_eq!(m.shape(), s);
        }
    }
    Ok(())
}

/// What identifies a multi-tensor error across backends.
fn multi_key(e: &Error) -> String {
    match e {
        Error::NonFiniteTensor {
            arg, tensor, index, ..
        } => format!("NonFiniteTensor({arg}, {tensor}, {index})"),
        other => key(other),
    }
}

/// NaN/Inf planted in 1 to 3 places of any input (params, gradients, Hessian samples, the
/// state m and v/h) or a negative v/h: each update reports the error the CPU reports
/// (variant, array, tensor, index) — checked also against the plants themselves: the first
/// array in slot order, its smallest flat position — and leaves params and state bit for bit
/// unchanged.
fn multi_errors(
    devs: &[Device],
    shapes: &[(usize, usize)],
    seed: u64,
    plants: &[(usize, usize, u8)],
) -> Result<(), TestCaseError> {
    use grng::ops::elementwise::{MultiLayout, MultiState, SophiaRefresh};
    let lens: Vec<usize> = shapes.iter().map(|&(r, c)| r * c).collect();
    let layout = MultiLayout::new(&lens);
    let total = layout.total();
    if total == 0 {
        return Ok(());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Flat arrays: 0 params, 1 grads, 2 m, 3 v/h, 4 samples.
    let mut arrays = [
        vals(&mut rng, total, -2.0, 2.0),
        vals(&mut rng, total, -2.0, 2.0),
        vals(&mut rng, total, -0.5, 0.5),
        vals(&mut rng, total, 0.0, 0.5),
        vals(&mut rng, total, -1.0, 1.0),
    ];
    // kind 0 NaN, 1 +Inf, 2 -Inf, 3 a negative (in v/h only).
    let mut planted: Vec<(usize, usize, u8)> = Vec::new();
    for &(which, at, kind) in plants {
        let (which, at, kind) = (which % 5, at % total, kind % 4);
        let which = if kind == 3 { 3 } else { which };
        arrays[which][at] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.25][kind as usize];
        planted.push((which, at, kind));
    }
    // Slot order per update: (array, arg) for NaN/Inf, then the sign of v/h.
    let expect = |order: &[(usize, &str)], sign: Option<&str>| -> String {
        for &(a, arg) in order {
            if let Some(pos) = (0..total).find(|&i| !arrays[a][i].is_finite()) {
                let (t, i) = layout.locate(pos);
                return format!("NonFiniteTensor({arg}, {t}, {i})");
            }
        }
        match sign.and_then(|arg| arrays[3].iter().find(|v| **v < 0.0).map(|v| (arg, v))) {
            Some((arg, v)) => format!("Value({arg}, {})", *v as f64),
            None => "ok".into(),
        }
    };
    let want = [
        expect(&[(0, "params"), (1, "grad"), (2, "momentum_buf")], None),
        expect(&[(0, "params"), (1, "grad"), (2, "m"), (3, "v")], Some("v")),
        expect(
            &[
                (0, "params"),
                (1, "grad"),
                (2, "m"),
                (3, "h"),
                (4, "sampled_grad"),
            ],
            Some("h"),
        ),
    ];
    let split = |a: &[f32]| -> Vec<Vec<f32>> {
        (0..shapes.len())
            .map(|t| a[layout.first(t)..layout.first(t) + lens[t]].to_vec())
            .collect()
    };
    let (sgd, adam, soph) = coeffs(0.1, 0.01, 3);
    let run = |dev: &Device| -> (Vec<String>, Vec<Vec<f32>>) {
        let p = ups(dev, shapes, &split(&arrays[0]));
        let g = ups(dev, shapes, &split(&arrays[1]));
        let gh = ups(dev, shapes, &split(&arrays[4]));
        let (g, gh): (Vec<&Matrix>, Vec<&Matrix>) = (g.iter().collect(), gh.iter().collect());
        let mut keys = Vec::new();
        let mut finals = Vec::new();
        for u in 0..3 {
            let mut st = MultiState::new(dev, shapes, if u == 0 { 1 } else { 2 }).unwrap();
            st.load(dev, 0, &arrays[2]).unwrap();
            if u > 0 {
                st.load(dev, 1, &arrays[3]).unwrap();
            }
            let mut ps: Vec<Matrix> = p.iter().map(|m| m.try_clone().unwrap()).collect();
            let mut ps_refs = refs(&mut ps);
            let r = match u {
                0 => dev.sgd_update_many(&mut ps_refs, &g, &mut st, &sgd),
                1 => dev.adamw_update_many(&mut ps_refs, &g, &mut st, &adam),
                _ => {
                    let r = SophiaRefresh {
                        sampled_grads: &gh,
                        beta2: 0.9,
                        batch: 4,
                    };
                    dev.sophia_update_many(&mut ps_refs, &g, &mut st, Some(r), &soph)
                }
            };
            keys.push(r.map_or_else(|e| multi_key(&e), |_| "ok".into()));
            finals.push(ps.iter().flat_map(|m| m.to_vec().unwrap()).collect());
            finals.push(st.to_host(0).unwrap());
            if u > 0 {
                finals.push(st.to_host(1).unwrap());
            }
        }
        (keys, finals)
    };
    let (cpu_keys, cpu_finals) = run(&Device::Cpu);
    prop_assert_eq!(&cpu_keys[..], &want[..], "planted {:?}", planted);
    // A failed step leaves params and state as they were.
    let before = [0, 2, 0, 2, 3, 0, 2, 3].map(|a| arrays[a].clone());
    let unchanged_when_failed = |keys: &[String], finals: &[Vec<f32>]| {
        let mut at = 0;
        for (u, k) in keys.iter().enumerate() {
            let n = if u == 0 { 2 } else { 3 };
            if k != "ok" {
                for j in at..at + n {
                    assert_eq!(bits(&finals[j]), bits(&before[j]), "update {u} array {j}");
                }
            }
            at += n;
        }
    };
    unchanged_when_failed(&cpu_keys, &cpu_finals);
    for dev in devs {
        let (keys, finals) = run(dev);
        prop_assert_eq!(&keys, &cpu_keys, "{}", dev.name());
        unchanged_when_failed(&keys, &finals);
        for (g, w) in finals.iter().zip(&cpu_finals) {
            prop_assert_eq!(bits(g), bits(w), "{}", dev.name());
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(32))]

    /// [`multi_updates`] on the CPU, the emulator (and CUDA) at ragged tensor lists.
    #[test]
    fn multi_updates_match_per_tensor_ops(shapes in shapes(), seed in any::<u64>(), lr in 1e-4f32..0.5, wd in 0f32..0.1) {
        multi_updates(&devices(), &shapes, seed, lr, wd)?;
    }

    /// [`multi_errors`] on the CPU, the emulator (and CUDA) at ragged tensor lists.
    #[test]
    fn multi_errors_name_tensor_and_index_and_leave_state(shapes in shapes(), seed in any::<u64>(), plants in prop::collection::vec((0usize..5, any::<usize>(), any::<u8>()), 1..4)) {
        multi_errors(&devices(), &shapes, seed, &plants)?;
    }
}

/// Per-tensor arrays of `shapes` in `[−1, 1)` times one scale `10^e` for the whole array (at
/// most `f32::MAX`). `e` is ordinary (`[−8, 10)`) or at one of the two edges where a
/// finite input can give a non-finite result: squares near `f32::MAX` (`[17, 22)`, `g²` in
/// AdamW and Sophia's refresh) and values near it (`[36, 38.6)`).
fn at_scale(rng: &mut ChaCha8Rng, shapes: &[(usize, usize)]) -> Vec<Vec<f32>> {
    let (lo, hi) = [(-8.0, 10.0), (17.0, 22.0), (36.0, 38.6)][rng.random_range(0..3)];
    let scale = 10f64.powf(rng.random_range(lo..hi)).min(f32::MAX as f64) as f32;
    per_tensor(rng, shapes, -1.0, 1.0)
        .into_iter()
        .map(|v| v.into_iter().map(|x| x * scale).collect())
        .collect()
}

/// Finite inputs at every scale up to `f32::MAX` with random coefficients, two steps of each
/// update: the CPU, which writes in place where its measured bounds prove a step clean and
/// through spare buffers otherwise, agrees with the emulator (and CUDA), whose kernels always
/// check every result before committing — the same bits after a clean step, the same error and
/// nothing changed after one that overflows. An in-place step that the proof let through and
/// that wrote a non-finite value would differ here.
fn multi_extreme_scales(
    devs: &[Device],
    shapes: &[(usize, usize)],
    seed: u64,
) -> Result<(), TestCaseError> {
    use grng::ops::elementwise::{MultiState, SophiaRefresh};
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut log_uniform = |lo: f32, hi: f32| 10f32.powf(rng.random_range(lo..hi));
    let (lr, wd, eps, gamma) = (
        log_uniform(-6.0, 2.0),
        log_uniform(-6.0, 0.0),
        log_uniform(-30.0, -1.0),
        log_uniform(-3.0, 1.0),
    );
    let beta = rng.random_range(0.0f32..0.9999);
    // AdamW's first step: early (bias corrections far from 1) or late (near 1).
    let t0 = 10f64.powf(rng.random_range(0.0..7.0)) as u64;
    let sgd = SgdCoeffs {
        lr,
        momentum: beta,
        weight_decay: wd,
    };
    let adam = |step| AdamWCoeffs {
        lr,
        beta1: beta,
        beta2: rng_beta(seed),
        eps,
        weight_decay: wd,
        step,
    };
    let soph = SophiaCoeffs {
        lr,
        beta1: beta,
        gamma,
        eps,
        weight_decay: wd,
    };
    let p0 = at_scale(&mut rng, shapes);
    let steps: Vec<[Vec<Vec<f32>>; 2]> = (0..2)
        .map(|_| [at_scale(&mut rng, shapes), at_scale(&mut rng, shapes)])
        .collect();
    let batch = rng.random_range(1usize..100);
    // Per update and step: the result key, then params and state.
    let run = |dev: &Device| -> Vec<(String, Vec<Vec<f32>>)> {
        let mut out = Vec::new();
        for u in 0..3 {
            let mut st = MultiState::new(dev, shapes, if u == 0 { 1 } else { 2 }).unwrap();
            let mut ps = ups(dev, shapes, &p0);
            for (k, [g, gh]) in steps.iter().enumerate() {
                let g = ups(dev, shapes, g);
                let g: Vec<&Matrix> = g.iter().collect();
                let gh = ups(dev, shapes, gh);
                let gh: Vec<&Matrix> = gh.iter().collect();
                let r = match u {
                    0 => dev.sgd_update_many(&mut refs(&mut ps), &g, &mut st, &sgd),
                    1 => {
                        dev.adamw_update_many(&mut refs(&mut ps), &g, &mut st, &adam(t0 + k as u64))
                    }
                    _ => {
                        // Refresh on the first step only: the second reads the `h` it wrote.
                        let r = (k == 0).then_some(SophiaRefresh {
                            sampled_grads: &gh,
                            beta2: beta,
                            batch,
                        });
                        dev.sophia_update_many(&mut refs(&mut ps), &g, &mut st, r, &soph)
                    }
                };
                let mut arrays: Vec<Vec<f32>> =
                    vec![ps.iter().flat_map(|m| m.to_vec().unwrap()).collect()];
                arrays.extend((0..st_arrays(u)).map(|a| st.to_host(a).unwrap()));
                out.push((r.map_or_else(|e| multi_key(&e), |_| "ok".into()), arrays));
            }
        }
        out
    };
    let cpu = run(&Device::Cpu);
    // A failed step leaves what the step before it left (the initial params, zero state).
    for (i, (key, arrays)) in cpu.iter().enumerate() {
        if key != "ok" {
            let before = match i % 2 {
                0 => {
                    let mut b = vec![p0.concat()];
                    b.extend((0..st_arrays(i / 2)).map(|_| vec![0.0; p0.concat().len()]));
                    b
                }
                _ => cpu[i - 1].1.clone(),
            };
            for (a, b) in arrays.iter().zip(&before) {
                prop_assert_eq!(
                    bits(a),
                    bits(b),
                    "step {} failed ({}) but changed its inputs",
                    i,
                    key
                );
            }
        }
    }
    for dev in devs {
        let got = run(dev);
        for (i, ((gk, ga), (ck, ca))) in got.iter().zip(&cpu).enumerate() {
            prop_assert_eq!(gk, ck, "{} step {}", dev.name(), i);
            for (g, c) in ga.iter().zip(ca) {
                prop_assert_eq!(bits(g), bits(c), "{} step {}", dev.name(), i);
            }
        }
    }
    Ok(())
}

/// State arrays of update `u` of [`multi_extreme_scales`] (SGD 1, AdamW and Sophia 2).
fn st_arrays(u: usize) -> usize {
    if u == 0 {
        1
    } else {
        2
    }
}

/// AdamW's `β₂` of [`multi_extreme_scales`]: near 1 as in practice, or anywhere in `[0, 1)`.
fn rng_beta(seed: u64) -> f32 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xb2);
    if rng.random_bool(0.5) {
        1.0 - 10f32.powf(rng.random_range(-6.0f32..-1.0))
    } else {
        rng.random_range(0.0f32..0.9999)
    }
}

proptest! {
    #![proptest_config(common::proptest_config(96))]

    /// [`multi_extreme_scales`] at ragged tensor lists.
    #[test]
    fn multi_updates_at_extreme_scales_match_the_checked_route(shapes in shapes(), seed in any::<u64>()) {
        multi_extreme_scales(&devices(), &shapes, seed)?;
    }
}

/// The CPU's route, seen from the parameters' buffers: a step its bounds prove clean is written
/// over them (same buffer), a finite step they cannot prove (a parameter above `f32::MAX / 8`)
/// goes through a spare buffer swapped in, and the next ordinary step is in place again, the
/// state re-measured. Every step has the bits of the one-tensor ops, and the gradients' `Σg²`
/// is reported.
#[test]
fn cpu_multi_update_writes_in_place_when_proven_clean() {
    use grng::ops::elementwise::MultiState;
    let dev = Device::Cpu;
    // Over the parallel threshold (65536) and ragged.
    let shapes = [(300, 301), (7, 3)];
    let mut rng = common::seeded_rng();
    let mut p = per_tensor(&mut rng, &shapes, -2.0, 2.0);
    let mut st = MultiState::new(&dev, &shapes, 2).unwrap();
    let mut ps = ups(&dev, &shapes, &p);
    let (mut m, mut v) = (
        shapes.map(|(r, c)| vec![0.0f32; r * c]),
        shapes.map(|(r, c)| vec![0.0f32; r * c]),
    );
    for (k, huge) in [false, false, true, false].into_iter().enumerate() {
        if huge {
            p[1][4] = 1e38;
            ps = ups(&dev, &shapes, &p);
        }
        let g = per_tensor(&mut rng, &shapes, -3.0, 3.0);
        let gm = ups(&dev, &shapes, &g);
        let gr: Vec<&Matrix> = gm.iter().collect();
        let (_, adam, _) = coeffs(1e-3, if huge { 0.0 } else { 0.01 }, k as u64 + 1);
        let ptrs: Vec<*const f32> = ps.iter().map(|m| m.host().unwrap().as_ptr()).collect();
        dev.adamw_update_many(&mut refs(&mut ps), &gr, &mut st, &adam)
            .unwrap();
        let same: Vec<bool> = ps
            .iter()
            .zip(&ptrs)
            .map(|(m, &q)| m.host().unwrap().as_ptr() == q)
            .collect();
        assert_eq!(
            same, [!huge; 2],
            "step {k}: written in place only when proven clean"
        );
        // The one-tensor op per tensor (its own route) gives the same bits.
        let mut sq = 0.0f64;
        for t in 0..shapes.len() {
            ew::adamw_update(&mut p[t], &g[t], &mut m[t], &mut v[t], &adam).unwrap();
            sq += g[t].iter().map(|&x| x as f64 * x as f64).sum::<f64>();
        }
        let flat: Vec<f32> = ps.iter().flat_map(|m| m.to_vec().unwrap()).collect();
        assert_eq!(bits(&flat), bits(&p.concat()), "step {k}");
        assert_eq!(bits(&st.to_host(0).unwrap()), bits(&m.concat()), "step {k}");
        assert_eq!(bits(&st.to_host(1).unwrap()), bits(&v.concat()), "step {k}");
        // Σg² summed in another order: within n·2⁻⁵² of it.
        let got = st.last_grad_sq().unwrap();
        assert!((got - sq).abs() <= 1e-12 * sq, "step {k}: {got} vs {sq}");
        if huge {
            p[1][4] = 0.5;
            ps = ups(&dev, &shapes, &p);
        }
    }
}

/// Finite inputs whose result overflows (AdamW's `g²` above `f32::MAX` in the third tensor):
/// the error names the overflowing output, its tensor and index, on every device, and nothing
/// changes; and a multi-tensor step is ONE kernel launch on a kernel device.
#[test]
fn multi_overflow_is_named_and_step_is_one_launch() {
    // This thread's launches only: other tests launch multi-tensor kernels too.
    use grng::hooks::{
        record_launches_here as record_launches, take_launches_here as take_launches,
    };
    use grng::ops::elementwise::MultiState;
    let shapes = [(3, 2), (0, 4), (5, 3), (1, 1)];
    let (_, adam, _) = coeffs(0.1, 0.0, 1);
    let mut all = vec![Device::Cpu];
    all.extend(devices());
    for dev in all {
        let p: Vec<Matrix> = shapes
            .iter()
            .map(|&(r, c)| dev.upload(r, c, &vec![0.5; r * c]).unwrap())
            .collect();
        let mut gv: Vec<Vec<f32>> = shapes.iter().map(|&(r, c)| vec![0.25; r * c]).collect();
        let mut st = MultiState::new(&dev, &shapes, 2).unwrap();
        let mut ps: Vec<Matrix> = p.iter().map(|m| m.try_clone().unwrap()).collect();
        // A clean step: one launch, recorded under the multi kernel's name.
        let g = ups(&dev, &shapes, &gv);
        let g: Vec<&Matrix> = g.iter().collect();
        record_launches(true);
        dev.adamw_update_many(&mut refs(&mut ps), &g, &mut st, &adam)
            .unwrap();
        let launched: Vec<_> = take_launches()
            .into_iter()
            .filter(|k| k.starts_with("elementwise_multi"))
            .collect();
        record_launches(false);
        let want: &[&str] = match dev {
            Device::Cpu => &[],
            _ => &["elementwise_multi_adamw"],
        };
        assert_eq!(launched, want, "{}", dev.name());
        // 3e19² = 9e38 > f32::MAX ≈ 3.4e38: v overflows at tensor 2, index 7.
        gv[2][7] = 3e19;
        let g = ups(&dev, &shapes, &gv);
        let g: Vec<&Matrix> = g.iter().collect();
        let before: Vec<Vec<f32>> = ps.iter().map(|m| m.to_vec().unwrap()).collect();
        let (m0, v0) = (st.to_host(0).unwrap(), st.to_host(1).unwrap());
        let r = dev.adamw_update_many(&mut refs(&mut ps), &g, &mut st, &adam);
        match r {
            Err(Error::NonFiniteTensor {
                arg: "v (overflow)",
                tensor: 2,
                index: 7,
                ..
            }) => {}
            other => panic!("{}: {other:?}", dev.name()),
        }
        let after: Vec<Vec<f32>> = ps.iter().map(|m| m.to_vec().unwrap()).collect();
        assert_eq!(after, before, "{}", dev.name());
        assert_eq!(bits(&st.to_host(0).unwrap()), bits(&m0));
        assert_eq!(bits(&st.to_host(1).unwrap()), bits(&v0));
        // Wrong counts and shapes are shape errors before any launch.
        let two: Vec<&Matrix> = g[..2].to_vec();
        assert!(matches!(
            dev.adamw_update_many(&mut refs(&mut ps), &two, &mut st, &adam),
            Err(Error::Shape { arg: "grad", .. })
        ));
        let mut wrong: Vec<Matrix> = shapes
            .iter()
            .map(|&(r, c)| dev.zeros(c, r).unwrap())
            .collect();
        assert!(matches!(
            dev.adamw_update_many(&mut refs(&mut wrong), &g, &mut st, &adam),
            Err(Error::Shape { arg: "params", .. })
        ));
    }
}

/// The optimizers' `step_many` over a model's tensors equals `step` over their concatenation
/// (bit for bit: the updates are element-wise), checkpoints included, on every device.
#[test]
fn optimizers_step_many_equals_one_flat_step() {
    use grng::optim::adamw::{AdamW, AdamWConfig};
    use grng::optim::sophia::{Sophia, SophiaConfig, SophiaHessian, SophiaHessians};
    let shapes = [(7, 3), (1, 5), (0, 2), (33, 1)];
    let n: usize = shapes.iter().map(|&(r, c)| r * c).sum();
    let mut rng = common::seeded_rng();
    let p0 = per_tensor(&mut rng, &shapes, -1.0, 1.0);
    let gs: Vec<Vec<Vec<f32>>> = (0..3)
        .map(|_| per_tensor(&mut rng, &shapes, -1.0, 1.0))
        .collect();
    let mut all = vec![Device::Cpu];
    all.extend(devices());
    for dev in all {
        let ac = AdamWConfig {
            warmup_steps: 2,
            ..AdamWConfig::default()
        };
        // Refresh at the first of the three steps; the fourth needs a sample again.
        let sc = SophiaConfig {
            hessian_every: 3,
            ..SophiaConfig::default()
        };
        let (mut am, mut af) = (
            AdamW::for_tensors(&dev, &shapes, ac).unwrap(),
            AdamW::new(&dev, n, ac).unwrap(),
        );
        let (mut sm, mut sf) = (
            Sophia::for_tensors(&dev, &shapes, sc).unwrap(),
            Sophia::new(&dev, n, sc).unwrap(),
        );
        let [mut pam, mut psm] = [0; 2].map(|_| ups(&dev, &shapes, &p0));
        let [mut paf, mut psf] = [0; 2].map(|_| dev.upload(n, 1, &concat(&p0)).unwrap());
        for g in &gs {
            let gm = ups(&dev, &shapes, g);
            let gm: Vec<&Matrix> = gm.iter().collect();
            let gf = dev.upload(n, 1, &concat(g)).unwrap();
            am.step_many(&mut refs(&mut pam), &gm).unwrap();
            af.step(&mut paf, &gf).unwrap();
            let need = sm.needs_hessian();
            let hm = need.then_some(SophiaHessians {
                sampled_grads: &gm,
                batch: 3,
            });
            sm.step_many(&mut refs(&mut psm), &gm, hm).unwrap();
            let hf = need.then_some(SophiaHessian {
                sampled_grad: &gf,
                batch: 3,
            });
            sf.step(&mut psf, &gf, hf).unwrap();
        }
        let flat =
            |ps: &[Matrix]| -> Vec<f32> { ps.iter().flat_map(|m| m.to_vec().unwrap()).collect() };
        assert_eq!(
            bits(&flat(&pam)),
            bits(&paf.to_vec().unwrap()),
            "{}",
            dev.name()
        );
        assert_eq!(
            bits(&flat(&psm)),
            bits(&psf.to_vec().unwrap()),
            "{}",
            dev.name()
        );
        assert_eq!(am.state().unwrap(), af.state().unwrap());
        assert_eq!(sm.state().unwrap(), sf.state().unwrap());
        // A missing Hessian sample on a refresh step: typed error, nothing changes.
        assert!(sm.needs_hessian());
        let st = sm.state().unwrap();
        let gm = ups(&dev, &shapes, &gs[0]);
        let gm: Vec<&Matrix> = gm.iter().collect();
        assert!(matches!(
            sm.step_many(&mut refs(&mut psm), &gm, None),
            Err(Error::Value { arg: "hess", .. })
        ));
        assert_eq!(sm.state().unwrap(), st);
    }
}

proptest! {
    #![proptest_config(common::proptest_config(24))]

    /// `Device::axpy_new_split_all` (`hooks::axpy_new_split_all`; on the kernel devices ONE
    /// launch of `elementwise_multi_axpy_new` for every job, as a lazy Kronecker step forms its
    /// first-order inverses): each result is the CPU's `axpy_new` of that job and this device's
    /// own `axpy_new` of it, bit for bit, eager and deferred; on the kernel devices each
    /// non-empty result comes with its split planes, `host_split3` of every element. Ragged
    /// lengths (empty jobs, float4 body and tail). A NaN or ±Inf planted in one job's `x` or
    /// `y`, or an overflowing `y + αx`, is the error the CPU reports for the first failing job
    /// (variant, argument, index), deferred or not.
    ///
    /// One list in four is long (80 to 200 small jobs): a launch's table holds 90, so it takes
    /// one launch per 90 jobs (counted), still with no upload.
    #[test]
    fn batched_axpys_are_each_axpy_new(
        lens in prop_oneof![
            3 => prop::collection::vec(prop_oneof![Just(0usize), 1usize..80, 1020usize..1030], 1..=5),
            1 => prop::collection::vec(prop_oneof![Just(0usize), 1usize..12], 80..=200),
        ],
        alphas in prop::collection::vec(-4.0f32..4.0, 200),
        bad in prop::option::of((any::<usize>(), 0usize..3, any::<usize>(), any::<u8>())),
        seed in any::<u64>(),
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut alphas = alphas;
        let mut xs: Vec<Vec<f32>> = lens.iter().map(|&n| vals(&mut rng, n, -3.0, 3.0)).collect();
        let mut ys: Vec<Vec<f32>> = lens.iter().map(|&n| vals(&mut rng, n, -3.0, 3.0)).collect();
        if let Some((job, which, at, kind)) = bad {
            let j = job % lens.len();
            if lens[j] > 0 {
                match which {
                    0 => plant(&mut xs[j..=j], 0, at, kind % 2),
                    1 => plant(&mut ys[j..=j], 0, at, kind % 2),
                    _ => {
                        let i = at % lens[j];
                        (xs[j][i], ys[j][i], alphas[j]) = (f32::MAX, f32::MAX, 1.0);
                    }
                }
            }
        }
        let cpu = |j: usize| {
            Device::Cpu
                .axpy_new(alphas[j], &up(&Device::Cpu, &xs[j]), &up(&Device::Cpu, &ys[j]))
                .map(|m| m.to_vec().unwrap())
                .map_err(|e| key(&e))
        };
        let want: Vec<_> = (0..lens.len()).map(cpu).collect();
        let first_err = want.iter().find_map(|r| r.as_ref().err()).cloned();
        for dev in devices() {
            let xd: Vec<Matrix> = xs.iter().map(|v| up(&dev, v)).collect();
            let yd: Vec<Matrix> = ys.iter().map(|v| up(&dev, v)).collect();
            let jobs: Vec<(f32, &Matrix, &Matrix)> =
                (0..lens.len()).map(|j| (alphas[j], &xd[j], &yd[j])).collect();
            let name = dev.name();
            for deferred in [false, true] {
                let uploads = grng::hooks::uploads();
                grng::hooks::record_launches_here(true);
                let got = grng::hooks::axpy_new_split_all(&dev, &jobs, deferred);
                let launched = grng::hooks::take_launches_here();
                grng::hooks::record_launches_here(false);
                // The tables travel as kernel parameters: nothing uploaded.
                prop_assert_eq!(grng::hooks::uploads(), uploads, "{}", name);
                if first_err.is_none() && !matches!(dev, Device::Cpu) {
                    // One job alone is elementwise_axpy_new's.
                    let batches = match lens.len() {
                        1 => 0,
                        _ => lens.chunks(90).filter(|b| b.iter().any(|&n| n > 0)).count(),
                    };
                    let multi = launched.iter().filter(|&&k| k == "elementwise_multi_axpy_new");
                    prop_assert_eq!(multi.count(), batches, "{}: {:?}", name, launched);
                }
                let got = match (&first_err, got) {
                    (Some(e), got) => {
                        prop_assert_eq!(got.map(|_| ()).map_err(|e| key(&e)), Err(e.clone()));
                        continue;
                    }
                    (None, got) => got.unwrap(),
                };
                for (j, (out, planes)) in got.iter().enumerate() {
                    let w = want[j].as_ref().unwrap();
                    prop_assert_eq!(bits(out), bits(w), "{}: job {}", name, j);
                    let own = dev.axpy_new(alphas[j], &xd[j], &yd[j]).unwrap().to_vec().unwrap();
                    prop_assert_eq!(bits(out), bits(&own), "{}: job {}", name, j);
                    let n = lens[j];
                    let kernel = !matches!(dev, Device::Cpu);
                    prop_assert_eq!(planes.is_some(), kernel && n > 0, "{}: job {}", name, j);
                    if let Some(p) = planes {
                        prop_assert_eq!(p.len(), 3 * n);
                        for (i, &v) in out.iter().enumerate() {
                            let s = common::host_split3(v);
                            prop_assert_eq!([p[i], p[n + i], p[2 * n + i]], s, "{}: job {}", name, j);
                        }
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(24))]

    /// The deferred dots of several groups of ragged lengths (`hooks::deferred_dots`: a
    /// Kronecker step's model terms, every layer's; empty groups and empty matrices included)
    /// in ONE launch on the kernel devices (`elementwise_multi_dot`, or `elementwise_dot` for a
    /// single chunk of at most three pairs) and one read-back: each value is the bits
    /// `Device::dot` gives its pair alone, so each chunk ran on the blocks and in the order of
    /// a launch of its own. A NaN or ±Inf planted in one pair is the CPU's error for the first
    /// failing pair (variant, argument, index).
    ///
    /// One list in four is long (80 to 200 small groups): a launch's table holds 55 chunks, so
    /// it takes one launch per 55 (counted), still with no upload.
    #[test]
    fn grouped_dots_are_each_dot(
        groups in prop_oneof![
            3 => prop::collection::vec((prop_oneof![Just(0usize), 1usize..80, 1020usize..1030, 4090usize..4200], 0usize..=4), 1..=5),
            1 => prop::collection::vec((prop_oneof![1 => Just(0usize), 5 => 1usize..40], 1usize..=4), 80..=200),
        ],
        bad in prop::option::of((any::<usize>(), any::<usize>(), any::<u8>())),
        seed in any::<u64>(),
    ) {
        let (lens, per): (Vec<usize>, Vec<usize>) = groups.into_iter().unzip();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // Group g: per[g] pairs of length lens[g], each of its own two arrays.
        let mut host: Vec<Vec<[Vec<f32>; 2]>> = lens
            .iter()
            .zip(&per)
            .map(|(&n, &k)| (0..k).map(|_| [vals(&mut rng, n, -1.0, 1.0), vals(&mut rng, n, -1.0, 1.0)]).collect())
            .collect();
        let all = host.iter().map(Vec::len).sum::<usize>();
        if let (Some((pair, at, kind)), true) = (bad, all > 0) {
            let flat: Vec<(usize, usize)> = host
                .iter()
                .enumerate()
                .flat_map(|(g, ps)| (0..ps.len()).map(move |j| (g, j)))
                .filter(|&(g, _)| lens[g] > 0)
                .collect();
            if !flat.is_empty() {
                let (g, j) = flat[pair % flat.len()];
                plant(&mut host[g][j], (kind / 2) as usize, at, kind % 2);
            }
        }
        let run = |dev: &Device| {
            let ms: Vec<Vec<[Matrix; 2]>> = host
                .iter()
                .map(|ps| ps.iter().map(|[x, y]| [up(dev, x), up(dev, y)]).collect())
                .collect();
            let pairs: Vec<Vec<(&Matrix, &Matrix)>> =
                ms.iter().map(|ps| ps.iter().map(|[x, y]| (x, y)).collect()).collect();
            let groups: Vec<&[(&Matrix, &Matrix)]> = pairs.iter().map(Vec::as_slice).collect();
            let (reads, uploads) = (grng::hooks::read_backs(), grng::hooks::uploads());
            grng::hooks::record_launches_here(true);
            let got = grng::hooks::deferred_dots(dev, &groups);
            let launched = grng::hooks::take_launches_here();
            grng::hooks::record_launches_here(false);
            let reads = grng::hooks::read_backs() - reads;
            // The tables travel as kernel parameters: nothing uploaded.
            assert_eq!(grng::hooks::uploads(), uploads, "{}", dev.name());
            let alone: Vec<Result<f32, String>> = pairs
                .iter()
                .flatten()
                .map(|&(x, y)| dev.dot(x, y).map_err(|e| key(&e)))
                .collect();
            (got.map_err(|e| key(&e)), alone, launched, reads)
        };
        let (want, cpu_alone, _, _) = run(&Device::Cpu);
        let first_err = cpu_alone.iter().find_map(|r| r.as_ref().err()).cloned();
        match &first_err {
            Some(e) => prop_assert_eq!(&want, &Err(e.clone())),
            None => prop_assert!(want.is_ok()),
        }
        for dev in devices().into_iter().filter(|d| !matches!(d, Device::Cpu)) {
            let name = dev.name();
            let (got, alone, launched, reads) = run(&dev);
            match &first_err {
                Some(e) => prop_assert_eq!(&got, &Err(e.clone()), "{}", name),
                None => {
                    let got = got.unwrap();
                    let alone: Vec<f32> = alone.into_iter().map(Result::unwrap).collect();
                    prop_assert_eq!(bits(&got), bits(&alone), "{}", name);
                    // The chunks: at most three pairs of one non-empty group each.
                    let chunks: usize = lens
                        .iter()
                        .zip(&host)
                        .filter(|(&n, _)| n > 0)
                        .map(|(_, ps)| ps.len().div_ceil(3))
                        .sum();
                    let dots = |k: &str| launched.iter().filter(|&&l| l == k).count();
                    let want = match chunks {
                        0 => (0, 0),
                        1 => (1, 0),
                        _ => (0, chunks.div_ceil(55)),
                    };
                    prop_assert_eq!((dots("elementwise_dot"), dots("elementwise_multi_dot")), want, "{}: {:?}", name, launched);
                    prop_assert_eq!(reads, u64::from(chunks > 0), "{}", name);
                }
            }
        }
    }
}
