//! Which GEMM mainloop runs: the sm_90a kernels of `kernels/gemm/wgmma_sm90.cuh` (wgmma,
//! warp-specialized) on a compute capability 9.0 device, the sm_80 engine everywhere else.
//!
//! A kernel with an sm_90a variant names it in [`Kernel::sm90`]; [`super::launch::launch`]
//! asks `select` which one to queue. The first launch of a variant on a device runs that
//! variant's self-check ([`Sm90Variant::check`]): small ragged products through both paths,
//! compared within the f32 accumulation bound. The checks are written beside the launchers
//! that declare the variants (`gemm`, `newton`, `syrk`) and reach this module as data, so this
//! module, below the launchers, names none of them. If the sm_90a module does not load, a
//! launch fails or a product differs, that variant falls back to sm_80 on that device for
//! good: the fallback is counted ([`fallbacks`]), said once on stderr, and never a wrong
//! product. The launch record (`hooks::record_launches`) names the kernels that actually ran.
//!
//! The emulator models sm_80 primitives only, so on [`Device::Emulated`] the sm_90a path
//! exists only under `inject_sm90` (feature `test-hooks`, tests of this logic): the "sm_90a" launches then run
//! their sm_80 twin's emulator entry with the sm_80 configuration.

use crate::device::{Device, Element, Matrix};
use crate::driver::kernel::{Kernel, LaunchConfig};
pub use crate::driver::kernel::{SelfCheck, Sm90Variant};
use crate::driver::CudaDevice;
use crate::error::Result;
use crate::mat::Trans;
use half::bf16;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// What a device runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Sm90,
    Sm80,
}

/// Per device (CUDA ordinal; `None`: the emulator under `inject_sm90`) and variant (its
/// kernel's name), the path decided at the variant's first launch there. Held across the
/// self-check, so concurrent first launches check once.
static DECIDED: Mutex<Vec<(Option<usize>, &'static str, Path)>> = Mutex::new(Vec::new());
/// Variants that fell back to sm_80 on a device (self-check mismatch or sm_90a load/launch
/// failure).
static FALLBACKS: AtomicU64 = AtomicU64::new(0);
/// The emulator's stand-in for a compute capability 9.0 device ([`inject_sm90`]).
#[cfg(feature = "test-hooks")]
static INJECTED: Mutex<Option<Sm90Injection>> = Mutex::new(None);

thread_local! {
    /// The path the self-check forces on its own launches (`None`: decide).
    static FORCED: Cell<Option<Path>> = const { Cell::new(None) };
}

/// How many (device, sm_90a variant) pairs fell back to the sm_80 engine (a self-check
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
    /// As `Capable`, but every self-check's sm_90a product comes back with one element off by
    /// far more than the bound: a miscompiled or misbehaving sm_90a kernel.
    Mismatch,
}

/// Fault injection for tests: from now on [`Device::Emulated`] behaves per `what` (`None`:
/// no sm_90a path, the default), and its decisions are forgotten, so the next launch of each
/// variant runs its self-check again. Combine with `hooks::inject_ptx_reject(Some("NEWTON_SM90A"))` for a
/// module the driver rejects. Process-wide, like the other injections (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
pub fn inject_sm90(what: Option<Sm90Injection>) {
    *INJECTED.lock().unwrap_or_else(PoisonError::into_inner) = what;
    DECIDED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .retain(|(key, ..)| key.is_some());
}

/// The injected sm_90a device of the emulator: `Some(mismatch)`.
fn injected() -> Option<bool> {
    #[cfg(feature = "test-hooks")]
    return INJECTED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .map(|i| i == Sm90Injection::Mismatch);
    #[cfg(not(feature = "test-hooks"))]
    None
}

/// Decides now which path `device` runs `kernel` on (its variant's self-check, on first use)
/// and tells: `true` when its sm_90a variant runs there (`false` too for a kernel without one).
///
/// # Errors
/// Only when the self-check's sm_80 side fails (nothing is decided then).
pub fn runs_sm90(kernel: &Kernel, device: &Device) -> Result<bool> {
    Ok(match kernel.sm90 {
        Some(v) => decide(device, v)? == Path::Sm90,
        None => false,
    })
}

/// The kernel and configuration to launch for `kernel` with `cfg` on `device`: its sm_90a
/// variant when the device runs it (deciding at the first call per device and variant, see
/// the module documentation), else `kernel` itself. Errors only when the self-check's sm_80
/// side fails.
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
        None => decide(device, v)?,
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

/// The path of variant `v` on `device`, running its self-check on first use.
fn decide(device: &Device, v: &Sm90Variant) -> Result<Path> {
    let injected = injected();
    let (key, gpu) = match device {
        Device::Cuda(d) => (Some(d.context().ordinal()), Some(d)),
        Device::Emulated if injected.is_some() => (None, None),
        _ => return Ok(Path::Sm80),
    };
    let name = v.kernel.name;
    let mut decided = DECIDED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(&(.., p)) = decided.iter().find(|(k, n, _)| *k == key && *n == name) {
        return Ok(p);
    }
    let path = match gpu {
        // sm_90a code runs on compute capability 9.0 exactly (the `a` features are not
        // forward compatible).
        Some(d)
            if d.context().compute_capability().ok() != Some((9, 0)) || v.kernel.ptx.is_none() =>
        {
            Path::Sm80
        }
        _ => match (v.check)(gpu)? {
            Ok(()) => Path::Sm90,
            Err(why) => {
                FALLBACKS.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "grng: the sm_90a GEMM kernel {name} failed its self-check on this {} \
                     device ({why}); using the sm_80 kernel",
                    device.name()
                );
                Path::Sm80
            }
        },
    };
    decided.push((key, name, path));
    Ok(path)
}

