//! Parameters, initialisation, the forward pass, losses and the shared row kernels.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::{Activation, Loss, MlpConfig, Targets};
use grng::cpu::{gemm, math};
use grng::error::{check_finite, check_len, check_shape, check_value, Error, Result};
use grng::mat::{Mat, MatMut, MatRef, Trans};
use grng::MatMul;

/// Source of parameter-state stamps: every new, cloned or mutated parameter vector gets a fresh
/// one, so a [`Forward`] computed with other parameters is caught instead of silently mixed.
static STAMPS: AtomicU64 = AtomicU64::new(1);

fn next_stamp() -> u64 {
    STAMPS.fetch_add(1, Ordering::Relaxed)
}

/// Rows per rayon task in the element-wise row loops: small batches stay sequential.
pub(crate) fn min_rows(cols: usize) -> usize {
    (8192 / cols.max(1)).max(1)
}

/// Multilayer perceptron with one flat parameter vector (layout in the module docs).
#[derive(Debug)]
pub struct Mlp {
    config: MlpConfig,
    params: Vec<f32>,
    /// `offsets[l]..offsets[l + 1]` is layer `l`'s `W̄_l`.
    offsets: Vec<usize>,
    stamp: u64,
    /// The stamp whose parameters are known finite (checked by a forward pass or
    /// [`Mlp::set_params`], or vouched for by the caller of [`Mlp::swap_params`]; 0: none), so
    /// a forward pass scans them once per change, not once per call.
    finite: AtomicU64,
}

impl Clone for Mlp {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
            params: self.params.clone(),
            offsets: self.offsets.clone(),
            stamp: next_stamp(),
            finite: AtomicU64::new(0),
        }
    }
}

/// What the forward pass caches for the backward passes.
#[derive(Clone, Debug)]
pub struct Forward {
    /// Per layer `l`, `m x (d_l + 1)`: augmented inputs `[x̄_l]` (hidden part `φ(z_{l−1})`).
    pub(crate) a: Vec<Mat>,
    /// `m x d_L`: last-layer pre-activations.
    pub(crate) logits: Mat,
    /// `m x d_L`: model outputs `ŷ` (probabilities for softmax, `= logits` for squared error).
    pub(crate) y: Mat,
    /// `m x d_1`: layer 0's pre-activations `z_0`, kept by [`Mlp::forward_keeping_first`]
    /// (else empty).
    pub(crate) first: Mat,
    pub(crate) stamp: u64,
}

impl Forward {
    /// No pass yet: buffers for [`Mlp::forward_into`] to fill, stale until it succeeds.
    pub fn empty() -> Forward {
        Forward {
            a: Vec::new(),
            logits: Mat::zeros(0, 0),
            y: Mat::zeros(0, 0),
            first: Mat::zeros(0, 0),
            // Stamps start at 1: 0 is no parameters' stamp.
            stamp: 0,
        }
    }

    /// Batch size `m`.
    pub fn batch_size(&self) -> usize {
        self.logits.rows()
    }
    /// Takes the kept pre-activations of [`Forward::first_outputs`] out of the pass.
    pub(crate) fn take_first(&mut self) -> Option<Mat> {
        (self.first.rows() > 0).then(|| std::mem::replace(&mut self.first, Mat::zeros(0, 0)))
    }
    /// Layer 0's pre-activations `z_0 = x̄_0·W̄_0ᵀ` (`m x d_1`) when the pass kept them
    /// ([`Mlp::forward_keeping_first`]), for [`Mlp::evaluate_from_first`].
    pub fn first_outputs(&self) -> Option<MatRef<'_, f32>> {
        (self.first.rows() > 0).then(|| self.first.as_ref())
    }
    /// Augmented inputs of layer `l`, `m x (d_l + 1)` (last column 1); `None` past the last layer.
    pub fn inputs(&self, l: usize) -> Option<MatRef<'_, f32>> {
        self.a.get(l).map(Mat::as_ref)
    }
    /// Last-layer pre-activations `z_L`, `m x d_L`.
    pub fn logits(&self) -> MatRef<'_, f32> {
        self.logits.as_ref()
    }
    /// Model outputs `ŷ`, `m x d_L`: class probabilities (softmax) or raw outputs (squared error).
    pub fn outputs(&self) -> MatRef<'_, f32> {
        self.y.as_ref()
    }
    /// Index of the largest output per sample (first one on ties).
    pub fn argmax(&self) -> Vec<usize> {
        (0..self.y.rows())
            .map(|k| {
                let row = self.y.as_ref().row(k);
                let mut best = 0;
                for (j, &v) in row.iter().enumerate() {
                    if v > row[best] {
                        best = j;
                    }
                }
                best
            })
            .collect()
    }
}

