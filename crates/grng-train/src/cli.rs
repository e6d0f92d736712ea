//! The main job's command line (`cargo run --release -- --help`) and its driver, kept in the
//! library so `src/main.rs` stays a one-liner and tests can check the flags.
//!
//! Everything it prints comes from [`crate::report`]; the training from [`crate::train`].

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

use crate::mlp::{Activation, FisherMode};
use crate::report;
use crate::train::{
    self, Checkpointing, Dist, Method, MethodConfig, MethodResult, OptimizerConfig, RunConfig,
    Splits, UnknownMethod,
};
use grng::device::Device;
use grng::dist::DataParallel;
use grng::error::{Error, Result};

/// Train an MLP on the UCI handwritten digits (1797 8x8 images, CC BY 4.0, shipped in the
/// crate) with RING, RENG, NGD, R-Kalman, Kalman, AdamW, SGD and Sophia, and compare them.
///
/// The split (60% train / 20% validation / 20% test) and the initialization are fixed by
/// --seed; the same seed gives the same numbers (wall times aside).
#[derive(Parser, Debug, Clone)]
#[command(name = "grng", version, about, long_about)]
pub struct Cli {
    /// Optimizers to train, comma-separated: ring, reng, ngd, rkalman, kalman, adamw, sgd,
    /// sophia, or all.
    #[arg(long, default_value = "all", value_parser = parse_methods)]
    pub optimizers: MethodList,

    /// Passes over the training split.
    #[arg(long, default_value_t = 10)]
    pub epochs: usize,

    /// Mini-batch size of the gradient methods (default: each method's own, 32). The Kalman
    /// methods always take one sample per step (docs/math.md §6).
    #[arg(long)]
    pub batch_size: Option<usize>,

    /// Seed of the data split, the initialization, the batch order and the sampled labels.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Output folder for curves.svg and curves.csv.
    #[arg(long, default_value = "out")]
    pub out: PathBuf,

    /// Validation accuracy for the "steps / time to target" columns, in (0, 1].
    #[arg(long, default_value_t = 0.95)]
    pub target_acc: f32,

    /// Where optimizer state lives and updates run: cpu, emulated (the CUDA kernels run on
    /// the CPU; slow), cuda, or auto (GRNG_DEVICE, else CUDA when usable, else CPU).
    #[arg(long, default_value = "cpu")]
    pub device: String,

    /// Hidden-layer widths, comma-separated (e.g. 64 or 128,64).
    #[arg(long, value_delimiter = ',', default_value = "64")]
    pub hidden: Vec<usize>,

    /// Hidden nonlinearity.
    #[arg(long, value_enum, default_value = "tanh")]
    pub activation: Act,

    /// Fisher statistics of the Kronecker methods: sampled (labels drawn from the model's
    /// predictive distribution, the true Fisher; the default), exact (expectation over the
    /// predicted class probabilities; C backward passes) or empirical (the data labels).
    #[arg(long, value_enum)]
    pub fisher: Option<Fisher>,

    /// Evaluation points per curve (validation accuracy and full-batch gradient norm).
    #[arg(long, default_value_t = 200)]
    pub eval_points: usize,

    /// Run the hyperparameter sweep (grids in grng::train::hyper) for the chosen optimizers
    /// and print a table per optimizer, instead of the comparison. Writes and reads no
    /// checkpoints.
    #[arg(long)]
    pub sweep: bool,

    /// Save each optimizer's full training state to OUT/OPTIMIZER.ckpt every N steps
    /// (atomically: temporary file, fsync, rename). The file is also written when an
    /// optimizer's training ends, whenever --checkpoint-every or --resume is given.
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,

    /// Continue each optimizer from OUT/OPTIMIZER.ckpt when it exists (an optimizer
    /// without one starts from scratch): the batches it already consumed are skipped and
    /// training continues bit for bit as if uninterrupted (on the CPU). The seed, split, batch
    /// size, network and hyperparameters must be the ones the checkpoint was made with.
    /// The curves, times and "to target" columns then report the resumed part only;
    /// "steps" counts the whole run.
    #[arg(long)]
    pub resume: bool,

    /// Stop each optimizer after this many steps in all (counting steps before a resume).
    #[arg(long, value_name = "N")]
    pub max_steps: Option<u64>,

    /// Data-parallel training, one process per rank started by mpirun: each rank steps on
    /// its shard of every batch and the optimizers reduce the shards, so the table is the
    /// single process's at the same --batch-size (docs/distributed.md). mpi: MPI between the
    /// ranks (build with --features mpi); nccl: NCCL between one GPU per rank, MPI to start
    /// them (--features mpi,nccl). Rank 0 prints and writes.
    #[arg(long, value_enum)]
    pub dist: Option<DistKind>,

