//! One launch path for every kernel, on a GPU or in the emulator.
//!
//! A launcher (one per kernel, in `src/cuda/<file>.rs`) checks what its kernel's memory
//! safety needs (the arguments themselves are validated once, by [`crate::ops`]), computes a
//! [`LaunchConfig`], pushes the arguments in the kernel's parameter order into
//! [`KernelArgs`] and calls [`launch`]. Everything up to the final dispatch is shared by
//! [`Device::Emulated`] and [`Device::Cuda`]: the only difference is where the kernel body
//! executes. See `kernels/README.md` for the conventions.

use super::emu::{EmuBuffer, EmuEntry};
use crate::device::{Device, Element, Matrix, Storage};
use crate::error::{Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, SyncOnDrop};
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

/// Largest dynamic shared memory of one block (sm_90's opt-in limit, 227 KiB). Above 48 KiB
/// the driver path raises the kernel's limit before launching; sm_80 stops at 163 KiB.
pub const MAX_SHARED_MEM: u32 = 232_448;

/// Whether [`launch`] records kernel names (off by default: one relaxed load per launch).
static RECORDING: AtomicBool = AtomicBool::new(false);
/// Kernels launched since recording was last switched on or drained, in launch order.
static LAUNCHED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

fn record(name: &'static str) {
    LAUNCHED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(name);
}

/// Records `name` when recording is on: for work that is not a kernel of ours (a cuSOLVER
/// call, a host fallback), so the record shows it beside the kernels.
pub(crate) fn record_other(name: &'static str) {
    if RECORDING.load(Ordering::Relaxed) {
        record(name);
    }
}

/// Switches the launch record on (clearing it) or off. For benchmarks, which must name the
/// kernels that produced a timing and refuse to time a path that fell back to the host or to
/// another kernel (`benches/gpu.rs`). Process-wide: every thread's launches are recorded.
#[doc(hidden)]
pub fn record_launches(on: bool) {
    LAUNCHED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clear();
    RECORDING.store(on, Ordering::Relaxed);
}

/// The kernels launched (emulated or on a GPU) since the last call or
/// [`record_launches`]`(true)`, in order, and clears the record.
#[doc(hidden)]
pub fn take_launches() -> Vec<&'static str> {
    std::mem::take(&mut *LAUNCHED.lock().unwrap_or_else(PoisonError::into_inner))
}

thread_local! {
    /// Matrices this thread copied to the host with `Matrix::to_vec` ([`read_backs`]).
    static READ_BACKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts one `Matrix::to_vec` on this thread.
pub(crate) fn count_read_back() {
    READ_BACKS.with(|c| c.set(c.get() + 1));
}

/// How many matrices this thread has read to the host with `Matrix::to_vec` so far: every
/// status, scalar and result read-back of the kernel devices goes through it, and on a GPU
/// each is a device→host copy that waits for the stream. Per thread, so tests running in
/// parallel do not see each other's reads; CPU-device matrices count too (a host copy), so
/// compare counts around work on one kernel device. For tests of the synchronizations an op
/// costs (`tests/emu_deferred.rs`).
#[doc(hidden)]
pub fn read_backs() -> u64 {
    READ_BACKS.with(std::cell::Cell::get)
}

/// Whether a PTX rejection is being injected ([`inject_ptx_reject`]): one relaxed load per
/// emulated launch, and per module load on a GPU, when off.
static INJECTING: AtomicBool = AtomicBool::new(false);
/// The kernel file whose module load fails while [`INJECTING`] (`"*"`: every file).
static REJECTED_FILE: Mutex<Option<&'static str>> = Mutex::new(None);

/// Fault injection for tests: from now on, loading the module of kernel file `file` (its PTX
/// constant name, `"KALMAN"` for `kernels/kalman.cu`; `"*"` for every file) fails as a driver
/// that rejects its PTX would, on [`Device::Emulated`] (each launch stands for a module load)
/// and on [`Device::Cuda`] (before the driver is asked); `None` stops it. Process-wide: use it
/// in a test binary whose other tests launch no kernel meanwhile.
#[doc(hidden)]
pub fn inject_ptx_reject(file: Option<&'static str>) {
    *REJECTED_FILE.lock().unwrap_or_else(PoisonError::into_inner) = file;
    INJECTING.store(file.is_some(), Ordering::Relaxed);
}

/// The error of a module the driver would not load: these kernels cannot run on this device.
pub(crate) fn ptx_rejected(file: &str, why: &dyn std::fmt::Display) -> Error {
    Error::DeviceUnavailable(format!(
        "the CUDA driver rejected the PTX of kernel file {file}: {why}"
    ))
}

/// Loading `kernel`'s module: `Err` only under [`inject_ptx_reject`] of its file.
pub(crate) fn check_module_load(kernel: &Kernel) -> Result<()> {
    if !INJECTING.load(Ordering::Relaxed) {
        return Ok(());
    }
    match *REJECTED_FILE.lock().unwrap_or_else(PoisonError::into_inner) {
        Some(f) if f == "*" || f == kernel.file => Err(ptx_rejected(
            kernel.file,
            &"injected by grng::cuda::launch::inject_ptx_reject",
        )),
        _ => Ok(()),
    }
}

/// `<<<grid, block, shared_mem>>>` of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z (each ≥ 1; y, z ≤ 65535).
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z (product 1..=1024, z ≤ 64).
    pub block: (u32, u32, u32),
    /// Bytes of dynamic shared memory (`GRNG_DYN_SHARED`), at most [`MAX_SHARED_MEM`].
    pub shared_mem: u32,
}

