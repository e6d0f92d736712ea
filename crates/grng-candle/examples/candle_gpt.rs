//! A small decoder-only transformer (character language model) trained through candle with
//! grng: every attention projection, MLP matrix and the output head is a `KronLinear`
//! preconditioned by RING / RENG / NGD; embeddings and layer norms take AdamW.
//!
//! ```sh
//! cargo run --release -p grng-candle --example candle_gpt            # RING, NGD, AdamW
//! cargo run --release -p grng-candle --example candle_gpt -- --methods ring,reng,ngd,adamw --steps 400
//! ```
//!
//! Data: Genesis and Exodus of the King James Bible (`data/kjv-genesis-exodus.txt`, public
//! domain, see `data/README.md`), 90% train / 10% validation. Writes validation loss vs steps
//! and vs wall time to `out/candle_gpt.svg` and prints a generated sample per method.

use candle_core::{DType, Device as CDevice, Tensor, Var, D};
use clap::Parser;
use grng::optim::adamw::AdamWConfig;
use grng::optim::kron::{InverseMethod, KronConfig};
use grng::{Error, Result};
use grng_candle::{capture_fisher, GrngConfig, GrngOptimizer, KronLinear, Observed};
use grng_train::mlp::{sample_class, FisherMode};
use grng_train::report::svg::{figure, Panel, Scale, Series};
use grng_train::train::{Method, OptimizerConfig};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

const TEXT: &str = include_str!("../../grng-train/data/kjv-genesis-exodus.txt");

#[derive(Parser)]
#[command(about = "A character-level GPT through candle with grng's optimizers")]
struct Args {
    /// Comma-separated methods: ring, reng, ngd, adamw, sgd, sophia.
    #[arg(long, default_value = "ring,ngd,adamw")]
    methods: String,
    /// Training steps per method.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Evaluate the validation loss every this many steps.
    #[arg(long, default_value_t = 10)]
    eval_every: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Model width (heads of 32).
    #[arg(long, default_value_t = 128)]
    width: usize,
    /// Context length.
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Kronecker methods: learning rate `α` (before the 1/L scaling), default per method.
    #[arg(long)]
    kron_lr: Option<f32>,
    /// Kronecker methods: initial damping `ρ`, default per method.
    #[arg(long)]
    rho: Option<f32>,
    /// Seed of the initial weights, the batches and the sampled labels.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output folder of the SVG.
    #[arg(long, default_value = "out")]
    out: std::path::PathBuf,
    /// `cpu`; `cuda` or `cuda:N` when built with `-p grng-candle --features cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn c<T>(r: candle_core::Result<T>) -> Result<T> {
    r.map_err(|e| Error::Candle(e.to_string()))
}

/// Layer norm with learnable scale and shift, written out so candle differentiates it.
struct Norm {
    w: Var,
    b: Var,
}

