//! Full training step per optimizer: forward, backward, the method's statistics, the update
//! (and the Kronecker methods' loss-after evaluation), through [`grng_train::train::Trainer::step`].
//!
//! Environment:
//! - `GRNG_BENCH_SHAPE`: MLP widths `d_0-…-d_L` (default `784-1024-1024-10`, tanh);
//! - `GRNG_BENCH_BATCH`: mini-batch of the gradient methods (default 256);
//! - `GRNG_BENCH_ACT`: `tanh` (default) or `relu`;
//! - `GRNG_BENCH_ONLY`: comma-separated subset of `ring,reng,ngd,rkalman,kalman,adamw,sgd,sophia`;
//! - `GRNG_BENCH_EMA`: the Kronecker factors' EMA `ε` (default: the method's, 0 = replaced at
//!   each refresh; kfac-jax's default is 0.95). With `ε > 0` the factors are full rank, so the
//!   low-rank paths of a refresh (the Woodbury inverse, the Gram norm) do not apply;
//! - `GRNG_BENCH_SKIPS`: comma-separated skip frequencies `S` of RING and RENG (default `1,8`);
//! - `GRNG_BENCH_LM_INTERVAL`: the Kronecker methods' Levenberg–Marquardt interval `T`
//!   (`KronConfig::damping_interval`; default the method's, 1: the model and the loss after
//!   every step; Martens & Grosse adapt every 5).
//!
//! RING and RENG run at `S = 1` (factors and inverses every step) and `S = 8` (the amortized
//! lazy cost: criterion averages over many consecutive steps); a large `S` (say 100000)
//! measures the lazy step alone. The Kalman methods take ONE sample per step (docs/math.md §6), so
//! their time is per sample, not per batch.
//! Before timing a variant the bench prints its GEMM work per step, `gemm LABEL: X GFLOP/step`
//! (`grng::cpu::gemm::gemm_flops` over 16 steps): a ratio of two steps' times cannot fall
//! below the ratio of their flops where both run the same micro-kernel near its peak.
//! `--test` runs each variant once after those steps: the flop lines alone, quickly.
//! Quick smoke run: `GRNG_BENCH_SHAPE=64-32-10 GRNG_BENCH_BATCH=32 cargo bench --bench step`.
//!
//! The learning rates are tiny so thousands of repeated steps on one batch stay finite; they
//! do not change the cost.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use grng::mat::Mat;
use grng::Device;
use grng_train::mlp::{Activation, Loss, Mlp, MlpConfig, Targets};
use grng_train::train::{Batch, Knob, Method, MethodConfig, OptimizerConfig, Trainer};

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn shape() -> Vec<usize> {
    let s = env_or("GRNG_BENCH_SHAPE", "784-1024-1024-10");
    let sizes: Vec<usize> = s
        .split(['-', ',', 'x'])
        .map(|w| {
            w.trim()
                .parse()
                .expect("GRNG_BENCH_SHAPE: widths like 784-1024-1024-10")
        })
        .collect();
    assert!(
        sizes.len() >= 2 && !sizes.contains(&0),
        "GRNG_BENCH_SHAPE needs at least two widths >= 1"
    );
    sizes
}

/// The skip frequencies `S` of RING and RENG (`GRNG_BENCH_SKIPS`).
fn skips() -> Vec<usize> {
    env_or("GRNG_BENCH_SKIPS", "1,8")
        .split(',')
        .map(|w| {
            w.trim()
                .parse()
                .ok()
                .filter(|&s| s >= 1)
                .expect("GRNG_BENCH_SKIPS: skip frequencies like 1,8")
        })
        .collect()
}

