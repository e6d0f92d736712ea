//! [`GrngOptimizer`]: grng's optimizers behind `candle_nn::Optimizer`, with parameter groups.

use super::buffer::{from_candle, to_candle};
use super::layer::{output_jacobian, KronLinear};
use super::view::{check_same_device, grng_device, owned, storage_addr, with_matrices, ViewAs};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use grng::error::{Error, Result};
use grng::ops::kalman::KalmanInfo;
use grng::optim::adamw::{AdamW, AdamWConfig};
use grng::optim::kalman::{RKalman, RKalmanConfig};
use grng::optim::kron::{KronConfig, KronGrad, KronOptimizer, KronStepInfo, KronVariant};
use grng::optim::sgd::Sgd;
use grng::optim::sophia::{Sophia, SophiaHessians};
use grng::optim::KronStats;
use grng::optim::OptimizerConfig;
use grng::{Device, Matrix};

/// What [`GrngOptimizer`] runs, and on what.
#[derive(Clone, Debug)]
pub struct GrngConfig {
    /// The method: [`OptimizerConfig::Kron`] (RING, RENG, NGD by its variant),
    /// [`OptimizerConfig::AdamW`], [`OptimizerConfig::Sgd`], [`OptimizerConfig::Sophia`], or
    /// [`OptimizerConfig::Kalman`] (R-Kalman, Kalman) when every variable is a [`KronLinear`]
    /// weight: the filters update from the output Jacobian `H = ∂ŷ/∂θ`, which
    /// [`output_jacobian`](crate::output_jacobian) forms from the layers' recorded inputs
    /// and probes (step with [`GrngOptimizer::step_kalman`]).
    pub method: OptimizerConfig,
    /// AdamW for the variables that are not [`KronLinear`] weights (Kronecker methods only:
    /// norms, embeddings, free biases).
    pub rest: AdamWConfig,
    /// The Kronecker-preconditioned layers (clones of the model's). With a first-order method
    /// their weights are plain variables.
    pub layers: Vec<KronLinear>,
}

/// What [`GrngOptimizer::step_observed`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Observed {
    /// The step stands; `after` is the loss after it (Kronecker methods).
    Applied {
        /// Loss on the batch after the step, when it was evaluated.
        after: Option<f32>,
    },
    /// The step overflowed or made the loss non-finite: nothing changed but the damping,
    /// which rose.
    Rejected,
}

/// The index of `t` in `ts`, appending it unless a tensor of the same storage is there
/// already at or after `from` ([`with_matrices`] lends each storage once; the read-only
/// operands after `from` may share one, as two adapters fed the same input do).
fn lend_once<'t>(ts: &mut Vec<&'t Tensor>, t: &'t Tensor, from: usize) -> usize {
    let addr = storage_addr(t);
    match ts[from..]
        .iter()
        .position(|u| addr.is_some() && storage_addr(u) == addr)
    {
        Some(i) => from + i,
        None => {
            ts.push(t);
            ts.len() - 1
        }
    }
}

/// R-Kalman or Kalman over the weights of the Kronecker layers, flattened layer after layer
/// (the columns of [`output_jacobian`]'s `H`). The filter is made at the first step, when the
/// observation's size `d_o = n·C` is known; its mean `μ` is the parameters, written back to
/// the layers' variables after every step.
struct KalmanArm {
    config: RKalmanConfig,
    filter: Option<RKalman>,
    layers: Vec<KronLinear>,
}

/// The first-order optimizer of the variables that are not `KronLinear` weights: one
/// multi-tensor optimizer over all of them (each seen as a column), so a step is one device op.
enum Flat {
    AdamW(AdamW),
    Sgd(Sgd),
    Sophia(Sophia),
}