    /// With --dist: where RING, RENG and NGD invert their factors at a refresh. everywhere:
    /// every rank inverts every layer (no bytes); spread: each layer on one rank, its
    /// inverses broadcast (KAISA-style; docs/distributed.md says when it wins).
    #[arg(long, value_enum, default_value = "everywhere")]
    pub inversions: InversionsArg,
}

/// `--inversions` ([`grng::dist::Inversions`]).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum InversionsArg {
    /// [`grng::dist::Inversions::Everywhere`].
    Everywhere,
    /// [`grng::dist::Inversions::Spread`].
    Spread,
}

impl From<InversionsArg> for grng::dist::Inversions {
    fn from(a: InversionsArg) -> Self {
        match a {
            InversionsArg::Everywhere => Self::Everywhere,
            InversionsArg::Spread => Self::Spread,
        }
    }
}

/// The distributed engine of `--dist`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DistKind {
    /// MPI (`grng::dist::Mpi`).
    Mpi,
    /// NCCL (`grng::dist::Nccl`), bootstrapped over MPI.
    Nccl,
}

/// A communicator of `--dist`.
type Comm = std::sync::Arc<dyn grng::dist::Communicator>;

/// The communicator of `--dist` on `device` (`None` without the flag), and the one that
/// started it when it must live as long (MPI stays initialized while NCCL runs).
fn communicator(kind: Option<DistKind>, device: &Device) -> Result<Option<(Comm, Option<Comm>)>> {
    let Some(kind) = kind else {
        return Ok(None);
    };
    #[cfg(feature = "mpi")]
    if kind == DistKind::Mpi {
        return Ok(Some((std::sync::Arc::new(grng::dist::Mpi::init()?), None)));
    }
    #[cfg(all(feature = "mpi", feature = "nccl"))]
    if kind == DistKind::Nccl {
        let Device::Cuda(cuda) = device else {
            return Err(Error::DeviceUnavailable(
                "--dist nccl needs --device cuda (one GPU per rank)".into(),
            ));
        };
        let mpi = grng::dist::Mpi::init()?;
        let nccl = grng::dist::Nccl::over(&mpi, cuda)?;
        return Ok(Some((
            std::sync::Arc::new(nccl),
            Some(std::sync::Arc::new(mpi)),
        )));
    }
    let _ = device;
    Err(Error::DeviceUnavailable(format!(
        "--dist {kind:?} needs a build with the `{}` feature(s) (docs/distributed.md)",
        if kind == DistKind::Mpi {
            "mpi"
        } else {
            "mpi,nccl"
        }
    )))
}

/// Hidden nonlinearity on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// `tanh`.
    Tanh,
    /// `max(z, 0)`.
    Relu,
}

/// Fisher statistics mode on the command line ([`FisherMode`]).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fisher {
    /// Labels sampled from the model (true Fisher).
    Sampled,
    /// Expectation over the predicted class probabilities.
    Exact,
    /// The data labels (empirical Fisher).
    Empirical,
}

/// The parsed `--optimizers` list (in order, without duplicates).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MethodList(pub Vec<Method>);

fn parse_methods(s: &str) -> std::result::Result<MethodList, UnknownMethod> {
    Method::parse_list(s).map(MethodList)
}

