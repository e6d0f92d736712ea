//! [`Trainer`]: one method driving the reference MLP, one uniform [`Trainer::step`].

use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::device::{Device, Matrix};
use crate::error::{check_len, Error, Result};
use crate::mat::MatRef;
use crate::mlp::{Loss, Mlp, Targets};
use crate::optim::adamw::AdamW;
use crate::optim::kalman::RKalman;
use crate::optim::kron::KronOptimizer;
use crate::optim::sgd::Sgd;
use crate::optim::sophia::{Sophia, SophiaHessian};
use crate::optim::KronStats;

use super::hyper::{MethodConfig, OptimizerConfig};
use super::Method;

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
    /// 1-based index of this step.
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
    /// The damping `ρ` after the step (Kronecker methods).
    pub rho: Option<f32>,
    /// Wall time of the whole step: forward, backward, statistics, transfers, update and the
    /// loss-after evaluation.
    pub time: Duration,
}

/// The optimizer of a method together with the parameters it owns on the device.
#[derive(Debug)]
enum Engine {
    /// Per-layer `W̄_l` on the device, `d_out x (d_in + 1)`.
    Kron {
        opt: Box<KronOptimizer>,
        params: Vec<Matrix>,
    },
    Sgd {
        opt: Sgd,
        params: Matrix,
    },
    AdamW {
        opt: AdamW,
        params: Matrix,
    },
    Sophia {
        opt: Sophia,
        params: Matrix,
    },
    /// The filter's mean `μ` is the parameter vector.
    Kalman {
        filter: Box<RKalman>,
    },
}