impl Mlp {
    /// A new network with the documented initialisation, deterministic in `seed`:
    /// weights `U(−s, s)` with Glorot's `s = √(6/(d_in + d_out))` for tanh networks and He's
    /// `s = √(6/d_in)` for ReLU networks (the output layer uses the same rule); biases 0.
    ///
    /// # Errors
    /// [`Error::Shape`] unless `sizes` has at least two entries, all ≥ 1.
    pub fn new(config: MlpConfig, seed: u64) -> Result<Self> {
        if config.sizes.len() < 2 || config.sizes.contains(&0) {
            return Err(Error::Shape {
                op: "Mlp::new",
                arg: "sizes",
                expected: "at least two layer widths, all >= 1".into(),
                got: format!("{:?}", config.sizes),
            });
        }
        let mut offsets = vec![0];
        for w in config.sizes.windows(2) {
            offsets.push(offsets.last().copied().unwrap_or(0) + w[1] * (w[0] + 1));
        }
        let n = offsets.last().copied().unwrap_or(0);
        let mut params = grng::error::try_vec(n, 1, 0.0f32)?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for (l, w) in config.sizes.windows(2).enumerate() {
            let (d_in, d_out) = (w[0], w[1]);
            let s = match config.activation {
                Activation::Tanh => (6.0 / (d_in + d_out) as f64).sqrt(),
                Activation::Relu => (6.0 / d_in as f64).sqrt(),
            } as f32;
            let layer = &mut params[offsets[l]..offsets[l + 1]];
            for row in layer.chunks_mut(d_in + 1) {
                for v in &mut row[..d_in] {
                    *v = rng.random_range(-s..s);
                }
            }
        }
        Ok(Self {
            config,
            params,
            offsets,
            stamp: next_stamp(),
            finite: AtomicU64::new(0),
        })
    }

    /// The configuration this network was built with.
    pub fn config(&self) -> &MlpConfig {
        &self.config
    }
    /// Number of layers `L` (weight matrices).
    pub fn num_layers(&self) -> usize {
        self.offsets.len() - 1
    }
    /// Total number of parameters `n`.
    pub fn num_params(&self) -> usize {
        self.params.len()
    }
    /// Input width `d_0`.
    pub fn input_dim(&self) -> usize {
        self.config.sizes[0]
    }
    /// Output width `d_L` (number of classes for softmax).
    pub fn output_dim(&self) -> usize {
        self.config.sizes[self.num_layers()]
    }

    fn check_layer(&self, op: &'static str, l: usize) -> Result<()> {
        if l < self.num_layers() {
            Ok(())
        } else {
            Err(Error::Value {
                op,
                arg: "l",
                value: l as f64,
                expected: "a layer index < num_layers()",
            })
        }
    }

