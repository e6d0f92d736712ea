//! One launch path for every kernel, on a GPU or in the emulator.
//!
//! A launcher (one per kernel, in `src/cuda/<file>.rs`) checks what its kernel's memory
//! safety needs (the arguments themselves are validated once, by [`crate::ops`]), computes a
//! [`LaunchConfig`], pushes the arguments in the kernel's parameter order into
//! [`KernelArgs`] and calls [`launch`]. Everything up to the final dispatch is shared by
//! [`Device::Emulated`] and [`Device::Cuda`]: the only difference is where the kernel body
//! executes. See `kernels/README.md` for the conventions.

use crate::device::{Device, Element, Matrix, Storage};
use crate::driver::emu::EmuBuffer;
pub(crate) use crate::driver::kernel::{check_module_load, kernel};
pub use crate::driver::kernel::{Kernel, LaunchConfig, MAX_SHARED_MEM};
use crate::error::{Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, SyncOnDrop};
use std::ffi::c_void;
use std::marker::PhantomData;

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
/// Every value gets its own 8-byte slot (its bytes at the start), a table its own buffer, and
/// a launch passes one pointer per parameter — cuLaunchKernel's `kernelParams`, and what
/// `GRNG_EMU_ENTRY` unpacks.
/// Buffers are borrowed for `'a` (shared for [`KernelArgs::input`], exclusive for
/// [`KernelArgs::output`]), so they outlive the launch and a written buffer cannot also be
/// passed as another argument.
pub struct KernelArgs<'a> {
    device: &'a Device,
    slots: Vec<u64>,
    /// By-value tables ([`KernelArgs::table`]) and the parameter index each stands at.
    tables: Vec<(usize, Box<[u32; TABLE_WORDS]>)>,
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
            tables: Vec::new(),
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

    /// Appends a by-value table parameter (`const __grid_constant__ EwTable` in
    /// `kernels/elementwise.cu`): `words`, padded with zeros to [`TABLE_WORDS`]. The launch
    /// carries it to the device, where an uploaded table would be a copy queued before it.
    /// Errors if `words` does not fit.
    pub fn table(&mut self, op: &'static str, words: &[u32]) -> Result<&mut Self> {
        let mut table = Box::new([0u32; TABLE_WORDS]);
        table
            .get_mut(..words.len())
            .ok_or_else(|| Error::Shape {
                op,
                arg: "table",
                expected: format!("at most {TABLE_WORDS} words (one launch's table)"),
                got: format!("{} words", words.len()),
            })?
            .copy_from_slice(words);
        self.tables.push((self.slots.len(), table));
        // The slot stands in for the table's place in the parameter order.
        self.slots.push(0);
        Ok(self)
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
///    width and kind, `table` for `EwTable`);
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
        mut tables,
        guards,
        host,
        ..
    } = args;
    // Pointers into `slots` and `tables`, neither moved nor resized until the launch returns.
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|s| (s as *mut u64).cast::<c_void>())
        .collect();
    for (at, table) in &mut tables {
        params[*at] = table.as_mut_ptr().cast::<c_void>();
    }
    crate::hooks::record(kernel.name);
    #[cfg(feature = "test-hooks")]
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
            unsafe {
                crate::driver::emu::launch(
                    kernel.emu,
                    (cfg.grid, cfg.block, cfg.shared_mem),
                    &mut params,
                    &host,
                )
            };
            Ok(())
        }
        // SAFETY: as above; device buffers outlive the queued kernel: cudarc frees a CudaSlice
        // stream-ordered (after the work already queued on its stream, this kernel included).
        Device::Cuda(d) => unsafe { d.launch(kernel, &cfg, &mut params) },
    };
    drop(guards);
    result?;
    #[cfg(feature = "test-hooks")]
    super::timing::finish(started, kernel.name)?;
    Ok(())
}

/// `n` as the kernels' `int`.
pub(crate) fn to_i32(op: &'static str, arg: &'static str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Value {
        op,
        arg,
        value: n as f64,
        expected: "below 2^31 (the kernels index with int)",
    })
}

/// 32-bit words of a by-value table parameter ([`KernelArgs::table`]; `EW_TABLE_WORDS` in
/// `kernels/elementwise.cu`): 4000 bytes, under the 4 KiB of a launch's parameters with the
/// kernels' other parameters.
pub const TABLE_WORDS: usize = 1000;

/// Threads per block of every element-wise kernel.
pub(crate) const STREAM_BLOCK: u32 = 256;
/// Grid cap of the streaming kernels (grid-stride loops above it): 4096 x 256 threads keep
/// every SM of an H100 busy with several resident blocks.
const STREAM_MAX_BLOCKS: usize = 4096;

/// The 1-D grid of the streaming kernels: one thread per float4 item, capped.
pub(crate) fn stream_config(n: usize) -> Result<LaunchConfig> {
    let items = n.div_ceil(4).max(1);
    let blocks = items
        .div_ceil(STREAM_BLOCK as usize)
        .clamp(1, STREAM_MAX_BLOCKS);
    Ok(LaunchConfig::linear(blocks as u32, STREAM_BLOCK))
}
