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

use grng::ops::elementwise::{AdamWCoeffs, SgdCoeffs, SophiaCoeffs};
use grng::{Device, Error, Matrix};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;
use common::{devices, uniform as vals};

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

/// axpy, scale and copy are bit-exact; copy's destination starts as NaN.
fn axpy_scale_copy(devs: &[Device], n: usize, seed: u64, alpha: f32) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (x, y) = (
        vals(&mut rng, n, -10.0, 10.0),
        vals(&mut rng, n, -10.0, 10.0),
    );
    let cpu = Device::Cpu;
    let (xc, mut yc) = (up(&cpu, &x), up(&cpu, &y));
    cpu.axpy(alpha, &xc, &mut yc).unwrap();
    cpu.scale(alpha, &mut yc).unwrap();
    for dev in devs {
        let (xd, mut yd) = (up(dev, &x), up(dev, &y));
        dev.axpy(alpha, &xd, &mut yd).unwrap();
        dev.scale(alpha, &mut yd).unwrap();
        prop_assert_eq!(bits(&yd.to_vec().unwrap()), bits(&yc.to_vec().unwrap()));
        let mut dst = up(dev, &vec![f32::NAN; n]);
        dev.copy(&xd, &mut dst).unwrap();
        prop_assert_eq!(bits(&dst.to_vec().unwrap()), bits(&x));
    }
    Ok(())
}

/// dot and norm2: deterministic two-pass f64 reductions within the bound of the header.
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
        // Repeated calls give the same bits (no atomics in the sum).
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
    let sgd = SgdCoeffs {
        lr,
        momentum: 0.9,
        weight_decay: wd,
    };
    let adam = AdamWCoeffs {
        lr,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: wd,
        step,
    };
    let soph = SophiaCoeffs {
        lr,
        beta1: 0.96,
        gamma: 0.01,
        eps: 1e-12,
        weight_decay: wd,
    };
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

/// The launch record (what `benches/gpu.rs` reports as "which kernel ran") names the kernels
/// an op launched, in order, and nothing for the CPU backend; switched off, it stays empty.
#[test]
fn launch_record_names_the_kernels_run() {
    use grng::cuda::launch::{record_launches, take_launches};
    for dev in devices() {
        let mut x = up(&dev, &[1.0, 2.0, 3.0]);
        record_launches(true);
        dev.scale(2.0, &mut x).unwrap();
        let on = take_launches();
        record_launches(false);
        dev.scale(2.0, &mut x).unwrap();
        assert!(on.contains(&"elementwise_scale"), "{}: {on:?}", dev.name());
        assert!(take_launches().is_empty(), "{}", dev.name());
    }
    let mut x = up(&Device::Cpu, &[1.0]);
    record_launches(true);
    Device::Cpu.scale(2.0, &mut x).unwrap();
    let cpu = take_launches();
    record_launches(false);
    assert!(cpu.is_empty(), "the CPU backend launched {cpu:?}");
}
