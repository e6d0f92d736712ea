//! [`SentenceClassifier`]: the adapted top of an encoder, mean pooling and a linear head, and
//! one training step of any grng method on it.

use crate::{mean_pool, BertModel, Candle, Pass};
use candle_core::{Tensor, Var};
use grng::error::{Error, Result};
use grng::optim::adamw::AdamWConfig;
use grng::optim::fisher::{sample_class, FisherMode};
use grng::optim::OptimizerConfig;
use grng_candle::{capture_fisher, GrngConfig, GrngOptimizer, KronLinear, Observed};
use rand::Rng;

/// The encoder layers `first..` (with their adapters), mean pooling and a head `W̄ = [W b]`
/// (`classes x (hidden + 1)`, a [`KronLinear`] trained with the adapters). It reads the
/// output of the layers below `first` (`batch x seq x hidden`, from
/// [`BertModel::embed_and_encode`] with [`Pass::Eval`]), so a trainer can cache it once.
pub struct SentenceClassifier {
    encoder: BertModel,
    head: KronLinear,
    first: usize,
}

impl SentenceClassifier {
    /// A head with `W` drawn from `U(±1/√hidden)` with `rng` and `b = 0` on `encoder`'s layers
    /// `first..`.
    ///
    /// # Errors
    /// [`Error::Value`] for `first` above the encoder's layers, or an adapter below `first`
    /// (its layer would be cached, never trained); [`Error::Shape`] for `classes < 2`;
    /// [`Error::Candle`].
    pub fn new<R: Rng + ?Sized>(
        encoder: BertModel,
        first: usize,
        classes: usize,
        rng: &mut R,
    ) -> Result<Self> {
        const OP: &str = "SentenceClassifier::new";
        let layers = encoder.config().num_hidden_layers;
        let lowest = encoder.first_adapted();
        grng::error::check_value(
            OP,
            "first",
            first as f64,
            first <= layers && first <= lowest,
            "first ≤ the encoder's layers and ≤ its lowest adapted layer",
        )?;
        if classes < 2 {
            return Err(Error::Shape {
                op: OP,
                arg: "classes",
                expected: "≥ 2".into(),
                got: classes.to_string(),
            });
        }
        let hidden = encoder.config().hidden_size;
        let bound = 1.0 / (hidden as f32).sqrt();
        let w: Vec<f32> = (0..classes * (hidden + 1))
            .map(|i| {
                if i % (hidden + 1) == hidden {
                    0.0
                } else {
                    rng.random_range(-bound..bound)
                }
            })
            .collect();
        let dev = encoder.device();
        let head =
            KronLinear::from_weights(&Tensor::from_vec(w, (classes, hidden + 1), &dev).grng()?)?;
        Ok(Self {
            encoder,
            head,
            first,
        })
    }

    /// What [`SentenceClassifier::logits`] reads for a batch of tokens (`batch x seq` ids, type
    /// ids and mask): the embeddings and the frozen layers below `first`, evaluated once.
    ///
    /// # Errors
    /// Those of [`BertModel::embed_and_encode`].
    pub fn embed(&self, ids: &Tensor, type_ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        self.encoder
            .embed_and_encode(ids, type_ids, mask, self.first, Pass::Eval)
    }

    /// The logits `batch x classes` of `hidden` (the output of the layers below `first`,
    /// `batch x seq x hidden`) and `mask` (`batch x seq`, 1 token / 0 padding). A
    /// [`Pass::Train`] records the adapters' and the head's statistics.
    ///
    /// # Errors
    /// Those of [`BertModel::encode_from`] and [`mean_pool`].
    pub fn logits(&self, hidden: &Tensor, mask: &Tensor, pass: Pass) -> Result<Tensor> {
        let h = self.encoder.encode_from(hidden, mask, self.first, pass)?;
        let pooled = mean_pool(&h, mask)?;
        match pass {
            Pass::Train => self.head.forward_record(&pooled),
            Pass::Eval => self.head.forward_eval(&pooled),
        }
    }

    /// Every trainable layer: the encoder's adapters, then the head.
    pub fn layers(&self) -> Vec<KronLinear> {
        let mut l = self.encoder.adapters();
        l.push(self.head.clone());
        l
    }

    /// The trainable variables, in [`SentenceClassifier::layers`]' order.
    pub fn vars(&self) -> Vec<Var> {
        self.layers().iter().map(|l| l.weight().clone()).collect()
    }

    /// A [`GrngOptimizer`] running `method` on every trainable layer (Kronecker methods
    /// precondition each adapter and the head with its own factors; the Kalman filters take
    /// all their weights as one vector; first-order methods update them all); `rest` is unused
    /// (every variable is a Kronecker layer's) but required by the config.
    ///
    /// # Errors
    /// Those of [`GrngOptimizer::try_new`].
    pub fn optimizer(&self, method: OptimizerConfig, rest: AdamWConfig) -> Result<GrngOptimizer> {
        GrngOptimizer::try_new(
            self.vars(),
            GrngConfig {
                method,
                rest,
                layers: self.layers(),
            },
        )
    }

