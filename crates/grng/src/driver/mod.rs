//! The CUDA runtime below both backends and the device layer: a CUDA device and its stream
//! ([`CudaDevice`]), kernel launches through the driver API (modules loaded lazily from the
//! embedded PTX, [`ptx`], functions cached by name), the kernel descriptors ([`kernel`]) and
//! the emulator's entry points ([`emu`]). Names nothing above `error`, `element` and
//! `hooks`: `crate::cuda`'s launchers build on it, `crate::device` holds its [`CudaDevice`].

pub mod emu;
pub mod kernel;
pub mod ptx;

use crate::element::Element;
use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;
use kernel::{check_module_load, ptx_rejected, Kernel, LaunchConfig};
use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

/// A loaded kernel and its dynamic shared memory limit (the driver's default until a launch
/// needs more and raises it).
struct Loaded {
    func: CudaFunction,
    shared_limit: u32,
}

#[derive(Default)]
struct Cache {
    modules: HashMap<&'static str, Arc<CudaModule>>,
    functions: HashMap<&'static str, Loaded>,
    /// The cuSOLVER handle on this device's stream, made on first use (`cuda::cholesky`).
    cusolver: Option<Arc<cudarc::cusolver::DnHandle>>,
    /// The cuBLAS handle on this device's stream, made on first use (`cuda::gemm_vendor`).
    cublas: Option<Arc<cudarc::cublas::CudaBlas>>,
}

/// Whether libcuda can be loaded: with dynamic loading the first real driver call would panic
/// if it could not. cudarc's own probe exists only under its `dynamic-loading` feature, which
/// candle's CUDA build (`dynamic-linking`, libcuda linked, so always present) turns off.
fn culib_present() -> bool {
    // The driver's names: Linux (the unversioned one comes only with a toolkit), Windows.
    ["libcuda.so.1", "libcuda.so", "nvcuda.dll"]
        .iter()
        // SAFETY: loading libcuda runs only its initialisers, as cudarc's own probe does.
        .any(|name| unsafe { libloading::Library::new(*name) }.is_ok())
}

/// The kernels' PTX is in the binary, or the error saying how to get it there.
fn kernels_built() -> Result<()> {
    if ptx::BUILT {
        return Ok(());
    }
    Err(Error::DeviceUnavailable(
        "grng was built without its CUDA kernels (no CUDA compiler at build time): run \
         scripts/install-cuda-tools.sh, export the GRNG_CUDA_TOOLS it prints, and rebuild"
            .into(),
    ))
}

/// A CUDA GPU with the stream its work is queued on: the context's default stream
/// ([`CudaDevice::new`]) or one shared with another library ([`CudaDevice::from_stream`]).
#[derive(Clone)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    cache: Arc<Mutex<Cache>>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

