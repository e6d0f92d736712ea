//! The paper's experiment on a real pretrained transformer: LoRA fine-tuning of
//! all-MiniLM-L6-v2 for sentence sentiment with every method, several seeds and training-set
//! sizes, and the paper's table and figures (docs/lora.md).
//!
//! ```sh
//! scripts/fetch-minilm.sh                                       # the model and the data, once
//! cargo run --release -p grng-lora --example lora_sentiment     # the full comparison
//! cargo run --release -p grng-lora --example lora_sentiment -- --quick
//! ```
//!
//! To fit 2 CPU cores, adapters (rank 8, α = 8, query and value, as the paper's LoRA setup) sit
//! in the top `--top-layers` encoder layers only: the frozen layers below run once over every
//! sentence and their outputs are cached, so a training step runs the adapted layers, mean
//! pooling and a linear head (`hidden → 2`, a `KronLinear` trained with the adapters).
//! Sequences are cut at `--max-len` tokens (32: the median snippet has 18 words).
//!
//! Writes `OUT/table.md` (the tables printed), `OUT/curves.csv` and `OUT/curves-N.svg` (validation
//! accuracy and gradient norm against iterations, the paper's Figures 1–2, per training size).

use candle_core::{DType, Device as CDevice, Tensor};
use clap::Parser;
use grng::optim::adamw::AdamWConfig;
use grng::optim::kalman::RKalmanConfig;
use grng::optim::kron::{InverseMethod, KronConfig};
use grng::optim::sophia::SophiaConfig;
use grng::optim::OptimizerConfig;
use grng::{Error, Result};
use grng_candle::LoraConfig;
use grng_lora::sentiment::{self, mcc, Example, Splits};
use grng_lora::{Adapt, AdaptConfig, BertModel, BertTokenizer, Pass, SentenceClassifier};
use grng_train::report::svg::{figure, Panel, Scale, Series};
use grng_train::report::{fmt_seconds, text_table};
use grng_train::train::{median, Method};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Clone)]
#[command(about = "LoRA fine-tuning of all-MiniLM-L6-v2 with grng's optimizers")]
struct Args {
    /// The model folder (config.json, model.safetensors, tokenizer.json); default
    /// `$GRNG_MINILM`, else scripts/fetch-minilm.sh's folder.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The snippets file; default scripts/fetch-minilm.sh's.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Comma-separated methods: ring, reng, ngd, rkalman, kalman, adamw, sophia, sgd, or all.
    #[arg(long, default_value = "ring,reng,ngd,rkalman,kalman,adamw,sophia")]
    methods: String,
    /// Seeds per method (adapter and head initialisation, batch order, sampled labels).
    #[arg(long, default_value_t = 3)]
    seeds: u64,
    /// Comma-separated training-set sizes (nested: the smaller are prefixes of the larger).
    #[arg(long, default_value = "64,256")]
    train_sizes: String,
    /// Optimizer steps per run.
    #[arg(long, default_value_t = 40)]
    steps: usize,
    /// Sentences per batch (the Kalman filters' observation is `batch x 2` probabilities).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per sentence, `[CLS]` and `[SEP]` included.
    #[arg(long, default_value_t = 32)]
    max_len: usize,
    /// Validation sentences.
    #[arg(long, default_value_t = 200)]
    val: usize,
    /// Test sentences.
    #[arg(long, default_value_t = 500)]
    test: usize,
    /// Evaluate every this many steps.
    #[arg(long, default_value_t = 10)]
    eval_every: usize,
    /// Encoder layers with adapters, from the top.
    #[arg(long, default_value_t = 1)]
    top_layers: usize,
    /// Adapters on every projection (query, key, value, attention output, both MLP matrices),
    /// not only query and value.
    #[arg(long)]
    all_projections: bool,
    /// Adapter rank `r`.
    #[arg(long, default_value_t = 8)]
    rank: usize,
    /// Adapter scale numerator `α` (the update is `(α/r)·B A`).
    #[arg(long, default_value_t = 8.0)]
    alpha: f32,
    /// Validation accuracy whose first crossing gives "steps/time to target".
    #[arg(long, default_value_t = 0.7)]
    target: f32,
    /// Also run RING with the Fisher refreshed every step (S = 1) beside its default S = 8:
    /// the paper's "lazy Fisher costs no accuracy".
    #[arg(long)]
    lazy_ablation: bool,
    /// Kronecker methods: initial damping `ρ` instead of the paper's (RING, RENG 1e-4; NGD
    /// 1e-6).
    #[arg(long)]
    rho: Option<f32>,
    /// Kronecker methods: learning rate `α` (before the 1/L scaling) instead of 1.
    #[arg(long)]
    kron_lr: Option<f32>,
    /// One seed, the 256-example training set, 30 steps.
    #[arg(long)]
    quick: bool,
    /// Output folder.
    #[arg(long, default_value = "out/lora")]
    out: PathBuf,
    /// `cpu`; `cuda` or `cuda:N` when built with `-p grng-lora --features cuda` (candle's CUDA
    /// build, see grng-candle's `cuda` feature: built, never run on a GPU yet).
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn c<T>(r: candle_core::Result<T>) -> Result<T> {
    r.map_err(|e| Error::Candle(e.to_string()))
}

/// The frozen lower layers' outputs for a set of sentences.
struct Features {
    /// `n x seq x hidden`.
    hidden: Tensor,
    /// `n x seq`, 1 token / 0 padding.
    mask: Tensor,
    labels: Vec<u32>,
}

impl Features {
    /// Runs the embeddings and the frozen layers below `first` over `examples`, in chunks.
    fn new(
        model: &BertModel,
        tok: &BertTokenizer,
        examples: &[Example],
        first: usize,
        dev: &CDevice,
    ) -> Result<Self> {
        // One encoding of the whole set: every row padded to the set's longest, so chunks
        // concatenate.
        let texts: Vec<&str> = examples.iter().map(|e| e.text.as_str()).collect();
        let enc = tok.encode(&texts, dev)?;
        let n = examples.len();
        let mut parts = Vec::new();
        for start in (0..n).step_by(64) {
            let len = 64.min(n - start);
            let cut = |t: &Tensor| c(t.narrow(0, start, len));
            let h = model.embed_and_encode(
                &cut(&enc.ids)?,
                &cut(&enc.type_ids)?,
                &cut(&enc.mask)?,
                first,
                Pass::Eval,
            )?;
            parts.push(h);
        }
        Ok(Self {
            hidden: c(Tensor::cat(&parts, 0))?,
            mask: c(enc.mask.to_dtype(DType::F32))?,
            labels: examples.iter().map(|e| e.label).collect(),
        })
    }

