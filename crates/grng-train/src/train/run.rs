//! The main job's training loop: one method on a train/validation/test split, with the
//! curves and summary numbers the report prints and plots.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::data::Dataset;
use crate::mlp::{Activation, FisherMode, Loss, Mlp, MlpConfig, Targets};
use grng::checkpoint::{Checkpoint, Reader, Writer};
use grng::device::Device;
use grng::error::{check_value, Error, Result};

use super::hyper::MethodConfig;
use super::trainer::{norm, Batch, Trainer, TrainerCounters};

/// Train / validation / test parts of a classification data set.
#[derive(Clone, Debug)]
pub struct Splits {
    /// Samples the optimizers train on.
    pub train: Dataset,
    /// Samples for the curves, the target-accuracy clock and the sweep.
    pub val: Dataset,
    /// Held-out samples, evaluated once at the end.
    pub test: Dataset,
}

/// Fractions of the main job's split: 60% train, 20% validation, the rest test.
pub const SPLIT: (f64, f64) = (0.6, 0.2);

impl Splits {
    /// The UCI digits ([`crate::data::digits`]) split 60/20/20 by a permutation fixed by `seed`.
    ///
    /// # Errors
    /// As [`crate::data::digits`].
    pub fn digits(seed: u64) -> Result<Self> {
        let (train, val, test) = crate::data::digits()?.split(seed, SPLIT)?;
        Ok(Self { train, val, test })
    }
}

/// Settings shared by every method of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    /// Passes over the training split.
    pub epochs: usize,
    /// Mini-batch size for the gradient methods; `None` keeps each method's own
    /// ([`MethodConfig::batch_size`]). The Kalman methods always keep theirs (batch 1).
    pub batch_size: Option<usize>,
    /// Seed of the network initialization (the same for every method), of the batch order and
    /// of the trainers' random streams.
    pub seed: u64,
    /// Hidden-layer widths.
    pub hidden: Vec<usize>,
    /// Hidden nonlinearity.
    pub activation: Activation,
    /// Which output gradients feed the Fisher statistics (Kronecker methods' `Γ`); `None`
    /// keeps each method's own ([`MethodConfig::fisher`], sampled labels by default).
    pub fisher: Option<FisherMode>,
    /// Validation accuracy the "steps / time to target" columns wait for, in `(0, 1]`.
    pub target_acc: f32,
    /// About how many evaluation points each curve gets (at least one per epoch end is not
    /// guaranteed; the last step is always evaluated).
    pub eval_points: usize,
    /// Stop after this many steps in all (counting the steps before a resume); `None` trains
    /// every epoch.
    pub max_steps: Option<u64>,
    /// Periodic checkpoints and resuming ([`Checkpointing`]); `None` reads and writes nothing.
    pub checkpoint: Option<Checkpointing>,
    /// Data-parallel training ([`Dist`]); `None`: one process.
    pub dist: Option<Dist>,
}

/// Data-parallel training of the gradient methods: every rank runs [`train_method`] with the
/// same run, and steps on its shard of each batch (rank `r` of `P` takes the `r`-th of `P`
/// nearly equal parts, the first `B mod P` one row longer) through
/// [`Trainer::step_shard`]; the Kalman methods (one sample per step) are not sharded. Only
/// rank 0 writes checkpoints; every rank can resume from them, whatever the number of
/// ranks that wrote them (the state is the same on every rank).
#[derive(Clone, Debug)]
pub struct Dist(pub grng::dist::DataParallel);

impl PartialEq for Dist {
    /// The same communicator.
    fn eq(&self, other: &Self) -> bool {
        std::ptr::addr_eq(self.0.comm(), other.0.comm())
    }
}

impl Dist {
    fn rank(&self) -> usize {
        self.0.comm().rank()
    }

    /// This rank's part of a batch of `b` rows: its first row and its row count.
    fn shard(&self, b: usize) -> (usize, usize) {
        let (p, r) = (self.0.comm().size(), self.rank());
        let (base, extra) = (b / p, b % p);
        (r * base + r.min(extra), base + usize::from(r < extra))
    }
}