    /// `(d_out, d_in + 1)`: the shape of layer `l`'s augmented `W̄_l`.
    pub fn layer_shape(&self, l: usize) -> Result<(usize, usize)> {
        self.check_layer("Mlp::layer_shape", l)?;
        Ok((self.config.sizes[l + 1], self.config.sizes[l] + 1))
    }
    /// Every layer's `(d_out, d_in + 1)`, layer 0 first.
    pub fn layer_shapes(&self) -> Vec<(usize, usize)> {
        self.config
            .sizes
            .windows(2)
            .map(|w| (w[1], w[0] + 1))
            .collect()
    }
    /// Where layer `l`'s `W̄_l` (row-major) sits in the flat parameter vector.
    pub fn layer_range(&self, l: usize) -> Result<Range<usize>> {
        self.check_layer("Mlp::layer_range", l)?;
        Ok(self.offsets[l]..self.offsets[l + 1])
    }
    /// Layer `l`'s `W̄_l = [W_l b_l]`, `d_out x (d_in + 1)`.
    pub fn layer(&self, l: usize) -> Result<MatRef<'_, f32>> {
        let (r, c) = self.layer_shape(l)?;
        MatRef::new(&self.params[self.offsets[l]..self.offsets[l + 1]], r, c)
    }
    /// Layer `l`'s `W̄_l`, mutable (the parameters count as changed).
    pub fn layer_mut(&mut self, l: usize) -> Result<MatMut<'_, f32>> {
        let (r, c) = self.layer_shape(l)?;
        self.changed(false);
        MatMut::new(&mut self.params[self.offsets[l]..self.offsets[l + 1]], r, c)
    }
    /// The flat parameter vector (layout in the module docs).
    pub fn params(&self) -> &[f32] {
        &self.params
    }
    /// The flat parameter vector, mutable (the parameters count as changed).
    pub fn params_mut(&mut self) -> &mut [f32] {
        self.changed(false);
        &mut self.params
    }
    /// Overwrites all parameters.
    ///
    /// # Errors
    /// [`Error::Shape`] on a wrong length, [`Error::NonFinite`] on NaN/Inf; nothing changes then.
    pub fn set_params(&mut self, params: &[f32]) -> Result<()> {
        check_len("Mlp::set_params", "params", params.len(), self.params.len())?;
        check_finite("Mlp::set_params", "params", params)?;
        self.params.copy_from_slice(params);
        self.changed(true);
        Ok(())
    }

    /// Marks the parameters changed (a new stamp, so cached forward passes go stale);
    /// `finite`: their values are known to be free of NaN/Inf (checked, or vouched for by a
    /// crate-internal caller), so the next forward pass skips its scan.
    fn changed(&mut self, finite: bool) {
        self.stamp = next_stamp();
        if finite {
            self.finite.store(self.stamp, Ordering::Relaxed);
        }
    }

    /// Exchanges the parameter vector with the host buffer of the `n x 1` matrix `m` (O(1), no
    /// copy; the parameters count as changed): how a trainer lets an optimizer step the
    /// network's own vector on a host device. Returns whether it did (GPU storage or another
    /// length: nothing changes). `finite`: the caller vouches that every value swapped in is
    /// finite (an update that checked its results), so the next forward pass need not scan
    /// them; the values are not checked here (the swap exists to avoid that pass), which is
    /// why this is crate-internal.
    pub(crate) fn swap_params(&mut self, m: &mut grng::Matrix, finite: bool) -> bool {
        let swapped = m.swap_host_vec(&mut self.params);
        if swapped {
            self.changed(finite);
        }
        swapped
    }

    /// Swaps the flat parameter vector with `v` (O(1)): the network takes `v`'s values, `v`
    /// the network's. `finite`: the caller vouches that `v` holds no NaN/Inf (checked
    /// already), so the next forward pass skips its scan; otherwise it scans once.
    ///
    /// # Errors
    /// [`Error::Shape`] unless `v` has `num_params()` elements; nothing changes then.
    pub(crate) fn swap_flat(&mut self, v: &mut Vec<f32>, finite: bool) -> Result<()> {
        check_len("Mlp::swap_flat", "v", v.len(), self.params.len())?;
        std::mem::swap(&mut self.params, v);
        self.changed(finite);
        Ok(())
    }

    /// Layer `l`'s `W_l` without the bias column: `d_out x d_in` with leading dimension `d_in + 1`.
    pub(crate) fn weights(&self, l: usize) -> Result<MatRef<'_, f32>> {
        let (d_in, d_out) = (self.config.sizes[l], self.config.sizes[l + 1]);
        MatRef::with_ld(
            &self.params[self.offsets[l]..self.offsets[l + 1]],
            d_out,
            d_in,
            d_in + 1,
        )
    }

    /// Forward pass over a batch `x` (`m x d_0`, one sample per row, `m ≥ 1`), caching the
    /// augmented layer inputs and the outputs for the backward passes.
    ///
    /// # Errors
    /// [`Error::Shape`] on a wrong width or an empty batch, [`Error::NonFinite`] when `x` or the
    /// parameters hold NaN/Inf.
    pub fn forward(&self, x: MatRef<'_, f32>) -> Result<Forward> {
        let mut fwd = Forward::empty();
        self.forward_into(x, &mut fwd)?;
        Ok(fwd)
    }

    /// [`Mlp::forward`] into an earlier pass's buffers, reused (not reallocated, not zeroed:
    /// every entry is written) where their shapes fit: a training loop's forward pass without
    /// per-step allocations. On error `fwd` is stale (its stamp matches no parameters, so every
    /// consumer rejects it) until a pass succeeds.
    ///
    /// # Errors
    /// As [`Mlp::forward`].
    pub fn forward_into(&self, x: MatRef<'_, f32>, fwd: &mut Forward) -> Result<()> {
        self.forward_with(x, fwd, false)
    }

    /// [`Mlp::forward`] that also keeps layer 0's pre-activations `z_0`
    /// ([`Forward::first_outputs`], one more `m x d_1` write as the activation reads them): a
    /// trainer that evaluates the loss after a step on the same batch then starts from
    /// `z_0 + Δz_0` ([`Mlp::evaluate_from_first`]).
    ///
    /// # Errors
    /// As [`Mlp::forward`].
    pub fn forward_keeping_first(&self, x: MatRef<'_, f32>) -> Result<Forward> {
        let mut fwd = Forward::empty();
        self.forward_with(x, &mut fwd, true)?;
        Ok(fwd)
    }

    fn forward_with(&self, x: MatRef<'_, f32>, fwd: &mut Forward, keep_first: bool) -> Result<()> {
        const OP: &str = "Mlp::forward";
        fwd.stamp = 0;
        self.check_input(OP, x)?;
        self.check_params_finite(OP)?;
        let m = x.rows();
        let nl = self.num_layers();
        let Forward {
            a,
            logits,
            y,
            first,
            ..
        } = fwd;
        a.truncate(nl);
        a.resize_with(nl, || Mat::zeros(0, 0));
        fit(&mut a[0], m, x.cols() + 1);
        fill_augmented(&mut a[0], |k| x.row(k));
        if !keep_first {
            *first = Mat::zeros(0, 0);
        }
        self.layers_from(0, a, logits, keep_first.then_some(first))?;
        self.outputs(logits, y);
        fwd.stamp = self.stamp;
        Ok(())
    }

    /// The mean loss on a batch whose layer-0 pre-activations are `z0 + dz` (`m x d_1` each),
    /// through layers `1..L` at the current parameters: with `z0` from
    /// [`Mlp::forward_keeping_first`] and `dz` the change a step made to them
    /// ([`grng::optim::kron::KronOptimizer::step_grads_with_output_change`]), the loss after
    /// the step on that batch without layer 0's `m·d_0·d_1` product — the loss of
    /// [`Mlp::evaluate`] up to rounding. Not finite where the sum or the layers overflow.
    ///
    /// # Errors
    /// [`Error::Shape`] for `z0`, `dz` or `targets` of the wrong shape, [`Error::NonFinite`]
    /// for NaN/Inf in the parameters.
    pub fn evaluate_from_first(
        &self,
        z0: MatRef<'_, f32>,
        dz: MatRef<'_, f32>,
        targets: Targets<'_>,
    ) -> Result<f32> {
        const OP: &str = "Mlp::evaluate_from_first";
        let (m, d1) = (z0.rows(), self.config.sizes[1]);
        check_shape(OP, "z0", z0.shape(), (m.max(1), d1))?;
        check_shape(OP, "dz", dz.shape(), (m, d1))?;
        self.check_targets(OP, targets, m)?;
        self.check_params_finite(OP)?;
        let nl = self.num_layers();
        let mut fwd = Forward::empty();
        let Forward { a, logits, y, .. } = &mut fwd;
        a.resize_with(nl, || Mat::zeros(0, 0));
        // Layer 0's outputs as the pass would leave them: `φ(z)` augmented by 1 in layer 1's
        // inputs, or the logits of a one-layer network.
        let sum = |dst: &mut [f32], k: usize| {
            for ((o, &z), &d) in dst.iter_mut().zip(z0.row(k)).zip(dz.row(k)) {
                *o = z + d;
            }
        };
        if nl == 1 {
            fit(logits, m, d1);
            logits
                .as_mut_slice()
                .par_chunks_mut(d1)
                .with_min_len(min_rows(d1))
                .enumerate()
                .for_each(|(k, row)| sum(row, k));
        } else {
            fit(&mut a[1], m, d1 + 1);
            let act = self.config.activation;
            a[1].as_mut_slice()
                .par_chunks_mut(d1 + 1)
                .with_min_len(min_rows(d1))
                .enumerate()
                .for_each(|(k, row)| {
                    sum(&mut row[..d1], k);
                    activate(act, &mut row[..d1]);
                    row[d1] = 1.0;
                });
            self.layers_from(1, a, logits, None)?;
        }
        self.outputs(logits, y);
        Ok(self.output_grad(&fwd, targets).1)
    }

    /// Layers `from..L` of a forward pass whose inputs `a[from]` are in place: each layer's
    /// `z_l` lands straight in the first `d_out` columns of the augmented `x̄_{l+1}` and `φ`
    /// runs in place there (no separate `z`, no copy), the last one's in `logits`. `first`,
    /// when given, receives layer `from`'s pre-activations (copied as the activation reads
    /// them).
    fn layers_from(
        &self,
        from: usize,
        a: &mut [Mat],
        logits: &mut Mat,
        mut first: Option<&mut Mat>,
    ) -> Result<()> {
        let nl = self.num_layers();
        let m = a[from].rows();
        for l in from..nl {
            let d_out = self.config.sizes[l + 1];
            let hidden = l + 1 < nl;
            let width = d_out + usize::from(hidden);
            let (inputs, rest) = a.split_at_mut(l + 1);
            let out = if hidden { &mut rest[0] } else { &mut *logits };
            fit(out, m, width);
            gemm(
                MatMul::new(
                    Trans::No,
                    Trans::Yes,
                    1.0,
                    inputs[l].as_ref(),
                    self.layer(l)?,
                ),
                0.0,
                MatMut::with_ld(out.as_mut_slice(), m, d_out, width)?,
            )?;
            let mut keep = first.take();
            if let Some(k) = keep.as_deref_mut() {
                fit(k, m, d_out);
            }
            if hidden {
                let act = self.config.activation;
                let rows = out.as_mut_slice().par_chunks_mut(width);
                match keep {
                    Some(keep) => rows
                        .zip(keep.as_mut_slice().par_chunks_mut(d_out))
                        .with_min_len(min_rows(d_out))
                        .for_each(|(row, z)| {
                            z.copy_from_slice(&row[..d_out]);
                            activate(act, &mut row[..d_out]);
                            row[d_out] = 1.0;
                        }),
                    None => rows.with_min_len(min_rows(d_out)).for_each(|row| {
                        activate(act, &mut row[..d_out]);
                        row[d_out] = 1.0;
                    }),
                }
            } else if let Some(keep) = keep {
                keep.as_mut_slice().copy_from_slice(out.as_slice());
            }
        }
        Ok(())
    }

    /// `ŷ` from the logits: a copy, softmax by rows for the cross-entropy loss.
    fn outputs(&self, logits: &Mat, y: &mut Mat) {
        fit(y, logits.rows(), logits.cols());
        y.as_mut_slice().copy_from_slice(logits.as_slice());
        if let Loss::SoftmaxCrossEntropy = self.config.loss {
            let c = logits.cols();
            y.as_mut_slice()
                .par_chunks_mut(c)
                .with_min_len(min_rows(c))
                .for_each(softmax_in_place);
        }
    }

    /// `Err(Error::NonFinite)` for NaN/Inf in the parameters: one scan per parameter change
    /// (the `finite` stamp), the parameters' mutable accessors being the only way to change
    /// them without a check.
    fn check_params_finite(&self, op: &'static str) -> Result<()> {
        if self.finite.load(Ordering::Relaxed) != self.stamp {
            check_finite(op, "params", &self.params)?;
            self.finite.store(self.stamp, Ordering::Relaxed);
        }
        Ok(())
    }

    pub(crate) fn check_input(&self, op: &'static str, x: MatRef<'_, f32>) -> Result<()> {
        if x.cols() != self.input_dim() || x.rows() == 0 {
            return Err(Error::Shape {
                op,
                arg: "x",
                expected: format!("m x {} with m >= 1", self.input_dim()),
                got: format!("{}x{}", x.rows(), x.cols()),
            });
        }
        // The vectorized scan: a per-element `position` took ~0.7% of an AdamW step, twice a
        // step (the trainer's batch check and the forward pass).
        for k in 0..x.rows() {
            if let Some(j) = grng::error::first_non_finite(x.row(k)) {
                return Err(Error::NonFinite {
                    op,
                    arg: "x",
                    index: k * x.ld() + j,
                    value: x.at(k, j),
                });
            }
        }
        Ok(())
    }

    /// Errors unless `fwd` was computed by this network with its current parameters.
    pub(crate) fn check_forward(&self, op: &'static str, fwd: &Forward) -> Result<()> {
        let shapes_ok = fwd.a.len() == self.num_layers()
            && fwd.logits.cols() == self.output_dim()
            && fwd.a[0].cols() == self.input_dim() + 1;
        if !shapes_ok || fwd.stamp != self.stamp {
            return Err(Error::Value {
                op,
                arg: "fwd",
                value: fwd.stamp as f64,
                expected: "a Forward computed by this network with its current parameters",
            });
        }
        Ok(())
    }

    /// Validates `targets` for a batch of `m` samples.
    pub(crate) fn check_targets(
        &self,
        op: &'static str,
        targets: Targets<'_>,
        m: usize,
    ) -> Result<()> {
        let c = self.output_dim();
        match targets {
            Targets::Classes(labels) => {
                check_len(op, "targets", labels.len(), m)?;
                if let Some(&bad) = labels.iter().find(|&&y| y >= c) {
                    return Err(Error::Value {
                        op,
                        arg: "targets",
                        value: bad as f64,
                        expected: "class labels < the output width",
                    });
                }
                Ok(())
            }
            Targets::Values(t) => {
                if self.config.loss == Loss::SoftmaxCrossEntropy {
                    return Err(Error::Shape {
                        op,
                        arg: "targets",
                        expected: "class labels (softmax cross-entropy)".into(),
                        got: format!("a {}x{} value matrix", t.rows(), t.cols()),
                    });
                }
                check_shape(op, "targets", t.shape(), (m, c))?;
                for k in 0..m {
                    if let Some(j) = t.row(k).iter().position(|v| !v.is_finite()) {
                        return Err(Error::NonFinite {
                            op,
                            arg: "targets",
                            index: k * t.ld() + j,
                            value: t.at(k, j),
                        });
                    }
                }
                Ok(())
            }
        }
    }

    /// Output gradients `E` (`m x d_L`, rows `∂ℓ_k/∂z_k`) and the mean loss, for validated targets.
    pub(crate) fn output_grad(&self, fwd: &Forward, targets: Targets<'_>) -> (Mat, f32) {
        let mut e = Mat::zeros(0, 0);
        let loss = self.output_grad_into(fwd, targets, &mut e);
        (e, loss)
    }

    /// [`Mlp::output_grad`] into `e`, its buffer reused when the shape fits.
    pub(crate) fn output_grad_into(&self, fwd: &Forward, targets: Targets<'_>, e: &mut Mat) -> f32 {
        let m = fwd.batch_size();
        let c = self.output_dim();
        fit(e, m, fwd.y.cols());
        e.as_mut_slice().copy_from_slice(fwd.y.as_slice());
        let mut total = 0.0f64;
        for k in 0..m {
            let z = fwd.logits.as_ref().row(k);
            let row = row_mut(e, k);
            match (self.config.loss, targets) {
                (Loss::SoftmaxCrossEntropy, Targets::Classes(labels)) => {
                    let y = labels[k];
                    // −log p_y = logsumexp(z) − z_y, stable against large logits.
                    total += (log_sum_exp(z) - z[y] as f64).max(0.0);
                    row[y] -= 1.0;
                }
                (Loss::SquaredError, Targets::Classes(labels)) => {
                    row[labels[k]] -= 1.0;
                    total += 0.5 * row.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
                }
                (Loss::SquaredError, Targets::Values(t)) => {
                    for (r, &tv) in row.iter_mut().zip(t.row(k)) {
                        *r -= tv;
                    }
                    total += 0.5 * row.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
                }
                // Rejected by `check_targets`.
                (Loss::SoftmaxCrossEntropy, Targets::Values(_)) => {}
            }
        }
        debug_assert_eq!(e.cols(), c);
        (total / m as f64) as f32
    }

    /// Mean loss of a forward pass.
    ///
    /// # Errors
    /// [`Error::Value`] for a stale `fwd`; target errors as in [`Mlp::backward`].
    pub fn loss(&self, fwd: &Forward, targets: Targets<'_>) -> Result<f32> {
        const OP: &str = "Mlp::loss";
        self.check_forward(OP, fwd)?;
        self.check_targets(OP, targets, fwd.batch_size())?;
        Ok(self.output_grad(fwd, targets).1)
    }

    /// Forward pass and mean loss in one call.
    pub fn evaluate(&self, x: MatRef<'_, f32>, targets: Targets<'_>) -> Result<f32> {
        self.check_targets("Mlp::evaluate", targets, x.rows())?;
        let fwd = self.forward(x)?;
        self.loss(&fwd, targets)
    }

    /// Fraction of samples whose largest output is the label.
    ///
    /// # Errors
    /// [`Error::Value`] for a stale `fwd` or a label ≥ the output width, [`Error::Shape`] on a
    /// wrong number of labels.
    pub fn accuracy(&self, fwd: &Forward, labels: &[usize]) -> Result<f32> {
        const OP: &str = "Mlp::accuracy";
        self.check_forward(OP, fwd)?;
        self.check_targets(OP, Targets::Classes(labels), fwd.batch_size())?;
        let hits = fwd
            .argmax()
            .iter()
            .zip(labels)
            .filter(|(p, y)| p == y)
            .count();
        Ok(hits as f32 / labels.len() as f32)
    }

    /// Predicted class (largest output) for each row of `x` (`m x d_0`).
    pub fn predict(&self, x: MatRef<'_, f32>) -> Result<Vec<usize>> {
        Ok(self.forward(x)?.argmax())
    }
}

