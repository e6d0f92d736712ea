//! [`BertModel`]: a BERT encoder (post-LN, as Devlin et al. and Hugging Face's `BertModel`)
//! whose six projections per layer are frozen tensors or [`LoraLinear`] adapters.
//!
//! Layouts: token ids, token-type ids and the attention mask are `batch x seq` (row-major, the
//! mask 1 for a token and 0 for padding); hidden states `batch x seq x hidden`; attention
//! runs as batched matmuls over `batch x heads x seq x head_dim`.

mod config;
mod weights;

pub use config::{Adapt, AdaptConfig, BertConfig};
pub use weights::random_weights;

use crate::{model_file, Candle, LoraConfig, LoraLinear};
use candle_core::{DType, Device, Tensor, Var, D};
use grng::{Error, Result};
use grng_candle::KronLinear;
use rand::Rng;
use std::ops::Range;
use std::path::Path;
use weights::{random_tensor, Checkpoint};

/// The weights file of a model folder.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// Which forward pass: what training differentiates, or evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The adapters record their inputs and output gradients (for the Kronecker factors), and
    /// from the lowest adapted layer up softmax and LayerNorm are candle's differentiable
    /// compositions. Below it (frozen whole) the fused kernels of [`Pass::Eval`] run.
    Train,
    /// Nothing is recorded, and softmax and LayerNorm are candle's fused kernels, which have
    /// **no backward pass**: gradients do not flow through an evaluation pass. Use it for
    /// evaluation and for caching the frozen lower layers' outputs.
    Eval,
}

/// A BERT encoder with optional LoRA adapters. See the module docs for layouts.
pub struct BertModel {
    config: BertConfig,
    frozen: Frozen,
    /// The lowest layer holding an adapter (`num_hidden_layers` when none does): from it up a
    /// training pass must be differentiable.
    first_adapted: usize,
}

/// The encoder's parameters as the checkpoint gives them, before any adapter is added.
struct Frozen {
    words: Tensor,
    positions: Tensor,
    types: Tensor,
    embed_norm: Norm,
    layers: Vec<Layer>,
}

/// One encoder layer: `h' = LN(h + O(attn(Q h, K h, V h)))`, `out = LN(h' + W₂ gelu(W₁ h'))`.
struct Layer {
    /// In [`PROJECTIONS`]' order.
    proj: [Projection; 6],
    attn_norm: Norm,
    out_norm: Norm,
}

/// The projections of a layer, by checkpoint name (under `encoder.layer.{i}.`), in the order
/// of [`Layer::proj`] and of [`BertModel::adapters`].
const PROJECTIONS: [&str; 6] = [
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
];
/// The indices in [`PROJECTIONS`] of the query and value projections (LoRA's default
/// placement, [`Adapt::QueryValue`]).
const QUERY_VALUE: [usize; 2] = [0, 2];

/// A dense projection `y = x Wᵀ + b`.
enum Projection {
    /// Plain tensors (no candle `Var`: nothing tracks a gradient for them). `wt` is `Wᵀ`
    /// (`d_in x d_out`, contiguous), so the product is one plain matmul.
    Frozen { wt: Tensor, b: Tensor },
    /// The frozen `W`, `b` with trainable adapters.
    Lora(LoraLinear),
}

/// LayerNorm over the last dimension.
struct Norm {
    gamma: Tensor,
    beta: Tensor,
    eps: f32,
}

/// How one layer runs in a pass.
#[derive(Clone, Copy)]
struct Ops {
    /// Adapters record their statistics.
    record: bool,
    /// Softmax and LayerNorm must have a backward pass.
    grad: bool,
}

impl Projection {
    /// `x` is `batch x seq x d_in`; the result `batch x seq x d_out`.
    fn forward(&self, x: &Tensor, ops: Ops) -> Result<Tensor> {
        match self {
            Projection::Frozen { wt, b: bias } => (|| {
                let (b, s, d_in) = x.dims3()?;
                let rows = x.reshape((b * s, d_in))?.matmul(wt)?;
                rows.broadcast_add(bias)?.reshape((b, s, ()))
            })()
            .grng(),
            Projection::Lora(l) if ops.record => l.forward_record(x),
            Projection::Lora(l) => l.forward_eval(x),
        }
    }
}

