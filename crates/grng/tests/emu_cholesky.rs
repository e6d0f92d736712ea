//! `Device::cholesky_inverse` on the kernel devices (issue 9 item 5): under the emulator the
//! host path runs and is counted (`grng::cuda::cholesky::host_fallbacks`, the launch record)
//! with exactly the CPU's result and errors; the mirror kernel cuSOLVER's `potri` needs runs
//! against its definition on ragged sizes; and, when a GPU is present, the cuSOLVER path
//! matches the CPU (the CUDA arm — GPU-only: the emulator has no cuSOLVER).

use grng::cuda::cholesky::{available, host_fallbacks, mirror_lower};
use grng::hooks::{record_launches, take_launches};
use grng::{Device, Error, Matrix};
use rand::Rng;
use std::sync::{Mutex, MutexGuard, PoisonError};

use common::{spd, vals, U32};
use grng_testkit as common;

/// The fallback counter and the launch record are process-wide: the tests of this file take
/// turns so each sees its own calls only.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sizes on both sides of the 256-thread blocks and 128-wide tiles, and small ones.
const SIZES: [usize; 7] = [1, 2, 17, 64, 127, 129, 200];

fn host(m: &Matrix) -> Vec<f32> {
    m.to_vec().unwrap()
}

/// A not-positive-definite symmetric matrix: an SPD one with one eigenvalue made negative.
fn indefinite(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<f32> {
    let (_, mut d) = spd(rng, n, 10.0);
    d[rng.random_range(0..n)] = -0.5;
    common::with_spectrum(rng, &d)
}

#[test]
fn emulated_inverse_is_the_counted_host_path() {
    let _serial = serial();
    let mut rng = common::seeded_rng();
    for n in SIZES {
        let (a, _) = spd(&mut rng, n, 1e3);
        let want = Device::Cpu
            .cholesky_inverse(&Device::Cpu.upload(n, n, &a).unwrap())
            .unwrap();
        let dev = Device::Emulated;
        let am = dev.upload(n, n, &a).unwrap();
        let before = host_fallbacks();
        record_launches(true);
        let got = dev.cholesky_inverse(&am).unwrap();
        let launched = take_launches();
        record_launches(false);
        assert_eq!(host_fallbacks(), before + 1, "n = {n}");
        assert_eq!(launched, ["host:cholesky_inverse"], "n = {n}");
        // The same f64 computation on the same input.
        assert_eq!(host(&got), host(&want), "n = {n}");
        assert_eq!(host(&am), a, "input written, n = {n}");
    }
}

/// A matrix that is not SPD, or holds a NaN, gets the CPU's error (variant, index, pivot) on
/// the emulator, and the fallback is still counted for the attempt that reached the host.
#[test]
fn emulated_errors_match_cpu() {
    let _serial = serial();
    let mut rng = common::seeded_rng();
    for n in [1usize, 5, 130] {
        let mut bad = indefinite(&mut rng, n);
        if n == 5 {
            bad[2 * n + 1] = f32::NAN;
        }
        let cpu = Device::Cpu
            .cholesky_inverse(&Device::Cpu.upload(n, n, &bad).unwrap())
            .unwrap_err();
        let am = Device::Emulated.upload(n, n, &bad).unwrap();
        let emu = Device::Emulated.cholesky_inverse(&am).unwrap_err();
        assert!(
            matches!(cpu, Error::NotSpd { .. } | Error::NonFinite { .. }),
            "{cpu}"
        );
        assert_eq!(format!("{emu}"), format!("{cpu}"), "n = {n}");
        let same_bits = host(&am)
            .iter()
            .zip(&bad)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same_bits, "input written, n = {n}");
    }
}

/// `newton_mirror_lower` copies the strict lower triangle onto the upper one and leaves the
/// lower triangle and the diagonal alone, bit for bit, on every kernel device.
#[test]
fn mirror_lower_copies_the_lower_triangle() {
    let _serial = serial();
    let mut rng = common::seeded_rng();
    for dev in common::devices() {
        for n in SIZES.into_iter().chain([0, rng.random_range(1..=300)]) {
            let a = vals(&mut rng, n * n);
            let mut m = dev.upload(n, n, &a).unwrap();
            mirror_lower(&dev, &mut m).unwrap();
            let got = host(&m);
            for i in 0..n {
                for j in 0..n {
                    let want = if j > i { a[j * n + i] } else { a[i * n + j] };
                    assert_eq!(got[i * n + j].to_bits(), want.to_bits(), "({i}, {j}) n {n}");
                }
            }
        }
        let mut rect = dev.zeros(3, 4).unwrap();
        assert!(matches!(
            mirror_lower(&dev, &mut rect),
            Err(Error::Shape { .. })
        ));
    }
}

/// The CUDA arm (runs only with a GPU, and then needs libcusolver): the cuSOLVER inverse
/// matches the CPU's `f64` one and takes no host fallback; a non-SPD matrix gets the CPU's
/// error. Tolerance: `potrf` + `potri` in `f32` are backward stable, so the inverse is within
/// `c·n·u·κ` relative (Higham, *Accuracy and Stability*, §14.2); with `c = 4` and a factor 2 of
/// margin, `‖X − X_cpu‖_F ≤ 8·n·u·κ·‖X_cpu‖_F` (the CPU's own error, `u·κ`, is inside it).
#[test]
fn cuda_inverse_uses_cusolver() {
    let _serial = serial();
    let Some(dev) = common::cuda() else {
        return;
    };
    assert!(
        available(),
        "a GPU without libcusolver: the cuSOLVER arm cannot run"
    );
    let mut rng = common::seeded_rng();
    let kappa = 1e3;
    for n in SIZES.into_iter().chain([common::large_dim(&mut rng)]) {
        let (a, _) = spd(&mut rng, n, kappa);
        let want = host(
            &Device::Cpu
                .cholesky_inverse(&Device::Cpu.upload(n, n, &a).unwrap())
                .unwrap(),
        );
        let am = dev.upload(n, n, &a).unwrap();
        let before = host_fallbacks();
        record_launches(true);
        let got = host(&dev.cholesky_inverse(&am).unwrap());
        let launched = take_launches();
        record_launches(false);
        assert_eq!(host_fallbacks(), before, "n = {n}: fell back to the host");
        assert!(launched.contains(&"cusolverDnSpotri"), "{launched:?}");
        let frob = |v: &[f32]| v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let diff: Vec<f32> = got.iter().zip(&want).map(|(x, y)| x - y).collect();
        let tol = 8.0 * n as f64 * U32 * kappa * frob(&want);
        assert!(frob(&diff) <= tol, "n = {n}: {} > {tol}", frob(&diff));
        for i in 0..n {
            for j in 0..i {
                assert_eq!(
                    got[i * n + j],
                    got[j * n + i],
                    "not symmetric at ({i}, {j})"
                );
            }
        }
    }
    let n = 40;
    let bad = indefinite(&mut rng, n);
    let cpu = Device::Cpu
        .cholesky_inverse(&Device::Cpu.upload(n, n, &bad).unwrap())
        .unwrap_err();
    let gpu = dev
        .cholesky_inverse(&dev.upload(n, n, &bad).unwrap())
        .unwrap_err();
    assert_eq!(format!("{gpu}"), format!("{cpu}"));
}