impl Norm {
    fn new(d: usize, dev: &CDevice) -> Result<Self> {
        Ok(Self {
            w: c(Var::ones(d, DType::F32, dev))?,
            b: c(Var::zeros(d, DType::F32, dev))?,
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let x = x.broadcast_sub(&mean)?;
        let var = x.sqr()?.mean_keepdim(D::Minus1)?;
        x.broadcast_div(&(var + 1e-5)?.sqrt()?)?
            .broadcast_mul(self.w.as_tensor())?
            .broadcast_add(self.b.as_tensor())
    }
}

struct Block {
    ln1: Norm,
    q: KronLinear,
    k: KronLinear,
    v: KronLinear,
    o: KronLinear,
    ln2: Norm,
    fc1: KronLinear,
    fc2: KronLinear,
}

struct Gpt {
    tok: Var,
    pos: Var,
    blocks: Vec<Block>,
    lnf: Norm,
    head: KronLinear,
    heads: usize,
}

/// A uniform draw of standard deviation `std`.
fn uniform(rng: &mut ChaCha8Rng, std: f64) -> f32 {
    let a = (std * 3f64.sqrt()) as f32;
    rng.random_range(-a..a)
}

/// A `KronLinear` with W of standard deviation 0.02 (GPT-2's initialisation) and `b = 0`;
/// output projections scaled by `1/√(2·layers)` as GPT-2 does.
fn linear(
    d_in: usize,
    d_out: usize,
    scale: f64,
    rng: &mut ChaCha8Rng,
    dev: &CDevice,
) -> Result<KronLinear> {
    let w: Vec<f32> = (0..d_out * (d_in + 1))
        .map(|i| {
            if i % (d_in + 1) == d_in {
                0.0
            } else {
                uniform(rng, 0.02 * scale)
            }
        })
        .collect();
    KronLinear::from_weights(&c(Tensor::from_vec(w, (d_out, d_in + 1), dev))?)
}

fn normal_var(shape: (usize, usize), rng: &mut ChaCha8Rng, dev: &CDevice) -> Result<Var> {
    let v: Vec<f32> = (0..shape.0 * shape.1).map(|_| uniform(rng, 0.02)).collect();
    c(Var::from_vec(v, shape, dev))
}

impl Gpt {
    fn new(args: &Args, vocab: usize, dev: &CDevice) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
        let d = args.width;
        let out_scale = 1.0 / (2.0 * args.layers as f64).sqrt();
        let blocks = (0..args.layers)
            .map(|_| {
                Ok(Block {
                    ln1: Norm::new(d, dev)?,
                    q: linear(d, d, 1.0, &mut rng, dev)?,
                    k: linear(d, d, 1.0, &mut rng, dev)?,
                    v: linear(d, d, 1.0, &mut rng, dev)?,
                    o: linear(d, d, out_scale, &mut rng, dev)?,
                    ln2: Norm::new(d, dev)?,
                    fc1: linear(d, 4 * d, 1.0, &mut rng, dev)?,
                    fc2: linear(4 * d, d, out_scale, &mut rng, dev)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            tok: normal_var((vocab, d), &mut rng, dev)?,
            pos: normal_var((args.context, d), &mut rng, dev)?,
            blocks,
            lnf: Norm::new(d, dev)?,
            head: linear(d, vocab, 1.0, &mut rng, dev)?,
            heads: (d / 32).max(1),
        })
    }

    /// The preconditioned layers.
    fn kron_layers(&self) -> Vec<KronLinear> {
        let mut l = Vec::new();
        for b in &self.blocks {
            l.extend([&b.q, &b.k, &b.v, &b.o, &b.fc1, &b.fc2].map(KronLinear::clone));
        }
        l.push(self.head.clone());
        l
    }

    /// Every trainable variable.
    fn vars(&self) -> Vec<Var> {
        let mut v: Vec<Var> = self
            .kron_layers()
            .iter()
            .map(|l| l.weight().clone())
            .collect();
        v.extend([self.tok.clone(), self.pos.clone()]);
        for n in self
            .blocks
            .iter()
            .flat_map(|b| [&b.ln1, &b.ln2])
            .chain([&self.lnf])
        {
            v.extend([n.w.clone(), n.b.clone()]);
        }
        v
    }

    /// Logits `(b·t) x vocab` of the ids `(b, t)`; recording the layer statistics or not.
    fn forward(&self, ids: &Tensor, record: bool) -> Result<Tensor> {
        let lin = |l: &KronLinear, x: &Tensor| {
            if record {
                l.forward_record(x)
            } else {
                l.forward_eval(x)
            }
        };
        let (b, t) = c(ids.dims2())?;
        let d = c(self.tok.dim(1))?;
        let (h, dh) = (self.heads, d / self.heads);
        let mut x = c((|| {
            let e = self
                .tok
                .embedding(&ids.flatten_all()?)?
                .reshape((b, t, d))?;
            e.broadcast_add(&self.pos.narrow(0, 0, t)?)
        })())?;
        // Causal mask: −∞ above the diagonal.
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = c(Tensor::from_vec(mask, (t, t), ids.device()))?;
        let split = |y: Tensor| c(c(c(y.reshape((b, t, h, dh)))?.transpose(1, 2))?.contiguous());
        for blk in &self.blocks {
            let a = c(blk.ln1.forward(&x))?;
            let (q, k, v) = (
                split(lin(&blk.q, &a)?)?,
                split(lin(&blk.k, &a)?)?,
                split(lin(&blk.v, &a)?)?,
            );
            let y = c((|| {
                let att = (q.matmul(&k.t()?)? / (dh as f64).sqrt())?.broadcast_add(&mask)?;
                // `softmax`, not `softmax_last_dim`: the fused op has no backward pass.
                let att = candle_nn::ops::softmax(&att, D::Minus1)?;
                att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))
            })())?;
            x = c(x.add(&lin(&blk.o, &y)?))?;
            let m = c(blk.ln2.forward(&x))?;
            let m = c(lin(&blk.fc1, &m)?.gelu_erf())?;
            x = c(x.add(&lin(&blk.fc2, &m)?))?;
        }
        let x = c(self.lnf.forward(&x))?;
        c(lin(&self.head, &x)?.reshape((b * t, ())))
    }
}

/// The character vocabulary and the text as ids.
struct Corpus {
    chars: Vec<char>,
    train: Vec<u32>,
    val: Vec<u32>,
}

impl Corpus {
    fn new() -> Self {
        let mut chars: Vec<char> = TEXT.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids: Vec<u32> = TEXT
            .chars()
            .map(|ch| chars.binary_search(&ch).unwrap_or(0) as u32)
            .collect();
        let cut = ids.len() * 9 / 10;
        Self {
            chars,
            train: ids[..cut].to_vec(),
            val: ids[cut..].to_vec(),
        }
    }
}

/// `batch` random windows of `context + 1` ids: inputs `(b, t)` and next-character targets.
fn windows(
    ids: &[u32],
    args: &Args,
    rng: &mut ChaCha8Rng,
    dev: &CDevice,
) -> Result<(Tensor, Vec<u32>)> {
    let t = args.context;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for _ in 0..args.batch {
        let s = rng.random_range(0..ids.len() - t - 1);
        x.extend_from_slice(&ids[s..s + t]);
        y.extend_from_slice(&ids[s + 1..s + t + 1]);
    }
    Ok((c(Tensor::from_vec(x, (args.batch, t), dev))?, y))
}

fn loss(logits: &Tensor, y: &[u32]) -> Result<Tensor> {
    let y = c(Tensor::from_slice(y, y.len(), logits.device()))?;
    c(candle_nn::loss::cross_entropy(logits, &y))
}

fn scalar(t: &Tensor) -> Result<f32> {
    c(t.to_scalar::<f32>())
}

/// The optimizer configuration of `method` for this model (CPU: Cholesky inverses).
fn method_config(method: Method, args: &Args) -> Result<OptimizerConfig> {
    let kron = |k: KronConfig| {
        OptimizerConfig::Kron(KronConfig {
            lr: args.kron_lr.unwrap_or(k.lr),
            rho: args.rho.unwrap_or(k.rho),
            ema: 0.95,
            inverse: InverseMethod::Cholesky,
            ..k
        })
    };
    Ok(match method {
        // Measured on this model (20-step probes): RING and RENG diverge with the paper's
        // ρ = 1e-3 and α = 1; NGD is stable with ρ = 1e-2.
        Method::Ring => kron(KronConfig {
            lr: 0.25,
            rho: 0.1,
            skip: 8,
            ..KronConfig::ring()
        }),
        Method::Reng => kron(KronConfig {
            lr: 0.25,
            rho: 0.1,
            skip: 8,
            ..KronConfig::reng()
        }),
        Method::Ngd => kron(KronConfig {
            rho: 1e-2,
            ..KronConfig::ngd()
        }),
        Method::AdamW => OptimizerConfig::AdamW(adamw()),
        other => {
            return Err(Error::Value {
                op: "candle_gpt",
                arg: "methods",
                value: other as u64 as f64,
                expected: "ring, reng, ngd or adamw",
            })
        }
    })
}

/// AdamW for the transformer (and for the non-Kronecker variables of the others).
fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 3e-3,
        warmup_steps: 20,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    }
}

