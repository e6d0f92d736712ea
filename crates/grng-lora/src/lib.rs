//! # grng-lora — LoRA fine-tuning of pretrained transformers with grng
//!
//! A BERT encoder in candle whose projections are frozen tensors or LoRA adapters
//! ([`grng_candle::LoraLinear`], each adapter a Kronecker layer of its own, so RING, RENG and
//! NGD precondition it with its own factors), loaded from a Hugging Face checkpoint folder
//! (`config.json`, `model.safetensors`, `tokenizer.json`); the model the experiment fine-tunes
//! is all-MiniLM-L6-v2, which `scripts/fetch-minilm.sh` downloads (issue 37, docs/lora.md).
//!
//! Depends on `grng`, `grng-candle`, candle 0.11, `serde_json` (the config) and `tokenizers`
//! (built without its network, progress-bar and C features).
//!
//! - [`BertModel`]: the encoder ([`BertModel::load`], [`BertModel::random`] for tests),
//!   [`BertModel::forward`] and its two halves for caching the frozen lower layers,
//!   [`mean_pool`] (sentence-transformers' pooling), [`BertModel::adapters`] for the optimizer.
//! - [`BertTokenizer`]: batch encoding with truncation and padding into candle tensors.
//!
//! Bad input (a missing folder, a checkpoint of another architecture, a tokenizer of another
//! vocabulary) is a [`grng::Error::Pretrained`] naming the file and the tensor or token.
//!
//! Where things are: `bert/config.rs` (config, adapter placement), `bert/weights.rs` (named
//! tensors: loading, random init), `bert/mod.rs` (the forward pass), `tokenize.rs`; tests
//! `tests/bert.rs` (tiny random models, no download) and `tests/minilm.rs` (the real model
//! against `tests/fixtures/minilm-reference.json`, made by `scripts/minilm-reference.py`).

mod bert;
mod classifier;
pub mod sentiment;
mod tokenize;

pub use bert::{
    mean_pool, random_weights, Adapt, AdaptConfig, BertConfig, BertModel, Pass, WEIGHTS_FILE,
};
pub use classifier::SentenceClassifier;
pub use grng_candle::{LoraConfig, LoraLinear};
pub use tokenize::{BertTokenizer, Encoded};

use grng::{Error, Result};
use std::path::{Path, PathBuf};

/// What `scripts/fetch-minilm.sh` fills by default: `${GRNG_CACHE:-$HOME/.cache/grng}`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("GRNG_CACHE").map_or_else(
        || {
            let home = std::env::var_os("HOME").unwrap_or_default();
            Path::new(&home).join(".cache/grng")
        },
        PathBuf::from,
    )
}

/// The model's folder: `$GRNG_MINILM` when set, else `scripts/fetch-minilm.sh`'s default,
/// [`cache_dir`]`/all-MiniLM-L6-v2`.
pub fn minilm_dir() -> PathBuf {
    std::env::var_os("GRNG_MINILM")
        .map_or_else(|| cache_dir().join("all-MiniLM-L6-v2"), PathBuf::from)
}

/// [`Error::Pretrained`] on `path`.
pub(crate) fn pretrained(path: &Path, reason: impl Into<String>) -> Error {
    Error::Pretrained {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// `dir/name`, after checking that the folder and the file exist: a missing folder's error
/// says how to get the model.
pub(crate) fn model_file(dir: &Path, name: &str) -> Result<PathBuf> {
    if !dir.is_dir() {
        return Err(pretrained(
            dir,
            "no such model folder: scripts/fetch-minilm.sh [DIR] downloads all-MiniLM-L6-v2 \
             (into ${GRNG_CACHE:-$HOME/.cache/grng}/all-MiniLM-L6-v2 by default; \
             GRNG_MINILM names another folder)",
        ));
    }
    let path = dir.join(name);
    if !path.is_file() {
        return Err(pretrained(
            &path,
            "missing from the model folder (scripts/fetch-minilm.sh fetches a complete one)",
        ));
    }
    Ok(path)
}

/// candle's results as grng's: its errors become [`Error::Candle`].
pub(crate) trait Candle<T> {
    /// The value, or candle's error as [`Error::Candle`].
    fn grng(self) -> Result<T>;
}

impl<T> Candle<T> for candle_core::Result<T> {
    fn grng(self) -> Result<T> {
        self.map_err(|e| Error::Candle(e.to_string()))
    }
}
