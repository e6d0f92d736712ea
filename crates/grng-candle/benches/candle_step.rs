//! Full training step through candle (`grng-candle`): forward, backward, the method's
//! statistics, the update (and for RING the loss-after evaluation of the Levenberg–Marquardt
//! rule) of the MLP 784-1024-1024-10 tanh at batch 256, on the CPU (`candle-step/…`) and, with
//! the grng-candle `cuda` feature, on candle's CUDA GPU 0 (`candle-step-cuda/…`, bench filter
//! `cuda`; skipped with a note without a GPU, an error under `GRNG_REQUIRE_CUDA=1`):
//!
//! - `candle-adamw`: candle's own `candle_nn::AdamW` (the baseline);
//! - `grng-adamw`: grng's AdamW through `GrngOptimizer`;
//! - `grng-ring/S=8`: RING, factors and inverses every 8th step (criterion averages over
//!   consecutive steps), `KronLinear` + `capture_fisher` + `GrngOptimizer::step_observed`,
//!   each layer's gradient by its batch factors (`GrngOptimizer::set_factored_gradients`);
//! - `grng-ring-dense/S=8`: the same with candle's dense gradients.
//!
//! Each step ends with the device synchronized, so a GPU step is timed to its end, not to the
//! queueing of its kernels.
//!
//! `cargo bench --features candle --bench candle_step -- --warm-up-time 1 --measurement-time 3`
//! (`GRNG_BENCH_SHAPE` / `GRNG_BENCH_BATCH` as in `benches/step.rs`). Tiny learning rates keep
//! thousands of repeated steps on one batch finite; they do not change the cost.

use std::hint::black_box;

use candle_core::{Device as CDevice, Tensor};
use candle_nn::Optimizer;
use criterion::{criterion_group, criterion_main, Criterion};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use grng::optim::adamw::AdamWConfig;
use grng::optim::kron::KronConfig;
use grng_candle::{capture_fisher, GrngConfig, GrngOptimizer, KronLinear};
use grng_train::mlp::FisherMode;
use grng_train::train::OptimizerConfig;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn sizes() -> Vec<usize> {
    env_or("GRNG_BENCH_SHAPE", "784-1024-1024-10")
        .split(['-', ',', 'x'])
        .map(|w| {
            w.trim()
                .parse()
                .expect("GRNG_BENCH_SHAPE: widths like 784-1024-1024-10")
        })
        .collect()
}

fn model(sizes: &[usize], dev: &CDevice) -> Vec<KronLinear> {
    sizes
        .windows(2)
        .map(|w| KronLinear::new(w[0], w[1], dev).expect("layer"))
        .collect()
}

fn forward(layers: &[KronLinear], x: &Tensor, record: bool) -> Tensor {
    let mut h = x.clone();
    for (l, layer) in layers.iter().enumerate() {
        h = if record {
            layer.forward_record(&h)
        } else {
            layer.forward_eval(&h)
        }
        .expect("forward");
        if l + 1 < layers.len() {
            h = h.tanh().expect("tanh");
        }
    }
    h
}

fn bench(c: &mut Criterion) {
    rows(c, &CDevice::Cpu, "candle-step");
    #[cfg(feature = "cuda")]
    match grng_candle::candle_device("cuda") {
        Ok(dev) => rows(c, &dev, "candle-step-cuda"),
        Err(e) => {
            let required = std::env::var("GRNG_REQUIRE_CUDA").is_ok_and(|v| v == "1");
            assert!(!required, "GRNG_REQUIRE_CUDA=1 but no usable GPU: {e}");
            eprintln!("candle_step: CUDA rows skipped (no GPU: {e})");
        }
    }
}

/// The rows on candle device `dev`, in benchmark group `prefix/<shape>/batch=<m>`.
fn rows(c: &mut Criterion, dev: &CDevice, prefix: &str) {
    let sizes = sizes();
    let batch: usize = env_or("GRNG_BENCH_BATCH", "256")
        .parse()
        .expect("GRNG_BENCH_BATCH");
    let sync = || dev.synchronize().expect("synchronize");
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (d0, classes) = (sizes[0], sizes[sizes.len() - 1]);
    let x: Vec<f32> = (0..batch * d0).map(|_| rng.random::<f32>()).collect();
    let x = Tensor::from_vec(x, (batch, d0), dev).expect("batch");
    let labels: Vec<u32> = (0..batch)
        .map(|_| rng.random_range(0..classes as u32))
        .collect();
    let y = Tensor::from_slice(&labels, batch, dev).expect("labels");
    let loss = |logits: &Tensor| candle_nn::loss::cross_entropy(logits, &y).expect("loss");

    let name = sizes
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join("-");
    let mut group = c.benchmark_group(format!("{prefix}/{name}/batch={batch}"));
    group.sample_size(10);

    let layers = model(&sizes, dev);
    let vars = layers.iter().map(|l| l.weight().clone()).collect();
    let params = candle_nn::ParamsAdamW {
        lr: 1e-5,
        ..Default::default()
    };
    let mut adamw = candle_nn::AdamW::new(vars, params).expect("candle AdamW");
    group.bench_function("candle-adamw", |b| {
        b.iter(|| {
            let l = loss(&forward(&layers, &x, false));
            adamw.backward_step(&l).expect("step");
            sync();
            black_box(l)
        })
    });

    let grng_opt = |layers: &[KronLinear], method| {
        let vars = layers.iter().map(|l| l.weight().clone()).collect();
        let config = GrngConfig {
            method,
            rest: AdamWConfig::default(),
            layers: layers.to_vec(),
        };
        GrngOptimizer::try_new(vars, config).expect("optimizer")
    };
    let layers = model(&sizes, dev);
    let adamw_cfg = AdamWConfig {
        lr: 1e-5,
        ..AdamWConfig::default()
    };
    let mut opt = grng_opt(&layers, OptimizerConfig::AdamW(adamw_cfg));
    group.bench_function("grng-adamw", |b| {
        b.iter(|| {
            let l = loss(&forward(&layers, &x, false));
            opt.try_step(&l.backward().expect("backward"))
                .expect("step");
            sync();
            black_box(l)
        })
    });

    // RING with the gradient by its batch factors (what grng's own trainer passes), and with
    // the dense gradient candle computed.
    for (name, factored) in [("grng-ring/S=8", true), ("grng-ring-dense/S=8", false)] {
        let layers = model(&sizes, dev);
        let ring = KronConfig {
            lr: 1e-3,
            skip: 8,
            ..KronConfig::ring()
        };
        let mut opt = grng_opt(&layers, OptimizerConfig::Kron(ring));
        opt.set_factored_gradients(factored)
            .expect("RING takes factors");
        let mut fisher_rng = ChaCha8Rng::seed_from_u64(3);
        group.bench_function(name, |b| {
            b.iter(|| {
                let logits = forward(&layers, &x, true);
                let l = loss(&logits);
                let before = l.to_scalar::<f32>().expect("loss");
                let grads = l.backward().expect("backward");
                if opt.needs_fisher() {
                    capture_fisher(
                        &layers,
                        &logits,
                        FisherMode::Sampled,
                        &labels,
                        &mut fisher_rng,
                    )
                    .expect("statistics");
                }
                let after = || {
                    let l = loss(&forward(&layers, &x, false));
                    l.to_scalar::<f32>()
                        .map_err(|e| grng::Error::Candle(e.to_string()))
                };
                let observed = opt.step_observed(&grads, before, after).expect("step");
                sync();
                black_box(observed)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