struct Run {
    method: Method,
    /// `(step, seconds, validation loss)`.
    curve: Vec<(usize, f64, f32)>,
    sample: String,
}

fn val_loss(model: &Gpt, corpus: &Corpus, args: &Args, dev: &CDevice) -> Result<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(u64::MAX - args.seed);
    let mut sum = 0.0;
    for _ in 0..4 {
        let (x, y) = windows(&corpus.val, args, &mut rng, dev)?;
        sum += scalar(&loss(&model.forward(&x, false)?, &y)?)?;
    }
    Ok(sum / 4.0)
}

/// `n` characters continuing `prompt`, sampled at temperature 0.8.
fn generate(
    model: &Gpt,
    corpus: &Corpus,
    args: &Args,
    prompt: &str,
    n: usize,
    dev: &CDevice,
) -> Result<String> {
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut ids: Vec<u32> = prompt
        .chars()
        .map(|ch| corpus.chars.binary_search(&ch).unwrap_or(0) as u32)
        .collect();
    for _ in 0..n {
        let ctx = &ids[ids.len().saturating_sub(args.context)..];
        let x = c(Tensor::from_slice(ctx, (1, ctx.len()), dev))?;
        let logits = model.forward(&x, false)?;
        let last = c((|| {
            let l = logits.get(ctx.len() - 1)? / 0.8;
            candle_nn::ops::softmax_last_dim(&l?)?.to_vec1::<f32>()
        })())?;
        ids.push(sample_class(&last, rng.random::<f64>()) as u32);
    }
    Ok(ids.iter().map(|&i| corpus.chars[i as usize]).collect())
}