/// grng's optimizers on candle variables (CPU tensors): with a Kronecker method the
/// [`KronLinear`] weights `W̄_l` are updated by one [`KronOptimizer`] (statistics from
/// [`capture_fisher`](super::capture_fisher) on refresh steps, see
/// [`GrngOptimizer::needs_fisher`]) and every other variable by AdamW; first-order methods
/// update every variable. Variables are updated in place (see [`with_matrices`]).
///
/// Gradients come from candle's [`GradStore`] (the mean loss's, as grng expects). RENG: the
/// gradient passed is used as is: form `g + 2c·H_L g` first with
/// [`GrngOptimizer::regularize`] (central differences: candle has no Hessian-vector product). The Levenberg–Marquardt damping moves only when the
/// loss after a step is reported ([`GrngOptimizer::observe_loss`]).
pub struct GrngOptimizer {
    device: Device,
    kron: Option<(KronOptimizer, Vec<KronLinear>)>,
    kalman: Option<KalmanArm>,
    /// `None` when every variable is a `KronLinear` weight.
    flat: Option<(Flat, Vec<Var>)>,
    rest: AdamWConfig,
    method: OptimizerConfig,
    /// Sophia's Hessian sample: per variable, the sampled-label gradient, and the batch size.
    sophia_sample: Option<(Vec<Option<Tensor>>, usize)>,
    /// Kronecker layers take their gradient by its batch factors when `grads` has them
    /// ([`GrngOptimizer::set_factored_gradients`]).
    factored: bool,
}

impl std::fmt::Debug for GrngOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrngOptimizer")
            .field("method", &self.method)
            .field("kron_layers", &self.kron.as_ref().map(|(_, l)| l.len()))
            .field("flat_vars", &self.flat.as_ref().map_or(0, |(_, v)| v.len()))
            .finish()
    }
}

impl GrngOptimizer {
    /// The optimizer for `vars` (the model's trainable variables; `KronLinear` weights among
    /// them are recognised by identity).
    ///
    /// # Errors
    /// [`Error::Value`] for a Kalman method or an invalid hyperparameter;
    /// [`Error::DeviceUnavailable`] for variables on a device grng does not view (see
    /// [`grng_device`](super::grng_device)); [`Error::DeviceMismatch`] for variables on
    /// different devices; [`Error::Tensor`] / [`Error::Shape`] for variables grng cannot view
    /// (non-f32, empty).
    pub fn try_new(vars: Vec<Var>, config: GrngConfig) -> Result<Self> {
        const OP: &str = "GrngOptimizer::new";
        let all: Vec<&Tensor> = vars
            .iter()
            .chain(config.layers.iter().map(KronLinear::weight))
            .map(|v| v.as_tensor())
            .collect();
        check_same_device(OP, &all)?;
        let device = match all.first() {
            Some(v) => grng_device(v.device())?,
            None => Device::Cpu,
        };
        let kron_ids: Vec<_> = config.layers.iter().map(|l| l.weight().id()).collect();
        let mut kalman = None;
        let (kron, flat_vars): (_, Vec<Var>) = match config.method {
            OptimizerConfig::Kron(k) => {
                let shapes: Vec<_> = config.layers.iter().map(KronLinear::shape).collect();
                let kron = (!shapes.is_empty())
                    .then(|| KronOptimizer::new(&device, &shapes, k))
                    .transpose()?
                    .map(|o| (o, config.layers.clone()));
                let rest = vars.into_iter().filter(|v| !kron_ids.contains(&v.id()));
                (kron, rest.collect())
            }
            OptimizerConfig::Kalman(c) => {
                c.validate()?;
                if config.layers.is_empty() || vars.iter().any(|v| !kron_ids.contains(&v.id())) {
                    return Err(Error::Value {
                        op: OP,
                        arg: "vars",
                        value: vars.len() as f64,
                        expected: "KronLinear weights only, at least one (the Kalman filters' \
                                   Jacobian comes from the layers' recorded passes)",
                    });
                }
                kalman = Some(KalmanArm {
                    config: c,
                    filter: None,
                    layers: config.layers.clone(),
                });
                (None, Vec::new())
            }
            _ => (None, vars),
        };
        let shapes = flat_vars
            .iter()
            .map(|v| {
                // Refuse now what could not be viewed at the first step.
                super::view::with_matrix(v, ViewAs::Column, |_| Ok(()))?;
                Ok((v.elem_count(), 1))
            })
            .collect::<Result<Vec<_>>>()?;
        let flat = if flat_vars.is_empty() {
            None
        } else {
            let opt = match config.method {
                OptimizerConfig::Sgd(c) => Flat::Sgd(Sgd::for_tensors(&device, &shapes, c)?),
                OptimizerConfig::Sophia(c) => {
                    Flat::Sophia(Sophia::for_tensors(&device, &shapes, c)?)
                }
                OptimizerConfig::AdamW(c) => Flat::AdamW(AdamW::for_tensors(&device, &shapes, c)?),
                _ => Flat::AdamW(AdamW::for_tensors(&device, &shapes, config.rest)?),
            };
            Some((opt, flat_vars))
        };
        Ok(Self {
            device,
            kron,
            kalman,
            flat,
            rest: config.rest,
            method: config.method,
            sophia_sample: None,
            factored: false,
        })
    }

