//! Data for the reference trainer: the UCI handwritten digits shipped with the crate
//! (`data/digits.csv`, CC BY 4.0, see `data/README.md`), deterministic splits and mini-batches,
//! and small synthetic problems for the optimizer tests.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use grng::error::{check_value, Error, Result};
use grng::mat::Mat;

/// The 8x8 digits: 1797 lines of 64 pixel counts in `0..=16`, then the class `0..=9`.
const DIGITS_CSV: &str = include_str!("../data/digits.csv");

/// A labelled classification data set.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// `n x d` features, one sample per row.
    pub x: Mat,
    /// `n` labels, each `< classes`.
    pub labels: Vec<usize>,
    /// Number of classes.
    pub classes: usize,
}

/// One standard normal draw (Box–Muller; `1 − u` keeps the logarithm's argument in `(0, 1]`).
pub(crate) fn standard_normal<R: Rng + ?Sized>(rng: &mut R) -> f64 {
    let u1 = 1.0 - rng.random::<f64>();
    let u2 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The UCI handwritten digits (1797 samples, 64 features, 10 classes), pixels scaled from
/// `0..=16` to `[0, 1]`. Parsed from the copy embedded at build time.
///
/// # Errors
/// [`Error::Shape`] if the embedded file is malformed (it is checked by the tests).
pub fn digits() -> Result<Dataset> {
    const D: usize = 64;
    let bad = |line: usize, what: &str| Error::Shape {
        op: "data::digits",
        arg: "digits.csv",
        expected: "lines of 64 pixel counts in 0..=16 and a class in 0..=9".into(),
        got: format!("line {}: {what}", line + 1),
    };
    let mut x = Vec::with_capacity(1797 * D);
    let mut labels = Vec::with_capacity(1797);
    for (i, line) in DIGITS_CSV
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let fields: Vec<&str> = line.trim().split(',').collect();
        if fields.len() != D + 1 {
            return Err(bad(i, &format!("{} fields", fields.len())));
        }
        for f in &fields[..D] {
            let v: u8 = f.parse().map_err(|_| bad(i, f))?;
            if v > 16 {
                return Err(bad(i, f));
            }
            x.push(v as f32 / 16.0);
        }
        let c: usize = fields[D].parse().map_err(|_| bad(i, fields[D]))?;
        if c > 9 {
            return Err(bad(i, fields[D]));
        }
        labels.push(c);
    }
    let n = labels.len();
    Dataset::new(Mat::from_vec(x, n, D)?, labels, 10)
}

impl Dataset {
    /// Validates and wraps `x` (`n x d`) with `n` labels `< classes`.
    ///
    /// # Errors
    /// [`Error::Shape`] when the label count differs from the rows of `x`; [`Error::Value`] for
    /// `classes = 0` or a label `≥ classes`; [`Error::NonFinite`] for NaN/Inf features.
    pub fn new(x: Mat, labels: Vec<usize>, classes: usize) -> Result<Self> {
        const OP: &str = "Dataset::new";
        grng::error::check_len(OP, "labels", labels.len(), x.rows())?;
        check_value(
            OP,
            "classes",
            classes as f64,
            classes > 0,
            "at least one class",
        )?;
        if let Some(&bad) = labels.iter().find(|&&y| y >= classes) {
            return Err(Error::Value {
                op: OP,
                arg: "labels",
                value: bad as f64,
                expected: "labels < classes",
            });
        }
        grng::error::check_finite(OP, "x", x.as_slice())?;
        Ok(Self { x, labels, classes })
    }
    /// Number of samples `n`.
    pub fn len(&self) -> usize {
        self.labels.len()
    }
    /// Whether the data set has no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
    /// Feature dimension `d`.
    pub fn dim(&self) -> usize {
        self.x.cols()
    }