impl Norm {
    fn forward(&self, x: &Tensor, ops: Ops) -> Result<Tensor> {
        if ops.grad {
            candle_nn::ops::layer_norm_slow(x, &self.gamma, &self.beta, self.eps)
        } else {
            candle_nn::ops::layer_norm(x, &self.gamma, &self.beta, self.eps)
        }
        .grng()
    }
}

impl Layer {
    /// `h` is `batch x seq x hidden`, `bias` the additive attention mask `batch x 1 x 1 x seq`.
    fn forward(&self, h: &Tensor, bias: &Tensor, heads: usize, ops: Ops) -> Result<Tensor> {
        let (b, s, hidden) = h.dims3().grng()?;
        let hd = hidden / heads;
        // `batch x seq x hidden` → `batch x heads x seq x head_dim`, contiguous for the
        // batched matmul.
        let split = |t: Tensor| t.reshape((b, s, heads, hd))?.transpose(1, 2)?.contiguous();
        let [query, key, value, attn_out, intermediate, output] = &self.proj;
        // 1/√head_dim folded into Q: b·s·h multiplies instead of b·heads·s².
        let q = query.forward(h, ops)?;
        let q = split(q.affine(1.0 / (hd as f64).sqrt(), 0.0).grng()?).grng()?;
        let k = split(key.forward(h, ops)?).grng()?;
        let v = split(value.forward(h, ops)?).grng()?;
        let ctx = (|| {
            let scores = q.matmul(&k.t()?)?.broadcast_add(bias)?;
            let probs = if ops.grad {
                candle_nn::ops::softmax(&scores, D::Minus1)?
            } else {
                candle_nn::ops::softmax_last_dim(&scores)?
            };
            probs.matmul(&v)?.transpose(1, 2)?.reshape((b, s, hidden))
        })()
        .grng()?;
        let attn = attn_out.forward(&ctx, ops)?;
        let h = self.attn_norm.forward(&(attn + h).grng()?, ops)?;
        let inner = intermediate.forward(&h, ops)?.gelu_erf().grng()?;
        let out = output.forward(&inner, ops)?;
        self.out_norm.forward(&(out + h).grng()?, ops)
    }
}

impl Frozen {
    /// The parameters of `config`'s architecture, each asked of `source` by its checkpoint
    /// name and shape.
    fn build(
        config: &BertConfig,
        source: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
    ) -> Result<Self> {
        config
            .check()
            .map_err(|reason| crate::pretrained(Path::new(""), reason))?;
        let h = config.hidden_size;
        let eps = config.layer_norm_eps as f32;
        let mut norm = |name: &str| -> Result<Norm> {
            Ok(Norm {
                gamma: source(&format!("{name}.LayerNorm.weight"), &[h])?,
                beta: source(&format!("{name}.LayerNorm.bias"), &[h])?,
                eps,
            })
        };
        let embed_norm = norm("embeddings")?;
        let words = source("embeddings.word_embeddings.weight", &[config.vocab_size, h])?;
        let positions = source(
            "embeddings.position_embeddings.weight",
            &[config.max_position_embeddings, h],
        )?;
        let types = source(
            "embeddings.token_type_embeddings.weight",
            &[config.type_vocab_size, h],
        )?;
        let i = config.intermediate_size;
        // (d_out, d_in) of each projection, in PROJECTIONS' order.
        let shapes = [(h, h), (h, h), (h, h), (h, h), (i, h), (h, i)];
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let base = format!("encoder.layer.{l}");
                let mut proj = |k: usize| -> Result<Projection> {
                    let (d_out, d_in) = shapes[k];
                    let name = format!("{base}.{}", PROJECTIONS[k]);
                    let w = source(&format!("{name}.weight"), &[d_out, d_in])?;
                    let b = source(&format!("{name}.bias"), &[d_out])?;
                    let wt = w.t().and_then(|w| w.contiguous()).grng()?;
                    Ok(Projection::Frozen { wt, b })
                };
                let proj = [proj(0)?, proj(1)?, proj(2)?, proj(3)?, proj(4)?, proj(5)?];
                let mut norm = |name: &str| -> Result<Norm> {
                    Ok(Norm {
                        gamma: source(&format!("{base}.{name}.LayerNorm.weight"), &[h])?,
                        beta: source(&format!("{base}.{name}.LayerNorm.bias"), &[h])?,
                        eps,
                    })
                };
                Ok(Layer {
                    proj,
                    attn_norm: norm("attention.output")?,
                    out_norm: norm("output")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            words,
            positions,
            types,
            embed_norm,
            layers,
        })
    }
}

