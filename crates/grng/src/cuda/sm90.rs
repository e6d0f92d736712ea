//! Which GEMM mainloop runs: the sm_90a kernels of `kernels/gemm/wgmma_sm90.cuh` (wgmma,
//! warp-specialized) on a compute capability 9.0 device, the sm_80 engine everywhere else.
//!
//! A kernel with an sm_90a variant names it in [`Kernel::sm90`]; [`super::launch::launch`]
//! asks `select` which one to queue. The first such launch on a device runs a self-check
//! (`super::sm90_check`, above the launchers it runs):
//! small ragged products through both paths (`newton_gemm_tc` against `newton_gemm_wg_tc`
//! on the 16-byte cp.async path; `syrk_ema_tc` against `syrk_ema_wg_tc`,
//! `gemm3_tc` against `gemm3_wg_tc` (split3 planes, a transposed operand),
//! `gemm_tc` against `gemm_wg_tc` (bf16, the same shapes) and
//! `newton_gemm3_tc` against `newton_gemm3_wg_tc` on the element-wise path), compared within
//! the f32 accumulation bound. If an sm_90a module does not load, a launch fails or a product
//! differs, the device falls back to sm_80 for good:
//! the fallback is counted ([`fallbacks`]), said once on stderr, and never a wrong product.
//! The launch record (`hooks::record_launches`) names the kernels that actually ran.
//!
//! The emulator models sm_80 primitives only, so on [`Device::Emulated`] the sm_90a path
//! exists only under `inject_sm90` (feature `test-hooks`, tests of this logic): the "sm_90a" launches then run
//! their sm_80 twin's emulator entry with the sm_80 configuration.

use crate::device::Device;
pub use crate::driver::kernel::Sm90Variant;
use crate::driver::kernel::{Kernel, LaunchConfig};
use crate::error::Result;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// What a device runs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    Sm90,
    Sm80,
}

/// Per device (CUDA ordinal; `None`: the emulator under `inject_sm90`), the path decided at
/// its first GEMM launch. Held across the self-check, so concurrent first launches check once.
static DECIDED: Mutex<Vec<(Option<usize>, Path)>> = Mutex::new(Vec::new());
/// Devices that fell back to sm_80 (self-check mismatch or sm_90a load/launch failure).
static FALLBACKS: AtomicU64 = AtomicU64::new(0);
/// The emulator's stand-in for a compute capability 9.0 device ([`inject_sm90`]).
#[cfg(feature = "test-hooks")]
static INJECTED: Mutex<Option<Sm90Injection>> = Mutex::new(None);

thread_local! {
    /// The path the self-check forces on its own launches (`None`: decide).
    static FORCED: Cell<Option<Path>> = const { Cell::new(None) };
}

/// How many devices fell back from the sm_90a GEMM kernels to the sm_80 engine (a self-check
/// mismatch, or an sm_90a module the driver would not load or launch), since the process
/// started. Each fallback also printed one line on stderr.
pub fn fallbacks() -> u64 {
    FALLBACKS.load(Ordering::Relaxed)
}

/// Test injection: what the emulator pretends about the sm_90a path (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sm90Injection {
    /// The emulator acts as a compute capability 9.0 device whose sm_90a kernels agree with
    /// sm_80 (they are their sm_80 twins).
    Capable,
    /// As `Capable`, but the self-check's sm_90a product comes back with one element off by
    /// far more than the bound: a miscompiled or misbehaving sm_90a kernel.
    Mismatch,
}

/// Fault injection for tests: from now on [`Device::Emulated`] behaves per `what` (`None`:
/// no sm_90a path, the default), and its decision is forgotten, so its next GEMM launch runs
/// the self-check again. Combine with `hooks::inject_ptx_reject(Some("NEWTON_SM90A"))` for a
/// module the driver rejects. Process-wide, like the other injections (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
pub fn inject_sm90(what: Option<Sm90Injection>) {
    *INJECTED.lock().unwrap_or_else(PoisonError::into_inner) = what;
    DECIDED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .retain(|(key, _)| key.is_some());
}

