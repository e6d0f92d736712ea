//! [`Trainer`]: one method driving the reference MLP, one uniform [`Trainer::step`].

use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::mlp::{BackwardScratch, FisherMode, Forward, LayerStats, Loss, Mlp, Targets};
use grng::checkpoint::{load_all, save_all, Checkpoint, Reader, Writer};
use grng::device::{Device, Matrix};
use grng::dist::DataParallel;
use grng::error::{check_len, Error, Result};
use grng::mat::{Mat, MatRef};
use grng::optim::adamw::AdamW;
use grng::optim::kalman::RKalman;
use grng::optim::kron::{KronGrad, KronOptimizer};
use grng::optim::sgd::Sgd;
use grng::optim::sophia::{Sophia, SophiaHessians};
use grng::optim::KronStats;

use super::hyper::MethodConfig;
use super::Method;
use grng::optim::OptimizerConfig;

/// One mini-batch: `x` is `m x d_0` (one sample per row) with its targets (`m` labels, or
/// `m x d_L` values for a squared-error network).
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    /// Inputs, `m x d_0`.
    pub x: MatRef<'a, f32>,
    /// Training targets of the `m` samples.
    pub targets: Targets<'a>,
}

/// What one [`Trainer::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// 1-based index of this step among the applied ones; for a skipped step, the number of
    /// steps applied so far.
    pub step: u64,
    /// Mean loss of the batch before the update.
    pub loss: f32,
    /// Mean loss of the same batch after the update (Kronecker methods, for the
    /// Levenberg–Marquardt rule; `None` for the others).
    pub loss_after: Option<f32>,
    /// Euclidean norm of the gradient the update used: the mini-batch gradient, for RENG the
    /// gradient of `L + c‖∇L‖²`; for the Kalman methods the mini-batch gradient (computed for
    /// this report only — the filter does not use it).
    pub grad_norm: f32,
    /// Whether this step drew curvature statistics: the sampled-label pass of a Fisher
    /// refresh (Kronecker methods), Sophia's Hessian estimate, the Jacobian (Kalman: always).
    pub refreshed: bool,
    /// Whether the step was skipped for a non-finite value (see [`Trainer::step`]): nothing
    /// changed (for a rejected Kronecker update, only `ρ` and the optimizer's factors moved).
    pub skipped: bool,
    /// The damping `ρ` after the step (Kronecker methods).
    pub rho: Option<f32>,
    /// Wall time of the whole step: forward, backward, statistics, transfers, update and the
    /// loss-after evaluation.
    pub time: Duration,
}

/// Numerical events of a [`Trainer`] (issue 5: fallbacks are reported, never hidden).
///
/// `skipped_nonfinite`, `rejected_updates` and the Kalman counts are the trainer's own (saved
/// in its checkpoint); the Kronecker counts are read from the optimizer's
/// [`grng::optim::kron::KronCounters`] (saved with the optimizer) and are 0 for the other
/// methods.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrainerCounters {
    /// Steps skipped for a NaN/Inf in the batch, the loss, the gradient, the curvature
    /// statistics, the Jacobian or the innovation, plus rejected Kronecker updates.
    pub skipped_nonfinite: u64,
    /// Kronecker updates undone because the loss after them was non-finite (`ρ` raised).
    pub rejected_updates: u64,
    /// Kronecker: Newton inversions retried with more damping after diverging.
    pub newton_retries: u64,
    /// Kronecker: inversions that fell back to Cholesky after the retry diverged too.
    pub cholesky_fallbacks: u64,
    /// Kronecker: power iterations stopped at their budget (their estimate was used).
    pub power_unconverged: u64,
    /// Kalman: total ×10 escalations of the jitter added to the innovation matrix `S`.
    pub jitter_escalations: u64,
    /// Kalman: steps whose `S` needed at least one jitter escalation.
    pub jittered_steps: u64,
    /// Kalman: covariance entries `σ_i` raised to the positivity floor.
    pub sigma_floored: u64,
}

impl TrainerCounters {
    /// Newton fallbacks taken (retries with more damping plus Cholesky fallbacks).
    pub fn fallbacks(&self) -> u64 {
        self.newton_retries + self.cholesky_fallbacks
    }

