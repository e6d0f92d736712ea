//! Backward passes: the loss gradient with per-layer statistics, sampled labels and the three
//! Fisher modes.

use rand::Rng;
use rayon::prelude::*;

use super::model::{min_rows, mul_act_deriv, row_mut, Forward};
use super::{Backward, FisherMode, LayerStats, Loss, Mlp, Targets, TargetsBuf};
use crate::data::standard_normal;
use grng::cpu::elementwise::dot_f64;
use grng::cpu::gemm;
use grng::cpu::gemm::gemm_new;
use grng::cpu::syrk::gram_rows;
use grng::error::{try_vec, Result};
use grng::mat::{Mat, MatMut, Trans};
use grng::optim::fisher::sample_class;
use grng::MatMul;

impl Mlp {
    /// Backpropagates output gradients `e_out` (`M x d_L`, `M = m·r`, row `i` belonging to
    /// sample `i / r`) to every layer: returns `E_l` (`M x d_{l+1}`), layer 0 first. Linear in
    /// `e_out`; `fwd` must be current (checked by the callers).
    pub(crate) fn backprop(&self, fwd: &Forward, e_out: Mat, r: usize) -> Result<Vec<Mat>> {
        let mut es: Vec<Mat> = (0..self.num_layers()).map(|_| Mat::zeros(0, 0)).collect();
        if let Some(last) = es.last_mut() {
            *last = e_out;
        }
        self.backprop_into(fwd, r, &mut es, |_, _| Ok(()))?;
        Ok(es)
    }

    /// [`Mlp::backprop`] in `es` (one matrix per layer, the last holding `e_out`; the others'
    /// buffers are reused when their shape fits, all their values overwritten), calling
    /// `per_layer(l, E_l)` on each layer's errors as they are known (last layer first), beside
    /// the product that carries them to the layer below: the two are independent tasks
    /// ([`grng::cpu::join_tasks`]), so a pool worker left idle by one takes the other's work.
    /// `per_layer`'s first error is returned.
    fn backprop_into(
        &self,
        fwd: &Forward,
        r: usize,
        es: &mut [Mat],
        mut per_layer: impl FnMut(usize, &Mat) -> Result<()> + Send,
    ) -> Result<()> {
        let act = self.config().activation;
        for l in (1..es.len()).rev() {
            let (below, here) = es.split_at_mut(l);
            let (cur, next) = (&here[0], &mut below[l - 1]);
            let carry = || -> Result<()> {
                let d_in = self.config().sizes[l];
                // ∂ℓ/∂x_l = E_l W_l (bias column dropped), into the reused buffer or a new one
                // (not zero-filled first), then ⊙ φ'(z_{l−1}) read off x_l = φ(z_{l−1}).
                let (no, w) = (Trans::No, self.weights(l)?);
                if next.shape() == (cur.rows(), d_in) {
                    gemm(
                        MatMul::new(no, no, 1.0, cur.as_ref(), w),
                        0.0,
                        next.as_mut(),
                    )?;
                } else {
                    *next = gemm_new(MatMul::new(no, no, 1.0, cur.as_ref(), w))?;
                }
                let h = fwd.a[l].as_ref();
                next.as_mut_slice()
                    .par_chunks_mut(d_in)
                    .enumerate()
                    .with_min_len(min_rows(d_in))
                    .for_each(|(i, row)| mul_act_deriv(act, row, h.row(i / r)));
                Ok(())
            };
            let (done, carried) = grng::cpu::join_tasks(|| per_layer(l, cur), carry);
            done?;
            carried?;
        }
        match es.first() {
            Some(e0) => per_layer(0, e0),
            None => Ok(()),
        }
    }

