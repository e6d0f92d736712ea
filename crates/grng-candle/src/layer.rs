//! [`KronLinear`]: a linear layer that records what the Kronecker factors need, and
//! [`capture_fisher`], which forms the statistics in the reference trainer's Fisher modes.

use super::buffer::from_candle;
use super::view::owned;
use candle_core::{DType, Module, Tensor, Var};
use grng::error::{check_len, Error, Result};
use grng::optim::fisher::{sample_class, FisherMode};
use rand::Rng;
use std::sync::{Arc, Mutex, PoisonError};

/// What the last forward pass and [`capture_fisher`] left in a layer.
#[derive(Default)]
struct Record {
    /// `x̄` rows of the last forward pass (`n x (d_in + 1)`, detached).
    a: Option<Tensor>,
    /// Zero variable added to the output: its gradient is `∂(loss)/∂z`, the output gradient.
    probe: Option<Var>,
    /// Fisher statistics `(A, E)` captured for the next optimizer step.
    stats: Option<(Tensor, Tensor)>,
    /// Recording forward passes since the optimizer's last step ([`KronLinear::end_step`]).
    forwards: usize,
}

struct Inner {
    w: Var,
    d_in: usize,
    d_out: usize,
    /// Whether `W̄` carries a bias column (inputs augmented with a 1).
    bias: bool,
    record: Mutex<Record>,
}

/// A dense layer `z = W̄ x̄` with `W̄ = [W b]` (`d_out x (d_in + 1)`, one candle [`Var`]) and
/// `x̄ = [x; 1]` (docs/math.md §1), recording its inputs and a probe for its output gradients on every
/// forward pass. Clones share the weights and the records (hand one to the optimizer).
///
/// Inputs are `(..., d_in)`; every leading dimension is a sample (a sequence position counts
/// as one), so the statistics have `n` = product-of-leading-dimensions rows.
///
/// [`KronLinear::bias_free`] makes a layer `z = W x` without the bias column (LoRA's
/// adapters, [`crate::LoraLinear`]): there `W̄ = W` and `x̄ = x`.
#[derive(Clone)]
pub struct KronLinear {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for KronLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KronLinear")
            .field("d_in", &self.inner.d_in)
            .field("d_out", &self.inner.d_out)
            .finish()
    }
}

impl KronLinear {
    /// A layer with the given augmented weights `W̄ = [W b]` (`d_out x (d_in + 1)`, f32),
    /// copied into a fresh variable.
    ///
    /// # Errors
    /// [`Error::Shape`] for a tensor of another rank or fewer than 2 columns;
    /// [`Error::Candle`] when candle cannot copy it.
    pub fn from_weights(w_bar: &Tensor) -> Result<Self> {
        Self::with_weights("KronLinear::from_weights", w_bar, true)
    }

    /// A layer `z = W x` without bias, with the weights `W` (`d_out x d_in`, f32) copied into a
    /// fresh variable: its Kronecker shape is `(d_out, d_in)`.
    ///
    /// # Errors
    /// [`Error::Shape`] for a tensor of another rank or a zero size; [`Error::Candle`] when
    /// candle cannot copy it.
    pub fn bias_free(w: &Tensor) -> Result<Self> {
        Self::with_weights("KronLinear::bias_free", w, false)
    }

    fn with_weights(op: &'static str, w_bar: &Tensor, bias: bool) -> Result<Self> {
        let min_cols = 1 + usize::from(bias);
        let (d_out, cols) = match w_bar.dims() {
            [r, c] if *c >= min_cols && *r >= 1 => (*r, *c),
            d => {
                return Err(Error::Shape {
                    op,
                    arg: "w_bar",
                    expected: if bias {
                        "d_out x (d_in + 1) with d_out, d_in ≥ 1".into()
                    } else {
                        "d_out x d_in with d_out, d_in ≥ 1".into()
                    },
                    got: format!("{d:?}"),
                })
            }
        };
        let w = Var::from_tensor(&w_bar.to_dtype(DType::F32).map_err(from_candle)?)
            .map_err(from_candle)?;
        Ok(Self {
            inner: Arc::new(Inner {
                w,
                d_in: cols - usize::from(bias),
                d_out,
                bias,
                record: Mutex::new(Record::default()),
            }),
        })
    }