    /// The trainer-owned counts as `(name, value)` pairs (the records of a checkpoint).
    fn owned(&self) -> [(&'static str, u64); 5] {
        [
            ("skipped_nonfinite", self.skipped_nonfinite),
            ("rejected_updates", self.rejected_updates),
            ("jitter_escalations", self.jitter_escalations),
            ("jittered_steps", self.jittered_steps),
            ("sigma_floored", self.sigma_floored),
        ]
    }
}

/// SGD and AdamW as [`first_order_step`] steps them.
trait FirstOrder {
    /// `step_many`, then `‖g‖₂` where the update measured it (`last_grad_norm`).
    fn step_reporting_norm(&mut self, p: &mut [&mut Matrix], g: &[&Matrix]) -> Result<Option<f32>>;
}

impl FirstOrder for Sgd {
    fn step_reporting_norm(&mut self, p: &mut [&mut Matrix], g: &[&Matrix]) -> Result<Option<f32>> {
        self.step_many(p, g).map(|()| self.last_grad_norm())
    }
}

impl FirstOrder for AdamW {
    fn step_reporting_norm(&mut self, p: &mut [&mut Matrix], g: &[&Matrix]) -> Result<Option<f32>> {
        self.step_many(p, g).map(|()| self.last_grad_norm())
    }
}

/// The buffers a first-order step reuses from step to step (scratch, not state).
#[derive(Debug)]
struct Scratch {
    /// The flat gradient.
    grad: Vec<f32>,
    /// The forward pass ([`Mlp::forward_into`]).
    fwd: Forward,
    /// The backward pass's errors ([`Mlp::gradient_into_with`]).
    bwd: BackwardScratch,
}

impl Scratch {
    fn new() -> Scratch {
        Scratch {
            grad: Vec::new(),
            fwd: Forward::empty(),
            bwd: BackwardScratch::default(),
        }
    }
}

/// The optimizer of a method together with the parameters it owns on the device.
#[derive(Debug)]
enum Engine {
    /// Per-layer `W̄_l` on the device, `d_out x (d_in + 1)`.
    Kron {
        opt: Box<KronOptimizer>,
        params: Vec<Matrix>,
        /// The flat buffer the stepped layers are gathered into and swapped with the network's
        /// vector, which it then holds until the loss after the step decides (scratch).
        flat: Vec<f32>,
    },
    /// First-order methods: the flat `n x 1` parameter vector (element-wise updates need no
    /// layer structure), stepped by one device op. On a host device it is the network's own
    /// vector, swapped in for the step ([`step_network`]); `params` is then the optimizer's
    /// spare buffer, not a copy.
    Sgd {
        opt: Sgd,
        params: Matrix,
        scratch: Scratch,
    },
    AdamW {
        opt: AdamW,
        params: Matrix,
        scratch: Scratch,
    },
    Sophia {
        opt: Sophia,
        params: Matrix,
        scratch: Scratch,
    },
    /// The filter's mean `μ` is the parameter vector.
    Kalman { filter: Box<RKalman> },
}

/// Trains an [`Mlp`] with one method.
///
/// The device holds the optimizer state and its copy of the parameters; the MLP (host, CPU)
/// runs the forward/backward passes and is synchronized from the device after every update
/// (on a host device the first-order methods step the network's own vector: no copy).
/// All randomness (sampled Fisher labels, Sophia's sampled labels) comes from a ChaCha8 stream
/// stored here, so the state is explicit and a run is reproducible from its seed.
#[derive(Debug)]
pub struct Trainer {
    config: MethodConfig,
    device: Device,
    mlp: Mlp,
    engine: Engine,
    rng: ChaCha8Rng,
    steps: u64,
    /// Trainer-owned counts (the Kronecker fields stay 0 here; see [`Trainer::counters`]).
    counters: TrainerCounters,
    /// Data-parallel training ([`Trainer::set_data_parallel`]) and this step's shard: its
    /// first row and the global batch's rows.
    dist: Option<(DataParallel, usize, usize)>,
}

// `skip_nonfinite!(expr)`: the value of a `Result`, or a skipped step for a
// non-finite-value error (every input is known finite here, so such an error means an
// intermediate overflowed); other errors propagate.
macro_rules! skip_nonfinite {
    ($e:expr, $loss:expr, $gn:expr) => {
        match $e {
            Ok(v) => v,
            // `Ranks`: data-parallel, another rank's shard gave such a value (or disagreed).
            Err(Error::NonFinite { .. } | Error::NonFiniteTensor { .. } | Error::Ranks { .. }) => {
                return Ok(Outcome::skip($loss, $gn))
            }
            Err(e) => return Err(e),
        }
    };
}

impl Trainer {
    /// A trainer for `mlp` with `config` on `device`; `seed` seeds the trainer's own random
    /// stream (the network's initialization is the caller's).
    ///
    /// The Kalman methods observe `batch_size · d_L` outputs per step (class probabilities for
    /// softmax, raw outputs for squared error).
    ///
    /// # Errors
    /// [`Error::Value`] for a zero batch size or an optimizer config that is not `method`'s;
    /// the optimizer's own validation errors; device errors.
    pub fn new(device: &Device, mlp: Mlp, config: MethodConfig, seed: u64) -> Result<Self> {
        const OP: &str = "Trainer::new";
        grng::error::check_value(
            OP,
            "batch_size",
            config.batch_size as f64,
            config.batch_size >= 1,
            "batch_size >= 1",
        )?;
        let shapes = mlp.layer_shapes();
        let n = mlp.num_params();
        let flat = || device.upload(n, 1, mlp.params());
        let engine = match (config.method, config.optimizer) {
            (Method::Ring | Method::Reng | Method::Ngd, OptimizerConfig::Kron(c)) => {
                let opt = KronOptimizer::new(device, &shapes, c)?;
                let params = (0..mlp.num_layers())
                    .map(|l| {
                        let w = mlp.layer(l)?;
                        device.upload(w.rows(), w.cols(), w.data())
                    })
                    .collect::<Result<Vec<_>>>()?;
                Engine::Kron {
                    opt: Box::new(opt),
                    params,
                    flat: Vec::new(),
                }
            }
            (Method::Sgd, OptimizerConfig::Sgd(c)) => Engine::Sgd {
                opt: Sgd::new(device, n, c)?,
                params: flat()?,
                scratch: Scratch::new(),
            },
            (Method::AdamW, OptimizerConfig::AdamW(c)) => Engine::AdamW {
                opt: AdamW::new(device, n, c)?,
                params: flat()?,
                scratch: Scratch::new(),
            },
            (Method::Sophia, OptimizerConfig::Sophia(c)) => Engine::Sophia {
                opt: Sophia::new(device, n, c)?,
                params: flat()?,
                scratch: Scratch::new(),
            },
            (Method::RKalman | Method::Kalman, OptimizerConfig::Kalman(c)) => {
                let d_o = config.batch_size * mlp.output_dim();
                Engine::Kalman {
                    filter: Box::new(RKalman::new(device, mlp.params(), d_o, c)?),
                }
            }
            _ => {
                return Err(Error::Value {
                    op: OP,
                    arg: "config.optimizer",
                    value: f64::NAN,
                    expected: "the optimizer config variant of config.method",
                })
            }
        };
        Ok(Self {
            config,
            device: device.clone(),
            mlp,
            engine,
            rng: ChaCha8Rng::seed_from_u64(seed),
            dist: None,
            steps: 0,
            counters: TrainerCounters::default(),
        })
    }

    /// The method's configuration.
    pub fn config(&self) -> &MethodConfig {
        &self.config
    }
    /// The method.
    pub fn method(&self) -> Method {
        self.config.method
    }
    /// The network with the current parameters.
    pub fn mlp(&self) -> &Mlp {
        &self.mlp
    }
    /// Applied steps (skipped ones are counted in [`Trainer::counters`] instead).
    pub fn steps(&self) -> u64 {
        self.steps
    }
    /// The trainer's random stream (sampled labels); part of the state a checkpoint saves.
    pub fn rng(&self) -> &ChaCha8Rng {
        &self.rng
    }