/// Where and how often [`train_method`] saves its state, and whether it resumes from it.
///
/// The file is `<dir>/<method key>.ckpt` (e.g. `out/ring.ckpt`), written atomically
/// ([`Writer::write_atomic`]): the scope `trainer` holds the [`Trainer`] (network, optimizer,
/// random stream, counters), the scope `run` the position in the batch schedule (see
/// [`train_method`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpointing {
    /// Folder of the checkpoint files (created when missing).
    pub dir: PathBuf,
    /// Also write every this many steps (the file is always written when training ends
    /// without an error); `None` or `Some(0)`: only at the end.
    pub every: Option<u64>,
    /// Load the method's file when it exists and continue from there.
    pub resume: bool,
}

impl Checkpointing {
    /// The checkpoint file of `config`'s method: `<dir>/<key>.ckpt`.
    pub fn path(&self, config: &MethodConfig) -> PathBuf {
        self.dir.join(format!("{}.ckpt", config.method.key()))
    }
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            epochs: 10,
            batch_size: None,
            seed: 0,
            hidden: vec![64],
            activation: Activation::Tanh,
            fisher: None,
            target_acc: 0.95,
            eval_points: 200,
            max_steps: None,
            checkpoint: None,
            dist: None,
        }
    }
}

impl RunConfig {
    /// `Err(Error::Value)` naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "RunConfig::validate";
        check_value(
            OP,
            "epochs",
            self.epochs as f64,
            self.epochs >= 1,
            "epochs >= 1",
        )?;
        if let Some(b) = self.batch_size {
            check_value(OP, "batch_size", b as f64, b >= 1, "batch_size >= 1")?;
        }
        check_value(
            OP,
            "hidden",
            self.hidden.len() as f64,
            self.hidden.iter().all(|&h| h >= 1),
            "hidden widths >= 1",
        )?;
        check_value(
            OP,
            "target_acc",
            self.target_acc as f64,
            self.target_acc > 0.0 && self.target_acc <= 1.0,
            "0 < target_acc <= 1",
        )?;
        check_value(
            OP,
            "eval_points",
            self.eval_points as f64,
            self.eval_points >= 1,
            "eval_points >= 1",
        )
    }

    /// `config` with this run's batch-size override applied (gradient methods only).
    pub fn apply(&self, mut config: MethodConfig) -> MethodConfig {
        if let (Some(b), false) = (self.batch_size, config.method.is_kalman()) {
            config.batch_size = b;
        }
        if let Some(f) = self.fisher {
            config.fisher = f;
        }
        config
    }

    /// The network every method starts from: `[d, hidden…, classes]`, softmax
    /// cross-entropy, initialized from `seed`.
    pub fn network(&self, data: &Dataset) -> Result<Mlp> {
        let mut sizes = vec![data.dim()];
        sizes.extend_from_slice(&self.hidden);
        sizes.push(data.classes);
        Mlp::new(
            MlpConfig {
                sizes,
                activation: self.activation,
                loss: Loss::SoftmaxCrossEntropy,
            },
            self.seed,
        )
    }

    /// Steps `config` takes over the whole run on `train_len` samples (at most
    /// [`RunConfig::max_steps`]). Kalman methods drop an incomplete last batch (their
    /// observation size is fixed); the others keep it.
    pub fn total_steps(&self, config: &MethodConfig, train_len: usize) -> u64 {
        let b = config.batch_size.max(1);
        let per_epoch = if config.method.is_kalman() {
            train_len / b
        } else {
            train_len.div_ceil(b)
        };
        let all = (per_epoch * self.epochs) as u64;
        self.max_steps.map_or(all, |m| m.min(all))
    }
}

/// One evaluation point of a curve.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CurvePoint {
    /// Completed optimizer steps.
    pub step: u64,
    /// Completed passes over the training split (fractional).
    pub epoch: f64,
    /// Accuracy on the validation split.
    pub val_acc: f32,
    /// Mean loss on the whole training split.
    pub train_loss: f32,
    /// Norm of the gradient of the mean loss over the whole training split (full batch, so
    /// methods with different batch sizes compare on the same quantity).
    pub grad_norm: f32,
    /// Sum of the step times so far (evaluation excluded), seconds.
    pub train_time: f64,
}

