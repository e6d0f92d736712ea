//! The task: sentence-level sentiment of movie-review snippets rated by people.
//!
//! `movieReviewSnippets_GroundTruth.txt` (Hutto & Gilbert, ICWSM 2014, shipped in the sdist of
//! the PyPI package `vaderSentiment==3.3.2`, MIT license; `scripts/fetch-minilm.sh` gets it):
//! 10,605 sentences of Rotten Tomatoes reviews (the review set of Pang & Lee 2004, the same
//! source as GLUE's SST-2), each with the mean of at least 20 human ratings on `[−4, 4]`.
//! A snippet is positive when the mean is `≥ +MARGIN`, negative when `≤ −MARGIN`; the
//! near-neutral ones between are dropped, as SST-2 drops its neutral phrases (10,072 remain,
//! 49.6% positive).

use grng::error::{Error, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};

/// The file's name inside the fetch script's `vader/` folder.
pub const FILE: &str = "movieReviewSnippets_GroundTruth.txt";

/// Mean ratings in `(−MARGIN, MARGIN)` are near-neutral and dropped.
pub const MARGIN: f32 = 0.5;

/// One labeled snippet.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    /// The sentence.
    pub text: String,
    /// 1 positive, 0 negative.
    pub label: u32,
    /// The raters' mean on `[−4, 4]`.
    pub rating: f32,
}

/// Where `scripts/fetch-minilm.sh` puts the file: `$GRNG_CACHE` (default `~/.cache/grng`)
/// `/vader/` [`FILE`].
pub fn default_path() -> PathBuf {
    crate::cache_dir().join("vader").join(FILE)
}

/// The labeled snippets of `path` (`id<TAB>mean<TAB>text` per line, CRLF or LF), in file
/// order, near-neutral ones dropped.
///
/// # Errors
/// [`Error::Pretrained`] naming the path and the fetch script when the file is missing;
/// [`Error::Io`] when it cannot be read; [`Error::Value`] naming the line of a malformed row
/// (not three fields, a rating that is not a finite number in `[−4, 4]`, an empty text).
pub fn load(path: &Path) -> Result<Vec<Example>> {
    const OP: &str = "sentiment::load";
    if !path.exists() {
        return Err(Error::Pretrained {
            path: path.to_path_buf(),
            reason: "no such file: run scripts/fetch-minilm.sh (it downloads vaderSentiment's \
                     sdist from PyPI and extracts the snippets), or pass --data"
                .into(),
        });
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.is_empty() {
            continue;
        }
        let bad = || Error::Value {
            op: OP,
            arg: "line",
            value: (i + 1) as f64,
            expected: "id<TAB>mean rating in [-4, 4]<TAB>non-empty text",
        };
        let mut fields = line.splitn(3, '\t');
        let (Some(_id), Some(rating), Some(sentence)) =
            (fields.next(), fields.next(), fields.next())
        else {
            return Err(bad());
        };
        let rating: f32 = rating.trim().parse().map_err(|_| bad())?;
        let sentence = sentence.trim();
        if !(rating.is_finite() && (-4.0..=4.0).contains(&rating)) || sentence.is_empty() {
            return Err(bad());
        }
        if rating.abs() < MARGIN {
            continue;
        }
        out.push(Example {
            text: sentence.to_string(),
            label: u32::from(rating > 0.0),
            rating,
        });
    }
    Ok(out)
}

/// A train / validation / test split.
#[derive(Clone, Debug)]
pub struct Splits {
    /// The training pool, shuffled: [`Splits::train`] takes a prefix, so smaller training
    /// sets are subsets of larger ones.
    pub pool: Vec<Example>,
    /// Validation examples (model selection, curves, time to target).
    pub val: Vec<Example>,
    /// Test examples (the table's accuracy and MCC).
    pub test: Vec<Example>,
}

impl Splits {
    /// Shuffles `examples` with `seed` (ChaCha8) and deals `test`, then `val`, then the rest as
    /// the training pool.
    ///
    /// # Errors
    /// [`Error::Value`] when fewer than `val + test + 1` examples are given.
    pub fn new(mut examples: Vec<Example>, seed: u64, val: usize, test: usize) -> Result<Self> {
        let n = examples.len();
        if n <= val + test {
            return Err(Error::Value {
                op: "Splits::new",
                arg: "examples",
                value: n as f64,
                expected: "more examples than val + test",
            });
        }
        examples.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        let pool = examples.split_off(val + test);
        let val_set = examples.split_off(test);
        Ok(Self {
            pool,
            val: val_set,
            test: examples,
        })
    }

    /// The first `n` examples of the training pool.
    ///
    /// # Errors
    /// [`Error::Value`] when the pool holds fewer than `n` (or `n = 0`).
    pub fn train(&self, n: usize) -> Result<&[Example]> {
        if n == 0 || n > self.pool.len() {
            return Err(Error::Value {
                op: "Splits::train",
                arg: "n",
                value: n as f64,
                expected: "1 ≤ n ≤ the training pool's size",
            });
        }
        Ok(&self.pool[..n])
    }
}

/// Matthews correlation coefficient of binary predictions (0 when a margin of the confusion
/// matrix is empty, as scikit-learn reports it).
pub fn mcc(pred: &[u32], truth: &[u32]) -> f64 {
    let (mut tp, mut tn, mut fp, mut fne) = (0.0f64, 0.0, 0.0, 0.0);
    for (&p, &t) in pred.iter().zip(truth) {
        match (p, t) {
            (1, 1) => tp += 1.0,
            (0, 0) => tn += 1.0,
            (1, _) => fp += 1.0,
            _ => fne += 1.0,
        }
    }
    let den = ((tp + fp) * (tp + fne) * (tn + fp) * (tn + fne)).sqrt();
    if den == 0.0 {
        0.0
    } else {
        (tp * tn - fp * fne) / den
    }
}