    fn len(&self) -> usize {
        self.labels.len()
    }

    /// The classifier's predictions over every row, in chunks.
    fn predict(&self, clf: &SentenceClassifier) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(self.len());
        let all: Vec<u32> = (0..self.len() as u32).collect();
        for idx in all.chunks(128) {
            let (h, m, _) = self.rows(idx)?;
            out.extend(clf.predict(&h, &m)?);
        }
        Ok(out)
    }

    /// Rows `idx`: hidden, mask, labels.
    fn rows(&self, idx: &[u32]) -> Result<(Tensor, Tensor, Vec<u32>)> {
        let i = c(Tensor::from_slice(idx, idx.len(), self.hidden.device()))?;
        Ok((
            c(self.hidden.index_select(&i, 0))?,
            c(self.mask.index_select(&i, 0))?,
            idx.iter().map(|&k| self.labels[k as usize]).collect(),
        ))
    }
}

fn accuracy(pred: &[u32], truth: &[u32]) -> f64 {
    let right = pred.iter().zip(truth).filter(|(p, t)| p == t).count();
    right as f64 / truth.len().max(1) as f64
}

/// A method as the experiment runs it: the paper's method and, for the lazy-Fisher
/// ablation, RING's refresh interval.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Arm {
    method: Method,
    skip: Option<usize>,
}

impl Arm {
    fn label(&self) -> String {
        match self.skip {
            Some(s) => format!("{} S={s}", self.method.label()),
            None => self.method.label().to_string(),
        }
    }

