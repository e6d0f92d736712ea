//! The CUDA backend: the kernels of `kernels/*.cu` driven through cudarc, or executed on the
//! CPU by the emulator (`kernels/emu/`) for [`crate::Device::Emulated`].
//!
//! cudarc is built with dynamic loading, so nothing here needs a CUDA library at build
//! time or on a machine without a GPU; [`CudaDevice::new`] reports a clear error there.
//!
//! Layers: [`launch`] (launch config, argument list, [`launch::Kernel`] descriptors and the
//! one `launch` that dispatches to [`emu`] or [`driver`]); one launcher file per kernel file
//! above it (see `kernels/README.md`).

pub mod cusolver;
pub(crate) mod deferred;
pub mod driver;
pub mod elementwise;
pub mod emu;
pub mod kalman;
pub mod kron;
pub mod launch;
pub mod newton;
pub mod precond;
pub mod ptx;
#[cfg(feature = "emu-selftest")]
pub mod selftest;
pub mod sm90;
pub mod timing;

pub use driver::CudaDevice;
