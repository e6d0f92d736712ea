//! SPD inversion: grng's cubic Newton iteration (`f32`, scaled-identity start, `tol = 1e-4`)
//! against grng's Cholesky inverse (computed in `f64`) and faer's Cholesky (`llt`) inverse in
//! `f32`, on the same damped Gram matrix `A = GᵀG/n + 0.04 I` (κ ≈ 100, the shape of a
//! damped Kronecker factor). Throughput: matrix entries of the inverse per second (n²).
//! Group `low_rank_inverse`: the Cholesky inverse against the low-rank (Woodbury) inverse from
//! `m < n` rows, at a refresh's shapes.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use faer::linalg::solvers::DenseSolveCore;
use grng::ops::newton::NewtonOptions;
use grng::MatMul;
use grng::{Mat, Trans};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;

/// `GᵀG/m + λI` for a random `m x n` G with entries in [-√3, √3] (unit variance), and G.
/// For `m = n` the spectrum is Marchenko–Pastur on [0, 4], shifted by the damping; for
/// `m < n` the Gram part has rank `m`.
fn damped_gram(rng: &mut ChaCha8Rng, m: usize, n: usize, lambda: f32) -> (Mat, Mat) {
    let s = 3f32.sqrt();
    let g = Mat::from_vec((0..m * n).map(|_| rng.random_range(-s..s)).collect(), m, n).unwrap();
    let mut a = Mat::identity(n);
    grng::cpu::gemm(
        MatMul::new(
            Trans::Yes,
            Trans::No,
            1.0 / m as f32,
            g.as_ref(),
            g.as_ref(),
        ),
        lambda,
        a.as_mut(),
    )
    .unwrap();
    // Exact symmetry (the GEMM's two triangles round differently).
    let d = a.as_mut_slice();
    for i in 0..n {
        for j in 0..i {
            d[i * n + j] = d[j * n + i];
        }
    }
    (g, a)
}

fn bench_newton(c: &mut Criterion) {
    let mut group = common::flat_group(c, "spd_inverse_f32");
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let opts = NewtonOptions {
        lambda_low: 0.04,
        ..NewtonOptions::default()
    };
    for n in [128usize, 256, 512, 1024, 2048] {
        group.throughput(Throughput::Elements((n * n) as u64));
        let (_, a) = damped_gram(&mut rng, n, n, 0.04);
        let (_, info) = grng::cpu::newton::newton_inverse(a.as_ref(), None, &opts).unwrap();
        eprintln!(
            "n = {n}: cubic Newton {} iterations, residual {:.1e}",
            info.iterations, info.residual
        );
        group.bench_with_input(BenchmarkId::new("grng_newton_cubic", n), &n, |b, _| {
            b.iter(|| grng::cpu::newton::newton_inverse(a.as_ref(), None, &opts).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("grng_cholesky_inverse", n), &n, |b, _| {
            b.iter(|| grng::cpu::cholesky_inverse(a.as_ref()).unwrap())
        });
        let fa = faer::Mat::<f32>::from_fn(n, n, |i, j| a.as_slice()[i * n + j]);
        group.bench_with_input(BenchmarkId::new("faer_llt_inverse", n), &n, |b, _| {
            b.iter(|| fa.llt(faer::Side::Lower).unwrap().inverse())
        });
    }
    group.finish();
}

/// The damped factor of a refresh from `m < n` statistics rows (`F = XᵀX/m`, rank `m`):
/// grng's Cholesky inverse of the formed `F + λI` against the Woodbury inverse from the rows
/// (`cpu::low_rank_damped_inverse`), at the optimizer's shapes (MLP 784-1024-1024-10, batch
/// 256: `d_in + 1 = 785`, `1024`).
fn bench_low_rank(c: &mut Criterion) {
    let mut group = common::flat_group(c, "low_rank_inverse");
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let lambda = 0.04;
    for (n, m) in [(1024usize, 256usize), (785, 256)] {
        let id = format!("n{n}_m{m}");
        let (x, f) = damped_gram(&mut rng, m, n, lambda);
        group.bench_with_input(
            BenchmarkId::new("grng_cholesky_inverse", &id),
            &n,
            |b, _| b.iter(|| grng::cpu::cholesky_inverse(f.as_ref()).unwrap()),
        );
        group.bench_with_input(
            BenchmarkId::new("grng_low_rank_inverse", &id),
            &n,
            |b, _| b.iter(|| grng::cpu::low_rank_damped_inverse(x.as_ref(), lambda).unwrap()),
        );
    }
    group.finish();
}

criterion_group!(benches, bench_newton, bench_low_rank);
criterion_main!(benches);