    /// Numerical events so far: skipped steps (this trainer's), the Kronecker optimizer's
    /// Newton fallbacks and the Kalman filter's jitter escalations.
    pub fn counters(&self) -> TrainerCounters {
        let mut c = self.counters;
        if let Engine::Kron { opt, .. } = &self.engine {
            let k = opt.counters();
            c.newton_retries = k.newton_retries;
            c.cholesky_fallbacks = k.cholesky_fallbacks;
            c.power_unconverged = k.power_unconverged;
        }
        c
    }

    /// Makes the training data-parallel (or single-process again with `None`): every rank
    /// holds the whole network and steps on its shard of each batch
    /// ([`Trainer::step_shard`]); the optimizer reduces the shards' gradients and statistics
    /// (`grng::dist`), so every rank takes the step one process takes on the whole batch.
    /// RENG's gradient `g + 2c·H_L g` is formed from the reduced `g` and reduced again. The
    /// sampled labels stay the single process's: each rank draws the whole batch's and keeps
    /// its rows'. The Kalman methods observe one sample per step: they are not sharded (every
    /// rank steps the whole batch, nothing to reduce), so `dp` is ignored for them.
    ///
    /// # Errors
    /// [`Error::Value`] for a squared-error network with sampled labels (its per-value
    /// draws are not sharded).
    pub fn set_data_parallel(&mut self, dp: Option<DataParallel>) -> Result<()> {
        let sampled = matches!(self.config.fisher, FisherMode::Sampled)
            || matches!(self.engine, Engine::Sophia { .. });
        if dp.is_some() && sampled && self.mlp.config().loss != Loss::SoftmaxCrossEntropy {
            return Err(Error::Value {
                op: "Trainer::set_data_parallel",
                arg: "loss",
                value: f64::NAN,
                expected: "softmax cross-entropy when labels are sampled",
            });
        }
        let reng = self.config.method == Method::Reng;
        let opt_dp = dp
            .clone()
            .map(|d| if reng { d.with_grads_reduced() } else { d });
        match &mut self.engine {
            Engine::Kron { opt, .. } => opt.set_data_parallel(opt_dp),
            Engine::Sgd { opt, .. } => opt.set_data_parallel(opt_dp),
            Engine::AdamW { opt, .. } => opt.set_data_parallel(opt_dp),
            Engine::Sophia { opt, .. } => opt.set_data_parallel(opt_dp),
            Engine::Kalman { .. } => {
                self.dist = None;
                return Ok(());
            }
        }
        self.dist = dp.map(|d| (d, 0, 0));
        Ok(())
    }

    /// [`Trainer::step`] on this rank's shard of a data-parallel batch: `batch` holds rows
    /// `first .. first + m` of a global batch of `total` rows (see
    /// [`Trainer::set_data_parallel`]; single-process, `first = 0` and `total = m`). A step
    /// this rank skips before its optimizer reduced anything is announced to the other ranks
    /// ([`DataParallel::abstain`]), which then skip it too.
    ///
    /// # Errors
    /// As [`Trainer::step`]; [`Error::Value`] for a shard outside `total`.
    pub fn step_shard(
        &mut self,
        batch: Batch<'_>,
        first: usize,
        total: usize,
    ) -> Result<StepReport> {
        const OP: &str = "Trainer::step_shard";
        let m = batch.x.rows();
        grng::error::check_value(
            OP,
            "total",
            total as f64,
            first + m <= total,
            "first + batch rows <= total",
        )?;
        let Some((dp, ..)) = &self.dist else {
            return self.step(batch);
        };
        let mut dp = dp.clone();
        dp.set_rows(m);
        let before = dp.reductions();
        self.dist = Some((dp.clone(), first, total));
        match &mut self.engine {
            Engine::Kron { opt, .. } => set_rows(opt.data_parallel_mut(), m),
            Engine::Sgd { opt, .. } => set_rows(opt.data_parallel_mut(), m),
            Engine::AdamW { opt, .. } => set_rows(opt.data_parallel_mut(), m),
            Engine::Sophia { opt, .. } => set_rows(opt.data_parallel_mut(), m),
            Engine::Kalman { .. } => {}
        }
        let report = self.step(batch)?;
        if report.skipped && dp.reductions() == before {
            dp.abstain(OP)?;
        }
        Ok(report)
    }

