//! Newton inversion on the CPU against plain `f64` references written here: random SPD
//! matrices `Q D Qᵀ` (random Householder `Q`) with prescribed condition numbers up to 1e3,
//! ragged sizes 1..=200.

use grng::cpu::newton::newton_inverse;
use grng::ops::newton::{InitialGuess, NewtonInfo, NewtonOptions, NewtonOrder, Precision};
use grng::{Device, DivergenceReason, Error, Mat, MatRef};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `Q D Qᵀ` in `f64`, `Q` a product of three random Householder reflectors, eigenvalues
/// log-spaced over `[1/κ, 1]` in random order (both ends present), rounded to `f32`.
fn spd(rng: &mut ChaCha8Rng, n: usize, kappa: f64) -> Vec<f32> {
    let mut d: Vec<f64> = (0..n)
        .map(|i| {
            let t = if n == 1 { 0.0 } else { i as f64 / (n - 1) as f64 };
            kappa.powf(-t)
        })
        .collect();
    for i in (1..n).rev() {
        d.swap(i, rng.random_range(0..=i));
    }
    with_spectrum(rng, &d)
}

fn with_spectrum(rng: &mut ChaCha8Rng, d: &[f64]) -> Vec<f32> {
    let n = d.len();
    let mut q = vec![0.0f64; n * n];
    (0..n).for_each(|i| q[i * n + i] = 1.0);
    for _ in 0..3 {
        let v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let vv: f64 = v.iter().map(|x| x * x).sum::<f64>().max(1e-300);
        for i in 0..n {
            let qv: f64 = (0..n).map(|p| q[i * n + p] * v[p]).sum();
            for j in 0..n {
                q[i * n + j] -= 2.0 * qv * v[j] / vv;
            }
        }
    }
    let mut a = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..n).map(|p| q[i * n + p] * d[p] * q[j * n + p]).sum();
            a[i * n + j] = s as f32;
            a[j * n + i] = s as f32;
        }
    }
    a
}

/// `A⁻¹` of the given `f32` matrix in `f64` (Cholesky, then `L⁻ᵀ L⁻¹`).
fn inverse64(a: &[f32], n: usize) -> Vec<f64> {
    let mut l = vec![0.0f64; n * n];
    for j in 0..n {
        let d = a[j * n + j] as f64 - (0..j).map(|k| l[j * n + k].powi(2)).sum::<f64>();
        assert!(d > 0.0, "test matrix not SPD in f64");
        l[j * n + j] = d.sqrt();
        for i in j + 1..n {
            let s = a[i * n + j] as f64 - (0..j).map(|k| l[i * n + k] * l[j * n + k]).sum::<f64>();
            l[i * n + j] = s / l[j * n + j];
        }
    }
    let mut li = vec![0.0f64; n * n];
    for c in 0..n {
        for i in c..n {
            let rhs = if i == c { 1.0 } else { 0.0 };
            let s: f64 = (c..i).map(|k| l[i * n + k] * li[k * n + c]).sum();
            li[i * n + c] = (rhs - s) / l[i * n + i];
        }
    }
    let mut inv = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            inv[i * n + j] = (i.max(j)..n).map(|k| li[k * n + i] * li[k * n + j]).sum();
        }
    }
    inv
}

/// `‖I − A X‖_F / √n` in `f64`.
fn residual64(a: &[f32], x: &[f32], n: usize) -> f64 {
    let mut s = 0.0;
    for i in 0..n {
        for j in 0..n {
            let ax: f64 = (0..n).map(|k| a[i * n + k] as f64 * x[k * n + j] as f64).sum();
            let e = if i == j { 1.0 - ax } else { -ax };
            s += e * e;
        }
    }
    (s / n as f64).sqrt()
}

fn run(a: &[f32], n: usize, warm: Option<&[f32]>, opts: &NewtonOptions) -> grng::Result<(Mat, NewtonInfo)> {
    let warm = warm.map(|w| MatRef::new(w, n, n).unwrap());
    newton_inverse(MatRef::new(a, n, n).unwrap(), warm, opts)
}

#[test]
fn measure_floors() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for &n in &[24usize, 64, 200, 256, 512] { for _seed in 0..3 {
        for &kappa in &[10.0, 33.0, 100.0, 1000.0] {
            let a = spd(&mut rng, n, kappa);
            let mut o = NewtonOptions { tol: 1e-9, ..Default::default() };
            let f = run(&a, n, None, &o);
            let f32floor = match &f {
                Ok((_, i)) => i.residual as f64,
                Err(Error::Diverged { residual, .. }) => *residual,
                Err(e) => panic!("{e}"),
            };
            o.precision = Precision::Bf16;
            o.polish = false;
            let (xb, ib) = run(&a, n, None, &o).unwrap();
            o.polish = true;
            let (xp, ip) = run(&a, n, None, &o).unwrap();
            o.init = InitialGuess::Paper;
            let pb = run(&a, n, None, &o);
            eprintln!(
                "n {n} kappa {kappa}: f32 {f32floor:.2e} | bf16 {:.2e} ({:.2e}) it {} | polish {:.2e} ({:.2e}) | paper bf16 {:?}",
                ib.residual,
                residual64(&a, xb.as_slice(), n),
                ib.iterations,
                ip.residual,
                residual64(&a, xp.as_slice(), n),
                pb.map(|(_, i)| (i.residual, i.iterations))
            );
        }
    }}
}

#[test]
fn debug_small() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for _ in 0..3 {
        let n = 24;
        let a = spd(&mut rng, n, 1000.0);
        let o = NewtonOptions { tol: 1e-9, max_iter: 30, ..Default::default() };
        let f = run(&a, n, None, &o);
        eprintln!("{:?}", f.as_ref().map(|x| &x.1));
        let o = NewtonOptions { tol: 1e-4, max_iter: 30, ..Default::default() };
        let f = run(&a, n, None, &o);
        eprintln!("{:?}", f.as_ref().map(|x| &x.1));
    }
}

#[test]
fn debug_gemm_noise() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for &n in &[24usize, 64, 200] {
        let a = spd(&mut rng, n, 1000.0);
        let inv = inverse64(&a, n);
        let x32: Vec<f32> = inv.iter().map(|&v| v as f32).collect();
        let r_store = residual64(&a, &x32, n);
        let mut t = vec![0f32; n * n];
        grng::cpu::gemm(grng::Trans::No, grng::Trans::No, 1.0, MatRef::new(&a, n, n).unwrap(), MatRef::new(&x32, n, n).unwrap(), 0.0, grng::MatMut::new(&mut t, n, n).unwrap()).unwrap();
        let mut s = 0.0;
        for i in 0..n { for j in 0..n {
            let e = if i == j { 1.0 - t[i*n+j] as f64 } else { -(t[i*n+j] as f64) };
            s += e * e;
        }}
        let xmax = x32.iter().fold(0f32, |m, v| m.max(v.abs()));
        eprintln!("n {n}: storage residual {r_store:.2e}, f32-gemm residual of it {:.2e}, max|x| {xmax}", (s / n as f64).sqrt());
    }
}