    /// A layer with `W` drawn uniformly from `±1/√d_in` (PyTorch's `Linear` default) and
    /// `b = 0`, on `device`.
    ///
    /// # Errors
    /// [`Error::Shape`] for a zero size; [`Error::Candle`] from candle.
    pub fn new(d_in: usize, d_out: usize, device: &candle_core::Device) -> Result<Self> {
        check_value_pos("KronLinear::new", d_in, d_out)?;
        let bound = 1.0 / (d_in as f64).sqrt();
        let w = Tensor::rand(-bound as f32, bound as f32, (d_out, d_in), device)
            .and_then(|w| {
                let b = Tensor::zeros((d_out, 1), DType::F32, device)?;
                Tensor::cat(&[&w, &b], 1)
            })
            .map_err(from_candle)?;
        Self::from_weights(&w)
    }

    /// The augmented weights `W̄ = [W b]`, `d_out x (d_in + 1)` (`W`, `d_out x d_in`, for a
    /// [`KronLinear::bias_free`] layer).
    pub fn weight(&self) -> &Var {
        &self.inner.w
    }

    /// `(d_out, d_in + 1)`: the Kronecker shape of `W̄` (`(d_out, d_in)` without bias).
    pub fn shape(&self) -> (usize, usize) {
        (
            self.inner.d_out,
            self.inner.d_in + usize::from(self.inner.bias),
        )
    }

    fn record(&self) -> std::sync::MutexGuard<'_, Record> {
        self.inner
            .record
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The Fisher statistics captured by [`capture_fisher`] for the next step, if any:
    /// `A` (`rows x (d_in + 1)`, rows `x̄`) and `E` (`rows x d_out`, not divided by the batch).
    pub fn fisher_stats(&self) -> Option<(Tensor, Tensor)> {
        self.record().stats.clone()
    }

    /// The batch factors of this layer's weight gradient in `grads`, as
    /// [`grng::optim::kron::KronGrad::Factored`] takes them: `(e, a)` with `a` the rows `x̄`
    /// of the last recorded forward pass (`n x (d_in + 1)`) and `e = n·∂L/∂z` (`n x d_out`)
    /// from the gradient of that pass's output probe, so that `(1/n)·eᵀa = ∂L/∂W̄`. `None`
    /// when `grads` holds no gradient for that probe (it came from another forward pass, or
    /// the layer does not reach the loss).
    ///
    /// Only exact when `grads` is one backward pass of a loss on that forward pass: a store
    /// whose weight gradients were accumulated over several passes, or changed afterwards
    /// (RENG's [`super::GrngOptimizer::regularize`]), has a weight gradient these factors do
    /// not give.
    ///
    /// # Errors
    /// [`Error::Candle`] when candle cannot scale the probe's gradient.
    pub fn gradient_factors(
        &self,
        grads: &candle_core::backprop::GradStore,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let r = self.record();
        let (Some(a), Some(probe), 1) = (&r.a, &r.probe, r.forwards) else {
            return Ok(None);
        };
        let Some(g) = grads.get(probe.as_tensor()) else {
            return Ok(None);
        };
        let n = a.dims()[0];
        let e = g.affine(n as f64, 0.0).map_err(from_candle)?;
        Ok(Some((owned(&e)?, owned(a)?)))
    }

    /// After an optimizer step: drops the captured statistics and restarts the count of
    /// recorded forward passes ([`KronLinear::gradient_factors`]).
    pub(crate) fn end_step(&self) {
        let mut r = self.record();
        r.stats = None;
        r.forwards = 0;
    }

    /// Forward pass without recording (evaluation).
    ///
    /// # Errors
    /// [`Error::Shape`] when the last dimension is not `d_in`; [`Error::Candle`].
    pub fn forward_eval(&self, x: &Tensor) -> Result<Tensor> {
        let (a, lead) = self.augmented(x)?;
        self.project(&a, &lead, None)
    }

    /// `x̄ = [x; 1]` as `n x (d_in + 1)` rows (`x` as `n x d_in` without bias) and the leading
    /// dimensions of `x`.
    fn augmented(&self, x: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        let dims = x.dims();
        let d_in = self.inner.d_in;
        match dims.last() {
            Some(&d) if d == d_in => {}
            _ => {
                return Err(Error::Shape {
                    op: "KronLinear::forward",
                    arg: "x",
                    expected: format!("(..., {d_in})"),
                    got: format!("{dims:?}"),
                })
            }
        }
        let lead = dims[..dims.len() - 1].to_vec();
        let n = lead.iter().product::<usize>();
        let bias = self.inner.bias;
        let a = (|| {
            let x = x.reshape((n, d_in))?;
            if !bias {
                return Ok(x);
            }
            let ones = Tensor::ones((n, 1), x.dtype(), x.device())?;
            Tensor::cat(&[&x, &ones], 1)
        })()
        .map_err(from_candle)?;
        Ok((a, lead))
    }