/// Everything the report needs about one method's run.
#[derive(Clone, Debug, PartialEq)]
pub struct MethodResult {
    /// The configuration it trained with.
    pub config: MethodConfig,
    /// Evaluation points, step 0 first.
    pub curve: Vec<CurvePoint>,
    /// Steps taken (batches consumed, skipped steps included; before a resume too).
    pub steps: u64,
    /// Accuracy on the test split at the end (`NaN` when training failed before the end).
    pub test_acc: f32,
    /// First evaluated step at which the validation accuracy reached the target.
    pub steps_to_target: Option<u64>,
    /// Training time (sum of step times) up to that step, seconds.
    pub time_to_target: Option<f64>,
    /// Median step time, seconds.
    pub median_step_time: f64,
    /// Sum of all step times, seconds.
    pub train_time: f64,
    /// Why training stopped early (an optimizer error), if it did.
    pub failure: Option<String>,
    /// Whether that error was the device's ([`grng::Error::is_device_fault`]: a kernel that
    /// did not load or launch, out of memory), not the method's: the main job then exits
    /// non-zero after its table.
    pub device_fault: bool,
    /// Skipped steps and numerical fallbacks ([`Trainer::counters`]; over the whole run,
    /// before a resume too).
    pub counters: TrainerCounters,
    /// The step this run resumed from (`None`: it started from scratch). The curve, the
    /// times and the "to target" numbers cover only the steps after it.
    pub resumed_from: Option<u64>,
}

impl MethodResult {
    /// The last evaluation point (the initial one if no step completed).
    pub fn last(&self) -> Option<&CurvePoint> {
        self.curve.last()
    }
}

/// Evaluation of a network: `(validation accuracy, train loss, train gradient norm)`.
fn evaluate(mlp: &Mlp, splits: &Splits) -> Result<(f32, f32, f32)> {
    let val_fwd = mlp.forward(splits.val.x.as_ref())?;
    let val_acc = mlp.accuracy(&val_fwd, &splits.val.labels)?;
    let fwd = mlp.forward(splits.train.x.as_ref())?;
    let b = mlp.backward(&fwd, Targets::Classes(&splits.train.labels))?;
    Ok((val_acc, b.loss, norm(&b.grad)))
}

/// Where a run stands in the deterministic `(seed, epoch)` batch schedule
/// ([`Dataset::batches`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Position {
    /// Epoch of the next batch.
    epoch: u64,
    /// Index of the next batch within that epoch.
    batch: u64,
    /// Steps taken (batches consumed; a Kalman method's dropped short batch is not a step).
    steps: u64,
    /// Samples consumed.
    seen: u64,
}

/// Writes `<trainer, position>` to `path` atomically (creating its folder).
fn save_checkpoint(
    path: &Path,
    trainer: &Trainer,
    pos: &Position,
    run: &RunConfig,
    train_len: usize,
) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let mut w = Writer::new();
    w.scope("trainer", |w| trainer.save(w))?;
    w.scope("run", |w| {
        w.str("kind", "run")?;
        w.u64("seed", run.seed)?;
        w.u64("train_len", train_len as u64)?;
        w.u64("batch_size", trainer.config().batch_size as u64)?;
        w.u64("epoch", pos.epoch)?;
        w.u64("batch", pos.batch)?;
        w.u64("steps", pos.steps)?;
        w.u64("seen", pos.seen)
    })?;
    w.write_atomic(path)
}