/// Decides now which GEMM path `device` runs (the self-check, on its first use) and tells:
/// `true` when the sm_90a kernels run there. Benchmarks call it before timing, so the
/// self-check's launches stay out of their first measurement.
///
/// # Errors
/// Only when the self-check's sm_80 side fails (nothing is decided then).
pub fn check(device: &Device) -> Result<bool> {
    Ok(decide(device)? == Path::Sm90)
}

/// The kernel and configuration to launch for `kernel` with `cfg` on `device`: its sm_90a
/// variant when the device runs them (deciding at the first call per device, see the module
/// documentation), else `kernel` itself. Errors only when the self-check's sm_80 side fails.
pub(crate) fn select<'k>(
    kernel: &'k Kernel,
    cfg: LaunchConfig,
    device: &Device,
) -> Result<(&'k Kernel, LaunchConfig)> {
    let Some(v) = kernel.sm90 else {
        return Ok((kernel, cfg));
    };
    let path = match FORCED.with(Cell::get) {
        Some(p) => p,
        None => decide(device)?,
    };
    Ok(match (path, device) {
        (Path::Sm80, _) => (kernel, cfg),
        (Path::Sm90, Device::Cuda(_)) => (
            &v.kernel,
            LaunchConfig {
                block: (v.block, 1, 1),
                shared_mem: v.shared_mem,
                ..cfg
            },
        ),
        // The emulator's stand-in: the twin's entry needs the twin's configuration.
        (Path::Sm90, _) => (&v.kernel, cfg),
    })
}

/// The path of `device`, running the self-check on first use.
fn decide(device: &Device) -> Result<Path> {
    // The emulator's injected sm_90a device: `Some(mismatch)`.
    #[cfg(feature = "test-hooks")]
    let injected = INJECTED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .map(|i| i == Sm90Injection::Mismatch);
    #[cfg(not(feature = "test-hooks"))]
    let injected: Option<bool> = None;
    let key = match device {
        Device::Cuda(d) => Some(d.context().ordinal()),
        Device::Emulated if injected.is_some() => None,
        _ => return Ok(Path::Sm80),
    };
    let mut decided = DECIDED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(&(_, p)) = decided.iter().find(|(k, _)| *k == key) {
        return Ok(p);
    }
    let path = match device {
        // sm_90a code runs on compute capability 9.0 exactly (the `a` features are not
        // forward compatible).
        Device::Cuda(d)
            if d.context().compute_capability().ok() != Some((9, 0))
                || crate::driver::ptx::SYRK_SM90A.is_none()
                || crate::driver::ptx::NEWTON_SM90A.is_none()
                || crate::driver::ptx::GEMM_SM90A.is_none() =>
        {
            Path::Sm80
        }
        // SAFETY: defined once, with this signature, by `super::sm90_check` (`no_mangle`);
        // the linker fails without it.
        _ => match unsafe { grng_sm90_self_check(device, injected == Some(true)) }? {
            Ok(()) => Path::Sm90,
            Err(why) => {
                FALLBACKS.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "grng: the sm_90a GEMM kernels failed their self-check on this {} device \
                     ({why}); using the sm_80 kernels",
                    device.name()
                );
                Path::Sm80
            }
        },
    };
    decided.push((key, path));
    Ok(path)
}

/// Runs `f` with every GEMM launch of this thread forced onto `path`.
pub(crate) fn forced<R>(path: Path, f: impl FnOnce() -> Result<R>) -> Result<R> {
    FORCED.with(|c| c.set(Some(path)));
    let r = f();
    FORCED.with(|c| c.set(None));
    r
}

extern "Rust" {
    /// The first-use comparison of every sm_90a kernel against sm_80, defined above the
    /// launchers it runs (`super::sm90_check`). Declared here rather than named so
    /// that this module, below `launch`, imports no launcher: the check's launches come back
    /// through `launch` to [`select`] (under [`forced`]), a recursion at run time only.
    /// `Err`: an sm_80 launch failed (nothing decided); `Ok(Err(why))`: the sm_90a side failed
    /// or differs.
    fn grng_sm90_self_check(
        dev: &Device,
        mismatch: bool,
    ) -> Result<std::result::Result<(), String>>;
}