/// Runs `f` with every GEMM launch of this thread forced onto `path`.
fn forced<R>(path: Path, f: impl FnOnce() -> Result<R>) -> Result<R> {
    FORCED.with(|c| c.set(Some(path)));
    let r = f();
    FORCED.with(|c| c.set(None));
    r
}

/// `len` bf16 values in [-1, 1) from a fixed xorshift stream (`seed` ≠ 0): not symmetric, so a
/// transposed operand shows.
pub(crate) fn check_values(len: usize, mut seed: u64) -> Vec<bf16> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            bf16::from_f32((seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

/// `len` f32 values in [-1.37, 1.37) for the split3 checks (bf16 values scaled, so each
/// splits into more than one plane).
pub(crate) fn check_values_f32(len: usize, seed: u64) -> Vec<f32> {
    check_values(len, seed)
        .iter()
        .map(|v| v.to_f32() * 1.37)
        .collect()
}

/// Bound on |sm_90a − sm_80| for an element Σ_k a_k·b_k of `k` terms whose Σ|a_k·b_k| is
/// `abs`, both scaled by `alpha` in the epilogue. bf16 products are exact in f32; each of the
/// k additions of either path errs by at most one f32 ulp (2^-23 relative to the running
/// magnitude ≤ abs: round-to-nearest or truncating accumulators alike), in any order; the
/// epilogue's α rounding adds ≤ 2^-24·α·abs per path. So the difference is at most
/// 2·(k + 1)·2^-23·α·abs; the factor 2 on top is margin. A wrong product (swizzle,
/// descriptor, pipeline hazard) is off by O(α·abs), 2^13/k times more.
pub(crate) fn bound(k: usize, alpha: f64, abs: f64) -> f64 {
    4.0 * (k as f64 + 1.0) * f64::powi(2.0, -23) * alpha * abs
}

/// Bound on |sm_90a − sm_80| for a split3 (f32-accurate) product element whose Σ|a_k·b_k| over
/// `k` terms is `abs`: each path is within `(k + 8)·2⁻²⁴·abs` of the exact product
/// (`gemm::gemm3`); 2x on top is margin.
pub(crate) fn split3_bound(k: usize, abs: f64) -> f64 {
    4.0 * (k as f64 + 8.0) * f64::powi(2.0, -24) * abs
}

/// An operand of a self-check: rows, columns and the row-major values.
pub(crate) type Values<'a, T> = (usize, usize, &'a [T]);

/// A variant's self-check: `product` computes `C = op(A)·B` (`C` zeros of its shape; `op(A)` is
/// `a` or its transpose per `op_a`) on the sm_80 path and on the sm_90a path; element `(i, j)`
/// must agree within `per(k, Σ_p |op(A)(i, p)·B(p, j)|)`. `Err`: the sm_80 side failed;
/// `Ok(Err(why))`: the sm_90a side failed or differs (under the `Mismatch` injection its
/// first element is off by 1).
pub(crate) fn check_product<T: Element>(
    gpu: Option<&CudaDevice>,
    name: &str,
    (a, op_a, b): (Values<'_, T>, Trans, Values<'_, T>),
    per: impl Fn(usize, f64) -> f64,
    product: impl Fn(&Device, &Matrix<T>, &Matrix<T>, &mut Matrix) -> Result<()>,
) -> Result<std::result::Result<(), String>> {
    let dev = &gpu.map_or(Device::Emulated, |d| Device::Cuda(d.clone()));
    let ((ar, ac, av), (_, n, bv)) = (a, b);
    let (am, bm) = (dev.upload(ar, ac, av)?, dev.upload(b.0, n, bv)?);
    let (m, k) = match op_a {
        Trans::No => (ar, ac),
        Trans::Yes => (ac, ar),
    };
    let run = || {
        let mut c = dev.zeros(m, n)?;
        product(dev, &am, &bm, &mut c)?;
        c.to_vec()
    };
    let x = |i: usize, p: usize| match op_a {
        Trans::No => av[i * ac + p].to_f32(),
        Trans::Yes => av[p * ac + i].to_f32(),
    };
    let bound = |e: usize| {
        let (i, j) = (e / n, e % n);
        let abs = (0..k)
            .map(|p| (f64::from(x(i, p)) * f64::from(bv[p * n + j].to_f32())).abs())
            .sum();
        per(k, abs)
    };
    let want = forced(Path::Sm80, run)?;
    let mut got = match forced(Path::Sm90, run) {
        Ok(v) => v,
        Err(e) => return Ok(Err(format!("{name}: {e}"))),
    };
    if injected() == Some(true) {
        got[0] += 1.0;
    }
    Ok(
        match (0..want.len()).find(|&e| {
            let d = (f64::from(got[e]) - f64::from(want[e])).abs();
            d.is_nan() || d > bound(e)
        }) {
            None => Ok(()),
            Some(e) => Err(format!(
                "{name}: element {e} is {} where sm_80 gives {} (bound {:.3e})",
                got[e],
                want[e],
                bound(e)
            )),
        },
    )
}
