//! Kernel descriptors: which kernel ([`Kernel`]: its file's PTX, its name, its emulator entry,
//! its sm_90a variant) runs with which launch configuration ([`LaunchConfig`]). Below the
//! CUDA backend's launchers (`crate::cuda`), which declare one [`Kernel`] per kernel with
//! `kernel!`, and above nothing but the emulator's entry type and the embedded PTX.

use super::emu::EmuEntry;
use super::CudaDevice;
use crate::error::{Error, Result};

/// Largest dynamic shared memory of one block (sm_90's opt-in limit, 227 KiB). Above 48 KiB
/// the driver path raises the kernel's limit before launching; sm_80 stops at 163 KiB.
pub const MAX_SHARED_MEM: u32 = 232_448;

/// The error of a module the driver would not load: these kernels cannot run on this device.
pub(crate) fn ptx_rejected(file: &str, why: &dyn std::fmt::Display) -> Error {
    Error::DeviceUnavailable(format!(
        "the CUDA driver rejected the PTX of kernel file {file}: {why}"
    ))
}

/// Loading `kernel`'s module: `Err` only under an injected rejection of its file
/// (`hooks::inject_ptx_reject`, feature `test-hooks`).
pub(crate) fn check_module_load(kernel: &Kernel) -> Result<()> {
    if crate::hooks::rejection_injected(kernel.file) {
        return Err(ptx_rejected(
            kernel.file,
            &"injected by grng::hooks::inject_ptx_reject",
        ));
    }
    Ok(())
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
    /// A 1-D launch of `grid` blocks of `block` threads, no shared memory (not validated).
    pub const fn linear(grid: u32, block: u32) -> Self {
        Self {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_mem: 0,
        }
    }

    /// A 1-D launch of `ceil(n / block)` blocks of `block` threads, no shared memory.
    pub fn for_elements(n: usize, block: u32) -> Result<Self> {
        let blocks = if block == 0 {
            0
        } else {
            n.div_ceil(block as usize).max(1)
        };
        let cfg = Self::linear(u32::try_from(blocks).unwrap_or(u32::MAX), block);
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
    /// Kernel file's PTX constant name (`SYRK` for `kernels/syrk.cu`).
    pub file: &'static str,
    /// The `extern "C"` kernel name.
    pub name: &'static str,
    /// The file's PTX ([`super::ptx`]), `None` when not built.
    pub ptx: Option<&'static str>,
    /// `grng_emu_<name>`.
    pub emu: EmuEntry,
    /// The sm_90a variant `cuda::launch::launch` runs instead on a compute capability 9.0
    /// device whose first-use self-check passed (`cuda::sm90`).
    pub sm90: Option<&'static Sm90Variant>,
}

/// Declares a [`Kernel`]: `kernel!(pub(crate) SYRK = SYRK::syrk_tc);` for the kernel
/// `syrk_tc` of `kernels/syrk.cu`. A misspelt file or kernel name fails to compile or
/// link (the emulator symbol `grng_emu_syrk_tc` must exist). `, sm90 = VARIANT` names
/// its sm_90a variant; an sm_90a kernel (`SYRK_SM90A::syrk_ema_wg_tc, emu =
/// syrk_ema_tc`) names the sm_80 twin whose emulator entry stands in for it.
macro_rules! kernel {
    ($(#[$attr:meta])* $vis:vis $NAME:ident = $FILE:ident :: $kname:ident;) => {
        $crate::driver::kernel::kernel!(@make $(#[$attr])* $vis $NAME = $FILE::$kname, $kname, None);
    };
    ($(#[$attr:meta])* $vis:vis $NAME:ident = $FILE:ident :: $kname:ident,
     sm90 = $v:path;) => {
        $crate::driver::kernel::kernel!(@make $(#[$attr])* $vis $NAME = $FILE::$kname, $kname,
                                      Some(&$v));
    };
    ($(#[$attr:meta])* $vis:vis $NAME:ident = $FILE:ident :: $kname:ident,
     emu = $twin:ident;) => {
        $crate::driver::kernel::kernel!(@make $(#[$attr])* $vis $NAME = $FILE::$kname, $twin, None);
    };
    (@make $(#[$attr:meta])* $vis:vis $NAME:ident = $FILE:ident :: $kname:ident, $emu:ident,
     $sm90:expr) => {
        $(#[$attr])*
        $vis const $NAME: $crate::driver::kernel::Kernel = {
            extern "C" {
                #[link_name = concat!("grng_emu_", stringify!($emu))]
                fn entry(
                    cfg: *const $crate::driver::emu::EmuLaunch,
                    args: *mut *mut ::std::ffi::c_void,
                );
            }
            $crate::driver::kernel::Kernel {
                file: stringify!($FILE),
                name: stringify!($kname),
                ptx: $crate::driver::ptx::$FILE,
                emu: entry,
                sm90: $sm90,
            }
        };
    };
}
pub(crate) use kernel;

/// The sm_90a variant of a kernel: same parameters and grid, its own block and shared memory,
/// and the self-check that must pass before it runs on a device.
#[derive(Debug)]
pub struct Sm90Variant {
    /// The sm_90a kernel (`<FILE>_SM90A` PTX; its emulator entry is the sm_80 twin's).
    pub kernel: Kernel,
    /// Threads per block (1-D).
    pub block: u32,
    /// Bytes of dynamic shared memory.
    pub shared_mem: u32,
    /// Its first-use comparison with the sm_80 kernel (`cuda::sm90`), written beside the
    /// launcher that declares the variant.
    pub check: SelfCheck,
}

/// A variant's self-check on a GPU (`Some`) or the emulator (`None`; the device as this layer,
/// below `crate::device`, knows it). `Err`: its sm_80 side failed (nothing is decided);
/// `Ok(Err(why))`: the sm_90a side failed or differs.
pub type SelfCheck = fn(Option<&CudaDevice>) -> Result<std::result::Result<(), String>>;