fn train(method: Method, corpus: &Corpus, args: &Args, dev: &CDevice) -> Result<Run> {
    let model = Gpt::new(args, corpus.chars.len(), dev)?;
    let config = method_config(method, args)?;
    let mut opt = GrngOptimizer::try_new(
        model.vars(),
        GrngConfig {
            method: config,
            rest: adamw(),
            layers: model.kron_layers(),
        },
    )?;
    // RING and NGD take each layer's gradient by its batch factors, as the main job does: the
    // preconditioning and the model's terms from n x n products where that is cheaper.
    opt.set_factored_gradients(matches!(method, Method::Ring | Method::Ngd))?;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut fisher_rng = ChaCha8Rng::seed_from_u64(args.seed ^ 0xF15E);
    let bar = ProgressBar::new(args.steps as u64).with_style(
        ProgressStyle::with_template(
            "{prefix:>6} {bar:30} {pos}/{len} steps, {elapsed}, val loss {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(method.label());
    let mut curve = vec![(0, 0.0, val_loss(&model, corpus, args, dev)?)];
    let (mut clock, mut rejected) = (0.0f64, 0);
    for step in 1..=args.steps {
        let (x, y) = windows(&corpus.train, args, &mut rng, dev)?;
        let t0 = Instant::now();
        let logits = model.forward(&x, true)?;
        let l = loss(&logits, &y)?;
        let before = scalar(&l)?;
        let mut grads = c(l.backward())?;
        // RENG: g + 2c·H g (a no-op for the other methods).
        opt.regularize(&mut grads, || {
            c(loss(&model.forward(&x, false)?, &y)?.backward())
        })?;
        if opt.needs_fisher() {
            capture_fisher(
                &model.kron_layers(),
                &logits,
                FisherMode::Sampled,
                &y,
                &mut fisher_rng,
            )?;
        }
        let eval_after = || scalar(&loss(&model.forward(&x, false)?, &y)?);
        if opt.step_observed(&grads, before, eval_after)? == Observed::Rejected {
            rejected += 1;
        }
        clock += t0.elapsed().as_secs_f64();
        if step % args.eval_every == 0 || step == args.steps {
            let v = val_loss(&model, corpus, args, dev)?;
            curve.push((step, clock, v));
            bar.set_message(format!("{v:.3}"));
        }
        bar.inc(1);
    }
    bar.finish();
    if rejected > 0 {
        println!("{}: {rejected} steps rejected (overflow)", method.label());
    }
    let sample = generate(&model, corpus, args, "And God said", 200, dev)?;
    Ok(Run {
        method,
        curve,
        sample,
    })
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let dev = grng_candle::candle_device(&args.device)?;
    let corpus = Corpus::new();
    println!(
        "{} characters ({} distinct), {} blocks of width {}, context {}, batch {}",
        TEXT.len(),
        corpus.chars.len(),
        args.layers,
        args.width,
        args.context,
        args.batch
    );
    let runs = Method::parse_list(&args.methods)?
        .into_iter()
        .map(|m| train(m, &corpus, &args, &dev))
        .collect::<Result<Vec<_>>>()?;
    println!(
        "\n{:<6} {:>11} {:>9} {:>12} {:>10}",
        "method", "val loss@0", "val loss", "train time", "s/step"
    );
    for r in &runs {
        let first = r.curve.first().map_or(f32::NAN, |p| p.2);
        let &(steps, secs, v) = r.curve.last().unwrap_or(&(0, 0.0, f32::NAN));
        println!(
            "{:<6} {:>11.3} {:>9.3} {:>11.1}s {:>10.3}",
            r.method.label(),
            first,
            v,
            secs,
            secs / steps.max(1) as f64
        );
    }
    for r in &runs {
        println!("\n--- {} sample ---\n{}", r.method.label(), r.sample);
    }
    let series = |x: fn(&(usize, f64, f32)) -> f64| -> Vec<Series> {
        runs.iter()
            .map(|r| Series {
                name: r.method.label().into(),
                points: r.curve.iter().map(|p| (x(p), p.2 as f64)).collect(),
            })
            .collect()
    };
    let panel = |title: &str, x_label: &str, x_scale, s| Panel {
        title: title.into(),
        x_label: x_label.into(),
        y_label: "validation loss (nats/char)".into(),
        x_scale,
        y_scale: Scale::Linear,
        series: s,
    };
    let svg = figure(
        &[
            panel(
                "Validation loss vs steps",
                "step",
                Scale::Linear,
                series(|p| p.0 as f64),
            ),
            panel(
                "Validation loss vs wall time",
                "training time (s)",
                Scale::Linear,
                series(|p| p.1),
            ),
        ],
        &runs
            .iter()
            .map(|r| r.method.label().to_string())
            .collect::<Vec<_>>(),
    );
    std::fs::create_dir_all(&args.out)?;
    let path = args.out.join("candle_gpt.svg");
    std::fs::write(&path, svg)?;
    println!("\nwrote {}", path.display());
    Ok(())
}