    /// The mean cross-entropy of a batch.
    ///
    /// # Errors
    /// As [`SentenceClassifier::logits`]; [`Error::Candle`] for a label ≥ classes.
    pub fn loss(
        &self,
        hidden: &Tensor,
        mask: &Tensor,
        labels: &[u32],
        pass: Pass,
    ) -> Result<Tensor> {
        cross_entropy(&self.logits(hidden, mask, pass)?, labels)
    }

    /// One step of `opt` on a batch, as the paper's methods take it, returning the batch's
    /// loss before the step:
    /// - Kalman filters: one [`GrngOptimizer::step_kalman`] on the batch's softmax outputs;
    /// - Kronecker methods: Fisher statistics from labels sampled from the model with `rng`
    ///   on refresh steps; RENG's gradient regularized ([`GrngOptimizer::regularize`]); the
    ///   step observed (Levenberg–Marquardt damping from the loss after
    ///   it, a non-finite step rejected);
    /// - Sophia: the sampled-label gradient on its Hessian-refresh steps.
    ///
    /// # Errors
    /// Those of the optimizer and the forward passes; on an optimizer error nothing changed.
    pub fn train_step<R: Rng + ?Sized>(
        &self,
        opt: &mut GrngOptimizer,
        hidden: &Tensor,
        mask: &Tensor,
        labels: &[u32],
        rng: &mut R,
    ) -> Result<f32> {
        let z = self.logits(hidden, mask, Pass::Train)?;
        let l = cross_entropy(&z, labels)?;
        let before = l.to_scalar::<f32>().grng()?;
        if opt.is_kalman() {
            opt.step_kalman(&z, labels)?;
            return Ok(before);
        }
        let mut grads = l.backward().grng()?;
        // Before RENG's extra passes: the statistics are read from the pass that made `z`.
        if opt.needs_fisher() {
            capture_fisher(&self.layers(), &z, FisherMode::Sampled, labels, rng)?;
        }
        opt.regularize(&mut grads, || {
            self.loss(hidden, mask, labels, Pass::Train)?
                .backward()
                .grng()
        })?;
        if opt.needs_sophia_sample() {
            let classes = z.dims2().grng()?.1;
            let p: Vec<f32> = candle_nn::ops::softmax_last_dim(&z)
                .and_then(|p| p.flatten_all()?.to_vec1())
                .grng()?;
            let drawn: Vec<u32> = p
                .chunks(classes)
                .map(|pk| sample_class(pk, rng.random::<f64>()) as u32)
                .collect();
            let sampled = self
                .loss(hidden, mask, &drawn, Pass::Train)?
                .backward()
                .grng()?;
            opt.set_sophia_sample(&sampled, labels.len());
        }
        let after = || {
            self.loss(hidden, mask, labels, Pass::Eval)?
                .to_scalar::<f32>()
                .grng()
        };
        match opt.step_observed(&grads, before, after)? {
            Observed::Applied { .. } | Observed::Rejected => Ok(before),
        }
    }

    /// `‖∇L‖` of the batch's mean loss over every trainable variable.
    ///
    /// # Errors
    /// As [`SentenceClassifier::loss`].
    pub fn grad_norm(&self, hidden: &Tensor, mask: &Tensor, labels: &[u32]) -> Result<f64> {
        let grads = self
            .loss(hidden, mask, labels, Pass::Train)?
            .backward()
            .grng()?;
        let mut sq = 0.0f64;
        for v in self.vars() {
            if let Some(g) = grads.get(v.as_tensor()) {
                sq += g
                    .sqr()
                    .and_then(|s| s.sum_all()?.to_scalar::<f32>())
                    .grng()? as f64;
            }
        }
        Ok(sq.sqrt())
    }

    /// The predicted classes of a batch.
    ///
    /// # Errors
    /// As [`SentenceClassifier::logits`].
    pub fn predict(&self, hidden: &Tensor, mask: &Tensor) -> Result<Vec<u32>> {
        let z = self.logits(hidden, mask, Pass::Eval)?;
        z.argmax(1).and_then(|a| a.to_vec1::<u32>()).grng()
    }
}

/// Mean cross-entropy of `logits` (`n x C`) against `labels`.
fn cross_entropy(logits: &Tensor, labels: &[u32]) -> Result<Tensor> {
    let y = Tensor::from_slice(labels, labels.len(), logits.device()).grng()?;
    candle_nn::loss::cross_entropy(logits, &y).grng()
}