/// Trains an [`Mlp`] with one method.
///
/// The device holds the optimizer state and its copy of the parameters; the MLP (host, CPU)
/// runs the forward/backward passes and is synchronized from the device after every update.
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
        crate::error::check_value(
            OP,
            "batch_size",
            config.batch_size as f64,
            config.batch_size >= 1,
            "batch_size >= 1",
        )?;
        let n = mlp.num_params();
        let upload_flat = || device.upload(n, 1, mlp.params());
        let engine = match (config.method, config.optimizer) {
            (Method::Ring | Method::Reng | Method::Ngd, OptimizerConfig::Kron(c)) => {
                let shapes = mlp.layer_shapes();
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
                }
            }
            (Method::Sgd, OptimizerConfig::Sgd(c)) => Engine::Sgd {
                opt: Sgd::new(device, n, c)?,
                params: upload_flat()?,
            },
            (Method::AdamW, OptimizerConfig::AdamW(c)) => Engine::AdamW {
                opt: AdamW::new(device, n, c)?,
                params: upload_flat()?,
            },
            (Method::Sophia, OptimizerConfig::Sophia(c)) => Engine::Sophia {
                opt: Sophia::new(device, n, c)?,
                params: upload_flat()?,
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
            steps: 0,
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
    /// Completed steps.
    pub fn steps(&self) -> u64 {
        self.steps
    }
    /// The trainer's random stream (sampled labels); part of the state a checkpoint saves.
    pub fn rng(&self) -> &ChaCha8Rng {
        &self.rng
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
    /// # Errors
    /// [`Error::Shape`]/[`Error::Value`] for a batch that does not fit the network (or a
    /// Kalman batch of the wrong size); [`Error::NonFinite`] when the parameters or the
    /// loss become non-finite; optimizer and device errors. On error nothing is updated
    /// unless the optimizer itself already stepped (then the network is re-synchronized).
    pub fn step(&mut self, batch: Batch<'_>) -> Result<StepReport> {
        const OP: &str = "Trainer::step";
        let start = Instant::now();
        let m = batch.x.rows();
        if self.method().is_kalman() {
            check_len(OP, "batch.x rows", m, self.config.batch_size)?;
        }
        let fisher = self.config.fisher;
        let device = &self.device;
        let mlp = &mut self.mlp;
        let rng = &mut self.rng;
        let mut loss_after = None;
        let mut rho = None;
        let (loss, grad_norm, refreshed) = match &mut self.engine {
            Engine::Kron { opt, params } => {
                let refresh = opt.needs_stats();
                let (loss, grad) = if self.config.method == Method::Reng {
                    let c = match self.config.optimizer {
                        OptimizerConfig::Kron(k) => k.grad_reg,
                        _ => 0.0,
                    };
                    mlp.regularized_gradient(batch.x, batch.targets, c)?
                } else {
                    let fwd = mlp.forward(batch.x)?;
                    let b = mlp.backward(&fwd, batch.targets)?;
                    (b.loss, b.grad)
                };
                check_finite_loss(OP, loss)?;
                let grads = upload_layers(device, mlp, &grad)?;
                let stats = if refresh {
                    let fwd = mlp.forward(batch.x)?;
                    let layers = mlp.fisher_stats(&fwd, fisher, batch.targets, rng)?;
                    let mats = layers
                        .iter()
                        .map(|s| {
                            Ok((
                                device.upload(s.a.rows(), s.a.cols(), s.a.as_slice())?,
                                device.upload(s.e.rows(), s.e.cols(), s.e.as_slice())?,
                            ))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Some(mats)
                } else {
                    None
                };
                let kron: Option<Vec<KronStats<'_>>> = stats
                    .as_ref()
                    .map(|v| v.iter().map(|(a, e)| KronStats { a, e }).collect());
                let grad_refs: Vec<&Matrix> = grads.iter().collect();
                opt.step(params, &grad_refs, kron.as_deref())?;
                sync_layers(mlp, params)?;
                // The LM rule compares plain losses, also for RENG (its regularized loss
                // would need a second backward pass after the step). A non-finite `after`
                // raises ρ there.
                let after = mlp.evaluate(batch.x, batch.targets)?;
                opt.observe_loss(loss, after)?;
                loss_after = Some(after);
                rho = Some(opt.rho());
                (loss, norm(&grad), refresh)
            }
            Engine::Sgd { opt, params } => {
                let (loss, grad) = plain_gradient(mlp, batch)?;
                check_finite_loss(OP, loss)?;
                let g = device.upload(grad.len(), 1, &grad)?;
                opt.step(params, &g)?;
                sync_flat(mlp, params)?;
                (loss, norm(&grad), false)
            }
            Engine::AdamW { opt, params } => {
                let (loss, grad) = plain_gradient(mlp, batch)?;
                check_finite_loss(OP, loss)?;
                let g = device.upload(grad.len(), 1, &grad)?;
                opt.step(params, &g)?;
                sync_flat(mlp, params)?;
                (loss, norm(&grad), false)
            }
            Engine::Sophia { opt, params } => {
                let fwd = mlp.forward(batch.x)?;
                let b = mlp.backward(&fwd, batch.targets)?;
                check_finite_loss(OP, b.loss)?;
                let g = device.upload(b.grad.len(), 1, &b.grad)?;
                let refresh = opt.needs_hessian();
                let sampled = if refresh {
                    let s = mlp.backward_sampled(&fwd, rng)?;
                    Some(device.upload(s.grad.len(), 1, &s.grad)?)
                } else {
                    None
                };
                let hess = sampled.as_ref().map(|s| SophiaHessian {
                    sampled_grad: s,
                    batch: m,
                });
                opt.step(params, &g, hess)?;
                sync_flat(mlp, params)?;
                (b.loss, norm(&b.grad), refresh)
            }
            Engine::Kalman { filter } => {
                let (loss, grad) = plain_gradient(mlp, batch)?;
                check_finite_loss(OP, loss)?;
                let jac = mlp.output_jacobian(batch.x)?;
                let innovation = innovation(mlp, batch.targets, jac.y.as_slice())?;
                let h = device.upload(jac.h.rows(), jac.h.cols(), jac.h.as_slice())?;
                let v = device.upload(innovation.len(), 1, &innovation)?;
                filter.step(&h, &v)?;
                sync_flat(mlp, filter.params())?;
                (loss, norm(&grad), true)
            }
        };
        self.steps += 1;
        Ok(StepReport {
            step: self.steps,
            loss,
            loss_after,
            grad_norm,
            refreshed,
            rho,
            time: start.elapsed(),
        })
    }
}

fn check_finite_loss(op: &'static str, loss: f32) -> Result<()> {
    if loss.is_finite() {
        Ok(())
    } else {
        Err(Error::NonFinite {
            op,
            arg: "loss",
            index: 0,
            value: loss,
        })
    }
}

/// Forward and backward pass: `(mean loss, flat gradient)`.
fn plain_gradient(mlp: &Mlp, batch: Batch<'_>) -> Result<(f32, Vec<f32>)> {
    let fwd = mlp.forward(batch.x)?;
    let b = mlp.backward(&fwd, batch.targets)?;
    Ok((b.loss, b.grad))
}

/// Euclidean norm, accumulated in f64.
pub(crate) fn norm(v: &[f32]) -> f32 {
    v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt() as f32
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

/// Copies per-layer device parameters into the network.
fn sync_layers(mlp: &mut Mlp, params: &[Matrix]) -> Result<()> {
    let mut flat = Vec::with_capacity(mlp.num_params());
    for p in params {
        match p.host() {
            Some(h) => flat.extend_from_slice(h),
            None => flat.extend_from_slice(&p.to_vec()?),
        }
    }
    mlp.set_params(&flat)
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
