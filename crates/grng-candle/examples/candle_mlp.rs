//! The main job's digits MLP (64-64-10 tanh, softmax) trained through candle with grng's
//! optimizers: `KronLinear` layers, `capture_fisher`, `GrngOptimizer`.
//!
//! ```sh
//! cargo run --release --features candle --example candle_mlp -- --methods ring,ngd,adamw
//! ```
//!
//! Same data split, initial weights, hyperparameters (the main job's tuned ones), batches and
//! epochs as `cargo run --release`, so the test accuracies are comparable with its table
//! (docs/main-job.md). Kalman methods are not offered: they need the output Jacobian.

use candle_core::{Device as CDevice, Tensor};
use clap::Parser;
use grng::optim::adamw::AdamWConfig;
use grng::{Error, Result};
use grng_candle::{capture_fisher, GrngConfig, GrngOptimizer, KronLinear, Observed};
use grng_train::mlp::{sample_class, Activation, Loss, Mlp, MlpConfig};
use grng_train::train::{Method, MethodConfig, Splits};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(about = "The digits MLP through candle with grng's optimizers")]
struct Args {
    /// Comma-separated methods (ring, reng, ngd, adamw, sgd, sophia).
    #[arg(long, default_value = "ring,reng,ngd,adamw,sgd,sophia")]
    methods: String,
    /// Passes over the training split.
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Seed of the split, the initial weights, the batches and the sampled labels.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// `cpu`; `cuda` or `cuda:N` when built with `-p grng-candle --features cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn c<T>(r: candle_core::Result<T>) -> Result<T> {
    r.map_err(|e| Error::Candle(e.to_string()))
}

/// Logits of the batch `x`; recording (for the Fisher statistics) or not.
fn forward(layers: &[KronLinear], x: &Tensor, record: bool) -> Result<Tensor> {
    let mut h = x.clone();
    for (l, layer) in layers.iter().enumerate() {
        h = if record {
            layer.forward_record(&h)?
        } else {
            layer.forward_eval(&h)?
        };
        if l + 1 < layers.len() {
            h = c(h.tanh())?;
        }
    }
    Ok(h)
}

fn loss(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    c(candle_nn::loss::cross_entropy(logits, labels))
}

fn scalar(t: &Tensor) -> Result<f32> {
    c(t.to_scalar::<f32>())
}

fn batch(
    data: &grng_train::data::Dataset,
    idx: &[usize],
    dev: &CDevice,
) -> Result<(Tensor, Vec<u32>)> {
    let (x, y) = data.gather(idx)?;
    let y: Vec<u32> = y.into_iter().map(|v| v as u32).collect();
    Ok((
        c(Tensor::from_slice(x.as_slice(), (x.rows(), x.cols()), dev))?,
        y,
    ))
}

fn labels(y: &[u32], dev: &CDevice) -> Result<Tensor> {
    c(Tensor::from_slice(y, y.len(), dev))
}

fn accuracy(layers: &[KronLinear], data: &grng_train::data::Dataset, dev: &CDevice) -> Result<f32> {
    let idx: Vec<usize> = (0..data.len()).collect();
    let (x, y) = batch(data, &idx, dev)?;
    let pred: Vec<u32> = c(forward(layers, &x, false)?
        .argmax(1)
        .and_then(|p| p.to_vec1()))?;
    let hits = pred.iter().zip(&y).filter(|(p, y)| p == y).count();
    Ok(hits as f32 / y.len() as f32)
}

struct Outcome {
    test_acc: f32,
    train_loss: f32,
    steps: usize,
    rejected: usize,
    median_step: Duration,
    wall: Duration,
}