/// Loads the checkpoint at `path` into `trainer` after checking that its batch schedule is
/// this run's; returns the position to continue from. `trainer` is unchanged on error.
fn load_checkpoint(
    path: &Path,
    trainer: &mut Trainer,
    run: &RunConfig,
    train_len: usize,
) -> Result<Position> {
    let bad = |m: String| Error::Checkpoint(format!("{}: {m}", path.display()));
    let r = Reader::open(path)?;
    let rr = r.scope("run");
    rr.expect_kind("run").map_err(|e| bad(e.to_string()))?;
    let batch_size = trainer.config().batch_size;
    for (name, want) in [
        ("seed", run.seed),
        ("train_len", train_len as u64),
        ("batch_size", batch_size as u64),
    ] {
        let got = rr.u64(name).map_err(|e| bad(e.to_string()))?;
        if got != want {
            return Err(bad(format!(
                "`run.{name}` = {got}, this run has {want}: the batch schedule differs"
            )));
        }
    }
    let read = |name: &str| rr.u64(name).map_err(|e| bad(e.to_string()));
    let pos = Position {
        epoch: read("epoch")?,
        batch: read("batch")?,
        steps: read("steps")?,
        seen: read("seen")?,
    };
    let per_epoch = train_len.div_ceil(batch_size) as u64;
    if pos.batch > per_epoch {
        return Err(bad(format!(
            "`run.batch` = {} is past the {per_epoch} batches of an epoch",
            pos.batch
        )));
    }
    // Validate the position against the stored trainer before committing anything.
    let tr = r.scope("trainer");
    let stored = tr.u64("steps").map_err(|e| bad(e.to_string()))?
        + tr.scope("counters")
            .u64("skipped_nonfinite")
            .map_err(|e| bad(e.to_string()))?;
    if stored != pos.steps {
        return Err(bad(format!(
            "`run.steps` = {} but the trainer took {stored} steps (applied + skipped)",
            pos.steps
        )));
    }
    trainer.load(&tr).map_err(|e| match e {
        Error::Checkpoint(m) => bad(m),
        other => other,
    })?;
    Ok(pos)
}