    /// The rows `indices` as a `len x d` matrix and their labels.
    ///
    /// # Errors
    /// [`Error::Value`] for an index `≥ n` (nothing is built).
    pub fn gather(&self, indices: &[usize]) -> Result<(Mat, Vec<usize>)> {
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len()) {
            return Err(Error::Value {
                op: "Dataset::gather",
                arg: "indices",
                value: bad as f64,
                expected: "indices < the number of samples",
            });
        }
        let d = self.dim();
        let mut x = Vec::with_capacity(indices.len() * d);
        for &i in indices {
            x.extend_from_slice(self.x.as_ref().row(i));
        }
        let labels = indices.iter().map(|&i| self.labels[i]).collect();
        Ok((Mat::from_vec(x, indices.len(), d)?, labels))
    }

    /// Shuffled split into `(train, validation, test)`, deterministic in `seed`: the first
    /// `round(train·n)` samples of a seeded permutation train, the next `round(val·n)` validate,
    /// the rest test. `fractions = (train, val)` with both ≥ 0 and `train + val ≤ 1`.
    ///
    /// # Errors
    /// [`Error::Value`] for fractions outside that range.
    pub fn split(&self, seed: u64, fractions: (f64, f64)) -> Result<(Dataset, Dataset, Dataset)> {
        const OP: &str = "Dataset::split";
        let (ft, fv) = fractions;
        check_value(
            OP,
            "fractions.0",
            ft,
            (0.0..=1.0).contains(&ft),
            "in [0, 1]",
        )?;
        check_value(
            OP,
            "fractions.1",
            fv,
            (0.0..=1.0).contains(&fv),
            "in [0, 1]",
        )?;
        check_value(
            OP,
            "fractions",
            ft + fv,
            ft + fv <= 1.0 + 1e-12,
            "a sum <= 1",
        )?;
        let n = self.len();
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        let n_train = ((ft * n as f64).round() as usize).min(n);
        let n_val = ((fv * n as f64).round() as usize).min(n - n_train);
        let part = |idx: &[usize]| -> Result<Dataset> {
            let (x, labels) = self.gather(idx)?;
            Ok(Dataset {
                x,
                labels,
                classes: self.classes,
            })
        };
        Ok((
            part(&order[..n_train])?,
            part(&order[n_train..n_train + n_val])?,
            part(&order[n_train + n_val..])?,
        ))
    }

    /// Mini-batches of sample indices for one epoch: a permutation deterministic in
    /// `(seed, epoch)` cut into batches of `batch_size` (the last one may be shorter).
    ///
    /// # Errors
    /// [`Error::Value`] for `batch_size = 0`.
    pub fn batches(&self, seed: u64, epoch: u64, batch_size: usize) -> Result<Batches> {
        check_value(
            "Dataset::batches",
            "batch_size",
            batch_size as f64,
            batch_size > 0,
            "at least 1",
        )?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // One ChaCha stream per epoch: independent permutations from one seed.
        rng.set_stream(epoch);
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.shuffle(&mut rng);
        Ok(Batches {
            order,
            batch_size,
            pos: 0,
        })
    }
}

/// Iterator over one epoch's index batches (see [`Dataset::batches`]).
#[derive(Clone, Debug)]
pub struct Batches {
    order: Vec<usize>,
    batch_size: usize,
    pos: usize,
}

impl Iterator for Batches {
    type Item = Vec<usize>;
    fn next(&mut self) -> Option<Vec<usize>> {
        if self.pos >= self.order.len() {
            return None;
        }
        let end = (self.pos + self.batch_size).min(self.order.len());
        let batch = self.order[self.pos..end].to_vec();
        self.pos = end;
        Some(batch)
    }
}