    /// Per-layer `E_l` into `es` (reused as [`Mlp::backprop_into`] says) and the loss; with
    /// `grad`, the flat mean-loss gradient written there.
    fn errors_and_grad(
        &self,
        fwd: &Forward,
        targets: Targets<'_>,
        grad: Option<&mut Vec<f32>>,
        es: &mut Vec<Mat>,
    ) -> Result<f32> {
        let m = fwd.batch_size();
        let nl = self.num_layers();
        es.truncate(nl);
        es.resize_with(nl, || Mat::zeros(0, 0));
        let loss = self.output_grad_into(fwd, targets, &mut es[nl - 1]);
        let Some(grad) = grad else {
            self.backprop_into(fwd, 1, es, |_, _| Ok(()))?;
            return Ok(loss);
        };
        // Reused when it has the length: the layers' ranges tile it and every product below
        // has β = 0, so each element is written without being read.
        if grad.len() != self.num_params() {
            *grad = grng::error::try_vec(self.num_params(), 1, 0.0f32)?;
        }
        // Each layer's range as a slice of its own, taken by the task that writes it.
        let mut rest = &mut grad[..];
        let mut ranges = Vec::with_capacity(nl);
        for l in 0..nl {
            let (here, tail) = std::mem::take(&mut rest).split_at_mut(self.layer_range(l)?.len());
            ranges.push(here);
            rest = tail;
        }
        self.backprop_into(fwd, 1, es, |l, e_l| {
            let (rows, cols) = self.layer_shape(l)?;
            let g = std::mem::take(&mut ranges[l]);
            // G_l = (1/m) E_lᵀ A_l.
            gemm(
                MatMul::new(
                    Trans::Yes,
                    Trans::No,
                    1.0 / m as f32,
                    e_l.as_ref(),
                    fwd.a[l].as_ref(),
                ),
                0.0,
                MatMut::new(g, rows, cols)?,
            )
        })?;
        Ok(loss)
    }

    /// Per-layer statistics, the flat mean-loss gradient (empty unless `with_grad`) and the loss.
    fn backward_stats(
        &self,
        fwd: &Forward,
        targets: Targets<'_>,
        with_grad: bool,
    ) -> Result<Backward> {
        let (mut grad, mut es) = (Vec::new(), Vec::new());
        let loss = self.errors_and_grad(fwd, targets, with_grad.then_some(&mut grad), &mut es)?;
        let layers = fwd
            .a
            .iter()
            .zip(es)
            .map(|(a, e)| LayerStats { a: a.clone(), e })
            .collect();
        Ok(Backward { layers, grad, loss })
    }

    /// The flat gradient of the mean loss and the mean loss, as [`Mlp::backward`] returns them,
    /// without the per-layer statistics: for first-order methods, which would only copy `A_l`
    /// to drop it.
    ///
    /// # Errors
    /// As [`Mlp::backward`].
    pub fn gradient(&self, fwd: &Forward, targets: Targets<'_>) -> Result<(Vec<f32>, f32)> {
        let mut grad = Vec::new();
        let loss = self.gradient_into(fwd, targets, &mut grad)?;
        Ok((grad, loss))
    }

    /// [`Mlp::gradient`] into a caller's buffer, reused (not reallocated, not cleared) when it
    /// has `num_params()` elements: a training loop's per-step gradient without an allocation
    /// and a zeroing pass. Returns the mean loss; on error `grad`'s contents are unspecified.
    ///
    /// # Errors
    /// As [`Mlp::backward`].
    pub fn gradient_into(
        &self,
        fwd: &Forward,
        targets: Targets<'_>,
        grad: &mut Vec<f32>,
    ) -> Result<f32> {
        self.gradient_into_with(fwd, targets, grad, &mut BackwardScratch::default())
    }