    /// The optimizer configuration (CPU: Cholesky inverses). ρ: the paper's values, 1e-4 for
    /// RING and RENG, 1e-6 for NGD.
    fn config(&self, args: &Args) -> OptimizerConfig {
        let kron = |k: KronConfig| {
            OptimizerConfig::Kron(KronConfig {
                inverse: InverseMethod::Cholesky,
                skip: self.skip.unwrap_or(8),
                rho: args.rho.unwrap_or(k.rho),
                lr: args.kron_lr.unwrap_or(k.lr),
                ..k
            })
        };
        let steps = args.steps;
        match self.method {
            Method::Ring => kron(KronConfig {
                rho: 1e-4,
                ..KronConfig::ring()
            }),
            Method::Reng => kron(KronConfig {
                rho: 1e-4,
                ..KronConfig::reng()
            }),
            Method::Ngd => kron(KronConfig {
                rho: 1e-6,
                ..KronConfig::ngd()
            }),
            Method::RKalman => OptimizerConfig::Kalman(RKalmanConfig::default()),
            Method::Kalman => OptimizerConfig::Kalman(RKalmanConfig::plain()),
            Method::AdamW => OptimizerConfig::AdamW(adamw(steps)),
            Method::Sophia => OptimizerConfig::Sophia(SophiaConfig {
                lr: 1e-3,
                weight_decay: 0.0,
                hessian_every: 4,
                ..SophiaConfig::default()
            }),
            Method::Sgd => OptimizerConfig::Sgd(grng::optim::sgd::SgdConfig {
                lr: 0.1,
                ..Default::default()
            }),
        }
    }
}

/// AdamW as LoRA fine-tuning runs it (no weight decay on adapters, a short warm-up).
fn adamw(steps: usize) -> AdamWConfig {
    AdamWConfig {
        lr: 3e-3,
        weight_decay: 0.0,
        warmup_steps: (steps / 10) as u64,
        ..AdamWConfig::default()
    }
}

/// One evaluation point.
#[derive(Clone, Copy, Debug)]
struct Point {
    step: usize,
    val_acc: f64,
    /// `‖∇L‖` of the mean loss on the fixed probe batch.
    grad_norm: f64,
}

struct RunResult {
    curve: Vec<Point>,
    test_acc: f64,
    test_mcc: f64,
    step_times: Vec<f64>,
    time_to_target: Option<(usize, f64)>,
    failure: Option<String>,
}

/// Everything a run reads.
struct Setup<'a> {
    args: &'a Args,
    model_dir: &'a std::path::Path,
    first: usize,
    train: &'a Features,
    val: &'a Features,
    test: &'a Features,
    dev: &'a CDevice,
}

fn run(s: &Setup<'_>, arm: Arm, n_train: usize, seed: u64) -> Result<RunResult> {
    let args = s.args;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let adapt = AdaptConfig {
        adapt: if args.all_projections {
            Adapt::All
        } else {
            Adapt::QueryValue
        },
        top_layers: Some(args.top_layers),
    };
    let lora = LoraConfig {
        rank: args.rank,
        alpha: args.alpha,
    };
    let model = BertModel::load(s.model_dir, s.dev, Some((lora, adapt)), &mut rng)?;
    let clf = SentenceClassifier::new(model, s.first, 2, &mut rng)?;
    let mut opt = clf.optimizer(arm.config(args), adamw(args.steps))?;
    let probe_idx: Vec<u32> = (0..n_train.min(32) as u32).collect();
    let probe = s.train.rows(&probe_idx)?;
    let mut order: Vec<u32> = Vec::new();
    let mut fisher_rng = ChaCha8Rng::seed_from_u64(seed ^ 0xF15E);
    let eval = |clf: &SentenceClassifier, step: usize| -> Result<Point> {
        Ok(Point {
            step,
            val_acc: accuracy(&s.val.predict(clf)?, &s.val.labels),
            grad_norm: clf.grad_norm(&probe.0, &probe.1, &probe.2)?,
        })
    };
    let mut curve = vec![eval(&clf, 0)?];
    let (mut step_times, mut clock, mut to_target, mut failure) = (Vec::new(), 0.0f64, None, None);
    for step in 1..=args.steps {
        if order.len() < args.batch {
            // A fresh epoch: the whole training set reshuffled (a partial batch is never
            // taken: the Kalman filters' observation size is fixed).
            let mut epoch: Vec<u32> = (0..n_train as u32).collect();
            epoch.shuffle(&mut rng);
            order = epoch;
        }
        let idx: Vec<u32> = order.drain(..args.batch.min(order.len())).collect();
        let (h, m, y) = s.train.rows(&idx)?;
        let t0 = Instant::now();
        let outcome = clf.train_step(&mut opt, &h, &m, &y, &mut fisher_rng);
        let dt = t0.elapsed().as_secs_f64();
        if let Err(e) = outcome {
            failure = Some(format!("step {step}: {e}"));
            break;
        }
        step_times.push(dt);
        clock += dt;
        if step % args.eval_every == 0 || step == args.steps {
            let p = eval(&clf, step)?;
            if to_target.is_none() && p.val_acc >= args.target as f64 {
                to_target = Some((step, clock));
            }
            curve.push(p);
        }
    }
    let pred = s.test.predict(&clf)?;
    Ok(RunResult {
        curve,
        test_acc: accuracy(&pred, &s.test.labels),
        test_mcc: mcc(&pred, &s.test.labels),
        step_times,
        time_to_target: to_target,
        failure,
    })
}