/// `φ` in place over one row's pre-activations.
fn activate(act: Activation, z: &mut [f32]) {
    match act {
        Activation::Tanh => math::tanh_in_place(z),
        Activation::Relu => relu_in_place(z),
    }
}

/// Makes `m` an `rows x cols` matrix, keeping its buffer (and stale values) when the shape
/// already fits: for outputs whose every entry is written next.
fn fit(m: &mut Mat, rows: usize, cols: usize) {
    if m.rows() != rows || m.cols() != cols {
        *m = Mat::zeros(rows, cols);
    }
}

/// `dst` (`m x (d + 1)`) ← rows `[src(k), 1]`.
fn fill_augmented<'a>(dst: &mut Mat, src: impl Fn(usize) -> &'a [f32]) {
    let d = dst.cols() - 1;
    for k in 0..dst.rows() {
        let row = row_mut(dst, k);
        row[..d].copy_from_slice(src(k));
        row[d] = 1.0;
    }
}

/// `log Σ exp(z)` in f64, shifted by the maximum.
fn log_sum_exp(z: &[f32]) -> f64 {
    let mx = z.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    mx + z.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln()
}

/// Numerically stable softmax of one row.
fn softmax_in_place(row: &mut [f32]) {
    let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - mx).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

grng::simd::multiversion! {
    /// `row ← row ⊙ φ'(z)`, `φ'` read off the activations `h = φ(z)` ([`act_deriv`]).
    pub(crate) fn mul_act_deriv(act: Activation, row: &mut [f32], h: &[f32]) {
        for (v, &hv) in row.iter_mut().zip(h) {
            *v *= act_deriv(act, hv);
        }
    }
}

