//! Kronecker-factor accumulation `Λ = (1/m) AᵀA`: grng's SYRK (f32 and bf16 inputs) against
//! grng's own GEMM and faer's matmul computing the full `AᵀA` on the same data, at m = n
//! (`…/256` to `…/2048`) and at the optimizer's batch m = 256 (`…/m256_n1024`, `…/m256_n2048`,
//! without faer). Throughput counts the GEMM-equivalent 2·m·n² flops for every contender, so a
//! SYRK that skips the upper triangle can exceed the GEMM's rate (up to 2x).
//!
//! `kron_optimizer_step`: one Kronecker optimizer step without the network (see
//! [`bench_optimizer_step`]).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use faer::linalg::matmul::matmul;
use faer::{Accum, Par};
use grng::MatMul;
use grng::{Mat, MatRef, Trans};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;

fn bench_kron(c: &mut Criterion) {
    let mut group = common::flat_group(c, "kron_factor");
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let shapes = [256usize, 512, 1024, 2048]
        .map(|n| (n, n, n.to_string()))
        .into_iter()
        .chain([1024usize, 2048].map(|n| (256, n, format!("m256_n{n}"))));
    for (m, n, id) in shapes {
        group.throughput(Throughput::Elements(2 * (m * n * n) as u64));
        let a: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let abf: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut factor = Mat::zeros(n, n);

        group.bench_with_input(BenchmarkId::new("grng_syrk_f32", &id), &n, |bch, _| {
            let av = MatRef::new(&a, m, n).unwrap();
            bch.iter(|| grng::cpu::syrk_ema(av, 0.0, factor.as_mut()).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("grng_syrk_bf16", &id), &n, |bch, _| {
            let av = MatRef::new(&abf, m, n).unwrap();
            bch.iter(|| grng::cpu::syrk_ema(av, 0.0, factor.as_mut()).unwrap())
        });

        group.bench_with_input(BenchmarkId::new("grng_gemm_ata", &id), &n, |bch, _| {
            let av = MatRef::new(&a, m, n).unwrap();
            bch.iter(|| {
                grng::cpu::gemm(
                    MatMul::new(Trans::Yes, Trans::No, 1.0 / m as f32, av, av),
                    0.0,
                    factor.as_mut(),
                )
                .unwrap()
            })
        });

        if m != n {
            continue;
        }
        let fa = faer::Mat::<f32>::from_fn(m, n, |i, j| a[i * n + j]);
        let mut fc = faer::Mat::<f32>::zeros(n, n);
        group.bench_with_input(BenchmarkId::new("faer_gemm_ata", &id), &n, |bch, _| {
            bch.iter(|| {
                matmul(
                    fc.as_mut(),
                    Accum::Replace,
                    fa.transpose(),
                    fa.as_ref(),
                    1.0 / m as f32,
                    Par::rayon(0),
                )
            })
        });
    }
    group.finish();
}

/// One optimizer-only step (no forward/backward: fixed random statistics and gradients) of
/// the MLP 784-1024-1024-10 with biases, batch 256, on the CPU: RING S = 8 (one iteration is
/// the 8 steps of a cycle: one refresh, seven lazy steps) and NGD (refresh and inverse every step), each with the
/// default inverse (`Auto`, Cholesky on the CPU) and with warm Newton (the GPU default).
fn bench_optimizer_step(c: &mut Criterion) {
    use grng::optim::kron::{InverseMethod, KronConfig, KronOptimizer};
    use grng::optim::KronStats;
    use grng::{Device, Matrix};
    let mut group = common::flat_group(c, "kron_optimizer_step");
    let dev = Device::Cpu;
    let m = 256;
    let layers = [(1024usize, 785usize), (1024, 1025), (10, 1025)];
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut random = |r: usize, c: usize| -> Matrix {
        let v: Vec<f32> = (0..r * c).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        dev.upload(r, c, &v).unwrap()
    };
    let a: Vec<Matrix> = layers.iter().map(|&(_, i)| random(m, i)).collect();
    let e: Vec<Matrix> = layers.iter().map(|&(o, _)| random(m, o)).collect();
    let grads: Vec<Matrix> = layers.iter().map(|&(o, i)| random(o, i)).collect();
    let stats: Vec<KronStats<'_>> = a.iter().zip(&e).map(|(a, e)| KronStats { a, e }).collect();
    let newton = InverseMethod::Auto.resolve(&Device::Emulated);
    for (name, base) in [
        (
            "ring_s8",
            KronConfig {
                skip: 8,
                ..KronConfig::ring()
            },
        ),
        ("ngd", KronConfig::ngd()),
    ] {
        for (inv_name, inverse) in [("auto_cholesky", InverseMethod::Auto), ("newton", newton)] {
            let cfg = KronConfig {
                lr: 1e-3,
                inverse,
                ..base
            };
            let mut opt = KronOptimizer::new(&dev, &layers, cfg).unwrap();
            let mut params: Vec<Matrix> = layers
                .iter()
                .map(|&(o, i)| dev.zeros(o, i).unwrap())
                .collect();
            let g: Vec<&Matrix> = grads.iter().collect();
            group.bench_function(BenchmarkId::new(name, inv_name), |b| {
                // One iteration is a whole cycle of S steps (one refresh, S − 1 lazy steps),
                // so every sample weighs them alike; the docs divide by S.
                b.iter(|| {
                    for _ in 0..cfg.skip {
                        // Statistics only on refresh steps, as the trainer passes them.
                        let s = opt.needs_stats().then_some(&stats[..]);
                        opt.step(&mut params, &g, s).unwrap();
                    }
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_kron, bench_optimizer_step);
criterion_main!(benches);