/// `mean ± std` (sample standard deviation) in percent.
fn pct(v: &[f64]) -> String {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return format!("{:.1}", 100.0 * mean);
    }
    let sd = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    format!("{:.1} ± {:.1}", 100.0 * mean, 100.0 * sd)
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut args = Args::parse();
    if args.quick {
        args.seeds = 1;
        args.train_sizes = "256".into();
        args.steps = 30;
    }
    let dev = grng_candle::candle_device(&args.device)?;
    let model_dir = args.model.clone().unwrap_or_else(grng_lora::minilm_dir);
    let data = args.data.clone().unwrap_or_else(sentiment::default_path);
    let mut arms: Vec<Arm> = Method::parse_list(&args.methods)?
        .into_iter()
        .map(|method| Arm { method, skip: None })
        .collect();
    if args.lazy_ablation {
        arms.push(Arm {
            method: Method::Ring,
            skip: Some(1),
        });
    }
    let sizes: Vec<usize> = args
        .train_sizes
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<std::result::Result<_, _>>()?;
    let max_train = sizes.iter().copied().max().unwrap_or(0);

    std::fs::create_dir_all(&args.out).map_err(|e| Error::io(&args.out, e))?;
    let t_setup = Instant::now();
    let frozen = BertModel::load(&model_dir, &dev, None, &mut ChaCha8Rng::seed_from_u64(0))?;
    let layers = frozen.config().num_hidden_layers;
    let first = layers.checked_sub(args.top_layers).ok_or(Error::Value {
        op: "lora_sentiment",
        arg: "--top-layers",
        value: args.top_layers as f64,
        expected: "at most the encoder's layers",
    })?;
    let tok = BertTokenizer::load(&model_dir, frozen.config(), args.max_len)?;
    let splits = Splits::new(sentiment::load(&data)?, 0, args.val, args.test)?;
    let train = Features::new(&frozen, &tok, splits.train(max_train)?, first, &dev)?;
    let val = Features::new(&frozen, &tok, &splits.val, first, &dev)?;
    let test = Features::new(&frozen, &tok, &splits.test, first, &dev)?;
    drop(frozen);
    let setup_time = t_setup.elapsed().as_secs_f64();
    let mut report = String::new();
    writeln!(
        report,
        "all-MiniLM-L6-v2, adapters r = {} α = {} on {} of the top {} layer(s), {} tokens, \
         batch {}, {} steps; {} validation / {} test sentences; frozen layers cached in {}",
        args.rank,
        args.alpha,
        if args.all_projections {
            "every projection"
        } else {
            "query and value"
        },
        args.top_layers,
        args.max_len,
        args.batch,
        args.steps,
        val.len(),
        test.len(),
        fmt_seconds(setup_time)
    )?;
    print!("{report}");
    let setup = Setup {
        args: &args,
        model_dir: &model_dir,
        first,
        train: &train,
        val: &val,
        test: &test,
        dev: &dev,
    };
    let mut csv = String::from("train_size,method,seed,step,val_acc,grad_norm\n");
    for &n in &sizes {
        let mut rows = Vec::new();
        let mut first_seed_curves = Vec::new();
        let mut adamw_step = None;
        for arm in &arms {
            let mut results = Vec::new();
            for seed in 0..args.seeds {
                let r = run(&setup, *arm, n, seed)?;
                for p in &r.curve {
                    writeln!(
                        csv,
                        "{n},{},{seed},{},{:.4},{:.6e}",
                        arm.label(),
                        p.step,
                        p.val_acc,
                        p.grad_norm
                    )?;
                }
                eprintln!(
                    "n = {n} {} seed {seed}: test {:.1}%{}",
                    arm.label(),
                    100.0 * r.test_acc,
                    r.failure
                        .as_deref()
                        .map_or(String::new(), |f| format!(" ({f})"))
                );
                results.push(r);
            }
            first_seed_curves.push((arm.label(), results[0].curve.clone()));
            let acc: Vec<f64> = results.iter().map(|r| r.test_acc).collect();
            let mccs: Vec<f64> = results.iter().map(|r| r.test_mcc).collect();
            let mut times: Vec<f64> = results.iter().flat_map(|r| r.step_times.clone()).collect();
            let step = median(&mut times);
            if arm.method == Method::AdamW {
                adamw_step = Some(step);
            }
            let reached: Vec<(usize, f64)> =
                results.iter().filter_map(|r| r.time_to_target).collect();
            let to_target = if reached.is_empty() {
                "—".to_string()
            } else {
                let k = reached.len() as f64;
                format!(
                    "{}/{}: {:.0} steps, {}",
                    reached.len(),
                    results.len(),
                    reached.iter().map(|r| r.0 as f64).sum::<f64>() / k,
                    fmt_seconds(reached.iter().map(|r| r.1).sum::<f64>() / k)
                )
            };
            let final_norm: Vec<f64> = results
                .iter()
                .filter_map(|r| r.curve.last().map(|p| p.grad_norm))
                .collect();
            let failures = results.iter().filter(|r| r.failure.is_some()).count();
            rows.push((
                *arm,
                vec![
                    arm.label(),
                    pct(&acc),
                    format!("{:.3}", mccs.iter().sum::<f64>() / mccs.len() as f64),
                    to_target,
                    fmt_seconds(step),
                    String::new(),
                    format!(
                        "{:.2e}",
                        final_norm.iter().sum::<f64>() / final_norm.len().max(1) as f64
                    ),
                    fmt_seconds(
                        results
                            .iter()
                            .map(|r| r.step_times.iter().sum::<f64>())
                            .sum::<f64>()
                            / results.len() as f64,
                    ),
                    failures.to_string(),
                ],
                step,
            ));
        }
        let table_rows: Vec<Vec<String>> = rows
            .into_iter()
            .map(|(_, mut r, step)| {
                r[5] = adamw_step.map_or("—".into(), |a| format!("{:.2}x", step / a));
                r
            })
            .collect();
        let target = format!("to {:.0}% val", 100.0 * args.target);
        let table = text_table(
            &[
                "method",
                "test acc %",
                "MCC",
                target.as_str(),
                "median step",
                "vs AdamW",
                "grad norm",
                "train time",
                "failed",
            ],
            &table_rows,
        );
        let block = format!(
            "\n{n} training sentences, {} seed(s) (test accuracy mean ± std):\n{table}",
            args.seeds
        );
        print!("{block}");
        report.push_str(&block);
        let series = |f: fn(&Point) -> f64| -> Vec<Series> {
            first_seed_curves
                .iter()
                .map(|(name, curve)| Series {
                    name: name.clone(),
                    points: curve.iter().map(|p| (p.step as f64, f(p))).collect(),
                })
                .collect()
        };
        let panel = |title: &str, y: &str, y_scale, s| Panel {
            title: title.into(),
            x_label: "iteration".into(),
            y_label: y.into(),
            x_scale: Scale::Linear,
            y_scale,
            series: s,
        };
        let svg = figure(
            &[
                panel(
                    "Validation accuracy",
                    "accuracy",
                    Scale::Linear,
                    series(|p| p.val_acc),
                ),
                panel(
                    "Gradient norm (probe batch)",
                    "‖∇L‖",
                    Scale::Log,
                    series(|p| p.grad_norm),
                ),
            ],
            &first_seed_curves
                .iter()
                .map(|(n, _)| n.clone())
                .collect::<Vec<_>>(),
        );
        let path = args.out.join(format!("curves-{n}.svg"));
        std::fs::write(&path, svg).map_err(|e| Error::io(&path, e))?;
    }
    for (name, body) in [("table.md", &report), ("curves.csv", &csv)] {
        let path = args.out.join(name);
        std::fs::write(&path, body).map_err(|e| Error::io(&path, e))?;
    }
    println!("\nwrote {}", args.out.display());
    Ok(())
}
