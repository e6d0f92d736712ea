//! f32 GEMM, grng's CPU GEMM against faer's matmul on the same inputs: square `C = A·B`, and
//! `C = A·Bᵀ` at the forward-pass shapes of the bench MLP (`A` the `256 x d_in` batch, `B` the
//! `d_out x d_in` weights), where the transposed `B` used to be packed by one thread.
//! Throughput is in floating-point operations (`2mnk` per product).

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use faer::linalg::matmul::matmul;
use faer::{Accum, Par};
use grng::MatMul;
use grng::{Mat, Trans};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// grng's `cpu::gemm` and faer's `matmul` on the same random `C = A·op(B)`, `A` `m x k`, `B`
/// stored `n x k` (`op = ᵀ`) when `tb`, else `k x n`; rows labelled `id`.
fn bench_pair(
    group: &mut BenchmarkGroup<'_, WallTime>,
    rng: &mut ChaCha8Rng,
    id: &str,
    (m, k, n): (usize, usize, usize),
    tb: Trans,
) {
    group.throughput(Throughput::Elements(2 * (m * n * k) as u64));
    let (a, b) = (random(rng, m * k), random(rng, k * n));
    let (b_rows, b_cols) = if tb == Trans::Yes { (n, k) } else { (k, n) };
    let am = Mat::from_vec(a.clone(), m, k).unwrap();
    let bm = Mat::from_vec(b.clone(), b_rows, b_cols).unwrap();
    let mut cm = Mat::zeros(m, n);
    group.bench_with_input(BenchmarkId::new("grng", id), &m, |bch, _| {
        bch.iter(|| {
            grng::cpu::gemm(
                MatMul::new(Trans::No, tb, 1.0, am.as_ref(), bm.as_ref()),
                0.0,
                cm.as_mut(),
            )
            .unwrap()
        })
    });
    let fa = faer::Mat::<f32>::from_fn(m, k, |i, j| a[i * k + j]);
    let fb = faer::Mat::<f32>::from_fn(b_rows, b_cols, |i, j| b[i * b_cols + j]);
    let fb = if tb == Trans::Yes {
        fb.transpose()
    } else {
        fb.as_ref()
    };
    let mut fc = faer::Mat::<f32>::zeros(m, n);
    group.bench_with_input(BenchmarkId::new("faer", id), &m, |bch, _| {
        bch.iter(|| {
            matmul(
                fc.as_mut(),
                Accum::Replace,
                fa.as_ref(),
                fb,
                1.0,
                Par::rayon(0),
            )
        })
    });
}

fn bench_gemm(c: &mut Criterion) {
    let mut group = common::flat_group(c, "gemm_f32");
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for n in [256usize, 512, 1024, 2048] {
        bench_pair(&mut group, &mut rng, &n.to_string(), (n, n, n), Trans::No);
    }
    group.finish();
}

/// `C = A·Bᵀ`, `A` `m x k`, `B` `n x k`: the forward pass `x̄ W̄ᵀ` of a dense layer.
fn bench_gemm_nt(c: &mut Criterion) {
    let mut group = common::flat_group(c, "gemm_f32_abt");
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for (m, k, n) in [
        (256usize, 785usize, 1024usize),
        (256, 1025, 1024),
        (1024, 1024, 1024),
    ] {
        let id = format!("{m}x{k}x{n}");
        bench_pair(&mut group, &mut rng, &id, (m, k, n), Trans::Yes);
    }
    group.finish();
}

criterion_group!(benches, bench_gemm, bench_gemm_nt);
criterion_main!(benches);