impl LaunchConfig {
    /// A 1-D launch of `ceil(n / block)` blocks of `block` threads, no shared memory.
    pub fn for_elements(n: usize, block: u32) -> Result<Self> {
        let blocks = if block == 0 {
            0
        } else {
            n.div_ceil(block as usize).max(1)
        };
        let cfg = Self {
            grid: (u32::try_from(blocks).unwrap_or(u32::MAX), 1, 1),
            block: (block, 1, 1),
            shared_mem: 0,
        };
        cfg.validate("LaunchConfig::for_elements")?;
        Ok(cfg)
    }

    /// Checks CUDA's limits, so both paths reject the same configurations.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        let (bx, by, bz) = self.block;
        let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
        if threads == 0 || threads > 1024 || bz > 64 {
            return Err(Error::Value {
                op,
                arg: "block",
                value: threads as f64,
                expected: "1..=1024 threads per block (block.z <= 64)",
            });
        }
        let (gx, gy, gz) = self.grid;
        if gx == 0 || gy == 0 || gz == 0 || gx > 0x7fff_ffff || gy > 65_535 || gz > 65_535 {
            return Err(Error::Value {
                op,
                arg: "grid",
                value: f64::from(gx) * f64::from(gy) * f64::from(gz),
                expected: "1..=2^31-1 blocks in x, 1..=65535 in y and z",
            });
        }
        if self.shared_mem > MAX_SHARED_MEM {
            return Err(Error::Value {
                op,
                arg: "shared_mem",
                value: f64::from(self.shared_mem),
                expected: "at most 232448 bytes of dynamic shared memory",
            });
        }
        Ok(())
    }
}

/// One kernel: where its PTX is and its emulator entry point. Declare with the crate-internal
/// `kernel!` macro.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    /// Kernel file's PTX constant name (`KRON` for `kernels/kron.cu`).
    pub file: &'static str,
    /// The `extern "C"` kernel name.
    pub name: &'static str,
    /// The file's PTX ([`super::ptx`]), `None` when not built.
    pub ptx: Option<&'static str>,
    /// `grng_emu_<name>`.
    pub emu: EmuEntry,
    /// The sm_90a variant [`launch`] runs instead on a compute capability 9.0 device whose
    /// first-use self-check passed ([`super::sm90`]).
    pub sm90: Option<&'static super::sm90::Sm90Variant>,
}