    /// [`Mlp::gradient_into`] with the backward pass's per-layer errors `E_l` in `scratch`,
    /// whose buffers are reused across calls where their shapes fit: with a reused [`Forward`]
    /// ([`Mlp::forward_into`]), a training step's forward and backward passes allocate nothing.
    ///
    /// # Errors
    /// As [`Mlp::backward`].
    pub fn gradient_into_with(
        &self,
        fwd: &Forward,
        targets: Targets<'_>,
        grad: &mut Vec<f32>,
        scratch: &mut BackwardScratch,
    ) -> Result<f32> {
        const OP: &str = "Mlp::gradient";
        self.check_forward(OP, fwd)?;
        self.check_targets(OP, targets, fwd.batch_size())?;
        self.errors_and_grad(fwd, targets, Some(grad), &mut scratch.es)
    }

    /// Backward pass for the data `targets` without the flat gradient: per layer `A_l` and
    /// `E_l` (as in [`Mlp::backward`], so `G_l = (1/m) E_lᵀ A_l`) and the mean loss. For
    /// consumers that take each gradient by its factors
    /// ([`grng::optim::kron::KronGrad::Factored`]) and would otherwise pay `2m·d_out·d_in`
    /// flops a layer to form it; [`LayerStats::gradient_norm_sq`] gives its norm.
    ///
    /// # Errors
    /// As [`Mlp::backward`].
    pub fn backward_factors(
        &self,
        fwd: &Forward,
        targets: Targets<'_>,
    ) -> Result<(Vec<LayerStats>, f32)> {
        const OP: &str = "Mlp::backward_factors";
        self.check_forward(OP, fwd)?;
        self.check_targets(OP, targets, fwd.batch_size())?;
        let b = self.backward_stats(fwd, targets, false)?;
        Ok((b.layers, b.loss))
    }

    /// [`Mlp::backward_factors`] taking the forward pass by value: its `A_l` buffers become
    /// the statistics' own, without the copy the borrowing version makes (~2.8 MB a step at
    /// 784-1024-1024-10, batch 256).
    ///
    /// # Errors
    /// As [`Mlp::backward`].
    pub fn backward_factors_from(
        &self,
        fwd: Forward,
        targets: Targets<'_>,
    ) -> Result<(Vec<LayerStats>, f32)> {
        const OP: &str = "Mlp::backward_factors_from";
        self.check_forward(OP, &fwd)?;
        self.check_targets(OP, targets, fwd.batch_size())?;
        let mut es = Vec::new();
        let loss = self.errors_and_grad(&fwd, targets, None, &mut es)?;
        let layers = fwd
            .a
            .into_iter()
            .zip(es)
            .map(|(a, e)| LayerStats { a, e })
            .collect();
        Ok((layers, loss))
    }

    /// Backward pass for the data `targets`: per layer `A_l` (`m x (d_l+1)`) and `E_l`
    /// (`m x d_{l+1}`, per-sample `∂ℓ_k/∂z_l`, not divided by `m`), the flat gradient of the mean
    /// loss (`G_l = (1/m) E_lᵀ A_l` in layer `l`'s range) and the mean loss.
    ///
    /// # Errors
    /// [`Error::Value`](grng::Error::Value) when `fwd` was not computed by this network with
    /// its current parameters or a label is ≥ the output width; [`Error::Shape`](grng::Error::Shape)
    /// when the targets' length/shape is not the batch's, or for value targets with softmax;
    /// [`Error::NonFinite`](grng::Error::NonFinite) for NaN/Inf target values.
    pub fn backward(&self, fwd: &Forward, targets: Targets<'_>) -> Result<Backward> {
        const OP: &str = "Mlp::backward";
        self.check_forward(OP, fwd)?;
        self.check_targets(OP, targets, fwd.batch_size())?;
        self.backward_stats(fwd, targets, true)
    }