    /// Whether RING and NGD take each [`KronLinear`]'s gradient by its batch factors
    /// ([`KronLinear::gradient_factors`]: `∂L/∂W̄ = (1/n)·eᵀa` from the layer's recorded
    /// inputs and its output probe's gradient) instead of the dense gradient: the step then
    /// preconditions `(1/n)(Γ̃⁻¹eᵀ)(aΛ̃⁻¹)` and forms the model's terms from `n x n` products
    /// where that costs fewer flops ([`grng::optim::kron::KronGrad`]; about 2.7x fewer for a
    /// `1024 x 1025` layer at `n = 256`), as grng's own trainer does. Off by default.
    ///
    /// On, every `grads` passed to a step must be ONE backward pass of a loss on the layers'
    /// last recorded forward pass — not gradients accumulated over several passes, which the
    /// recorded factors do not give. A layer without factors in `grads` (its probe has no
    /// gradient there, or it recorded more than one forward pass since the last step: see
    /// [`KronLinear::gradient_factors`]) takes its dense gradient; the dense gradients are
    /// still required and checked.
    ///
    /// # Errors
    /// [`Error::Value`] when turning it on for a method other than RING or NGD (RENG's
    /// gradient `g + 2c·H_L g` has no such factors; first-order methods precondition nothing).
    pub fn set_factored_gradients(&mut self, on: bool) -> Result<()> {
        let ok = matches!(
            self.method,
            OptimizerConfig::Kron(KronConfig {
                variant: KronVariant::Ring | KronVariant::Ngd,
                ..
            })
        );
        if on && !ok {
            return Err(Error::Value {
                op: "GrngOptimizer::set_factored_gradients",
                arg: "on",
                value: 1.0,
                expected: "RING or NGD (the methods whose gradient is the batch's E^T A / n)",
            });
        }
        self.factored = on;
        Ok(())
    }

    /// True for R-Kalman and Kalman, which step with [`GrngOptimizer::step_kalman`].
    pub fn is_kalman(&self) -> bool {
        self.kalman.is_some()
    }

    /// True when the coming step refreshes the Kronecker factors: run
    /// [`capture_fisher`](super::capture_fisher) on this batch before [`GrngOptimizer::try_step`].
    pub fn needs_fisher(&self) -> bool {
        self.kron.as_ref().is_some_and(|(o, _)| o.needs_stats())
    }

    /// True when the coming step refreshes Sophia's Hessian estimate: pass the gradients of
    /// the loss on labels sampled from the model with [`GrngOptimizer::set_sophia_sample`].
    pub fn needs_sophia_sample(&self) -> bool {
        matches!(&self.flat, Some((Flat::Sophia(s), _)) if s.needs_hessian())
    }

