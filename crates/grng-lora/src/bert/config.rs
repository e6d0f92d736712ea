//! [`BertConfig`] (a checkpoint's `config.json`) and [`AdaptConfig`] (where the adapters go).

use crate::pretrained;
use grng::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The architecture of a BERT encoder: the fields of a Hugging Face `config.json` that the
/// forward pass reads (others in the file are ignored).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BertConfig {
    /// Rows of the word-embedding table.
    pub vocab_size: usize,
    /// Width `h` of every hidden state.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads; `hidden_size` is a multiple of it.
    pub num_attention_heads: usize,
    /// Width of the feed-forward block.
    pub intermediate_size: usize,
    /// Longest sequence the position table covers.
    pub max_position_embeddings: usize,
    /// Rows of the token-type (segment) table.
    pub type_vocab_size: usize,
    /// ε of every LayerNorm.
    pub layer_norm_eps: f64,
    /// The feed-forward activation: only `"gelu"` (exact, erf-based, as Hugging Face's) is
    /// supported.
    pub hidden_act: String,
}

impl BertConfig {
    /// Reads and checks `path` (a `config.json`).
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read; [`Error::Pretrained`] when it is not JSON, lacks a
    /// field, or describes a model [`BertConfig::check`] refuses.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let config: Self = serde_json::from_str(&text)
            .map_err(|e| pretrained(path, format!("not a BERT config.json: {e}")))?;
        config.check().map_err(|reason| pretrained(path, reason))?;
        Ok(config)
    }

    /// Whether the forward pass can run this architecture: every size ≥ 1, `hidden_size` a
    /// multiple of `num_attention_heads`, `layer_norm_eps` finite and > 0, `hidden_act` =
    /// `"gelu"`. The reason names the field.
    pub fn check(&self) -> std::result::Result<(), String> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(format!("`{name}` = 0, expected ≥ 1"));
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "`hidden_size` = {} is not a multiple of `num_attention_heads` = {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return Err(format!(
                "`layer_norm_eps` = {}, expected finite and > 0",
                self.layer_norm_eps
            ));
        }
        if self.hidden_act != "gelu" {
            return Err(format!(
                "`hidden_act` = {:?} is not supported, expected \"gelu\"",
                self.hidden_act
            ));
        }
        Ok(())
    }

    /// `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}

/// Which projections of an adapted layer get LoRA adapters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Adapt {
    /// The attention's query and value (the paper's and LoRA's own setup).
    #[default]
    QueryValue,
    /// Every projection: query, key, value, attention output, intermediate, output.
    All,
}

/// Where the adapters go: which projections, in which layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdaptConfig {
    /// The projections adapted in each adapted layer.
    pub adapt: Adapt,
    /// Adapt only the top `k` encoder layers (`k ≤ num_hidden_layers`); `None`: all. With the
    /// lower layers frozen whole, their outputs can be cached
    /// ([`super::BertModel::embed_and_encode`]).
    pub top_layers: Option<usize>,
}

impl AdaptConfig {
    /// The first adapted layer of a `layers`-layer encoder.
    ///
    /// # Errors
    /// [`Error::Value`] when `top_layers` exceeds `layers`.
    pub(crate) fn first_layer(&self, layers: usize) -> Result<usize> {
        let k = self.top_layers.unwrap_or(layers);
        grng::error::check_value(
            "AdaptConfig",
            "top_layers",
            k as f64,
            k <= layers,
            "at most num_hidden_layers",
        )?;
        Ok(layers - k)
    }
}