/// `(label, config)` for every benchmarked variant.
fn variants(batch: usize) -> Vec<(String, MethodConfig)> {
    let only = std::env::var("GRNG_BENCH_ONLY")
        .ok()
        .map(|s| Method::parse_list(&s).expect("GRNG_BENCH_ONLY: optimizer names"));
    let mut out = Vec::new();
    for method in Method::ALL {
        if only.as_ref().is_some_and(|o| !o.contains(&method)) {
            continue;
        }
        let mut c = MethodConfig::tuned(method);
        if !method.is_kalman() {
            c.batch_size = batch;
            let lr = match method {
                Method::Ring | Method::Reng | Method::Ngd => 1e-3,
                _ => 1e-5,
            };
            c.set(Knob::Lr, lr)
                .expect("gradient methods have a learning rate");
        }
        if let (true, Ok(ema)) = (method.is_kronecker(), std::env::var("GRNG_BENCH_EMA")) {
            let ema: f32 = ema.parse().expect("GRNG_BENCH_EMA: a number in [0, 1)");
            c.set(Knob::Ema, ema)
                .expect("GRNG_BENCH_EMA: the Kronecker methods take 0 <= ema < 1");
        }
        if let (OptimizerConfig::Kron(k), Ok(t)) =
            (&mut c.optimizer, std::env::var("GRNG_BENCH_LM_INTERVAL"))
        {
            k.damping_interval = t
                .parse()
                .expect("GRNG_BENCH_LM_INTERVAL: an interval T >= 1");
        }
        match (method, c.optimizer) {
            (Method::Ring | Method::Reng, OptimizerConfig::Kron(k)) => {
                for s in skips() {
                    let mut k = k;
                    k.skip = s;
                    let mut cs = c;
                    cs.optimizer = OptimizerConfig::Kron(k);
                    out.push((format!("{}/S={s}", method.key()), cs));
                }
            }
            _ if method.is_kalman() => out.push((format!("{}/batch=1", method.key()), c)),
            _ => out.push((method.key().to_string(), c)),
        }
    }
    out
}

/// Steps over which each variant's GEMM flops are counted (`grng::cpu::gemm::gemm_flops`).
const FLOP_STEPS: usize = 16;

fn bench(c: &mut Criterion) {
    let sizes = shape();
    let batch: usize = env_or("GRNG_BENCH_BATCH", "256")
        .parse()
        .expect("GRNG_BENCH_BATCH: a positive integer");
    let activation = match env_or("GRNG_BENCH_ACT", "tanh").as_str() {
        "relu" => Activation::Relu,
        _ => Activation::Tanh,
    };
    let config = MlpConfig {
        sizes: sizes.clone(),
        activation,
        loss: Loss::SoftmaxCrossEntropy,
    };
    let (d0, classes) = (sizes[0], sizes[sizes.len() - 1]);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut x = Mat::zeros(batch, d0);
    x.as_mut_slice()
        .iter_mut()
        .for_each(|v| *v = rng.random::<f32>());
    let labels: Vec<usize> = (0..batch).map(|_| rng.random_range(0..classes)).collect();

    let mut group = c.benchmark_group(format!(
        "step/{}/batch={batch}",
        sizes
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join("-")
    ));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(5));
    for (label, mc) in variants(batch) {
        let mlp = Mlp::new(config.clone(), 1).expect("valid MLP shape");
        let mut trainer = Trainer::new(&Device::Cpu, mlp, mc, 3).expect("trainer");
        let m = mc.batch_size;
        let step_batch = Batch {
            x: grng::mat::MatRef::new(&x.as_slice()[..m * d0], m, d0).expect("batch view"),
            targets: Targets::Classes(&labels[..m]),
        };
        // The GEMM engine's work per step over `FLOP_STEPS` steps before the timing (two
        // refreshes at S = 8): each variant's flop floor against the others.
        let before = grng::cpu::gemm::gemm_flops();
        for _ in 0..FLOP_STEPS {
            black_box(trainer.step(step_batch).expect("training step"));
        }
        let flops = (grng::cpu::gemm::gemm_flops() - before) as f64 / FLOP_STEPS as f64;
        println!("gemm {label}: {:.3} GFLOP/step", flops / 1e9);
        group.bench_function(label, |b| {
            b.iter(|| black_box(trainer.step(step_batch).expect("training step")))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
