//! Square f32 GEMM `C = A·B`: grng's CPU GEMM against faer's matmul on the same inputs.
//! Throughput is in floating-point operations (2n³ per product).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use faer::linalg::matmul::matmul;
use faer::{Accum, Par};
use grng::{Mat, Trans};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n * n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn bench_gemm(c: &mut Criterion) {
    let mut group = common::flat_group(c, "gemm_f32");
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for n in [256usize, 512, 1024, 2048] {
        group.throughput(Throughput::Elements(2 * (n as u64).pow(3)));
        let (a, b) = (random(&mut rng, n), random(&mut rng, n));

        let (am, bm) = (
            Mat::from_vec(a.clone(), n, n).unwrap(),
            Mat::from_vec(b.clone(), n, n).unwrap(),
        );
        let mut cm = Mat::zeros(n, n);
        group.bench_with_input(BenchmarkId::new("grng", n), &n, |bch, _| {
            bch.iter(|| {
                grng::cpu::gemm(
                    Trans::No,
                    Trans::No,
                    1.0,
                    am.as_ref(),
                    bm.as_ref(),
                    0.0,
                    cm.as_mut(),
                )
                .unwrap()
            })
        });

        let fa = faer::Mat::<f32>::from_fn(n, n, |i, j| a[i * n + j]);
        let fb = faer::Mat::<f32>::from_fn(n, n, |i, j| b[i * n + j]);
        let mut fc = faer::Mat::<f32>::zeros(n, n);
        group.bench_with_input(BenchmarkId::new("faer", n), &n, |bch, _| {
            bch.iter(|| {
                matmul(
                    fc.as_mut(),
                    Accum::Replace,
                    fa.as_ref(),
                    fb.as_ref(),
                    1.0,
                    Par::rayon(0),
                )
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_gemm);
criterion_main!(benches);