    /// Sophia-G's Hessian sample for the next step: `grads` of the mean loss over `batch`
    /// samples with labels drawn from the model's predictive distribution.
    pub fn set_sophia_sample(&mut self, grads: &GradStore, batch: usize) {
        let per_var = self
            .flat_vars()
            .map(|v| grads.get(v.as_tensor()).cloned())
            .collect();
        self.sophia_sample = Some((per_var, batch));
    }

    /// The damping `ρ` of the Kronecker optimizer.
    pub fn rho(&self) -> Option<f32> {
        self.kron.as_ref().map(|(o, _)| o.rho())
    }

    /// The Kronecker optimizer, for its counters and state.
    pub fn kron(&self) -> Option<&KronOptimizer> {
        self.kron.as_ref().map(|(o, _)| o)
    }

    /// Levenberg–Marquardt update from the loss on the step's batch before and after it
    /// ([`KronOptimizer::observe_loss`]); a no-op for first-order methods.
    ///
    /// # Errors
    /// As [`KronOptimizer::observe_loss`].
    pub fn observe_loss(&mut self, before: f32, after: f32) -> Result<()> {
        match &mut self.kron {
            Some((o, _)) => o.observe_loss(before, after),
            None => Ok(()),
        }
    }

    /// Raises the damping after a step that had to be rejected ([`KronOptimizer::reject_step`]).
    pub fn reject_step(&mut self) {
        if let Some((o, _)) = &mut self.kron {
            o.reject_step();
        }
    }