    /// One training step on `batch` (forward, backward, the statistics the method needs, the
    /// optimizer update on the device, the loss-after evaluation of the Kronecker methods),
    /// then the network is synchronized with the updated parameters.
    ///
    /// Per method:
    /// - RING, NGD: mini-batch gradient; on Fisher-refresh steps (`needs_stats`) a second
    ///   backward pass from labels sampled from the model ([`MethodConfig::fisher`]);
    /// - RENG: as RING, with the gradient `g + 2c·H_L g` (exact Hessian-vector product);
    /// - SGD, AdamW: mini-batch gradient;
    /// - Sophia: mini-batch gradient; every `k` steps also the sampled-label gradient for the
    ///   Gauss–Newton–Bartlett estimate;
    /// - R-Kalman, Kalman: output Jacobian `H` and innovation `y − ŷ` (one-hot labels minus
    ///   probabilities for softmax); the batch size must be [`MethodConfig::batch_size`].
    ///
    /// # Numerical failure
    /// A batch holding NaN/Inf, or a non-finite loss, gradient, curvature statistic, Jacobian
    /// or innovation, **skips** the step: it returns `Ok` with [`StepReport::skipped`] set,
    /// counts it in [`TrainerCounters::skipped_nonfinite`], and changes nothing (network,
    /// optimizer, device parameters, random stream, step counter). For the Kronecker methods
    /// the loss after the step is evaluated on the steps that form the Levenberg–Marquardt
    /// model (every step unless [`grng::optim::kron::KronConfig::damping_interval`] says
    /// otherwise); an update whose loss after is non-finite is **rejected**: the parameters are
    /// put back, the Levenberg–Marquardt rule sees the non-finite loss and raises `ρ`
    /// ([`KronOptimizer::observe_loss`]), the step counts as skipped and as
    /// [`TrainerCounters::rejected_updates`] (the optimizer keeps its refreshed factors and its
    /// step count: that is the damping controller reacting).
    ///
    /// # Errors
    /// [`Error::Shape`]/[`Error::Value`] for a batch that does not fit the network (or a
    /// Kalman batch of the wrong size); optimizer errors other than non-finite values (e.g.
    /// [`Error::NotSpd`] when no jitter makes the Kalman innovation matrix factorable) and
    /// device errors — nothing changes then; [`Error::NonFinite`] when an SGD/AdamW/Sophia or
    /// Kalman update itself overflows the parameters (the optimizer has stepped then, the
    /// network keeps the previous parameters: stop training).
    pub fn step(&mut self, batch: Batch<'_>) -> Result<StepReport> {
        const OP: &str = "Trainer::step";
        let start = Instant::now();
        let m = batch.x.rows();
        if self.method().is_kalman() {
            check_len(OP, "batch.x rows", m, self.config.batch_size)?;
        }
        let rng_before = self.rng.clone();
        // The step's largest product: a layer's forward pass over the batch, or for the
        // Kalman methods its Jacobian backpropagation (`m·d_L` rows).
        let rows = if self.method().is_kalman() {
            m * self.mlp.config().sizes.last().copied().unwrap_or(1)
        } else {
            m
        };
        let largest = self.mlp.layer_shapes().iter().map(|&(r, c)| r * c).max();
        let work = rows * largest.unwrap_or(0);
        let outcome = grng::cpu::on_pool(work, || -> Result<Outcome> {
            Ok(if batch_is_finite(&self.mlp, batch)? {
                self.update(batch)?
            } else {
                Outcome::skip(f32::NAN, f32::NAN)
            })
        })?;
        if outcome.skipped {
            // Sampled labels drawn before the skip are given back: a skipped step leaves the
            // random stream where it was.
            self.rng = rng_before;
            self.counters.skipped_nonfinite += 1;
        } else {
            self.steps += 1;
        }
        let rho = match &self.engine {
            Engine::Kron { opt, .. } => Some(opt.rho()),
            _ => None,
        };
        Ok(StepReport {
            step: self.steps,
            loss: outcome.loss,
            loss_after: outcome.loss_after,
            grad_norm: outcome.grad_norm,
            refreshed: outcome.refreshed,
            skipped: outcome.skipped,
            rho,
            time: start.elapsed(),
        })
    }