fn train(method: Method, splits: &Splits, args: &Args, dev: &CDevice) -> Result<Outcome> {
    let config = MethodConfig::tuned(method);
    let mlp = Mlp::new(
        MlpConfig {
            sizes: vec![splits.train.dim(), 64, 10],
            activation: Activation::Tanh,
            loss: Loss::SoftmaxCrossEntropy,
        },
        args.seed,
    )?;
    let layers = (0..mlp.num_layers())
        .map(|l| {
            let w = mlp.layer(l)?;
            let t = c(Tensor::from_slice(w.data(), (w.rows(), w.cols()), dev))?;
            KronLinear::from_weights(&t)
        })
        .collect::<Result<Vec<_>>>()?;
    let vars = layers.iter().map(|l| l.weight().clone()).collect();
    let mut opt = GrngOptimizer::try_new(
        vars,
        GrngConfig {
            method: config.optimizer,
            rest: AdamWConfig::default(),
            layers: layers.clone(),
        },
    )?;
    // RING and NGD take each layer's gradient by its batch factors, as the main job does: the
    // preconditioning and the model's terms from n x n products where that is cheaper.
    opt.set_factored_gradients(matches!(method, Method::Ring | Method::Ngd))?;
    // The main job's per-method random stream (src/train/run.rs), for the same sampled labels.
    let stream = args.seed ^ 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(method as u64 + 1);
    let mut rng = ChaCha8Rng::seed_from_u64(stream);
    let per_epoch = splits.train.len().div_ceil(config.batch_size);
    let bar = ProgressBar::new((per_epoch * args.epochs) as u64).with_style(
        ProgressStyle::with_template("{prefix:>7} {bar:30} {pos}/{len} steps, loss {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(method.label());
    let (mut step_times, mut rejected, mut last_loss) = (Vec::new(), 0, f32::NAN);
    let start = Instant::now();
    for epoch in 0..args.epochs as u64 {
        for idx in splits.train.batches(args.seed, epoch, config.batch_size)? {
            let t0 = Instant::now();
            let (x, y) = batch(&splits.train, &idx, dev)?;
            let yt = labels(&y, dev)?;
            let logits = forward(&layers, &x, true)?;
            let l = loss(&logits, &yt)?;
            let before = scalar(&l)?;
            let mut grads = c(l.backward())?;
            // RENG: g + 2c·H g (a no-op for the other methods).
            opt.regularize(&mut grads, || {
                c(loss(&forward(&layers, &x, false)?, &yt)?.backward())
            })?;
            if opt.needs_fisher() {
                capture_fisher(&layers, &logits, config.fisher, &y, &mut rng)?;
            }
            if opt.needs_sophia_sample() {
                // Sophia-G: the gradient for labels drawn from the model.
                let p: Vec<Vec<f32>> =
                    c(candle_nn::ops::softmax_last_dim(&logits).and_then(|p| p.to_vec2()))?;
                let ys: Vec<u32> = p
                    .iter()
                    .map(|p| sample_class(p, rng.random::<f64>()) as u32)
                    .collect();
                let gs = c(loss(&logits, &labels(&ys, dev)?)?.backward())?;
                opt.set_sophia_sample(&gs, y.len());
            }
            let eval_after = || scalar(&loss(&forward(&layers, &x, false)?, &yt)?);
            if opt.step_observed(&grads, before, eval_after)? == Observed::Rejected {
                rejected += 1;
                continue;
            }
            step_times.push(t0.elapsed());
            last_loss = before;
            bar.set_message(format!("{before:.4}"));
            bar.inc(1);
        }
    }
    bar.finish();
    let wall = start.elapsed();
    step_times.sort();
    Ok(Outcome {
        test_acc: accuracy(&layers, &splits.test, dev)?,
        train_loss: last_loss,
        steps: step_times.len(),
        rejected,
        median_step: step_times
            .get(step_times.len() / 2)
            .copied()
            .unwrap_or_default(),
        wall,
    })
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let dev = grng_candle::candle_device(&args.device)?;
    let methods = Method::parse_list(&args.methods)?;
    let splits = Splits::digits(args.seed)?;
    let mut rows = Vec::new();
    for &m in &methods {
        rows.push((m, train(m, &splits, &args, &dev)?));
    }
    println!(
        "\n{:<8} {:>9} {:>11} {:>6} {:>9} {:>12} {:>9}",
        "method", "test acc", "last loss", "steps", "rejected", "median step", "wall"
    );
    for (m, o) in rows {
        println!(
            "{:<8} {:>8.2}% {:>11.4} {:>6} {:>9} {:>12.2?} {:>9.2?}",
            m.label(),
            100.0 * o.test_acc,
            o.train_loss,
            o.steps,
            o.rejected,
            o.median_step,
            o.wall
        );
    }
    Ok(())
}