    /// `z = x̄ W̄ᵀ (+ probe)`, reshaped to the input's leading dimensions.
    fn project(&self, a: &Tensor, lead: &[usize], probe: Option<&Var>) -> Result<Tensor> {
        (|| {
            let mut z = a.matmul(&self.inner.w.t()?)?;
            if let Some(p) = probe {
                z = z.add(p.as_tensor())?;
            }
            let mut shape = lead.to_vec();
            shape.push(self.inner.d_out);
            z.reshape(shape)
        })()
        .map_err(from_candle)
    }

    /// Forward pass recording `x̄` and a fresh zero probe on the output.
    ///
    /// # Errors
    /// As [`KronLinear::forward_eval`].
    pub fn forward_record(&self, x: &Tensor) -> Result<Tensor> {
        let (a, lead) = self.augmented(x)?;
        let n = a.dims()[0];
        let probe =
            Var::zeros((n, self.inner.d_out), DType::F32, a.device()).map_err(from_candle)?;
        let z = self.project(&a, &lead, Some(&probe))?;
        let mut r = self.record();
        r.a = Some(a.detach());
        r.probe = Some(probe);
        r.forwards += 1;
        Ok(z)
    }
}

/// Recording forward pass (what a training loop calls).
impl Module for KronLinear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_record(xs).map_err(super::buffer::to_candle)
    }
}

fn check_value_pos(op: &'static str, d_in: usize, d_out: usize) -> Result<()> {
    if d_in == 0 || d_out == 0 {
        return Err(Error::Shape {
            op,
            arg: "(d_in, d_out)",
            expected: "both ≥ 1".into(),
            got: format!("({d_in}, {d_out})"),
        });
    }
    Ok(())
}