    /// Labels drawn from the model's predictive distribution (docs/math.md §1): a class
    /// `c ~ Categorical(ŷ_k)` per sample for softmax, `y_k ~ N(ŷ_k, I)` for squared error.
    ///
    /// # Errors
    /// [`Error::Value`](grng::Error::Value) for a stale `fwd`.
    pub fn sample_targets<R: Rng + ?Sized>(
        &self,
        fwd: &Forward,
        rng: &mut R,
    ) -> Result<TargetsBuf> {
        self.check_forward("Mlp::sample_targets", fwd)?;
        let y = fwd.outputs();
        Ok(match self.config().loss {
            Loss::SoftmaxCrossEntropy => TargetsBuf::Classes(
                (0..y.rows())
                    .map(|k| sample_class(y.row(k), rng.random::<f64>()))
                    .collect(),
            ),
            Loss::SquaredError => {
                let mut t = fwd.y.clone();
                for v in t.as_mut_slice() {
                    *v += standard_normal(rng) as f32;
                }
                TargetsBuf::Values(t)
            }
        })
    }

    /// Backward pass with labels sampled by [`Mlp::sample_targets`]: the statistics of the
    /// true-Fisher error factor `Γ` and the flat gradient for those labels (Sophia-G's
    /// Gauss–Newton–Bartlett estimator); `loss` is the loss on the sampled labels.
    pub fn backward_sampled<R: Rng + ?Sized>(
        &self,
        fwd: &Forward,
        rng: &mut R,
    ) -> Result<Backward> {
        let t = self.sample_targets(fwd, rng)?;
        self.backward_stats(fwd, t.as_targets(), true)
    }

    /// Per-layer statistics for the Kronecker factors `Λ = (1/rows) aᵀa`, `Γ = (1/rows) eᵀe`
    /// in the given [`FisherMode`]: `m` rows for `Sampled` (labels drawn with `rng`) and
    /// `Empirical` (the data `targets`); `m·d_L` rows for `Exact` (see [`FisherMode::Exact`]).
    /// `targets` is checked in every mode so a misuse is caught, but only `Empirical` reads it;
    /// only `Sampled` draws from `rng`.
    ///
    /// # Errors
    /// As [`Mlp::backward`].
    pub fn fisher_stats<R: Rng + ?Sized>(
        &self,
        fwd: &Forward,
        mode: FisherMode,
        targets: Targets<'_>,
        rng: &mut R,
    ) -> Result<Vec<LayerStats>> {
        const OP: &str = "Mlp::fisher_stats";
        self.check_forward(OP, fwd)?;
        self.check_targets(OP, targets, fwd.batch_size())?;
        match mode {
            FisherMode::Empirical => Ok(self.backward_stats(fwd, targets, false)?.layers),
            FisherMode::Sampled => {
                let t = self.sample_targets(fwd, rng)?;
                Ok(self.backward_stats(fwd, t.as_targets(), false)?.layers)
            }
            FisherMode::Exact => self.exact_fisher_stats(fwd),
        }
    }

    /// [`FisherMode::Exact`]: `C = d_L` weighted rows per sample (the trick is documented there).
    fn exact_fisher_stats(&self, fwd: &Forward) -> Result<Vec<LayerStats>> {
        let m = fwd.batch_size();
        let c = self.output_dim();
        let mut e = Mat::zeros(m * c, c);
        let sqrt_c = (c as f32).sqrt();
        for k in 0..m {
            let p = fwd.y.as_ref().row(k);
            for cls in 0..c {
                let row = row_mut(&mut e, k * c + cls);
                match self.config().loss {
                    Loss::SoftmaxCrossEntropy => {
                        let w = (c as f32 * p[cls]).sqrt();
                        for (r, &pj) in row.iter_mut().zip(p) {
                            *r = w * pj;
                        }
                        row[cls] -= w;
                    }
                    // E[e eᵀ] = I for y ~ N(ŷ, I): the basis vectors with equal weights.
                    Loss::SquaredError => row[cls] = sqrt_c,
                }
            }
        }
        let es = self.backprop(fwd, e, c)?;
        Ok(fwd
            .a
            .iter()
            .zip(es)
            .map(|(a, e)| LayerStats {
                a: repeat_rows(a, c),
                e,
            })
            .collect())
    }
}

