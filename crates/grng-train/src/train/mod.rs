//! Training glue: drives every optimizer of [`grng::optim`] with the reference MLP
//! ([`crate::mlp`]) through one uniform [`Trainer::step`], the main job's training loop
//! ([`train_method`]) and the hyperparameter sweep ([`sweep()`]).
//!
//! Per-method hyperparameters live in [`MethodConfig`]: [`MethodConfig::paper`] gives the
//! docs/math.md §6 defaults, [`MethodConfig::tuned`] the values the documented sweep chose on the
//! digits task (see [`hyper`]).

pub mod hyper;
mod method;
mod run;
mod sweep;
mod trainer;

pub use grng::optim::OptimizerConfig;
pub use hyper::{Knob, MethodConfig, DEFAULT_BATCH};
pub use method::{Method, UnknownMethod};
pub use run::{
    median, train_method, Checkpointing, CurvePoint, Dist, MethodResult, RunConfig, Splits, SPLIT,
};
pub use sweep::{best, sweep, SweepPoint};
pub use trainer::{Batch, StepReport, Trainer, TrainerCounters};

use grng::device::Device;
use grng::error::{Error, Result};

/// The device named `cpu`, `emulated`, `cuda` or `auto` (case-insensitive). `auto` is
/// [`Device::auto`] (the `GRNG_DEVICE` variable, else CUDA when usable, else the CPU).
///
/// # Errors
/// [`Error::DeviceUnavailable`] for an unknown name or a CUDA device that cannot be opened.
pub fn device_by_name(name: &str) -> Result<Device> {
    match name.trim().to_ascii_lowercase().as_str() {
        "cpu" => Ok(Device::Cpu),
        "emulated" => Ok(Device::Emulated),
        "cuda" => grng::cuda::CudaDevice::new(0).map(Device::Cuda),
        "auto" => Device::auto(),
        other => Err(Error::DeviceUnavailable(format!(
            "unknown device {other:?}: expected cpu, emulated, cuda or auto"
        ))),
    }
}
