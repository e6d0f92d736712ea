//! The CUDA backend: the kernels of `kernels/*.cu` driven through cudarc, or executed on the
//! CPU by the emulator (`kernels/emu/`) for [`crate::Device::Emulated`].
//!
//! cudarc is built with dynamic loading, so nothing here needs a CUDA library at build
//! time or on a machine without a GPU; [`CudaDevice::new`] reports a clear error there.
//!
//! Layers: [`launch`] (the argument list and the one `launch` that dispatches to the emulator
//! or the GPU, over the runtime of [`crate::driver`]), `deferred` (status read-backs, now or
//! collected), [`engine`] (the tensor-core GEMM engine's shared pieces); one launcher file per kernel
//! file above them, [`gemm_vendor`] (cuBLAS) beside them, and [`gemm_plan`] (which of
//! `gemm` and `gemm_vendor` runs a product) above both (see `kernels/README.md` and docs/architecture.md).

#[cfg(feature = "test-hooks")]
pub mod anatomy;
pub mod cholesky;
pub(crate) mod deferred;
pub mod elementwise;
pub mod engine;
pub mod gemm;
pub mod gemm_plan;
pub mod gemm_vendor;
pub mod kalman;
pub mod launch;
pub mod newton;
#[cfg(feature = "test-hooks")]
pub mod selftest;
pub mod sm90;
pub mod syrk;
#[cfg(feature = "test-hooks")]
pub mod timing;

pub use crate::driver::{emu, ptx, CudaDevice};

/// Loads the module of every kernel file the ops use (through one kernel of each), so that a
/// driver rejecting the PTX is found when [`crate::Device::auto`] picks a device, not at the
/// first step.
pub(crate) fn load_modules(d: &CudaDevice) -> crate::Result<()> {
    for k in [
        elementwise::AXPY,
        kalman::SOLVE,
        syrk::SYRK_EMA_F32,
        newton::RESIDUAL,
        gemm::GEMM_NN,
    ] {
        d.preload(&k)?;
    }
    Ok(())
}

/// The kernels with an sm_90a variant (`Kernel::sm90`), each decided on its own.
pub const SM90_KERNELS: [&crate::driver::kernel::Kernel; 5] = [
    &gemm::GEMM3_TC,
    &gemm::GEMM_TC,
    &newton::GEMM_TC,
    &newton::GEMM3_TC,
    &syrk::SYRK_EMA_TC,
];

/// Decides now, for each of [`SM90_KERNELS`], which path `device` runs it on (its variant's
/// self-check, on first use: [`sm90`]) and tells whether all of them run sm_90a there.
/// Benchmarks and test kits call it before timing or recording launches, so the self-checks'
/// launches stay out of their first measurement.
///
/// # Errors
/// Only when a self-check's sm_80 side fails (that variant is not decided then).
pub fn check_sm90(device: &crate::Device) -> crate::Result<bool> {
    let mut all = true;
    for kernel in SM90_KERNELS {
        all &= sm90::runs_sm90(kernel, device)?;
    }
    Ok(all)
}