grng::simd::multiversion! {
    /// `z ← max(z, 0)`.
    fn relu_in_place(z: &mut [f32]) {
        z.iter_mut().for_each(|v| *v = v.max(0.0));
    }
}

/// `φ'(z)` from the activation's value `h = φ(z)`: `1 − h²` for tanh, `[h > 0]` for ReLU.
#[inline(always)]
pub(crate) fn act_deriv(act: Activation, h: f32) -> f32 {
    match act {
        Activation::Tanh => 1.0 - h * h,
        Activation::Relu => {
            if h > 0.0 {
                1.0
            } else {
                0.0
            }
        }
    }
}

/// `φ''(z)` from `h = φ(z)`: `−2h(1 − h²)` for tanh, 0 for ReLU (almost everywhere).
pub(crate) fn act_second_deriv(act: Activation, h: f32) -> f32 {
    match act {
        Activation::Tanh => -2.0 * h * (1.0 - h * h),
        Activation::Relu => 0.0,
    }
}

/// Range check for scalar hyperparameters of the MLP's entry points.
pub(crate) fn check_nonneg(op: &'static str, arg: &'static str, v: f32) -> Result<()> {
    check_value(op, arg, v as f64, v >= 0.0, "a finite number >= 0")
}

/// Row `k` of an owned matrix, mutable.
pub(crate) fn row_mut(a: &mut Mat, k: usize) -> &mut [f32] {
    let c = a.cols();
    &mut a.as_mut_slice()[k * c..(k + 1) * c]
}