    /// One step from the gradients in `grads`. The variables that are not `KronLinear` weights
    /// are stepped together, in one device op: they must all have a gradient, or none (then
    /// they are left alone, as candle's optimizers leave a variable without one). Returns the
    /// Kronecker step's report for Kronecker methods.
    ///
    /// # Errors
    /// [`Error::Value`] for a missing `KronLinear` gradient, gradients for only some of the
    /// other variables, missing Fisher statistics when [`GrngOptimizer::needs_fisher`], or a
    /// missing Sophia sample; [`Error::NonFinite`] for NaN/Inf gradients or parameters;
    /// [`Error::Tensor`] / [`Error::Shape`] for tensors grng cannot view; the errors of the
    /// grng optimizers ([`Error::NonFiniteTensor`] for a first-order update that overflows,
    /// naming the variable's index among the non-`KronLinear` ones). Every gradient is
    /// checked before any variable changes, so on these errors nothing changes (but for a
    /// first-order update that overflows after the Kronecker step ran).
    pub fn try_step(&mut self, grads: &GradStore) -> Result<Option<KronStepInfo>> {
        const OP: &str = "GrngOptimizer::step";
        if self.kalman.is_some() {
            return Err(Error::Value {
                op: OP,
                arg: "method",
                value: 0.0,
                expected: "a gradient method (Kalman filters step with step_kalman)",
            });
        }
        let dev = self.device.clone();
        let finite = |arg: &'static str, t: &Tensor| -> Result<Tensor> {
            let t = owned(t)?;
            super::view::with_matrix(&t, ViewAs::Column, |m| dev.check_finite(OP, arg, m))?;
            Ok(t)
        };
        let missing = |arg: &'static str, what: &'static str| Error::Value {
            op: OP,
            arg,
            value: 0.0,
            expected: what,
        };
        // Gather and check everything first.
        let kron_in = match &self.kron {
            Some((opt, layers)) => {
                let gs = layers
                    .iter()
                    .map(|l| match grads.get(l.weight().as_tensor()) {
                        Some(g) => finite("KronLinear gradient", g),
                        None => Err(missing("grads", "a gradient for every KronLinear")),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let stats = if opt.needs_stats() {
                    let s = layers
                        .iter()
                        .map(KronLinear::fisher_stats)
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| {
                            missing("fisher", "capture_fisher on this batch (needs_fisher())")
                        })?;
                    Some(s)
                } else {
                    None
                };
                // Checked by the Kronecker step itself (`grads.e`, `grads.a`) before anything
                // changes.
                let factors = layers
                    .iter()
                    .map(|l| {
                        if self.factored {
                            l.gradient_factors(grads)
                        } else {
                            Ok(None)
                        }
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some((gs, stats, factors))
            }
            None => None,
        };
        let flat_in = self
            .flat_vars()
            .map(|v| {
                grads
                    .get(v.as_tensor())
                    .map(|g| finite("gradient", g))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        // All or none: one multi-tensor step has a gradient for every tensor.
        let flat_in: Option<Vec<Tensor>> =
            match flat_in.iter().filter(|g| g.is_some()).count() {
                0 => None,
                k if k == flat_in.len() => Some(flat_in.into_iter().flatten().collect()),
                _ => return Err(missing(
                    "grads",
                    "a gradient for every variable that is not a KronLinear weight, or for none",
                )),
            };
        let sample = if self.needs_sophia_sample() {
            let (per_var, batch) = self.sophia_sample.as_ref().ok_or_else(|| {
                missing("sophia sample", "set_sophia_sample (needs_sophia_sample())")
            })?;
            let s = per_var
                .iter()
                .map(|g| match g {
                    Some(g) => finite("Sophia sample", g),
                    None => Err(missing(
                        "sophia sample",
                        "a sample gradient for every variable",
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            Some((s, *batch))
        } else {
            None
        };

        let mut info = None;
        if let (Some((opt, layers)), Some((gs, stats, factors))) = (&mut self.kron, kron_in) {
            let l = layers.len();
            let mut ts: Vec<&Tensor> = layers.iter().map(|k| k.weight().as_tensor()).collect();
            ts.extend(gs.iter());
            // The statistics and factors by index into `ts`, each storage lent once: layers
            // fed the same input (a LoRA layer's query and value adapters) record one
            // storage, and a layer's factor `a` is often its statistics' own tensor.
            let from = 2 * l;
            let si: Option<Vec<(usize, usize)>> = stats.as_ref().map(|s| {
                s.iter()
                    .map(|(a, e)| (lend_once(&mut ts, a, from), lend_once(&mut ts, e, from)))
                    .collect()
            });
            let mut fi: Vec<Option<(usize, usize)>> = Vec::with_capacity(l);
            for f in &factors {
                fi.push(
                    f.as_ref()
                        .map(|(e, a)| (lend_once(&mut ts, e, from), lend_once(&mut ts, a, from))),
                );
            }
            info = Some(with_matrices(&ts, ViewAs::Matrix, |ms| {
                let (w, rest) = ms.split_at_mut(l);
                let kg: Vec<KronGrad<'_>> = (0..l)
                    .map(|i| match fi[i] {
                        Some((e, a)) => KronGrad::Factored {
                            e: &rest[e - l],
                            a: &rest[a - l],
                        },
                        None => KronGrad::Dense(&rest[i]),
                    })
                    .collect();
                let st: Option<Vec<KronStats<'_>>> = si.as_ref().map(|si| {
                    si.iter()
                        .map(|&(a, e)| KronStats {
                            a: &rest[a - l],
                            e: &rest[e - l],
                        })
                        .collect()
                });
                opt.step_grads(w, &kg, st.as_deref())
            })?);
            layers.iter().for_each(KronLinear::end_step);
        }
        if let (Some((opt, vars)), Some(gs)) = (&mut self.flat, &flat_in) {
            let k = vars.len();
            let mut ts: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
            ts.extend(gs.iter());
            if let Some((s, _)) = &sample {
                ts.extend(s.iter());
            }
            with_matrices(&ts, ViewAs::Column, |ms| {
                let (p, rest) = ms.split_at_mut(k);
                let mut p: Vec<&mut Matrix> = p.iter_mut().collect();
                let g: Vec<&Matrix> = rest[..k].iter().collect();
                let s: Vec<&Matrix> = rest[k..].iter().collect();
                match opt {
                    Flat::AdamW(o) => o.step_many(&mut p, &g),
                    Flat::Sgd(o) => o.step_many(&mut p, &g),
                    Flat::Sophia(o) => {
                        let hess = sample.as_ref().map(|&(_, batch)| SophiaHessians {
                            sampled_grads: &s,
                            batch,
                        });
                        o.step_many(&mut p, &g, hess)
                    }
                }
            })?;
        }
        if sample.is_some() {
            self.sophia_sample = None;
        }
        Ok(info)
    }

    /// One R-Kalman / Kalman step (docs/math.md §3) on the batch whose recorded forward pass
    /// produced `logits` (`n x C`, softmax classifier) with the data `labels`: the
    /// observation is the one-hot labels against `ŷ = softmax(z)`, `d_o = n·C`, with the
    /// Jacobian of [`output_jacobian`](crate::output_jacobian). The filter is made at the
    /// first step from the layers' current weights; `n` is fixed from then on (the
    /// observation noise `R` is `d_o x d_o`). The layers' variables are set to the filter's
    /// mean afterwards.
    ///
    /// # Errors
    /// [`Error::Value`] when the method is not a Kalman filter, or for a label `≥ C`;
    /// [`Error::Shape`] for `labels` not `n` long or an `n` other than the first step's;
    /// those of [`output_jacobian`](crate::output_jacobian) and [`RKalman::step`]. On error
    /// nothing changes.
    pub fn step_kalman(&mut self, logits: &Tensor, labels: &[u32]) -> Result<KalmanInfo> {
        const OP: &str = "GrngOptimizer::step_kalman";
        let dev = self.device.clone();
        let Some(arm) = &mut self.kalman else {
            return Err(Error::Value {
                op: OP,
                arg: "method",
                value: 0.0,
                expected: "OptimizerConfig::Kalman (gradient methods step with try_step)",
            });
        };
        let jac = output_jacobian(&arm.layers, logits)?;
        let d_o = jac.probs.len();
        let (n, c) = logits.dims2().map_err(from_candle)?;
        grng::error::check_len(OP, "labels", labels.len(), n)?;
        if let Some(&bad) = labels.iter().find(|&&y| y as usize >= c) {
            grng::error::check_value(OP, "labels", bad as f64, false, "labels < C")?;
        }
        let mut innovation: Vec<f32> = jac.probs.iter().map(|p| -p).collect();
        for (k, &y) in labels.iter().enumerate() {
            innovation[k * c + y as usize] += 1.0;
        }
        let innovation = dev.upload(d_o, 1, &innovation)?;
        let filter = match &mut arm.filter {
            Some(f) => f,
            None => {
                let mut mu0 = Vec::new();
                for l in &arm.layers {
                    let w = l.weight().as_tensor();
                    mu0.extend(
                        w.flatten_all()
                            .and_then(|w| w.to_vec1::<f32>())
                            .map_err(from_candle)?,
                    );
                }
                arm.filter
                    .insert(RKalman::new(&dev, &mu0, d_o, arm.config)?)
            }
        };
        grng::error::check_shape(OP, "logits (n·C)", (d_o, 1), (filter.d_o(), 1))?;
        let info =
            super::view::with_matrix(&jac.h, ViewAs::Matrix, |h| filter.step(h, &innovation))?;
        let mu = filter.params().to_vec()?;
        let mut at = 0;
        for l in &arm.layers {
            let w = l.weight();
            let len = w.elem_count();
            let t = Tensor::from_slice(&mu[at..at + len], w.dims(), w.device());
            t.and_then(|t| w.set(&t)).map_err(from_candle)?;
            at += len;
        }
        arm.layers.iter().for_each(KronLinear::end_step);
        Ok(info)
    }

    /// RENG's coefficient `c` ([`KronConfig::grad_reg`](grng::optim::kron::KronConfig)); 0
    /// for every other method.
    pub fn grad_reg(&self) -> f32 {
        match self.method {
            OptimizerConfig::Kron(k) => k.grad_reg,
            _ => 0.0,
        }
    }

    /// RENG's gradient (docs/math.md §2): replaces each variable's gradient `g` in `grads` by
    /// `g + 2c·H_L g` with `c =` [`GrngOptimizer::grad_reg`] (nothing to do when it is 0).
    /// candle has no Hessian-vector product, so `H_L g` is a central difference of gradients,
    /// `(∇L(θ + εg) − ∇L(θ − εg)) / 2ε` with `ε = 10⁻²/‖g‖` (a parameter move of norm 10⁻²):
    /// `grads_at` must return the gradients of the same batch's loss at the variables' current
    /// values; it is called twice, and the variables are restored exactly afterwards.
    ///
    /// # Errors
    /// [`Error::NonFinite`] for a non-finite gradient norm; [`Error::Value`] when `grads_at`
    /// leaves out a variable; those of `grads_at`. The variables are restored in every case;
    /// `grads` changes only on success.
    pub fn regularize(
        &self,
        grads: &mut GradStore,
        mut grads_at: impl FnMut() -> Result<GradStore>,
    ) -> Result<()> {
        const OP: &str = "GrngOptimizer::regularize";
        let c = self.grad_reg();
        if c == 0.0 {
            return Ok(());
        }
        let with_grad: Vec<(Var, Tensor)> = self
            .vars()
            .filter_map(|v| grads.get(v.as_tensor()).map(|g| (v.clone(), g.clone())))
            .collect();
        let mut sq = 0.0f64;
        for (_, g) in &with_grad {
            let g_sq = || g.sqr()?.sum_all()?.to_scalar::<f32>();
            sq += g_sq().map_err(from_candle)? as f64;
        }
        let norm = sq.sqrt();
        grng::error::check_finite(OP, "‖g‖", &[norm as f32])?;
        if norm == 0.0 {
            return Ok(());
        }
        let eps = 1e-2 / norm;
        let saved = with_grad
            .iter()
            .map(|(v, _)| v.as_tensor().copy())
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(from_candle)?;
        let mut shifted = |sign: f64| -> Result<GradStore> {
            for ((v, g), w) in with_grad.iter().zip(&saved) {
                let step = || v.set(&(w + (g * (sign * eps))?)?);
                step().map_err(from_candle)?;
            }
            grads_at()
        };
        let pair = shifted(1.0).and_then(|plus| Ok((plus, shifted(-1.0)?)));
        for ((v, _), w) in with_grad.iter().zip(&saved) {
            v.set(w).map_err(from_candle)?;
        }
        let (plus, minus) = pair?;
        let mut updated = Vec::with_capacity(with_grad.len());
        for (v, g) in &with_grad {
            let (Some(p), Some(m)) = (plus.get(v.as_tensor()), minus.get(v.as_tensor())) else {
                return Err(Error::Value {
                    op: OP,
                    arg: "grads_at",
                    value: 0.0,
                    expected: "gradients for every variable that has one in `grads`",
                });
            };
            // g + 2c·(p − m)/(2ε) = g + (c/ε)·(p − m)
            let regularized = || g + ((p - m)? * (c as f64 / eps))?;
            updated.push((v, regularized().map_err(from_candle)?));
        }
        for (v, g) in updated {
            grads.insert(v.as_tensor(), g);
        }
        Ok(())
    }

    /// [`GrngOptimizer::try_step`] as the reference trainer takes it: for a Kronecker method,
    /// an overflowing step is rejected (damping raised, nothing changed), the loss on the same
    /// batch after the step (`loss_after`, called once) feeds the Levenberg–Marquardt rule
    /// with `before`, and a step after which that loss is not finite is undone (every variable
    /// restored; AdamW's moments keep the step) and counted as rejected. First-order methods,
    /// and Kronecker steps that form no model ([`KronOptimizer::adapts_damping`]), just step
    /// (`loss_after` is not called).
    ///
    /// # Errors
    /// As [`GrngOptimizer::try_step`] other than overflow, and those of `loss_after`.
    pub fn step_observed(
        &mut self,
        grads: &GradStore,
        before: f32,
        loss_after: impl FnOnce() -> Result<f32>,
    ) -> Result<Observed> {
        let Some(adapts) = self.kron.as_ref().map(|(o, _)| o.adapts_damping()) else {
            self.try_step(grads)?;
            return Ok(Observed::Applied { after: None });
        };
        // Only a step that forms the model reads the loss after it, and only such a step
        // can be undone: the variables are saved for those alone.
        let saved = if adapts {
            let vars: Vec<Var> = self.vars().cloned().collect();
            let copies = vars
                .iter()
                .map(|v| v.as_tensor().copy())
                .collect::<candle_core::Result<Vec<_>>>()
                .map_err(from_candle)?;
            Some((vars, copies))
        } else {
            None
        };
        match self.try_step(grads) {
            Ok(_) => {}
            Err(Error::NonFinite { .. } | Error::NonFiniteTensor { .. }) => {
                self.reject_step();
                return Ok(Observed::Rejected);
            }
            Err(e) => return Err(e),
        }
        let Some((vars, saved)) = saved else {
            return Ok(Observed::Applied { after: None });
        };
        let after = loss_after()?;
        self.observe_loss(before, after)?;
        if after.is_finite() {
            return Ok(Observed::Applied { after: Some(after) });
        }
        for (v, t) in vars.iter().zip(&saved) {
            v.set(t).map_err(from_candle)?;
        }
        Ok(Observed::Rejected)
    }

    /// Every variable this optimizer updates.
    fn vars(&self) -> impl Iterator<Item = &Var> {
        let kron = self
            .kron
            .iter()
            .flat_map(|(_, l)| l.iter().map(KronLinear::weight));
        kron.chain(self.flat_vars())
    }

    /// The variables of the first-order optimizer, in its tensor order.
    fn flat_vars(&self) -> impl Iterator<Item = &Var> {
        self.flat.iter().flat_map(|(_, vars)| vars.iter())
    }

    /// The learning rate of the method (Kronecker methods: `α` before the `1/L` scaling).
    fn lr(&self) -> f64 {
        match self.method {
            OptimizerConfig::Kron(k) => k.lr as f64,
            OptimizerConfig::AdamW(c) => c.lr as f64,
            OptimizerConfig::Sgd(c) => c.lr as f64,
            OptimizerConfig::Sophia(c) => c.lr as f64,
            OptimizerConfig::Kalman(_) => self.rest.lr as f64,
        }
    }
}

impl candle_nn::Optimizer for GrngOptimizer {
    type Config = GrngConfig;

    fn new(vars: Vec<Var>, config: GrngConfig) -> candle_core::Result<Self> {
        Self::try_new(vars, config).map_err(to_candle)
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.try_step(grads).map(|_| ()).map_err(to_candle)
    }

    fn learning_rate(&self) -> f64 {
        self.lr()
    }

    /// Sets the first-order optimizers' rate (out-of-range values are ignored, the trait
    /// cannot report them). A Kronecker optimizer's `α` is fixed at construction.
    fn set_learning_rate(&mut self, lr: f64) {
        if let Some((f, _)) = &mut self.flat {
            let _ = match f {
                Flat::AdamW(o) => o.set_config(AdamWConfig {
                    lr: lr as f32,
                    ..*o.config()
                }),
                Flat::Sgd(o) => {
                    let c = *o.config();
                    o.set_config(grng::optim::sgd::SgdConfig { lr: lr as f32, ..c })
                }
                Flat::Sophia(o) => {
                    let c = *o.config();
                    o.set_config(grng::optim::sophia::SophiaConfig { lr: lr as f32, ..c })
                }
            };
        }
        match &mut self.method {
            OptimizerConfig::AdamW(c) => c.lr = lr as f32,
            OptimizerConfig::Sgd(c) => c.lr = lr as f32,
            OptimizerConfig::Sophia(c) => c.lr = lr as f32,
            _ => self.rest.lr = lr as f32,
        }
    }
}
