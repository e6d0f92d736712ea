//! The encoder's named tensors: read from a safetensors checkpoint (Hugging Face's names, with
//! or without the `bert.` prefix) or drawn at random for tests.

use super::config::BertConfig;
use crate::{pretrained, Candle};
use candle_core::{DType, Device, Tensor};
use grng::{Error, Result};
use rand::Rng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The checkpoint tensors of a loaded `model.safetensors`, handed out by name and checked
/// against the shapes `config.json` implies.
pub(super) struct Checkpoint {
    tensors: HashMap<String, Tensor>,
    /// `"bert."` for a checkpoint saved from a model with a head (`BertForX`), else `""`.
    prefix: &'static str,
    path: PathBuf,
}

impl Checkpoint {
    /// Reads `path` onto `device`.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read; [`Error::Pretrained`] when it is not a
    /// safetensors file.
    pub(super) fn read(path: &Path, device: &Device) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let tensors = candle_core::safetensors::load_buffer(&bytes, device)
            .map_err(|e| pretrained(path, format!("not a safetensors file: {e}")))?;
        Ok(Self::new(tensors, path))
    }

    /// Tensors already in memory (named as in a file at `path`, for the error messages).
    pub(super) fn new(tensors: HashMap<String, Tensor>, path: &Path) -> Self {
        let prefix =
            if !tensors.contains_key(WORDS) && tensors.contains_key(&format!("bert.{WORDS}")) {
                "bert."
            } else {
                ""
            };
        Self {
            tensors,
            prefix,
            path: path.to_path_buf(),
        }
    }

    /// The f32 tensor `name` of shape `shape`, taken out of the checkpoint (no copy).
    ///
    /// # Errors
    /// [`Error::Pretrained`] naming the tensor when it is absent, not floating-point, or of
    /// another shape.
    pub(super) fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let key = format!("{}{name}", self.prefix);
        let t = self.tensors.remove(&key).ok_or_else(|| {
            pretrained(
                &self.path,
                format!(
                    "no tensor `{key}`: not a BERT checkpoint of the architecture in config.json"
                ),
            )
        })?;
        if t.dims() != shape {
            return Err(pretrained(
                &self.path,
                format!(
                    "tensor `{key}` has shape {:?}, expected {shape:?} (from config.json)",
                    t.dims()
                ),
            ));
        }
        match t.dtype() {
            DType::F32 => Ok(t),
            DType::F16 | DType::BF16 | DType::F64 => t.to_dtype(DType::F32).grng(),
            d => Err(pretrained(
                &self.path,
                format!("tensor `{key}` is {d:?}, expected floating-point weights"),
            )),
        }
    }
}

/// The word-embedding table's name, by which the `bert.` prefix is recognized.
const WORDS: &str = "embeddings.word_embeddings.weight";

/// A draw for the tensor `name` of `shape`, scaled as a trained BERT's roughly are so that
/// every part of the forward pass matters: LayerNorm gains near 1, projections
/// `U(±1/√d_in)`, embeddings `U(±1)`, biases `U(±0.1)`.
pub(super) fn random_tensor<R: Rng + ?Sized>(
    name: &str,
    shape: &[usize],
    device: &Device,
    rng: &mut R,
) -> Result<Tensor> {
    let (center, half_width) = if name.ends_with("LayerNorm.weight") {
        (1.0, 0.2)
    } else if name.ends_with("bias") {
        (0.0, 0.1)
    } else if name.starts_with("embeddings") {
        (0.0, 1.0)
    } else {
        (0.0, 1.0 / (shape[shape.len() - 1] as f32).sqrt())
    };
    let n = shape.iter().product::<usize>();
    let mut v = grng::error::try_vec(n, 1, 0.0f32)?;
    for x in &mut v {
        *x = center + rng.random_range(-half_width..half_width);
    }
    Tensor::from_vec(v, shape, device).grng()
}

/// A random checkpoint of `config`'s architecture, named as Hugging Face names BERT's tensors
/// (no prefix): save it with `candle_core::safetensors::save` beside a `config.json` to get a
/// model folder that [`super::BertModel::load`] reads.
///
/// # Errors
/// [`Error::Pretrained`] (with an empty path) when `config` fails [`BertConfig::check`];
/// [`Error::OutOfMemory`] or [`Error::Candle`] when the tensors cannot be made.
pub fn random_weights<R: Rng + ?Sized>(
    config: &BertConfig,
    device: &Device,
    rng: &mut R,
) -> Result<HashMap<String, Tensor>> {
    let mut tensors = HashMap::new();
    super::Frozen::build(config, &mut |name, shape| {
        let t = random_tensor(name, shape, device, rng)?;
        tensors.insert(name.to_string(), t.clone());
        Ok(t)
    })?;
    Ok(tensors)
}