/// Forms each layer's Fisher statistics `(A, E)` from the last recorded forward pass that
/// produced `logits` (`n x C`, softmax cross-entropy), exactly as the reference trainer's
/// `grng_train::mlp::Mlp::fisher_stats` does, and stores them in the layers for
/// the next optimizer step:
///
/// - [`FisherMode::Sampled`]: one label per row drawn from `softmax(z_k)` with `rng` (one
///   uniform per row, inverse CDF: the reference's draws for the same `rng`);
/// - [`FisherMode::Empirical`]: the data `labels`;
/// - [`FisherMode::Exact`]: `C` weighted rows per sample (see [`FisherMode::Exact`]).
///
/// `E` is the output gradient of the per-sample loss (not divided by `n`), obtained by one
/// extra backward pass of `Σ_k v_kᵀ z_k` with `v_k` the output-layer rows (`C` passes for
/// `Exact`). `labels` are checked in every mode, read only by `Empirical`.
///
/// A layer applied at `T` positions of each sample (a transformer's projection under a pooled
/// classifier: its recorded forward pass has `n·T` rows, sample-major) gets one row of `A` and
/// `E` per position, with `E` scaled by `√T`: the K-FAC-expand factors (Eschenhagen et al.,
/// NeurIPS 2023), `A = (1/(nT))Σ x̄x̄ᵀ`, `Γ = (1/n)Σ_k Σ_t e_kt e_ktᵀ`.
///
/// # Errors
/// [`Error::Shape`] for `logits` not `n x C` or `labels` not `n` long;
/// [`Error::Value`] for a label `≥ C`, or a layer without a recorded forward pass of `n` rows;
/// [`Error::NonFinite`] for NaN/Inf logits; [`Error::Candle`]. No layer changes on error.
pub fn capture_fisher<R: Rng + ?Sized>(
    layers: &[KronLinear],
    logits: &Tensor,
    mode: FisherMode,
    labels: &[u32],
    rng: &mut R,
) -> Result<()> {
    const OP: &str = "grng_candle::capture_fisher";
    let Probed { n, c, p, recorded } = probed(OP, layers, logits)?;
    check_len(OP, "labels", labels.len(), n)?;
    if let Some(&bad) = labels.iter().find(|&&y| y as usize >= c) {
        return grng::error::check_value(OP, "labels", bad as f64, false, "labels < C");
    }
    let rows = |k: usize| &p[k * c..(k + 1) * c];
    // Output-layer gradient rows `v` (n x C) of each backward pass.
    let passes: Vec<Vec<f32>> = match mode {
        FisherMode::Sampled | FisherMode::Empirical => {
            let y: Vec<usize> = match mode {
                FisherMode::Sampled => (0..n)
                    .map(|k| sample_class(rows(k), rng.random::<f64>()))
                    .collect(),
                _ => labels.iter().map(|&y| y as usize).collect(),
            };
            let mut v = p.clone();
            for (k, &yk) in y.iter().enumerate() {
                v[k * c + yk] -= 1.0;
            }
            vec![v]
        }
        FisherMode::Exact => (0..c)
            .map(|cls| {
                let mut v = vec![0.0f32; n * c];
                for k in 0..n {
                    let pk = rows(k);
                    let w = (c as f32 * pk[cls]).sqrt();
                    for (vj, &pj) in v[k * c..(k + 1) * c].iter_mut().zip(pk) {
                        *vj = w * pj;
                    }
                    v[k * c + cls] -= w;
                }
                v
            })
            .collect(),
    };
    let per_pass: Vec<Vec<Tensor>> = passes
        .iter()
        .map(|v| probe_gradients(OP, logits, &recorded, v))
        .collect::<Result<_>>()?;
    let stats: Vec<(Tensor, Tensor)> = recorded
        .iter()
        .enumerate()
        .map(|(l, (a, _))| {
            // K-FAC-expand for a layer applied at T positions per sample: √T·e, so that
            // Γ = EᵀE/(nT) = (1/n)Σ_k Σ_t e_kt e_ktᵀ (a sum over the positions of a sample,
            // a mean over samples) beside A = (1/(nT))Σ x̄ x̄ᵀ. T = 1 leaves E as it is.
            let positions = a.dims()[0] / n;
            let expand = |e: Tensor| match positions {
                1 => Ok(e),
                t => e.affine((t as f64).sqrt(), 0.0),
            };
            if per_pass.len() == 1 {
                return Ok((a.clone(), expand(per_pass[0][l].detach())?));
            }
            // Exact: row k·C + cls of E from pass `cls`, row k of A repeated C times.
            let es: Vec<&Tensor> = per_pass.iter().map(|p| &p[l]).collect();
            let e = expand(Tensor::stack(&es, 1)?.flatten_to(1)?.detach())?;
            let (rows_a, cols_a) = a.dims2()?;
            let a = a
                .unsqueeze(1)?
                .broadcast_as((rows_a, c, cols_a))?
                .contiguous()?
                .reshape((rows_a * c, cols_a))?;
            Ok((a, e))
        })
        .collect::<candle_core::Result<_>>()
        .map_err(from_candle)?;
    for (layer, (a, e)) in layers.iter().zip(stats) {
        layer.record().stats = Some((owned(&a)?, owned(&e)?));
    }
    Ok(())
}

/// The softmax of `logits` (`n x C`) and each layer's recorded rows `x̄` and output probe from
/// the forward pass that produced them.
struct Probed {
    n: usize,
    c: usize,
    /// `softmax(logits)`, row-major `n x C`, finite.
    p: Vec<f32>,
    recorded: Vec<(Tensor, Var)>,
}

fn probed(op: &'static str, layers: &[KronLinear], logits: &Tensor) -> Result<Probed> {
    let (n, c) = match logits.dims() {
        [n, c] if *n >= 1 && *c >= 1 => (*n, *c),
        d => {
            return Err(Error::Shape {
                op,
                arg: "logits",
                expected: "n x C with n, C ≥ 1".into(),
                got: format!("{d:?}"),
            })
        }
    };
    let recorded = layers
        .iter()
        .enumerate()
        .map(|(l, layer)| {
            let r = layer.record();
            match (&r.a, &r.probe) {
                (Some(a), Some(p)) if a.dims()[0] % n == 0 => Ok((a.clone(), p.clone())),
                _ => Err(Error::Value {
                    op,
                    arg: "layers",
                    value: l as f64,
                    expected: "layers whose last recorded forward pass produced `logits` \
                               (n or n·T rows)",
                }),
            }
        })
        .collect::<Result<_>>()?;
    let p: Vec<f32> =
        candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32).map_err(from_candle)?)
            .and_then(|p| p.flatten_all()?.to_vec1())
            .map_err(from_candle)?;
    grng::error::check_finite(op, "softmax(logits)", &p)?;
    Ok(Probed { n, c, p, recorded })
}