    /// The update of [`Trainer::step`] on a finite batch.
    fn update(&mut self, batch: Batch<'_>) -> Result<Outcome> {
        let m = batch.x.rows();
        let fisher = self.config.fisher;
        let device = &self.device;
        let mlp = &mut self.mlp;
        let rng = &mut self.rng;
        let dp = self.dist.as_ref().map(|(dp, ..)| dp);
        let shard = self
            .dist
            .as_ref()
            .map(|&(_, first, total)| (first, m, total));
        let outcome = match &mut self.engine {
            Engine::Kron { opt, params, flat } => {
                let refresh = opt.needs_stats();
                // RING's and NGD's steps that form the model give layer 0's output change on
                // this batch (`step_grads_with_output_change`): the loss after the step then
                // starts from the kept `z_0` instead of layer 0's product.
                let keep_first = self.config.method != Method::Reng && opt.adapts_damping();
                // One forward pass serves the gradient and, on refresh steps, the Fisher
                // statistics: same parameters, same batch, so the same numbers as two passes.
                let fwd = if keep_first {
                    mlp.forward_keeping_first(batch.x)
                } else {
                    mlp.forward(batch.x)
                };
                let mut fwd = skip_nonfinite!(fwd, f32::NAN, f32::NAN);
                let first = fwd.take_first();
                // The Fisher statistics first, while the pass is borrowed: RING's and NGD's
                // gradient factors then take its `A_l` without a copy. The gradient draws no
                // labels, and on a step skipped below the ones drawn here are given back
                // (`Trainer::step`).
                let fisher_layers = if refresh {
                    let draws = shard.filter(|_| fisher == FisherMode::Sampled);
                    Some(drawing_shard(rng, draws, |rng| {
                        mlp.fisher_stats(&fwd, fisher, batch.targets, rng)
                    })?)
                } else {
                    None
                };
                // RENG's gradient `g + 2c·H_L g` is handed over dense. RING and NGD hand over
                // the batch factors of `G = (1/m) EᵀA` instead, which the optimizer
                // preconditions with about 2.7x fewer flops on wide layers (`KronGrad`).
                let (loss, gn, grads) = if self.config.method == Method::Reng {
                    let c = match self.config.optimizer {
                        OptimizerConfig::Kron(k) => k.grad_reg,
                        _ => 0.0,
                    };
                    // Data-parallel: `g` reduced before its Hessian product, `H_L g` after.
                    let r = match dp {
                        None => mlp.regularized_gradient_from(&fwd, batch.targets, c),
                        // The batch's mean loss too: every rank skips on it alike.
                        Some(dp) => {
                            let reduce = &mut |v: &mut [f32]| {
                                dp.all_reduce_mean("Trainer::step", v).map(drop)
                            };
                            mlp.regularized_gradient_reduced(&fwd, batch.targets, c, reduce)
                                .and_then(|(loss, g)| {
                                    let mut l = [loss];
                                    reduce(&mut l)?;
                                    Ok((l[0], g))
                                })
                        }
                    };
                    let (loss, grad) = skip_nonfinite!(r, f32::NAN, f32::NAN);
                    let gn = norm(&grad);
                    if !loss.is_finite() || !gn.is_finite() {
                        return Ok(Outcome::skip(loss, gn));
                    }
                    drop(fwd);
                    (loss, gn, Upload::Dense(upload_layers(device, mlp, &grad)?))
                } else {
                    let b = mlp.backward_factors_from(fwd, batch.targets);
                    let (layers, loss) = skip_nonfinite!(b, f32::NAN, f32::NAN);
                    // Layers as parallel tasks (`cpu::map_tasks`), summed in layer order. The
                    // norm's Gram matrices go to the optimizer with the factors
                    // (`KronGrad::FactoredWithGrams`: the rows' route reuses them).
                    let mut sq = 0.0;
                    let mut grams = Vec::with_capacity(layers.len());
                    for n in grng::cpu::map_tasks(layers.iter().collect(), |s| s.gradient_norm()) {
                        let n = n?;
                        sq += n.norm_sq;
                        grams.push(n.grams);
                    }
                    // A non-finite `E` makes the norm non-finite (`A`'s bias column is 1),
                    // so this one test covers the factors (and their Gram matrices) too.
                    let gn = sq.sqrt() as f32;
                    if !loss.is_finite() || !gn.is_finite() {
                        return Ok(Outcome::skip(loss, gn));
                    }
                    // Only the CPU has the rows' route: elsewhere they would be uploaded for
                    // nothing.
                    let grams = grams
                        .into_iter()
                        .map(|g| match g {
                            Some((ee, aa)) if matches!(device, Device::Cpu) => {
                                Ok(Some((tensor(device, ee)?, tensor(device, aa)?)))
                            }
                            _ => Ok(None),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let factors = upload_stats(device, layers)?;
                    (loss, gn, Upload::Factored(factors, grams))
                };
                let stats = match fisher_layers {
                    Some(layers) => {
                        let finite = layers
                            .iter()
                            .all(|s| all_finite(s.a.as_slice()) && all_finite(s.e.as_slice()));
                        if !finite {
                            return Ok(Outcome::skip(loss, gn));
                        }
                        Some(upload_stats(device, layers)?)
                    }
                    None => None,
                };
                let kron: Option<Vec<KronStats<'_>>> = stats
                    .as_ref()
                    .map(|v| v.iter().map(|(a, e)| KronStats { a, e }).collect());
                let grad_refs: Vec<KronGrad<'_>> = match &grads {
                    Upload::Dense(gs) => gs.iter().map(KronGrad::Dense).collect(),
                    Upload::Factored(fs, grams) => fs
                        .iter()
                        .zip(grams)
                        .map(|((a, e), g)| match g {
                            Some((ee, aa)) => KronGrad::FactoredWithGrams { e, a, ee, aa },
                            None => KronGrad::Factored { e, a },
                        })
                        .collect(),
                };
                let stepped = match first {
                    Some(_) => {
                        opt.step_grads_with_output_change(params, &grad_refs, kron.as_deref(), 0)
                    }
                    None => opt
                        .step_grads(params, &grad_refs, kron.as_deref())
                        .map(|i| (i, None)),
                };
                let (predicted, change) = match stepped {
                    Ok((info, change)) => (info.predicted_change.is_some(), change),
                    Err(Error::NonFinite { .. }) => {
                        opt.reject_step();
                        self.counters.rejected_updates += 1;
                        return Ok(Outcome::skip(loss, gn));
                    }
                    // Data-parallel: another rank's shard failed its checks.
                    Err(Error::Ranks { .. }) => return Ok(Outcome::skip(loss, gn)),
                    Err(e) => return Err(e),
                };
                // The stepped layers go into the network by a swap of flat vectors: `flat`
                // then holds the parameters before the step, to swap back if it is rejected
                // (no copy of them, no second check: the step checked every value it wrote).
                gather_layers(mlp, params, flat)?;
                mlp.swap_flat(flat, true)?;
                // A step that formed no model (`KronConfig::damping_interval`) needs no loss
                // after it. Its weights are finite (the step checked every value it wrote).
                if !predicted {
                    return Ok(Outcome::applied(loss, gn, refresh));
                }
                // The LM rule compares plain losses, also for RENG (its regularized loss
                // would need a second backward pass after the step).
                let after = match (&first, change) {
                    (Some(z0), Some(dz)) => {
                        // The buffer itself on the CPU, a download elsewhere.
                        let (m, d) = dz.shape();
                        let dz = Mat::from_vec(dz.into_host_vec()?, m, d)?;
                        mlp.evaluate_from_first(z0.as_ref(), dz.as_ref(), batch.targets)
                    }
                    _ => mlp.evaluate(batch.x, batch.targets),
                };
                let after = match after {
                    Err(Error::NonFinite { .. }) => f32::NAN,
                    r => r?,
                };
                // A non-finite `after` raises ρ. Data-parallel, the losses are the ranks'
                // means: the observation counts a non-finite one on every rank alike.
                let nonfinite = opt.counters().nonfinite_losses;
                opt.observe_loss(loss, after)?;
                if opt.counters().nonfinite_losses == nonfinite {
                    Outcome {
                        loss,
                        loss_after: Some(after),
                        grad_norm: gn,
                        refreshed: refresh,
                        skipped: false,
                    }
                } else {
                    // Both vectors were checked: the network's when it was set, the step's by
                    // the step.
                    mlp.swap_flat(flat, true)?;
                    *params = upload_layers(device, mlp, mlp.params())?;
                    self.counters.rejected_updates += 1;
                    Outcome {
                        loss_after: Some(after),
                        refreshed: refresh,
                        ..Outcome::skip(loss, gn)
                    }
                }
            }
            Engine::Sgd {
                opt,
                params,
                scratch,
            } => first_order_step(device, mlp, batch, params, scratch, opt)?,
            Engine::AdamW {
                opt,
                params,
                scratch,
            } => first_order_step(device, mlp, batch, params, scratch, opt)?,
            Engine::Sophia {
                opt,
                params,
                scratch: Scratch { grad, fwd, bwd },
            } => {
                mlp.forward_into(batch.x, fwd)?;
                // The gradient only: `backward` would also copy every layer's inputs `A_l`.
                let r = mlp.gradient_into_with(fwd, batch.targets, grad, bwd);
                let loss = skip_nonfinite!(r, f32::NAN, f32::NAN);
                let gn = norm(grad);
                if !loss.is_finite() || !gn.is_finite() {
                    return Ok(Outcome::skip(loss, gn));
                }
                let refresh = opt.needs_hessian();
                let sampled = if refresh {
                    let s = drawing_shard(rng, shard, |rng| mlp.backward_sampled(fwd, rng));
                    let s = skip_nonfinite!(s, loss, gn);
                    if !all_finite(&s.grad) {
                        return Ok(Outcome::skip(loss, gn));
                    }
                    Some(flat_tensor(device, s.grad)?)
                } else {
                    None
                };
                let sampled: Option<[&Matrix; 1]> = sampled.as_ref().map(|s| [s]);
                let hess = sampled.as_ref().map(|s| SophiaHessians {
                    sampled_grads: s,
                    batch: m,
                });
                let r = step_with_grad(device, mlp, params, grad, |p, g| {
                    opt.step_many(&mut [p], &[g], hess)
                })?;
                skip_nonfinite!(r, loss, gn);
                Outcome::applied(loss, gn, refresh)
            }
            Engine::Kalman { filter } => {
                let (loss, grad) = skip_nonfinite!(plain_gradient(mlp, batch), f32::NAN, f32::NAN);
                let gn = norm(&grad);
                if !loss.is_finite() || !gn.is_finite() {
                    return Ok(Outcome::skip(loss, gn));
                }
                let jac = skip_nonfinite!(mlp.output_jacobian(batch.x), loss, gn);
                let innovation = innovation(mlp, batch.targets, jac.y.as_slice())?;
                if !all_finite(jac.h.as_slice()) || !all_finite(&innovation) {
                    return Ok(Outcome::skip(loss, gn));
                }
                let h = device.upload(jac.h.rows(), jac.h.cols(), jac.h.as_slice())?;
                let v = device.upload(innovation.len(), 1, &innovation)?;
                let info = skip_nonfinite!(filter.step(&h, &v), loss, gn);
                let c = &mut self.counters;
                c.jitter_escalations += info.jitter_escalations as u64;
                c.jittered_steps += u64::from(info.jitter_escalations > 0);
                c.sigma_floored += info.sigma_floored as u64;
                sync_flat(mlp, filter.params())?;
                Outcome::applied(loss, gn, true)
            }
        };
        Ok(outcome)
    }
}

/// Sets this step's rows on a data-parallel optimizer's handle.
fn set_rows(dp: Option<&mut DataParallel>, rows: usize) {
    if let Some(dp) = dp {
        dp.set_rows(rows);
    }
}

/// Runs `draw` (which draws one uniform per row of a `m`-row shard from `rng`) as if it drew
/// for the whole data-parallel batch: the rows before the shard's first and after its last
/// are drawn and dropped, so each rank keeps the single process's labels for its rows.
fn drawing_shard<T>(
    rng: &mut ChaCha8Rng,
    shard: Option<(usize, usize, usize)>,
    draw: impl FnOnce(&mut ChaCha8Rng) -> T,
) -> T {
    use rand::Rng as _;
    let Some((first, m, total)) = shard else {
        return draw(rng);
    };
    (0..first).for_each(|_| {
        let _: f64 = rng.random();
    });
    let t = draw(rng);
    (first + m..total).for_each(|_| {
        let _: f64 = rng.random();
    });
    t
}

/// What [`Trainer::update`] did (the parts of a [`StepReport`] it knows).
struct Outcome {
    loss: f32,
    loss_after: Option<f32>,
    grad_norm: f32,
    refreshed: bool,
    skipped: bool,
}

impl Outcome {
    fn skip(loss: f32, grad_norm: f32) -> Self {
        Self {
            loss,
            loss_after: None,
            grad_norm,
            refreshed: false,
            skipped: true,
        }
    }