/// Declares a [`Kernel`]: `kernel!(pub(crate) SYRK = KRON::kron_syrk_tc);` for the kernel
/// `kron_syrk_tc` of `kernels/kron.cu`. A misspelt file or kernel name fails to compile or
/// link (the emulator symbol `grng_emu_kron_syrk_tc` must exist). `, sm90 = VARIANT` names
/// its sm_90a variant; an sm_90a kernel (`KRON_SM90A::kron_syrk_ema_wg_tc, emu =
/// kron_syrk_ema_tc`) names the sm_80 twin whose emulator entry stands in for it.
macro_rules! kernel {
    ($(#[$attr:meta])* $vis:vis $NAME:ident = $FILE:ident :: $kname:ident;) => {
        $crate::cuda::launch::kernel!(@make $(#[$attr])* $vis $NAME = $FILE::$kname, $kname, None);
    };
    ($(#[$attr:meta])* $vis:vis $NAME:ident = $FILE:ident :: $kname:ident,
     sm90 = $v:path;) => {
        $crate::cuda::launch::kernel!(@make $(#[$attr])* $vis $NAME = $FILE::$kname, $kname,
                                      Some(&$v));
    };
    ($(#[$attr:meta])* $vis:vis $NAME:ident = $FILE:ident :: $kname:ident,
     emu = $twin:ident;) => {
        $crate::cuda::launch::kernel!(@make $(#[$attr])* $vis $NAME = $FILE::$kname, $twin, None);
    };
    (@make $(#[$attr:meta])* $vis:vis $NAME:ident = $FILE:ident :: $kname:ident, $emu:ident,
     $sm90:expr) => {
        $(#[$attr])*
        $vis const $NAME: $crate::cuda::launch::Kernel = {
            extern "C" {
                #[link_name = concat!("grng_emu_", stringify!($emu))]
                fn entry(
                    cfg: *const $crate::cuda::emu::EmuLaunch,
                    args: *mut *mut ::std::ffi::c_void,
                );
            }
            $crate::cuda::launch::Kernel {
                file: stringify!($FILE),
                name: stringify!($kname),
                ptx: $crate::cuda::ptx::$FILE,
                emu: entry,
                sm90: $sm90,
            }
        };
    };
}
pub(crate) use kernel;

/// Scalar kernel parameters: `int`, `unsigned`, `float`, `long long`, `unsigned long long`,
/// `double` on the CUDA side.
pub trait KernelScalar: bytemuck::Pod + private::Sealed {}
impl KernelScalar for i32 {}
impl KernelScalar for u32 {}
impl KernelScalar for f32 {}
impl KernelScalar for i64 {}
impl KernelScalar for u64 {}
impl KernelScalar for f64 {}
mod private {
    pub trait Sealed {}
    impl Sealed for i32 {}
    impl Sealed for u32 {}
    impl Sealed for f32 {}
    impl Sealed for i64 {}
    impl Sealed for u64 {}
    impl Sealed for f64 {}
}

/// A kernel's argument list, in parameter order, built against one device.
///
/// Every value gets its own 8-byte slot (its bytes at the start), and a launch passes one
/// pointer per slot — cuLaunchKernel's `kernelParams`, and what `GRNG_EMU_ENTRY` unpacks.
/// Buffers are borrowed for `'a` (shared for [`KernelArgs::input`], exclusive for
/// [`KernelArgs::output`]), so they outlive the launch and a written buffer cannot also be
/// passed as another argument.
pub struct KernelArgs<'a> {
    device: &'a Device,
    slots: Vec<u64>,
    /// Stream-ordering records of the CUDA buffers, dropped after the launch is queued.
    guards: Vec<SyncOnDrop<'a>>,
    /// Host buffers (emulator checks).
    host: Vec<EmuBuffer>,
    _buffers: PhantomData<&'a mut ()>,
}

impl<'a> KernelArgs<'a> {
    /// An empty list for a launch on `device`.
    pub fn new(device: &'a Device) -> Self {
        Self {
            device,
            slots: Vec::with_capacity(16),
            guards: Vec::new(),
            host: Vec::new(),
            _buffers: PhantomData,
        }
    }

    /// The device the arguments live on.
    pub fn device(&self) -> &'a Device {
        self.device
    }

    /// Appends a scalar parameter.
    pub fn scalar<S: KernelScalar>(&mut self, v: S) -> &mut Self {
        let mut slot = 0u64;
        let bytes = bytemuck::bytes_of(&v);
        bytemuck::bytes_of_mut(&mut slot)[..bytes.len()].copy_from_slice(bytes);
        self.slots.push(slot);
        self
    }

    /// Appends a `const T*` parameter: `m`'s first element (row-major, `m.len()` elements).
    /// Errors if `m` does not live on the launch's device.
    pub fn input<T: Element>(&mut self, op: &'static str, m: &'a Matrix<T>) -> Result<&mut Self> {
        let addr = self.address(op, m)?;
        self.slots.push(addr);
        Ok(self)
    }

    /// Appends a `T*` parameter the kernel may write: `m`'s first element. Errors if `m` does
    /// not live on the launch's device.
    pub fn output<T: Element>(
        &mut self,
        op: &'static str,
        m: &'a mut Matrix<T>,
    ) -> Result<&mut Self> {
        let addr = self.address_mut(op, m)?;
        self.slots.push(addr);
        Ok(self)
    }

    /// Appends a `T*` parameter the kernel may write: `m`'s element `offset`, for a kernel
    /// that touches `len` elements from there (a slot of a shared status buffer, see
    /// `cuda::deferred`). Errors if `m` does not live on the launch's device or
    /// `offset + len` exceeds `m.len()`, so the pointer and the `len` elements after it stay
    /// inside `m`.
    pub fn output_at<T: Element>(
        &mut self,
        op: &'static str,
        m: &'a mut Matrix<T>,
        offset: usize,
        len: usize,
    ) -> Result<&mut Self> {
        let total = m.len();
        if offset.checked_add(len).is_none_or(|end| end > total) {
            return Err(Error::Shape {
                op,
                arg: "status slot",
                expected: format!("{len} elements inside a buffer of {total}"),
                got: format!("offset {offset}"),
            });
        }
        let addr = self.address_mut(op, m)?;
        self.slots
            .push(addr + (offset * std::mem::size_of::<T>()) as u64);
        Ok(self)
    }

    /// The address of `m`'s first element for a pointer table the kernel reads (not a
    /// parameter): `m` is borrowed and stream-ordered with the launch as an
    /// [`KernelArgs::input`] is. Errors if `m` does not live on the launch's device.
    pub fn address<T: Element>(&mut self, op: &'static str, m: &'a Matrix<T>) -> Result<u64> {
        self.device.check_on(op, m)?;
        match (self.device, &m.storage) {
            (Device::Cpu | Device::Emulated, Storage::Host(v)) => {
                self.host.push(host_buffer(v));
                Ok(v.as_ptr() as u64)
            }
            (Device::Cuda(d), Storage::Cuda(s)) => {
                let (ptr, guard) = s.device_ptr(d.stream());
                self.guards.push(guard);
                Ok(ptr)
            }
            _ => Err(self.mismatch(op)),
        }
    }

    /// [`KernelArgs::address`] of a buffer the kernel may write through the table, borrowed
    /// exclusively as an [`KernelArgs::output`] is.
    pub fn address_mut<T: Element>(
        &mut self,
        op: &'static str,
        m: &'a mut Matrix<T>,
    ) -> Result<u64> {
        self.device.check_on(op, m)?;
        match (self.device, &mut m.storage) {
            (Device::Cpu | Device::Emulated, Storage::Host(v)) => {
                self.host.push(host_buffer(v));
                Ok(v.as_mut_ptr() as u64)
            }
            (Device::Cuda(d), Storage::Cuda(s)) => {
                let (ptr, guard) = s.device_ptr_mut(d.stream());
                self.guards.push(guard);
                Ok(ptr)
            }
            _ => Err(self.mismatch(op)),
        }
    }

    fn mismatch(&self, op: &'static str) -> Error {
        Error::DeviceMismatch {
            op,
            a: self.device.name(),
            b: "another device",
        }
    }
}

fn host_buffer<T>(v: &[T]) -> EmuBuffer {
    EmuBuffer {
        base: v.as_ptr() as u64,
        bytes: std::mem::size_of_val(v) as u64,
    }
}

/// Launches `kernel` with `cfg` and `args` on the device the arguments were built for:
/// in the emulator for [`Device::Emulated`] (synchronously), on the device's stream for
/// [`Device::Cuda`] (asynchronously, ordered with the stream's other work).
///
/// # Safety
/// What cannot be checked here, and each launcher's SAFETY comment must establish against
/// the kernel's signature:
/// 1. `args` holds exactly the kernel's parameters, in order, with matching types
///    (`input`/`output` for `const T*`/`T*` of the same element type, `scalar` of the same
///    width and kind);
/// 2. every access the kernel makes under `cfg` stays inside the buffers passed (as
///    parameters, or through a table of [`KernelArgs::address`]es), and it writes only buffers
///    passed through `output` or `address_mut`;
/// 3. `cfg.shared_mem` covers the kernel's `GRNG_DYN_SHARED` use.
///
/// And for a kernel with an sm_90a variant ([`Kernel::sm90`]), which may run instead with the
/// variant's block and shared memory: the variant has the same parameters and touches the same
/// elements under the same grid (`kernels/gemm/wgmma_sm90.cuh` keeps the engine's contract).
pub unsafe fn launch(kernel: &Kernel, cfg: LaunchConfig, args: KernelArgs<'_>) -> Result<()> {
    let (kernel, cfg) = super::sm90::select(kernel, cfg, args.device)?;
    cfg.validate(kernel.name)?;
    let KernelArgs {
        device,
        mut slots,
        guards,
        host,
        ..
    } = args;
    // Pointers into `slots`, which is neither moved nor resized until the launch returns.
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|s| (s as *mut u64).cast::<c_void>())
        .collect();
    if RECORDING.load(Ordering::Relaxed) {
        record(kernel.name);
    }
    let started = super::timing::start(device)?;
    let result = match device {
        Device::Cpu => Err(Error::DeviceUnavailable(format!(
            "kernel {} runs on the Emulated or Cuda device, not on the CPU backend",
            kernel.name
        ))),
        Device::Emulated => {
            check_module_load(kernel)?;
            // SAFETY: the caller guarantees 1-3; `params` points into `slots`, alive here, and
            // host buffers are borrowed by `args` for the whole (synchronous) call.
            unsafe { super::emu::launch(kernel, &cfg, &mut params, &host) };
            Ok(())
        }
        // SAFETY: as above; device buffers outlive the queued kernel: cudarc frees a CudaSlice
        // stream-ordered (after the work already queued on its stream, this kernel included).
        Device::Cuda(d) => unsafe { d.launch(kernel, &cfg, &mut params) },
    };
    drop(guards);
    result?;
    super::timing::finish(started, kernel.name)
}
