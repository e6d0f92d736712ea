//! [`LoraLinear`]: a frozen linear layer with low-rank adapters (LoRA, Hu et al., ICLR 2022)
//! whose two factors are Kronecker layers of their own, so RING, RENG and NGD precondition
//! each adapter with its own factors (docs/lora.md).

use super::buffer::from_candle;
use super::layer::KronLinear;
use candle_core::{DType, Module, Tensor};
use grng::error::{check_finite, check_value, Error, Result};
use rand::Rng;

/// The adapters' rank `r` and scale numerator `α` (the update is `(α/r)·B A`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraConfig {
    /// Rank `r ≥ 1` of the adapters. Default 8 (the paper's language tasks).
    pub rank: usize,
    /// `α > 0`: the adapters' product is scaled by `α/r`. Default 8.
    pub alpha: f32,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: 8.0,
        }
    }
}

/// `y = W₀ x + b₀ + (α/r)·B A x` with `W₀` (`d_out x d_in`) and `b₀` (`d_out`) frozen (plain
/// tensors: no gradient is tracked for them) and the adapters `A` (`r x d_in`, drawn from
/// `U(±1/√d_in)`, PyTorch's and peft's default) and `B` (`d_out x r`, zero, so a fresh layer
/// computes exactly the frozen one) trainable: each a bias-free [`KronLinear`]
/// ([`LoraLinear::adapters`]) that records its inputs and output gradients, `A` seeing `x` and
/// `B` seeing `A x`.
///
/// Inputs are `(..., d_in)` (every leading dimension a sample or position, as for
/// [`KronLinear`]); outputs `(..., d_out)`. Clones share the adapters.
#[derive(Clone, Debug)]
pub struct LoraLinear {
    /// `W₀ᵀ`, `d_in x d_out`, contiguous: the frozen product is one plain matmul.
    w0t: Tensor,
    b0: Option<Tensor>,
    a: KronLinear,
    b: KronLinear,
    scale: f64,
    d_out: usize,
    d_in: usize,
}

impl LoraLinear {
    /// Adapters of `config` on the frozen `w0` (`d_out x d_in`) and optional `b0` (`d_out`),
    /// `A` drawn with `rng`.
    ///
    /// # Errors
    /// [`Error::Shape`] for `w0` not a matrix, `b0` not `d_out` long, or `r = 0`;
    /// [`Error::Value`] for `α` not finite and positive; [`Error::NonFinite`] for NaN/Inf in
    /// `w0` or `b0`; [`Error::Candle`] from candle.
    pub fn new<R: Rng + ?Sized>(
        w0: &Tensor,
        b0: Option<&Tensor>,
        config: LoraConfig,
        rng: &mut R,
    ) -> Result<Self> {
        const OP: &str = "LoraLinear::new";
        let (d_out, d_in) = match w0.dims() {
            [o, i] if *o >= 1 && *i >= 1 => (*o, *i),
            d => return Err(shape_error(OP, "w0", "d_out x d_in".into(), d)),
        };
        if config.rank == 0 {
            return Err(shape_error(OP, "config.rank", "r ≥ 1".into(), &[0]));
        }
        check_value(
            OP,
            "config.alpha",
            config.alpha as f64,
            config.alpha.is_finite() && config.alpha > 0.0,
            "alpha finite and > 0",
        )?;
        let host = |t: &Tensor| -> Result<Vec<f32>> {
            t.to_dtype(DType::F32)
                .and_then(|t| t.flatten_all()?.to_vec1())
                .map_err(from_candle)
        };
        check_finite(OP, "w0", &host(w0)?)?;
        let b0 = match b0 {
            Some(b) if b.dims() == [d_out] => {
                check_finite(OP, "b0", &host(b)?)?;
                Some(b.to_dtype(DType::F32).map_err(from_candle)?)
            }
            Some(b) => return Err(shape_error(OP, "b0", format!("[{d_out}]"), b.dims())),
            None => None,
        };
        let w0t = w0
            .to_dtype(DType::F32)
            .and_then(|w| w.t()?.contiguous())
            .map_err(from_candle)?;
        let r = config.rank;
        let bound = 1.0 / (d_in as f32).sqrt();
        let a0: Vec<f32> = (0..r * d_in)
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        let dev = w0.device();
        let a0 = Tensor::from_vec(a0, (r, d_in), dev).map_err(from_candle)?;
        let b_zero = Tensor::zeros((d_out, r), DType::F32, dev).map_err(from_candle)?;
        Ok(Self {
            w0t,
            b0,
            a: KronLinear::bias_free(&a0)?,
            b: KronLinear::bias_free(&b_zero)?,
            scale: config.alpha as f64 / r as f64,
            d_out,
            d_in,
        })
    }

    /// The adapters `[A, B]` (`r x d_in` and `d_out x r`, bias-free): hand them to the
    /// optimizer as Kronecker layers ([`crate::GrngConfig::layers`]) or their weights as
    /// variables.
    pub fn adapters(&self) -> [KronLinear; 2] {
        [self.a.clone(), self.b.clone()]
    }

    /// `(d_out, d_in)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.d_out, self.d_in)
    }

    /// `α/r`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The merged weight `W₀ + (α/r)·B A` (`d_out x d_in`): the layer without adapters, for
    /// deployment.
    ///
    /// # Errors
    /// [`Error::Candle`] from candle.
    pub fn merged_weight(&self) -> Result<Tensor> {
        (|| {
            let ba = self.b.weight().matmul(self.a.weight())?;
            self.w0t.t()?.add(&ba.affine(self.scale, 0.0)?)
        })()
        .map_err(from_candle)
    }

    /// Forward pass without recording (evaluation).
    ///
    /// # Errors
    /// [`Error::Shape`] when the last dimension is not `d_in`; [`Error::Candle`].
    pub fn forward_eval(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, |layer, u| layer.forward_eval(u))
    }

    /// Forward pass recording both adapters' inputs and output probes (what training calls).
    ///
    /// # Errors
    /// As [`LoraLinear::forward_eval`].
    pub fn forward_record(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, |layer, u| layer.forward_record(u))
    }

    /// `x W₀ᵀ + b₀ + (α/r)·adapter(B, adapter(A, x))`, on `x` flattened to rows.
    fn forward_with(
        &self,
        x: &Tensor,
        adapter: impl Fn(&KronLinear, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (d_out, d_in) = self.shape();
        let dims = x.dims();
        if dims.last() != Some(&d_in) {
            return Err(shape_error(
                "LoraLinear::forward",
                "x",
                format!("(..., {d_in})"),
                dims,
            ));
        }
        let lead = &dims[..dims.len() - 1];
        let n = lead.iter().product::<usize>();
        let rows = x.reshape((n, d_in)).map_err(from_candle)?;
        let low = adapter(&self.b, &adapter(&self.a, &rows)?)?;
        (|| {
            let mut y = rows.matmul(&self.w0t)?;
            if let Some(b0) = &self.b0 {
                y = y.broadcast_add(b0)?;
            }
            let y = y.add(&low.affine(self.scale, 0.0)?)?;
            let mut shape = lead.to_vec();
            shape.push(d_out);
            y.reshape(shape)
        })()
        .map_err(from_candle)
    }
}

/// Recording forward pass (what a training loop calls).
impl Module for LoraLinear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_record(xs).map_err(super::buffer::to_candle)
    }
}

fn shape_error(op: &'static str, arg: &'static str, expected: String, got: &[usize]) -> Error {
    Error::Shape {
        op,
        arg,
        expected,
        got: format!("{got:?}"),
    }
}
