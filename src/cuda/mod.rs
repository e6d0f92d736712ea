//! The CUDA backend: the kernels of `kernels/*.cu` driven through cudarc.
//!
//! cudarc is built with dynamic loading, so nothing here needs a CUDA library at build
//! time or on a machine without a GPU; [`CudaDevice::new`] reports a clear error there.

use crate::error::{Error, Result};
use crate::Element;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use std::sync::Arc;

/// A CUDA GPU with its default stream.
#[derive(Clone, Debug)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl CudaDevice {
    /// Opens GPU `ordinal`. Errors (never panics) when libcuda, a GPU or the kernels are absent.
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: only probes whether the shared library can be loaded; with dynamic loading
        // the first real driver call would panic if it could not.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::DeviceUnavailable(
                "no CUDA driver (libcuda) found on this machine".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.default_stream();
        Ok(Self { ctx, stream })
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn upload<T: Element>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    pub(crate) fn zeros<T: Element>(&self, len: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(len)?)
    }
}