/// Runs the main job (or the sweep with `--sweep`) for parsed flags: prints the progress, the
/// table and where the outputs went.
///
/// # Errors
/// An unusable device, bad flags (validated by [`RunConfig::validate`]), a trainer that cannot
/// be built, or output files that cannot be written. A method whose training fails midway is
/// reported in the table instead.
pub fn run(cli: &Cli) -> Result<()> {
    // Before any work: a run that cannot write its results fails now, naming the folder.
    report::prepare_output_dir(&cli.out)?;
    let device = train::device_by_name(&cli.device)?;
    let (comm, _bootstrap) = communicator(cli.dist, &device)?.unzip();
    // Data-parallel: rank 0 prints, draws the bars and writes the outputs.
    let main = comm.as_ref().is_none_or(|c| c.rank() == 0);
    if comm.is_some() && cli.sweep {
        return Err(Error::Value {
            op: "grng",
            arg: "--sweep",
            value: 1.0,
            expected: "no --sweep with --dist",
        });
    }
    let run = RunConfig {
        epochs: cli.epochs,
        batch_size: cli.batch_size,
        seed: cli.seed,
        hidden: cli.hidden.clone(),
        activation: match cli.activation {
            Act::Tanh => Activation::Tanh,
            Act::Relu => Activation::Relu,
        },
        fisher: cli.fisher.map(|f| match f {
            Fisher::Sampled => FisherMode::Sampled,
            Fisher::Exact => FisherMode::Exact,
            Fisher::Empirical => FisherMode::Empirical,
        }),
        target_acc: cli.target_acc,
        eval_points: cli.eval_points,
        max_steps: cli.max_steps,
        checkpoint: (cli.checkpoint_every.is_some() || cli.resume).then(|| Checkpointing {
            dir: cli.out.clone(),
            every: cli.checkpoint_every,
            resume: cli.resume,
        }),
        dist: comm.map(|c| Dist(DataParallel::new(c).with_inversions(cli.inversions.into()))),
    };
    run.validate()?;
    let splits = Splits::digits(cli.seed)?;
    let methods = &cli.optimizers.0;
    if !main {
        for &method in methods {
            let config = run.apply(MethodConfig::tuned(method));
            train::train_method(&device, &splits, &run, config, &mut |_, _| {})?;
        }
        return Ok(());
    }
    if let Some(d) = &run.dist {
        println!("data-parallel: {} ranks", d.0.comm().size());
    }
    println!(
        "UCI digits: {} train / {} validation / {} test samples; MLP {:?} ({:?}); device {}",
        splits.train.len(),
        splits.val.len(),
        splits.test.len(),
        run.network(&splits.train)?.config().sizes,
        run.activation,
        device.name()
    );
    if cli.sweep {
        return sweep(&device, &splits, &run, methods);
    }
    let start = Instant::now();
    let mut results = Vec::with_capacity(methods.len());
    for &method in methods {
        let config = run.apply(MethodConfig::tuned(method));
        let bar = bar(run.total_steps(&config, splits.train.len()), method.label());
        let result = train::train_method(&device, &splits, &run, config, &mut |done, _| {
            bar.set_position(done)
        })?;
        bar.finish();
        results.push(result);
    }
    println!();
    print!("{}", report::summary_table(&results, run.target_acc));
    print!("{}", reliability_table(&results, &device));
    let (svg, csv) = report::write_outputs(&cli.out, &results)?;
    println!(
        "\nwall time {:.1} s; figure: {}; curves: {}",
        start.elapsed().as_secs_f64(),
        svg.display(),
        csv.display()
    );
    device_faults(&results)
}

/// `Err` naming the methods whose training a device fault stopped: a method that fails is a
/// result (the table shows it), a device that fails is not, so the run exits non-zero.
fn device_faults(results: &[MethodResult]) -> Result<()> {
    let faulted: Vec<&str> = results
        .iter()
        .filter(|r| r.device_fault)
        .map(|r| r.config.method.label())
        .collect();
    if faulted.is_empty() {
        Ok(())
    } else {
        Err(Error::DeviceUnavailable(format!(
            "{} stopped on a device fault (the table above shows where)",
            faulted.join(", ")
        )))
    }
}

/// Skipped steps and numerical fallbacks per method, printed under the summary table (issue
/// 5: fallbacks are reported, not hidden), the factor inverse the Kronecker methods used on
/// `device` ([`grng::optim::kron::InverseMethod::resolve`]), plus where a resumed run started.
pub fn reliability_table(results: &[MethodResult], device: &Device) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n{:<9} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>9} {:>8} {:>9}",
        "numerics",
        "inverse",
        "skipped",
        "rejected",
        "newton",
        "cholesky",
        "power",
        "jitter",
        "jittered",
        "sigma",
        "resumed"
    );
    let _ = writeln!(
        out,
        "{:<9} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>9} {:>8} {:>9}",
        "",
        "",
        "NaN/Inf",
        "updates",
        "retries",
        "fallback",
        "unconv.",
        "escal.",
        "steps",
        "floored",
        "at step"
    );
    for r in results {
        let c = &r.counters;
        let resumed = r
            .resumed_from
            .map_or_else(|| "-".to_string(), |s| s.to_string());
        let inverse = match &r.config.optimizer {
            OptimizerConfig::Kron(k) => k.inverse.resolve(device).label(),
            _ => "-",
        };
        let _ = writeln!(
            out,
            "{:<9} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>9} {:>8} {:>9}",
            r.config.method.label(),
            inverse,
            c.skipped_nonfinite,
            c.rejected_updates,
            c.newton_retries,
            c.cholesky_fallbacks,
            c.power_unconverged,
            c.jitter_escalations,
            c.jittered_steps,
            c.sigma_floored,
            resumed
        );
    }
    out
}

fn sweep(device: &Device, splits: &Splits, run: &RunConfig, methods: &[Method]) -> Result<()> {
    for &method in methods {
        let bar = bar(0, method.label());
        let points = train::sweep(device, splits, run, method, &mut |i, n| {
            bar.set_length(n as u64);
            bar.set_position(i as u64);
        })?;
        bar.finish_and_clear();
        let chosen = train::best(&points);
        println!("{}", report::sweep_table(&points, chosen));
    }
    Ok(())
}

fn bar(len: u64, label: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    // The template is a constant known to parse; fall back to the default style regardless.
    if let Ok(style) = ProgressStyle::with_template("{prefix:>9} [{bar:40}] {pos}/{len} {elapsed}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(label.to_string());
    bar
}
