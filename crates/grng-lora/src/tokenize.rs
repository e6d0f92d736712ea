//! [`BertTokenizer`]: a checkpoint's `tokenizer.json` (Hugging Face `tokenizers`), checked
//! against the model's config, encoding batches into candle tensors.

use crate::{model_file, pretrained, BertConfig, Candle};
use candle_core::{Device, Tensor};
use grng::{Error, Result};
use std::path::Path;
use std::str::FromStr;
use tokenizers::{
    PaddingDirection, PaddingParams, PaddingStrategy, Tokenizer, TruncationDirection,
    TruncationParams, TruncationStrategy,
};

/// A batch of encoded texts, each tensor `batch x seq` (u32, row-major), `seq` the longest
/// encoding of the batch: what [`crate::BertModel::forward`] takes.
#[derive(Clone, Debug)]
pub struct Encoded {
    /// Token ids, `[CLS] … [SEP]` then `[PAD]`s.
    pub ids: Tensor,
    /// Token-type (segment) ids: 0 for a single text.
    pub type_ids: Tensor,
    /// 1 for a token, 0 for padding.
    pub mask: Tensor,
}

/// A BERT WordPiece tokenizer whose vocabulary is the model's, truncating to a maximum length
/// and padding each batch to its longest text.
pub struct BertTokenizer {
    tokenizer: Tokenizer,
}

/// The special tokens every BERT tokenizer must know.
const SPECIAL: [&str; 3] = ["[CLS]", "[SEP]", "[PAD]"];

impl BertTokenizer {
    /// The `tokenizer.json` of the model folder `dir`, as [`BertTokenizer::from_file`].
    ///
    /// # Errors
    /// [`Error::Pretrained`] for a missing folder (saying how to fetch the model) or file;
    /// otherwise as [`BertTokenizer::from_file`].
    pub fn load(dir: &Path, config: &BertConfig, max_len: usize) -> Result<Self> {
        Self::from_file(&model_file(dir, "tokenizer.json")?, config, max_len)
    }

    /// The tokenizer in `path`, truncating every text to `max_len` tokens (with `[CLS]` and
    /// `[SEP]`), padding with `[PAD]` to the longest of the batch (its own truncation and
    /// padding settings are replaced).
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read; [`Error::Pretrained`] when it is not a tokenizer,
    /// its vocabulary size (added tokens included) is not `config.vocab_size`, it lacks one of
    /// `[CLS]`, `[SEP]`, `[PAD]`, or it does not frame a text as `[CLS] … [SEP]`;
    /// [`Error::Value`] for `max_len` < 3 (room for the two special tokens and one more) or
    /// above `config.max_position_embeddings`.
    pub fn from_file(path: &Path, config: &BertConfig, max_len: usize) -> Result<Self> {
        grng::error::check_value(
            "BertTokenizer",
            "max_len",
            max_len as f64,
            (3..=config.max_position_embeddings).contains(&max_len),
            "3 ≤ max_len ≤ max_position_embeddings",
        )?;
        let json = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let mut tokenizer = Tokenizer::from_str(&json)
            .map_err(|e| pretrained(path, format!("not a tokenizer.json: {e}")))?;
        let vocab = tokenizer.get_vocab_size(true);
        if vocab != config.vocab_size {
            return Err(pretrained(
                path,
                format!(
                    "vocabulary of {vocab} tokens, but the model's config.json has vocab_size = {}: \
                     a tokenizer of another model",
                    config.vocab_size
                ),
            ));
        }
        let [cls, sep, pad] = SPECIAL.map(|t| tokenizer.token_to_id(t));
        let (Some(cls), Some(sep), Some(pad)) = (cls, sep, pad) else {
            let absent = SPECIAL
                .iter()
                .filter(|t| tokenizer.token_to_id(t).is_none())
                .copied()
                .collect::<Vec<_>>();
            return Err(pretrained(
                path,
                format!("no {} token: not a BERT tokenizer", absent.join(", ")),
            ));
        };
        // The file's own truncation and padding (all-MiniLM-L6-v2's pads to 128) go: the
        // framing check sees the bare template, and ours replace them below.
        tokenizer.with_padding(None);
        let framed = tokenizer
            .encode("", true)
            .map_err(|e| pretrained(path, format!("cannot encode: {e}")))?;
        if framed.get_ids() != [cls, sep] {
            return Err(pretrained(
                path,
                format!(
                    "frames an empty text as {:?}, expected [CLS] [SEP] (ids {cls}, {sep}): \
                     not a BERT tokenizer",
                    framed.get_tokens()
                ),
            ));
        }
        tokenizer
            .with_truncation(Some(TruncationParams {
                direction: TruncationDirection::Right,
                max_length: max_len,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
            }))
            .map_err(|e| pretrained(path, format!("cannot truncate to {max_len}: {e}")))?;
        tokenizer.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            direction: PaddingDirection::Right,
            pad_to_multiple_of: None,
            pad_id: pad,
            pad_type_id: 0,
            pad_token: "[PAD]".into(),
        }));
        Ok(Self { tokenizer })
    }

    /// `texts` encoded, truncated and padded, as `batch x seq` u32 tensors on `device`.
    ///
    /// # Errors
    /// [`Error::Value`] for an empty batch; [`Error::Candle`] when `tokenizers` fails (it does
    /// not on valid UTF-8) or candle cannot make the tensors.
    pub fn encode<S: AsRef<str>>(&self, texts: &[S], device: &Device) -> Result<Encoded> {
        const OP: &str = "BertTokenizer::encode";
        grng::error::check_value(
            OP,
            "texts.len()",
            0.0,
            !texts.is_empty(),
            "at least one text",
        )?;
        let inputs = texts.iter().map(|t| t.as_ref()).collect::<Vec<_>>();
        let encodings = self
            .tokenizer
            .encode_batch(inputs, true)
            .map_err(|e| Error::Candle(format!("{OP}: tokenizers: {e}")))?;
        // Padding to the batch's longest makes every encoding this long.
        let seq = encodings[0].len();
        let tensor = |field: fn(&tokenizers::Encoding) -> &[u32]| -> Result<Tensor> {
            let mut flat = grng::error::try_vec(texts.len(), seq, 0u32)?;
            for (row, e) in flat.chunks_exact_mut(seq).zip(&encodings) {
                row.copy_from_slice(field(e));
            }
            Tensor::from_vec(flat, (texts.len(), seq), device).grng()
        };
        Ok(Encoded {
            ids: tensor(tokenizers::Encoding::get_ids)?,
            type_ids: tensor(tokenizers::Encoding::get_type_ids)?,
            mask: tensor(tokenizers::Encoding::get_attention_mask)?,
        })
    }
}
