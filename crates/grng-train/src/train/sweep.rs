//! The small hyperparameter sweep behind [`MethodConfig::tuned`] (grid in
//! [`MethodConfig::sweep_grid`], procedure in the [`super::hyper`] module docs).

use grng::device::Device;
use grng::error::Result;

use super::hyper::{Knob, MethodConfig};
use super::run::{train_method, MethodResult, RunConfig, Splits};
use super::Method;

/// One grid point and how it trained.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepPoint {
    /// The knob values of this point.
    pub values: Vec<(Knob, f32)>,
    /// Its run (validation curve, target clock; the test accuracy is not used to choose).
    pub result: MethodResult,
}

impl SweepPoint {
    /// Final validation accuracy, `NaN` for a failed run.
    pub fn val_acc(&self) -> f32 {
        match (&self.result.failure, self.result.last()) {
            (None, Some(p)) => p.val_acc,
            _ => f32::NAN,
        }
    }
    /// Final training loss, `NaN` for a failed run.
    pub fn train_loss(&self) -> f32 {
        match (&self.result.failure, self.result.last()) {
            (None, Some(p)) => p.train_loss,
            _ => f32::NAN,
        }
    }
}

/// Every point of `method`'s grid around [`MethodConfig::paper`], trained with `run`.
/// `progress(point, points)` is called before each point.
///
/// # Errors
/// As [`train_method`] (a failing point is recorded, not an error).
pub fn sweep(
    device: &Device,
    splits: &Splits,
    run: &RunConfig,
    method: Method,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<SweepPoint>> {
    let grid = MethodConfig::sweep_grid(method);
    let mut points: Vec<Vec<(Knob, f32)>> = vec![Vec::new()];
    for &(knob, values) in grid {
        points = points
            .into_iter()
            .flat_map(|p| {
                values.iter().map(move |&v| {
                    let mut q = p.clone();
                    q.push((knob, v));
                    q
                })
            })
            .collect();
    }
    let total = points.len();
    // Every point is the same method: one checkpoint file would be overwritten and resumed
    // across points. The sweep neither writes nor reads checkpoints.
    let run = &RunConfig {
        checkpoint: None,
        ..run.clone()
    };
    let mut out = Vec::with_capacity(total);
    for (i, values) in points.into_iter().enumerate() {
        progress(i, total);
        let mut config = MethodConfig::paper(method);
        for &(knob, v) in &values {
            config.set(knob, v)?;
        }
        let result = train_method(device, splits, run, config, &mut |_, _| {})?;
        out.push(SweepPoint { values, result });
    }
    Ok(out)
}

/// Index of the best point: highest final validation accuracy, then lowest final training
/// loss; failed points last. `None` for an empty slice.
pub fn best(points: &[SweepPoint]) -> Option<usize> {
    let key = |p: &SweepPoint| {
        let acc = p.val_acc();
        let loss = p.train_loss();
        (
            if acc.is_nan() { f32::NEG_INFINITY } else { acc },
            if loss.is_nan() { f32::INFINITY } else { loss },
        )
    };
    (0..points.len()).max_by(|&a, &b| {
        let (ka, kb) = (key(&points[a]), key(&points[b]));
        ka.0.total_cmp(&kb.0)
            .then(kb.1.total_cmp(&ka.1))
            .then(b.cmp(&a))
    })
}