impl CudaDevice {
    /// The cuSOLVER handle on this device's stream, created on the first call and kept with
    /// the device (creating one costs about a millisecond: not per inverse). The caller checked
    /// that libcusolver loads (`cuda::cholesky::available`).
    pub(crate) fn cusolver_handle(&self) -> Result<Arc<cudarc::cusolver::DnHandle>> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(h) = &cache.cusolver {
            return Ok(h.clone());
        }
        let h = Arc::new(
            cudarc::cusolver::DnHandle::new(self.stream.clone())
                .map_err(|e| Error::Cuda(format!("cusolverDnCreate: {e}")))?,
        );
        cache.cusolver = Some(h.clone());
        Ok(h)
    }

    /// The GPU's ordinal (as given to [`CudaDevice::new`]).
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The cuBLAS handle on this device's stream, created on the first call and kept with the
    /// device, as [`CudaDevice::cusolver_handle`]. The caller checked that libcublas loads
    /// (`cuda::gemm_vendor::available`).
    pub(crate) fn cublas_handle(&self) -> Result<Arc<cudarc::cublas::CudaBlas>> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(h) = &cache.cublas {
            return Ok(h.clone());
        }
        let h = Arc::new(
            cudarc::cublas::CudaBlas::new(self.stream.clone())
                .map_err(|e| Error::Cuda(format!("cublasCreate: {e}")))?,
        );
        cache.cublas = Some(h.clone());
        Ok(h)
    }

    /// Opens GPU `ordinal`. Errors (never panics) when the kernels were not compiled at build
    /// time, or libcuda or a GPU is absent.
    ///
    /// The device's default memory pool, which cudarc's stream-ordered allocations come from,
    /// is set to keep the memory it has reserved ([`CudaDevice::pool_release_threshold`]:
    /// `u64::MAX`): with the driver's default of 0 the pool hands every free byte back at each
    /// synchronization — every read-back of a status — and the next allocation maps it again.
    /// grng allocates per op (results are built beside the state and swapped in on success),
    /// so that re-mapping would come with nearly every op. The pool is the device's, shared
    /// by everything in the process that allocates through it (candle through cudarc too),
    /// and holds its peak: memory freed here is reused here, not returned to other processes.
    ///
    /// cudarc's cross-stream event tracking is off for this device's context (grng works on
    /// one stream; with tracking each allocation would create and destroy two CUDA events):
    /// a caller that makes another stream on [`CudaDevice::context`] and uses grng's
    /// buffers there synchronizes the two streams itself.
    pub fn new(ordinal: usize) -> Result<Self> {
        kernels_built()?;
        if !culib_present() {
            return Err(Error::DeviceUnavailable(
                "no CUDA driver (libcuda) found on this machine".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: cudarc's cross-stream events synchronize buffers used on several streams
        // of one context object. This object is grng's own (made here), and grng queues all
        // its work on the one default stream below and creates no other, so the events would
        // never be waited on — but with tracking on every allocation creates two of them
        // (and its drop destroys them): four driver calls per buffer, and grng allocates per
        // op. A stream made on `context()` by the caller must not share grng's buffers
        // unsynchronized (documented above).
        unsafe { ctx.disable_event_tracking() };
        if ctx.has_async_alloc() {
            let mut keep_all = u64::MAX;
            pool_release_threshold(&ctx, sys::cuMemPoolSetAttribute, &mut keep_all)?;
        }
        Ok(Self::on(ctx.default_stream()))
    }

    /// The release threshold of this device's default memory pool (bytes it keeps reserved
    /// across synchronizations; see [`CudaDevice::new`]), or `None` where the device has no
    /// stream-ordered allocator.
    ///
    /// # Errors
    /// [`Error::Cuda`] for a driver error.
    pub fn pool_release_threshold(&self) -> Result<Option<u64>> {
        if !self.ctx.has_async_alloc() {
            return Ok(None);
        }
        let mut value = 0u64;
        pool_release_threshold(&self.ctx, sys::cuMemPoolGetAttribute, &mut value)?;
        Ok(Some(value))
    }

    /// The device of `stream`'s context that queues every launch, allocation and copy on
    /// `stream`, a stream another library already works on (candle's: `grng_candle` with the
    /// grng-candle `cuda` feature). On the same stream grng's kernels run in order with that
    /// library's own work on the buffers they share — a tensor it has just written is read
    /// after the write — with no event or synchronization between them, and that still holds
    /// where its cross-stream event tracking is off (candle's `disable_event_tracking`); on a
    /// stream of grng's own ([`CudaDevice::new`]) the two would race there. Errors when the
    /// kernels were not compiled at build time.
    pub fn from_stream(stream: Arc<CudaStream>) -> Result<Self> {
        kernels_built()?;
        Ok(Self::on(stream))
    }

    fn on(stream: Arc<CudaStream>) -> Self {
        Self {
            ctx: stream.context().clone(),
            stream,
            cache: Arc::new(Mutex::new(Cache::default())),
        }
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch and copy of this device is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits until all queued work has finished.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    // The raw driver error, so that `Device` can tell an out-of-memory refusal from the rest.
    pub(crate) fn upload<T: Element>(
        &self,
        host: &[T],
    ) -> std::result::Result<CudaSlice<T>, DriverError> {
        self.stream.clone_htod(host)
    }

    pub(crate) fn zeros<T: Element>(
        &self,
        len: usize,
    ) -> std::result::Result<CudaSlice<T>, DriverError> {
        self.stream.alloc_zeros(len)
    }

    /// `len` elements of device memory as allocated, no memset queued (`Device::scratch`).
    pub(crate) fn scratch<T: Element>(
        &self,
        len: usize,
    ) -> std::result::Result<CudaSlice<T>, DriverError> {
        // SAFETY: cudarc leaves the memory unset; every bit pattern is a valid `T` (`Pod`), and
        // the callers' kernels write each element before anything reads it. Stream-ordered
        // like `alloc_zeros`'s allocation.
        unsafe { self.stream.alloc(len) }
    }

    /// Loads `kernel`'s module and function now (cached), so that a driver rejecting its PTX
    /// is found when a device is picked, not at the first step.
    pub(crate) fn preload(&self, kernel: &Kernel) -> Result<()> {
        self.function(kernel, 0).map(drop)
    }

    /// The function of `kernel`, loading its file's module on first use, with its dynamic
    /// shared memory limit raised to at least `shared_mem`.
    fn function(&self, kernel: &Kernel, shared_mem: u32) -> Result<CudaFunction> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if !cache.functions.contains_key(kernel.name) {
            let module = match cache.modules.get(kernel.file) {
                Some(m) => m.clone(),
                None => {
                    let ptx = kernel.ptx.ok_or_else(|| {
                        Error::DeviceUnavailable(format!(
                            "the PTX of kernel file {} was not built",
                            kernel.file
                        ))
                    })?;
                    check_module_load(kernel)?;
                    // A rejected PTX (e.g. built for a newer PTX ISA than the driver knows)
                    // means these kernels cannot run here at all: say which file and why.
                    let m = self
                        .ctx
                        .load_module(Ptx::from_src(ptx))
                        .map_err(|e| ptx_rejected(kernel.file, &e))?;
                    cache.modules.insert(kernel.file, m.clone());
                    m
                }
            };
            let func = module.load_function(kernel.name)?;
            // Not a fixed 48 KiB: the default is 48 KiB less the kernel's static shared
            // memory (a block reduction's scratch), so a GEMM's 48 KiB of dynamic stages
            // beside 128 static bytes must raise it (else CUDA_ERROR_INVALID_VALUE at launch,
            // as on an H200 on 2026-11-27). Read from the driver, which knows both.
            let limit = func.get_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            )?;
            cache.functions.insert(
                kernel.name,
                Loaded {
                    func,
                    shared_limit: u32::try_from(limit).unwrap_or(0),
                },
            );
        }
        let loaded = cache
            .functions
            .get_mut(kernel.name)
            .expect("inserted above");
        if shared_mem > loaded.shared_limit {
            loaded.func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                i32::try_from(shared_mem).unwrap_or(i32::MAX),
            )?;
            loaded.shared_limit = shared_mem;
        }
        Ok(loaded.func.clone())
    }

    /// Queues `kernel` on this device's stream.
    ///
    /// # Safety
    /// `params` must hold one pointer per kernel parameter, in order, each pointing at a value
    /// of that parameter's type, live until this returns; device pointers among them must
    /// stay allocated until the kernel has run and cover every access it makes under `cfg`.
    pub(crate) unsafe fn launch(
        &self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let func = self.function(kernel, cfg.shared_mem)?;
        self.ctx.bind_to_thread()?;
        // SAFETY: `func` belongs to this context, now current; the stream is this context's;
        // cuLaunchKernel copies the parameter values before returning, and the caller
        // guarantees they match the kernel's signature and bounds.
        unsafe {
            cudarc::driver::result::launch_kernel(
                func.cu_function(),
                cfg.grid,
                cfg.block,
                cfg.shared_mem,
                self.stream.cu_stream(),
                params,
            )
        }
        .map_err(|e| Error::Cuda(format!("launching {}: {e}", kernel.name)))
    }
}

/// `get_or_set` (`cuMemPoolGetAttribute` or `cuMemPoolSetAttribute`) of the release
/// threshold of `ctx`'s device's default memory pool (cudarc's stream-ordered allocations),
/// through `value`.
fn pool_release_threshold(
    ctx: &CudaContext,
    get_or_set: unsafe fn(
        sys::CUmemoryPool,
        sys::CUmemPool_attribute,
        *mut std::ffi::c_void,
    ) -> sys::CUresult,
    value: &mut u64,
) -> Result<()> {
    ctx.bind_to_thread()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `cu_device` is the context's valid device handle and `pool` an out-pointer; then
    // `pool` is that device's default pool, and the release threshold is a cuuint64_t read or
    // written through `value` during the call.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        get_or_set(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (value as *mut u64).cast(),
        )
        .result()?;
    }
    Ok(())
}