impl BertModel {
    /// The model in the folder `dir` (`config.json` and [`WEIGHTS_FILE`]; Hugging Face's
    /// tensor names, with or without a `bert.` prefix; f32, f16, bf16 or f64 weights, held as
    /// f32), on `device`, with adapters where `lora` says (their `A` drawn from `rng`).
    ///
    /// # Errors
    /// [`Error::Pretrained`] for a missing folder or file (saying how to fetch the model), a
    /// config the forward pass cannot run, or a checkpoint of another architecture (naming
    /// the tensor that is absent or of another shape); [`Error::Io`] for an unreadable file;
    /// [`Error::Value`] for `top_layers` > `num_hidden_layers`; errors of
    /// [`LoraLinear::new`].
    pub fn load<R: Rng + ?Sized>(
        dir: &Path,
        device: &Device,
        lora: Option<(LoraConfig, AdaptConfig)>,
        rng: &mut R,
    ) -> Result<Self> {
        let config = BertConfig::from_file(&model_file(dir, "config.json")?)?;
        let mut ck = Checkpoint::read(&model_file(dir, WEIGHTS_FILE)?, device)?;
        let frozen = Frozen::build(&config, &mut |name, shape| ck.take(name, shape))?;
        Self::adapt(config, frozen, lora, rng)
    }

    /// A model of `config`'s architecture with weights from [`random_weights`]' distribution
    /// (for tests), adapters as in [`BertModel::load`], all drawn from `rng`.
    ///
    /// # Errors
    /// [`Error::Pretrained`] (empty path) for a config that fails [`BertConfig::check`];
    /// otherwise as [`BertModel::load`].
    pub fn random<R: Rng + ?Sized>(
        config: BertConfig,
        device: &Device,
        lora: Option<(LoraConfig, AdaptConfig)>,
        rng: &mut R,
    ) -> Result<Self> {
        let frozen = Frozen::build(&config, &mut |name, shape| {
            random_tensor(name, shape, device, rng)
        })?;
        Self::adapt(config, frozen, lora, rng)
    }

    /// Puts adapters on the projections `lora` selects, layer by layer, in [`PROJECTIONS`]'
    /// order (the order of `rng`'s draws and of [`BertModel::adapters`]).
    fn adapt<R: Rng + ?Sized>(
        config: BertConfig,
        mut frozen: Frozen,
        lora: Option<(LoraConfig, AdaptConfig)>,
        rng: &mut R,
    ) -> Result<Self> {
        let layers = frozen.layers.len();
        let Some((lora, place)) = lora else {
            return Ok(Self {
                config,
                frozen,
                first_adapted: layers,
            });
        };
        let first_adapted = place.first_layer(layers)?;
        let chosen = |k: &usize| match place.adapt {
            Adapt::QueryValue => QUERY_VALUE.contains(k),
            Adapt::All => true,
        };
        for layer in &mut frozen.layers[first_adapted..] {
            for k in (0..PROJECTIONS.len()).filter(chosen) {
                if let Projection::Frozen { wt, b } = &layer.proj[k] {
                    let w0 = wt.t().grng()?;
                    layer.proj[k] = Projection::Lora(LoraLinear::new(&w0, Some(b), lora, rng)?);
                }
            }
        }
        Ok(Self {
            config,
            frozen,
            first_adapted,
        })
    }