    fn applied(loss: f32, grad_norm: f32, refreshed: bool) -> Self {
        Self {
            loss,
            loss_after: None,
            grad_norm,
            refreshed,
            skipped: false,
        }
    }
}

/// One plain-gradient step of a first-order optimizer (SGD, AdamW): the forward pass and the
/// flat mini-batch gradient into the [`Scratch`] buffers (reused from the last step), handed
/// to `opt` with the flat parameters ([`step_network`]); skipped (nothing changed) on a
/// non-finite value.
///
/// `opt` reports `‖g‖₂` where its update measured it (the CPU's multi-tensor update, in the
/// read-only pass it makes over its inputs anyway: the same bits as [`norm`], without a pass of
/// its own); otherwise, and on the paths that skip, [`norm`] computes it. A non-finite gradient
/// fails the update's own check, which leaves everything unchanged, so no separate test has to
/// come first.
fn first_order_step(
    device: &Device,
    mlp: &mut Mlp,
    batch: Batch<'_>,
    params: &mut Matrix,
    Scratch { grad, fwd, bwd }: &mut Scratch,
    opt: &mut impl FirstOrder,
) -> Result<Outcome> {
    skip_nonfinite!(mlp.forward_into(batch.x, fwd), f32::NAN, f32::NAN);
    let loss = skip_nonfinite!(
        mlp.gradient_into_with(fwd, batch.targets, grad, bwd),
        f32::NAN,
        f32::NAN
    );
    if !loss.is_finite() {
        return Ok(Outcome::skip(loss, norm(grad)));
    }
    let r = step_with_grad(device, mlp, params, grad, |p, g| {
        opt.step_reporting_norm(&mut [p], &[g])
    })?;
    // The norm of a skipped step is computed only on that path.
    let streamed = skip_nonfinite!(r, loss, norm(grad));
    Ok(Outcome::applied(
        loss,
        streamed.unwrap_or_else(|| norm(grad)),
        false,
    ))
}

/// `step` on the flat parameters ([`step_network`]) and the gradient in `grad` as an `n x 1`
/// tensor: on the CPU the buffer itself, moved in and back after (no copy), elsewhere an
/// upload. The outer error is the tensor's; the inner one is `step`'s, for the caller's skip
/// rule.
fn step_with_grad<R>(
    device: &Device,
    mlp: &mut Mlp,
    params: &mut Matrix,
    grad: &mut Vec<f32>,
    step: impl FnOnce(&mut Matrix, &Matrix) -> Result<R>,
) -> Result<Result<R>> {
    let g = flat_tensor(device, std::mem::take(grad))?;
    let r = step_network(mlp, params, |p| step(p, &g));
    if g.host().is_some() {
        *grad = g.into_host_vec()?;
    }
    Ok(r)
}

/// A flat host vector as an `n x 1` tensor on `device`: the vector itself (no copy) on the
/// CPU, an upload elsewhere.
fn flat_tensor(device: &Device, v: Vec<f32>) -> Result<Matrix> {
    let n = v.len();
    tensor(device, Mat::from_vec(v, n, 1)?)
}

/// Runs `step` on the flat `n x 1` parameters and brings the network up to date with its
/// result; on error the network keeps its parameters.
///
/// With host storage nothing is copied: the network's vector is swapped into `params`
/// (whatever `params` held goes to the network meanwhile), stepped — the optimizer computes
/// into its spare buffer and swaps that in, or leaves `params` untouched on error — and
/// swapped back, so the network holds the new (or, on error, its own) parameters. The update
/// checks that every value it writes is finite, which is what the network's own
/// [`Mlp::set_params`] would check. On a GPU the result is downloaded into the network.
fn step_network<R>(
    mlp: &mut Mlp,
    params: &mut Matrix,
    step: impl FnOnce(&mut Matrix) -> Result<R>,
) -> Result<R> {
    if mlp.swap_params(params, false) {
        let r = step(params);
        // On success the update checked every value it wrote.
        mlp.swap_params(params, r.is_ok());
        return r;
    }
    let out = step(params)?;
    sync_flat(mlp, params)?;
    Ok(out)
}

fn all_finite(v: &[f32]) -> bool {
    v.iter().all(|x| x.is_finite())
}

/// `Ok(false)` when the batch's inputs or target values hold NaN/Inf (a step to skip);
/// shape and label errors are errors.
fn batch_is_finite(mlp: &Mlp, batch: Batch<'_>) -> Result<bool> {
    const OP: &str = "Trainer::step";
    let m = batch.x.rows();
    let mut finite = true;
    for r in [
        mlp.check_input(OP, batch.x),
        mlp.check_targets(OP, batch.targets, m),
    ] {
        match r {
            Ok(()) => {}
            Err(Error::NonFinite { .. }) => finite = false,
            Err(e) => return Err(e),
        }
    }
    Ok(finite)
}

/// Forward and backward pass: `(mean loss, flat gradient)`.
fn plain_gradient(mlp: &Mlp, batch: Batch<'_>) -> Result<(f32, Vec<f32>)> {
    let fwd = mlp.forward(batch.x)?;
    let (grad, loss) = mlp.gradient(&fwd, batch.targets)?;
    Ok((loss, grad))
}

/// Euclidean norm, accumulated in f64 (NaN/Inf in `v` give a non-finite norm): the chunked,
/// parallel sum of the CPU backend's `dot`, deterministic for any thread count.
pub(crate) fn norm(v: &[f32]) -> f32 {
    grng::cpu::elementwise::dot_f64(v, v).sqrt() as f32
}

/// The flat gradient cut into per-layer `d_out x (d_in + 1)` matrices on the device.
fn upload_layers(device: &Device, mlp: &Mlp, flat: &[f32]) -> Result<Vec<Matrix>> {
    (0..mlp.num_layers())
        .map(|l| {
            let (r, c) = mlp.layer_shape(l)?;
            device.upload(r, c, &flat[mlp.layer_range(l)?])
        })
        .collect()
}

/// A Kronecker step's gradients on the device: dense per layer, or the batch factors `(A, E)`
/// of `G = (1/m) EᵀA`.
enum Upload {
    Dense(Vec<Matrix>),
    /// Per layer `(A, E)` and the Gram matrices `(EEᵀ/m, AAᵀ/m)` where the norm formed them.
    Factored(Vec<(Matrix, Matrix)>, Vec<Option<(Matrix, Matrix)>>),
}

/// Per-layer `(A, E)` statistics on `device`: on the CPU the buffers themselves (moved, no
/// copy: ~5 MB a step at 784-1024-1024-10, batch 256), elsewhere uploaded.
fn upload_stats(device: &Device, layers: Vec<LayerStats>) -> Result<Vec<(Matrix, Matrix)>> {
    layers
        .into_iter()
        .map(|s| Ok((tensor(device, s.a)?, tensor(device, s.e)?)))
        .collect()
}

/// A host matrix as a tensor on `device`: the matrix itself (no copy) on the CPU, an upload
/// elsewhere.
fn tensor(device: &Device, m: Mat) -> Result<Matrix> {
    let (rows, cols) = m.shape();
    match device {
        Device::Cpu => Matrix::from_host_vec(rows, cols, m.into_vec()),
        _ => device.upload(rows, cols, m.as_slice()),
    }
}

/// The per-layer parameters concatenated into `flat` (the network's flat layout, layer 0
/// first), reusing its allocation: after the first step it is the vector the last step swapped
/// out, of the right length, so nothing is zero-filled. Host matrices are copied by
/// [`grng::cpu::elementwise::copy`]'s parallel chunks (one thread's copy took 1.8% of a RING
/// step on 2 cores, the other core idle); device ones are read back once each.
fn gather_layers(mlp: &Mlp, params: &[Matrix], flat: &mut Vec<f32>) -> Result<()> {
    if flat.len() != mlp.num_params() {
        *flat = grng::error::try_vec(mlp.num_params(), 1, 0.0f32)?;
    }
    let mut rest = &mut flat[..];
    for p in params {
        let len = p.len().min(rest.len());
        let (dst, tail) = std::mem::take(&mut rest).split_at_mut(len);
        rest = tail;
        match p.host() {
            Some(h) => grng::cpu::elementwise::copy(h, dst)?,
            None => grng::cpu::elementwise::copy(&p.to_vec()?, dst)?,
        }
    }
    check_len(
        "gather_layers",
        "params",
        mlp.num_params() - rest.len(),
        mlp.num_params(),
    )
}

/// Copies a flat `n x 1` device parameter vector into the network.
fn sync_flat(mlp: &mut Mlp, params: &Matrix) -> Result<()> {
    match params.host() {
        Some(h) => mlp.set_params(h),
        None => mlp.set_params(&params.to_vec()?),
    }
}

/// The Kalman innovation `y − ŷ`, samples stacked (`m·d_o`): one-hot labels (or the target
/// values) minus the outputs `ŷ` (probabilities for softmax).
fn innovation(mlp: &Mlp, targets: Targets<'_>, y_hat: &[f32]) -> Result<Vec<f32>> {
    let d_o = mlp.output_dim();
    let mut v: Vec<f32> = y_hat.iter().map(|&p| -p).collect();
    match targets {
        Targets::Classes(labels) => {
            check_len("Trainer::step", "labels", labels.len() * d_o, v.len())?;
            for (k, &c) in labels.iter().enumerate() {
                // Labels were validated by the forward/backward pass above.
                if let Some(e) = v.get_mut(k * d_o + c) {
                    *e += 1.0;
                }
            }
        }
        Targets::Values(t) => {
            if mlp.config().loss != Loss::SquaredError {
                return Err(Error::Value {
                    op: "Trainer::step",
                    arg: "targets",
                    value: f64::NAN,
                    expected: "class labels for a softmax network",
                });
            }
            for (k, row) in v.chunks_mut(d_o).enumerate() {
                for (e, &tv) in row.iter_mut().zip(t.row(k)) {
                    *e += tv;
                }
            }
        }
    }
    Ok(v)
}

impl Engine {
    fn optimizer(&self) -> &dyn Checkpoint {
        match self {
            Engine::Kron { opt, .. } => opt.as_ref(),
            Engine::Sgd { opt, .. } => opt,
            Engine::AdamW { opt, .. } => opt,
            Engine::Sophia { opt, .. } => opt,
            Engine::Kalman { filter } => filter.as_ref(),
        }
    }