/// One backward pass of `Σ_k v_kᵀ z_k` (`v` row-major `n x C`, `z = logits`): each layer's
/// probe gradient, `∂(Σ_k v_kᵀ z_k)/∂(layer output)` (`rows x d_out`).
fn probe_gradients(
    op: &'static str,
    logits: &Tensor,
    recorded: &[(Tensor, Var)],
    v: &[f32],
) -> Result<Vec<Tensor>> {
    (|| {
        let v = Tensor::from_slice(v, logits.dims(), logits.device())?;
        let grads = logits.mul(&v)?.sum_all()?.backward()?;
        recorded
            .iter()
            .enumerate()
            .map(|(l, (_, probe))| {
                grads.get(probe.as_tensor()).cloned().ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "{op}: the output of layers[{l}] does not reach `logits`"
                    ))
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()
    })()
    .map_err(from_candle)
}

/// The Kalman filters' observation of a classifier (docs/math.md §3): the predicted
/// probabilities `ŷ = softmax(z)` and their Jacobian `H = ∂ŷ/∂θ` with respect to the weights
/// `θ` of `layers`, from the forward pass that produced `logits`.
#[derive(Clone, Debug)]
pub struct OutputJacobian {
    /// `ŷ`, `n·C` long, sample-major (`ŷ[k·C + j] = p_kj`): the layout of [`RKalman`]'s
    /// stacked observation.
    ///
    /// [`RKalman`]: grng::optim::kalman::RKalman
    pub probs: Vec<f32>,
    /// `H`, `n·C x N` (`f32`, row-major): row `k·C + j` is `∂p_kj/∂θ`; its columns are the
    /// layers' weights `W̄_l` flattened row-major, layer after layer (`N = Σ_l d_out·d_in`,
    /// the shapes of [`KronLinear::shape`]).
    pub h: Tensor,
}

/// The output Jacobian of a softmax classifier with respect to the weights of `layers` (each
/// must have recorded the forward pass that produced `logits`, `n x C`), from `C` backward
/// passes: pass `j` backpropagates row `j` of `∂p_k/∂z_k = diag(p_k) − p_k p_kᵀ` for every
/// sample at once, and the per-sample rows follow from each layer's recorded inputs and
/// probe gradients, `∂p_kj/∂W̄ = Σ_t e⁽ʲ⁾_kt x̄_ktᵀ` (a sum over the layer's `T` positions per
/// sample). Costs `C` backward passes and `n·C·N` memory — for classifiers with few classes,
/// as the Kalman filters' `d_o = n·C` observation is.
///
/// # Errors
/// [`Error::Shape`] for `logits` not `n x C`; [`Error::Value`] for a layer without a recorded
/// forward pass of `n·T` rows; [`Error::NonFinite`] for NaN/Inf logits; [`Error::Candle`].
pub fn output_jacobian(layers: &[KronLinear], logits: &Tensor) -> Result<OutputJacobian> {
    const OP: &str = "grng_candle::output_jacobian";
    let Probed { n, c, p, recorded } = probed(OP, layers, logits)?;
    let per_class: Vec<Tensor> = (0..c)
        .map(|j| {
            // Row j of diag(p_k) − p_k p_kᵀ: p_kj·(onehot(j) − p_k).
            let mut v = vec![0.0f32; n * c];
            for k in 0..n {
                let pk = &p[k * c..(k + 1) * c];
                for (vi, &pi) in v[k * c..(k + 1) * c].iter_mut().zip(pk) {
                    *vi = -pk[j] * pi;
                }
                v[k * c + j] += pk[j];
            }
            let es = probe_gradients(OP, logits, &recorded, &v)?;
            let blocks = recorded
                .iter()
                .zip(&es)
                .map(|((a, _), e)| {
                    // (n, d_out, T)·(n, T, d_in): the sum over a sample's positions.
                    let (rows, d_in) = a.dims2()?;
                    let d_out = e.dims2()?.1;
                    let t = rows / n;
                    let e = e.reshape((n, t, d_out))?.transpose(1, 2)?;
                    let a = a.reshape((n, t, d_in))?;
                    e.matmul(&a)?.reshape((n, d_out * d_in))
                })
                .collect::<candle_core::Result<Vec<_>>>()
                .map_err(from_candle)?;
            Tensor::cat(&blocks, 1).map_err(from_candle)
        })
        .collect::<Result<_>>()?;
    let h = (|| {
        let cols = per_class[0].dims2()?.1;
        Tensor::stack(&per_class, 1)?.reshape((n * c, cols))
    })()
    .map_err(from_candle)?;
    Ok(OutputJacobian { probs: p, h })
}