    /// The architecture.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// The lowest encoder layer holding an adapter (`num_hidden_layers` when none does): the
    /// layers below it are frozen whole, so their outputs may be cached
    /// ([`BertModel::embed_and_encode`]).
    pub fn first_adapted(&self) -> usize {
        self.first_adapted
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.frozen.words.device().clone()
    }

    /// Every adapter, `[A, B]` of each adapted projection, layer by layer (bottom up) and in
    /// the order query, key, value, attention output, intermediate, output: hand them to
    /// [`grng_candle::GrngConfig`] as Kronecker layers. Empty without adapters.
    pub fn adapters(&self) -> Vec<KronLinear> {
        self.frozen
            .layers
            .iter()
            .flat_map(|l| l.proj.iter())
            .filter_map(|p| match p {
                Projection::Lora(l) => Some(l.adapters()),
                Projection::Frozen { .. } => None,
            })
            .flatten()
            .collect()
    }

    /// The adapters' weight variables, in [`BertModel::adapters`]' order: the model's only
    /// trainable parameters.
    pub fn adapter_vars(&self) -> Vec<Var> {
        self.adapters().iter().map(|a| a.weight().clone()).collect()
    }

    /// The last hidden states `batch x seq x hidden` of `ids`, `type_ids` and `mask` (each
    /// `batch x seq`; ids and type ids u8, u32 or i64; mask 1 for a token and 0 for padding,
    /// any dtype).
    ///
    /// # Errors
    /// [`Error::Shape`] for inputs of other ranks or shapes, an empty batch or sequence, or a
    /// sequence longer than `max_position_embeddings`; [`Error::Candle`] for an id outside
    /// its table or ids that are not integers.
    pub fn forward(
        &self,
        ids: &Tensor,
        type_ids: &Tensor,
        mask: &Tensor,
        pass: Pass,
    ) -> Result<Tensor> {
        self.embed_and_encode(ids, type_ids, mask, self.frozen.layers.len(), pass)
    }

    /// The hidden states after the embeddings and the encoder layers `0..until_layer`
    /// (`batch x seq x hidden`; `until_layer = 0`: the embeddings). With [`Pass::Eval`] and
    /// every adapter at or above `until_layer`, the result is what training may cache and
    /// continue with [`BertModel::encode_from`]`(…, until_layer, …)`.
    ///
    /// # Errors
    /// As [`BertModel::forward`]; [`Error::Value`] for `until_layer` > `num_hidden_layers`.
    pub fn embed_and_encode(
        &self,
        ids: &Tensor,
        type_ids: &Tensor,
        mask: &Tensor,
        until_layer: usize,
        pass: Pass,
    ) -> Result<Tensor> {
        const OP: &str = "BertModel::embed_and_encode";
        self.check_layer(OP, "until_layer", until_layer)?;
        let (b, s) = self.check_tokens(OP, "ids", ids)?;
        check_dims(OP, "type_ids", type_ids, &[b, s])?;
        check_dims(OP, "mask", mask, &[b, s])?;
        let f = &self.frozen;
        let h = self.config.hidden_size;
        let embedded = (|| {
            let words = f.words.index_select(&ids.flatten_all()?, 0)?;
            let types = f.types.index_select(&type_ids.flatten_all()?, 0)?;
            (words + types)?
                .reshape((b, s, h))?
                .broadcast_add(&f.positions.narrow(0, 0, s)?)
        })()
        .grng()?;
        // Below every adapter: never differentiated.
        let frozen_ops = Ops {
            record: false,
            grad: false,
        };
        let hidden = f.embed_norm.forward(&embedded, frozen_ops)?;
        self.encode(hidden, mask, 0..until_layer, pass)
    }