    fn optimizer_mut(&mut self) -> &mut dyn Checkpoint {
        match self {
            Engine::Kron { opt, .. } => opt.as_mut(),
            Engine::Sgd { opt, .. } => opt,
            Engine::AdamW { opt, .. } => opt,
            Engine::Sophia { opt, .. } => opt,
            Engine::Kalman { filter } => filter.as_mut(),
        }
    }
}

/// The engine's device parameters rebuilt from a checkpoint's network, before anything is
/// committed.
enum DeviceParams {
    Layers(Vec<Matrix>),
    Flat(Matrix),
    /// The Kalman filter's `μ` is its own state, restored with it.
    Filter,
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Records (see [`grng::checkpoint::impls`] for the parts' own):
///
/// | record      | content                                                              |
/// |-------------|----------------------------------------------------------------------|
/// | `kind`      | `"trainer"`                                                          |
/// | `method`    | [`Method::key`]                                                      |
/// | `config`    | the [`MethodConfig`] (`Debug` form; must equal the loading trainer's) |
/// | `steps`     | applied steps, u64                                                   |
/// | `counters.*`| the trainer-owned [`TrainerCounters`] (u64 each)                      |
/// | `mlp.*`     | the network ([`Mlp`])                                                 |
/// | `optim.*`   | the method's optimizer                                               |
/// | `rng.*`     | the sampled-label stream ([`ChaCha8Rng`])                            |
///
/// `load` checks the tag, the method and the configuration, rebuilds the device copy of the
/// parameters from the stored network (per layer for the Kronecker methods, flat for the
/// first-order ones; for the Kalman methods the stored network
/// must equal the filter's `μ` bit for bit), and only then loads network, optimizer and stream all or nothing
/// ([`load_all`]) and commits: on any error the trainer is unchanged.
impl Checkpoint for Trainer {
    fn save(&self, w: &mut Writer) -> Result<()> {
        w.str("kind", "trainer")?;
        w.str("method", self.method().key())?;
        w.str("config", &format!("{:?}", self.config))?;
        w.u64("steps", self.steps)?;
        w.u64_scope("counters", &self.counters.owned())?;
        save_all(
            w,
            &[
                ("mlp", &self.mlp),
                ("optim", self.engine.optimizer()),
                ("rng", &self.rng),
            ],
        )
    }

    fn load(&mut self, r: &Reader) -> Result<()> {
        r.expect_kind("trainer")?;
        let want = self.method().key();
        let got = r.str("method")?;
        if got != want {
            return Err(Error::Checkpoint(format!(
                "`method`: the checkpoint holds a {got} trainer, this one is {want}"
            )));
        }
        let want = format!("{:?}", self.config);
        let got = r.str("config")?;
        if got != want {
            return Err(Error::Checkpoint(format!(
                "`config`: the checkpoint was trained with {got}, this trainer has {want}"
            )));
        }
        let steps = r.u64("steps")?;
        // The names `save` wrote (`TrainerCounters::owned`).
        let names = TrainerCounters::default().owned().map(|(name, _)| name);
        let [skipped_nonfinite, rejected_updates, jitter_escalations, jittered_steps, sigma_floored] =
            r.u64_scope("counters", names, &[])?;
        let counters = TrainerCounters {
            skipped_nonfinite,
            rejected_updates,
            jitter_escalations,
            jittered_steps,
            sigma_floored,
            ..TrainerCounters::default()
        };
        let n = self.mlp.num_params();
        // Unvalidated here (Mlp::load checks it below); the uploads commit nothing.
        let mlp_r = r.scope("mlp");
        let params = mlp_r.tensor("params", &[n])?;
        let device_params = match &self.engine {
            Engine::Kron { .. } => {
                DeviceParams::Layers(upload_layers(&self.device, &self.mlp, params)?)
            }
            Engine::Sgd { .. } | Engine::AdamW { .. } | Engine::Sophia { .. } => {
                DeviceParams::Flat(self.device.upload(n, 1, params)?)
            }
            Engine::Kalman { .. } => {
                let optim_r = r.scope("optim");
                let mu = optim_r.tensor("mu", &[n])?;
                if !bits_equal(mu, params) {
                    return Err(Error::Checkpoint(
                        "`mlp.params` and `optim.mu` differ: the network and the Kalman \
                         filter's mean must be the same parameters"
                            .into(),
                    ));
                }
                DeviceParams::Filter
            }
        };
        let Self {
            mlp, engine, rng, ..
        } = self;
        load_all(
            r,
            &mut [
                ("mlp", mlp),
                ("optim", engine.optimizer_mut()),
                ("rng", rng),
            ],
        )?;
        // Built from the same engine above: the variants correspond (the Kalman filter's μ
        // was restored with it).
        match (engine, device_params) {
            (Engine::Kron { params, .. }, DeviceParams::Layers(p)) => *params = p,
            (
                Engine::Sgd { params, .. }
                | Engine::AdamW { params, .. }
                | Engine::Sophia { params, .. },
                DeviceParams::Flat(p),
            ) => *params = p,
            _ => {}
        }
        self.steps = steps;
        self.counters = counters;
        Ok(())
    }
}