/// Gaussian blobs: `n` samples in `d` dimensions, `classes` balanced classes (sample `i` has
/// class `i mod classes`). Class centres lie on the unit sphere (the most spread of 64 seeded
/// draws), samples are centre + `N(0, 0.2² I)`: isotropic, unit-scale features, learnable to
/// high accuracy when the centres are well apart (`d ≥ 4`, a handful of classes).
///
/// # Errors
/// [`Error::Value`] for `n`, `d` or `classes` equal to 0.
pub fn synthetic_classification(n: usize, d: usize, classes: usize, seed: u64) -> Result<Dataset> {
    const OP: &str = "data::synthetic_classification";
    check_value(OP, "n", n as f64, n > 0, "at least 1")?;
    check_value(OP, "d", d as f64, d > 0, "at least 1")?;
    check_value(OP, "classes", classes as f64, classes > 0, "at least 1")?;
    const NOISE: f64 = 0.2;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut best: (f64, Vec<f64>) = (f64::NEG_INFINITY, Vec::new());
    for _ in 0..64 {
        let mut centres = vec![0.0f64; classes * d];
        for c in centres.chunks_mut(d) {
            c.iter_mut().for_each(|v| *v = standard_normal(&mut rng));
            let norm = c.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-12);
            c.iter_mut().for_each(|v| *v /= norm);
        }
        let mut min_dist = f64::INFINITY;
        for i in 0..classes {
            for j in 0..i {
                let dist: f64 = (0..d)
                    .map(|q| (centres[i * d + q] - centres[j * d + q]).powi(2))
                    .sum();
                min_dist = min_dist.min(dist);
            }
        }
        if min_dist > best.0 {
            best = (min_dist, centres);
        }
    }
    let centres = best.1;
    let mut x = Vec::with_capacity(n * d);
    let mut labels = Vec::with_capacity(n);
    for i in 0..n {
        let c = i % classes;
        for q in 0..d {
            x.push((centres[c * d + q] + NOISE * standard_normal(&mut rng)) as f32);
        }
        labels.push(c);
    }
    Dataset::new(Mat::from_vec(x, n, d)?, labels, classes)
}

/// Linear regression data `y = W x + b + noise·ε`: returns `(x, y, w_true)` with `x` `n x d`
/// (`N(0, 1)` entries), `y` `n x d_o` and `w_true = [W b]` `d_o x (d + 1)` — the augmented layout
/// of a one-layer [`Mlp`](crate::mlp::Mlp), whose parameters should converge to it. `W` has
/// `N(0, 1/d)` entries, `b` `N(0, 0.25)`, `ε` is standard normal.
///
/// # Errors
/// [`Error::Value`] for a zero size or a negative / non-finite `noise`.
pub fn linear_regression(
    n: usize,
    d: usize,
    d_o: usize,
    noise: f32,
    seed: u64,
) -> Result<(Mat, Mat, Mat)> {
    const OP: &str = "data::linear_regression";
    check_value(OP, "n", n as f64, n > 0, "at least 1")?;
    check_value(OP, "d", d as f64, d > 0, "at least 1")?;
    check_value(OP, "d_o", d_o as f64, d_o > 0, "at least 1")?;
    check_value(
        OP,
        "noise",
        noise as f64,
        noise >= 0.0,
        "a finite number >= 0",
    )?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut w = Mat::zeros(d_o, d + 1);
    let scale = 1.0 / (d as f64).sqrt();
    for (i, v) in w.as_mut_slice().iter_mut().enumerate() {
        let s = if i % (d + 1) == d { 0.5 } else { scale };
        *v = (s * standard_normal(&mut rng)) as f32;
    }
    let mut x = Mat::zeros(n, d);
    x.as_mut_slice()
        .iter_mut()
        .for_each(|v| *v = standard_normal(&mut rng) as f32);
    let mut y = Mat::zeros(n, d_o);
    for k in 0..n {
        let xk = x.as_ref().row(k);
        for j in 0..d_o {
            let wj = w.as_ref().row(j);
            let dot: f64 = xk.iter().zip(wj).map(|(&a, &b)| a as f64 * b as f64).sum();
            let val = dot + wj[d] as f64 + noise as f64 * standard_normal(&mut rng);
            y.as_mut().row_mut(k)[j] = val as f32;
        }
    }
    Ok((x, y, w))
}