    /// The last hidden states from `hidden`, the output of the layers below `from_layer`
    /// (`batch x seq x hidden`, as [`BertModel::embed_and_encode`] gives it), and `mask`
    /// (`batch x seq`): the encoder layers `from_layer..`.
    ///
    /// # Errors
    /// [`Error::Shape`] for `hidden` or `mask` of other shapes; [`Error::Value`] for
    /// `from_layer` > `num_hidden_layers`.
    pub fn encode_from(
        &self,
        hidden: &Tensor,
        mask: &Tensor,
        from_layer: usize,
        pass: Pass,
    ) -> Result<Tensor> {
        const OP: &str = "BertModel::encode_from";
        self.check_layer(OP, "from_layer", from_layer)?;
        let (b, s) = match hidden.dims() {
            &[b, s, h] if b > 0 && s > 0 && h == self.config.hidden_size => (b, s),
            d => {
                return Err(shape(
                    OP,
                    "hidden",
                    format!("batch x seq x {}", self.config.hidden_size),
                    d,
                ))
            }
        };
        check_dims(OP, "mask", mask, &[b, s])?;
        self.encode(
            hidden.clone(),
            mask,
            from_layer..self.frozen.layers.len(),
            pass,
        )
    }

    /// The encoder layers `layers` on `hidden`.
    fn encode(
        &self,
        mut hidden: Tensor,
        mask: &Tensor,
        layers: Range<usize>,
        pass: Pass,
    ) -> Result<Tensor> {
        // 0 where the mask is 1, f32::MIN where it is 0 (exactly: 1·MAX + MIN = 0), added to
        // the scores before the softmax: padding gets weight exactly 0, and a row that is all
        // padding stays finite (uniform), as in Hugging Face's BERT.
        let bias = (|| {
            mask.to_dtype(DType::F32)?
                .affine(f32::MAX as f64, f32::MIN as f64)?
                .unsqueeze(1)?
                .unsqueeze(1)
        })()
        .grng()?;
        for i in layers {
            let train = pass == Pass::Train;
            let ops = Ops {
                record: train,
                grad: train && i >= self.first_adapted,
            };
            hidden = self.frozen.layers[i].forward(
                &hidden,
                &bias,
                self.config.num_attention_heads,
                ops,
            )?;
        }
        Ok(hidden)
    }

    fn check_layer(&self, op: &'static str, arg: &'static str, layer: usize) -> Result<()> {
        let n = self.frozen.layers.len();
        grng::error::check_value(
            op,
            arg,
            layer as f64,
            layer <= n,
            "at most num_hidden_layers",
        )
    }

    /// `(batch, seq)` of a `batch x seq` token tensor with both ≥ 1 and `seq` within the
    /// position table.
    fn check_tokens(
        &self,
        op: &'static str,
        arg: &'static str,
        t: &Tensor,
    ) -> Result<(usize, usize)> {
        let max = self.config.max_position_embeddings;
        match t.dims() {
            &[b, s] if b > 0 && s > 0 && s <= max => Ok((b, s)),
            d => Err(shape(
                op,
                arg,
                format!("batch x seq, both ≥ 1, seq ≤ {max}"),
                d,
            )),
        }
    }
}

/// The mean of the hidden states over each sequence's tokens (sentence-transformers' pooling):
/// `hidden` `batch x seq x hidden`, `mask` `batch x seq` (1 token, 0 padding) → `batch x
/// hidden`. A row without tokens pools to 0 (its count is clamped to 1e-9, as
/// sentence-transformers clamps it).
///
/// # Errors
/// [`Error::Shape`] for other shapes; [`Error::Candle`].
pub fn mean_pool(hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
    const OP: &str = "mean_pool";
    let (b, s) = match hidden.dims() {
        &[b, s, _] => (b, s),
        d => return Err(shape(OP, "hidden", "batch x seq x hidden".into(), d)),
    };
    check_dims(OP, "mask", mask, &[b, s])?;
    (|| {
        let m = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
        let count = m.sum(1)?.clamp(1e-9f32, f32::INFINITY)?;
        hidden.broadcast_mul(&m)?.sum(1)?.broadcast_div(&count)
    })()
    .grng()
}

fn check_dims(op: &'static str, arg: &'static str, t: &Tensor, dims: &[usize]) -> Result<()> {
    if t.dims() == dims {
        Ok(())
    } else {
        Err(shape(op, arg, format!("{dims:?}"), t.dims()))
    }
}

fn shape(op: &'static str, arg: &'static str, expected: String, got: &[usize]) -> Error {
    Error::Shape {
        op,
        arg,
        expected,
        got: format!("{got:?}"),
    }
}