/// Trains `config` (after [`RunConfig::apply`]) on `splits.train` for `run.epochs` epochs
/// (at most `run.max_steps` steps) on `device`, evaluating about `run.eval_points` times;
/// `progress(done, total)` is called after every step. An optimizer error stops this
/// method's training and is recorded in [`MethodResult::failure`] (the run goes on with the
/// other methods); a step skipped for a non-finite value is counted in
/// [`MethodResult::counters`] and training goes on.
///
/// Batches come from the schedule fixed by `(run.seed, epoch)` ([`Dataset::batches`]).
/// With [`RunConfig::checkpoint`], the state is written to [`Checkpointing::path`] every
/// `every` steps and when training ends without an error; with `resume` and an existing
/// file, the trainer is loaded from it, the batches it already consumed are skipped, and
/// training continues — bit for bit as if it had never stopped (on the CPU). The returned
/// curve, times and "to target" numbers then cover the resumed part only (its first point
/// is the resumed state); `steps` and `counters` cover the whole run.
///
/// # Errors
/// A bad `run`, a network that cannot be built, a trainer that cannot be constructed, an
/// evaluation failure of the initial network, a checkpoint that cannot be read, does not
/// match this run (method, configuration, network, seed, split, batch size), or cannot be
/// written.
pub fn train_method(
    device: &Device,
    splits: &Splits,
    run: &RunConfig,
    config: MethodConfig,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<MethodResult> {
    run.validate()?;
    let config = run.apply(config);
    let mlp = run.network(&splits.train)?;
    // A per-method stream: methods do not share sampled labels, yet every run repeats.
    let stream = run.seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(config.method as u64 + 1));
    let mut trainer = Trainer::new(device, mlp, config, stream)?;
    trainer.set_data_parallel(run.dist.as_ref().map(|d| d.0.clone()))?;
    // Sharded: the gradient methods under `run.dist`; only rank 0 writes checkpoints.
    let dist = run.dist.as_ref().filter(|_| !config.method.is_kalman());
    let writes = run.dist.as_ref().is_none_or(|d| d.rank() == 0);
    let train_len = splits.train.len();
    let total = run.total_steps(&config, train_len);
    let ckpt = run.checkpoint.as_ref().map(|c| (c, c.path(&config)));
    let mut pos = Position::default();
    let mut resumed_from = None;
    if let Some((c, path)) = &ckpt {
        if c.resume && path.exists() {
            pos = load_checkpoint(path, &mut trainer, run, train_len)?;
            resumed_from = Some(pos.steps);
        }
    }
    let save_every = ckpt.as_ref().and_then(|(c, _)| c.every).filter(|&n| n > 0);
    let every = (total / run.eval_points as u64).max(1);

    let (acc0, loss0, gn0) = evaluate(trainer.mlp(), splits)?;
    let mut curve = vec![CurvePoint {
        step: pos.steps,
        epoch: pos.seen as f64 / train_len as f64,
        val_acc: acc0,
        train_loss: loss0,
        grad_norm: gn0,
        train_time: 0.0,
    }];
    let mut step_times: Vec<f64> = Vec::with_capacity(total.saturating_sub(pos.steps) as usize);
    let mut elapsed = Duration::ZERO;
    let mut failure: Option<Error> = None;
    let first_epoch = pos.epoch;
    'epochs: for epoch in first_epoch..run.epochs as u64 {
        let skip = if epoch == first_epoch { pos.batch } else { 0 } as usize;
        for (j, idx) in splits
            .train
            .batches(run.seed, epoch, config.batch_size)?
            .enumerate()
            .skip(skip)
        {
            if pos.steps >= total {
                break 'epochs;
            }
            pos.epoch = epoch;
            pos.batch = j as u64 + 1;
            if config.method.is_kalman() && idx.len() != config.batch_size {
                continue;
            }
            let (first, rows) = dist.map_or((0, idx.len()), |d| d.shard(idx.len()));
            if rows == 0 {
                failure = Some(Error::Value {
                    op: "train_method",
                    arg: "batch_size",
                    value: idx.len() as f64,
                    expected: "a batch of at least one row per rank",
                });
                break 'epochs;
            }
            let (x, labels) = splits.train.gather(&idx[first..first + rows])?;
            let batch = Batch {
                x: x.as_ref(),
                targets: Targets::Classes(&labels),
            };
            match trainer.step_shard(batch, first, idx.len()) {
                Ok(r) => {
                    elapsed += r.time;
                    step_times.push(r.time.as_secs_f64());
                }
                Err(e) => {
                    failure = Some(e);
                    break 'epochs;
                }
            }
            pos.steps += 1;
            pos.seen += idx.len() as u64;
            let step = pos.steps;
            progress(step, total);
            if step % every == 0 || step == total {
                match evaluate(trainer.mlp(), splits) {
                    Ok((val_acc, train_loss, grad_norm)) => curve.push(CurvePoint {
                        step,
                        epoch: pos.seen as f64 / train_len as f64,
                        val_acc,
                        train_loss,
                        grad_norm,
                        train_time: elapsed.as_secs_f64(),
                    }),
                    Err(e) => {
                        failure = Some(e);
                        break 'epochs;
                    }
                }
            }
            if let (Some(n), Some((_, path))) = (save_every, &ckpt) {
                if step % n == 0 && step < total && writes {
                    save_checkpoint(path, &trainer, &pos, run, train_len)?;
                }
            }
        }
        pos.epoch = epoch + 1;
        pos.batch = 0;
    }
    if let (None, Some((_, path)), true) = (&failure, &ckpt, writes) {
        save_checkpoint(path, &trainer, &pos, run, train_len)?;
    }
    let test_acc = if failure.is_none() {
        let fwd = trainer.mlp().forward(splits.test.x.as_ref())?;
        trainer.mlp().accuracy(&fwd, &splits.test.labels)?
    } else {
        f32::NAN
    };
    let hit = curve.iter().find(|p| p.val_acc >= run.target_acc);
    Ok(MethodResult {
        config,
        steps: pos.steps,
        test_acc,
        steps_to_target: hit.map(|p| p.step),
        time_to_target: hit.map(|p| p.train_time),
        median_step_time: median(&mut step_times),
        train_time: elapsed.as_secs_f64(),
        curve,
        device_fault: failure.as_ref().is_some_and(Error::is_device_fault),
        failure: failure.map(|e| e.to_string()),
        counters: trainer.counters(),
        resumed_from,
    })
}

/// Median of `v` (sorted in place; the mean of the two middle values for an even length);
/// `NaN` when empty.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}