/// Buffers of a backward pass reused across calls ([`Mlp::gradient_into_with`]): the
/// per-layer errors `E_l` (`m x d_{l+1}`) of the last pass. Their values are not meaningful
/// between calls.
#[derive(Debug, Default)]
pub struct BackwardScratch {
    es: Vec<Mat>,
}

/// Each row of `a` repeated `r` times in place (`(rows·r) x cols`).
fn repeat_rows(a: &Mat, r: usize) -> Mat {
    let cols = a.cols();
    let mut out = Mat::zeros(a.rows() * r, cols);
    for (i, dst) in out.as_mut_slice().chunks_mut(cols).enumerate() {
        dst.copy_from_slice(a.as_ref().row(i / r));
    }
    out
}

/// [`LayerStats::gradient_norm`]: `‖G‖_F²` and the Gram matrices it came from, if it did.
#[derive(Debug)]
pub struct GradientNorm {
    /// `‖(1/m) eᵀa‖_F²` in `f64`.
    pub norm_sq: f64,
    /// `((1/m)·eeᵀ, (1/m)·aaᵀ)`, `m x m` each, when the norm came from them: what
    /// [`grng::optim::kron::KronGrad::FactoredWithGrams`] takes.
    pub grams: Option<(Mat, Mat)>,
}

impl LayerStats {
    /// `‖(1/m) eᵀa‖_F²` (`m` = rows) in `f64`, the squared norm of the gradient these data
    /// statistics factor. When the two `m x m` Gram matrices (by the SYRK, `m²/2` multiply-adds
    /// per column) cost less than the `d_out x d_in` product (`m·(d_out + d_in) <
    /// 2·d_out·d_in`) it is `⟨eeᵀ, aaᵀ⟩/m²` (`‖eᵀa‖² = tr(aᵀe·eᵀa) = tr(eeᵀ·aaᵀ)`), and the
    /// Gram matrices come with it; else the product is formed. Both are f32 products summed
    /// in f64: off by about `k·2⁻²⁴` (`k` the inner dimension) relative to the same sum on
    /// absolute values.
    ///
    /// # Errors
    /// Allocation failures ([`grng::Error::OutOfMemory`]).
    pub fn gradient_norm(&self) -> Result<GradientNorm> {
        let (m, d_out, d_in) = (self.e.rows(), self.e.cols(), self.a.cols());
        let inv_m = 1.0 / m.max(1) as f32;
        let product = |r: usize, c: usize, f: &dyn Fn(MatMut<'_, f32>) -> Result<()>| {
            let mut out = Mat::from_vec(try_vec(r, c, 0.0f32)?, r, c)?;
            f(out.as_mut())?;
            Ok::<Mat, grng::Error>(out)
        };
        if m * (d_out + d_in) < 2 * d_out * d_in {
            let gram = |x: &Mat| product(m, m, &|c| gram_rows(x.as_ref(), inv_m, c));
            let (ee, aa) = grng::cpu::join_tasks(|| gram(&self.e), || gram(&self.a));
            let (ee, aa) = (ee?, aa?);
            Ok(GradientNorm {
                norm_sq: dot_f64(ee.as_slice(), aa.as_slice()),
                grams: Some((ee, aa)),
            })
        } else {
            let (e, a) = (self.e.as_ref(), self.a.as_ref());
            let g = product(d_out, d_in, &|c| {
                gemm(MatMul::new(Trans::Yes, Trans::No, inv_m, e, a), 0.0, c)
            })?;
            Ok(GradientNorm {
                norm_sq: dot_f64(g.as_slice(), g.as_slice()),
                grams: None,
            })
        }
    }

    /// [`LayerStats::gradient_norm`]'s `‖G‖_F²` alone.
    ///
    /// # Errors
    /// As [`LayerStats::gradient_norm`].
    pub fn gradient_norm_sq(&self) -> Result<f64> {
        Ok(self.gradient_norm()?.norm_sq)
    }
}
