//! Which GEMM mainloop runs: the sm_90a kernels of `kernels/gemm/wgmma_sm90.cuh` (wgmma,
//! warp-specialized) on a compute capability 9.0 device, the sm_80 engine everywhere else.
//!
//! A kernel with an sm_90a variant names it in [`Kernel::sm90`]; [`super::launch::launch`]
//! asks `select` which one to queue. The first such launch on a device runs a self-check:
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

use super::newton::{product_f32, product_tc, Epilogue, Planes, Unused};
use crate::device::{Device, Matrix};
pub use crate::driver::kernel::Sm90Variant;
use crate::driver::kernel::{Kernel, LaunchConfig};
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
        _ => match self_check(device, injected == Some(true))? {
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
fn forced<R>(path: Path, f: impl FnOnce() -> Result<R>) -> Result<R> {
    FORCED.with(|c| c.set(Some(path)));
    let r = f();
    FORCED.with(|c| c.set(None));
    r
}

/// `len` bf16 values in [-1, 1) from a fixed xorshift stream (`seed` ≠ 0): not symmetric, so a
/// transposed operand shows.
fn check_values(len: usize, mut seed: u64) -> Vec<bf16> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            bf16::from_f32((seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

/// First element of `got` outside `want ± bound`, as a message.
fn compare(
    what: &str,
    got: &[f32],
    want: &[f32],
    bound: &[f64],
) -> std::result::Result<(), String> {
    match (0..want.len()).find(|&i| {
        let d = (f64::from(got[i]) - f64::from(want[i])).abs();
        d.is_nan() || d > bound[i]
    }) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i} is {} where sm_80 gives {} (bound {:.3e})",
            got[i], want[i], bound[i]
        )),
    }
}

/// Bound on |sm_90a − sm_80| for an element Σ_k a_k·b_k of `k` terms whose Σ|a_k·b_k| is
/// `abs`, both scaled by `alpha` in the epilogue. bf16 products are exact in f32; each of the
/// k additions of either path errs by at most one f32 ulp (2^-23 relative to the running
/// magnitude ≤ abs: round-to-nearest or truncating accumulators alike), in any order; the
/// epilogue's α rounding adds ≤ 2^-24·α·abs per path. So the difference is at most
/// 2·(k + 1)·2^-23·α·abs; the factor 2 on top is margin. A wrong product (swizzle,
/// descriptor, pipeline hazard) is off by O(α·abs), 2^13/k times more.
fn bound(k: usize, alpha: f64, abs: f64) -> f64 {
    4.0 * (k as f64 + 1.0) * f64::powi(2.0, -23) * alpha * abs
}

/// One comparison of the self-check: `run` on sm_80 (an error there is the caller's: `Err`)
/// and on sm_90a (an error there fails the check), element `e` within `bound(e)`; `corrupt`
/// adds 1 to the sm_90a result's first element (the `Mismatch` injection).
fn both_paths(
    name: &str,
    run: impl Fn(Path) -> Result<Vec<f32>>,
    bound: impl Fn(usize) -> f64,
    corrupt: bool,
) -> Result<std::result::Result<(), String>> {
    let want = run(Path::Sm80)?;
    let mut got = match run(Path::Sm90) {
        Ok(v) => v,
        Err(e) => return Ok(Err(format!("{name}: {e}"))),
    };
    if corrupt {
        got[0] += 1.0;
    }
    let bounds: Vec<f64> = (0..want.len()).map(bound).collect();
    Ok(compare(name, &got, &want, &bounds))
}

/// Bound on |sm_90a − sm_80| for a split3 (f32-accurate) product element whose Σ|a_k·b_k| over
/// `k` terms is `abs`: each path is within `(k + 8)·2⁻²⁴·abs` of the exact product
/// (`precond::gemm3`); 2x on top is margin.
fn split3_bound(k: usize, abs: f64) -> f64 {
    4.0 * (k as f64 + 8.0) * f64::powi(2.0, -24) * abs
}

/// The first-use comparison of every sm_90a kernel against sm_80. `Err`: an sm_80 launch
/// failed (nothing decided); `Ok(Err(why))`: the sm_90a side failed or differs.
fn self_check(dev: &Device, mismatch: bool) -> Result<std::result::Result<(), String>> {
    // Newton product C = A·B, n = 136 (n % 8 == 0: the cp.async loads; a partial tile).
    let n = 136;
    let (a, b) = (check_values(n * n, 0x9E37), check_values(n * n, 0x7F4A));
    let (am, bm) = (dev.upload(n, n, &a)?, dev.upload(n, n, &b)?);
    let product = |path| -> Result<Vec<f32>> {
        let mut out = dev.zeros(n, n)?;
        let mut unused = Unused::new(dev)?;
        forced(path, || {
            let epi = Epilogue {
                out: Some(&mut out),
                ..Epilogue::new()
            };
            product_tc(dev, &am, &bm, epi, &mut unused)
        })?;
        out.to_vec()
    };
    let product_bound = |e: usize| {
        let (i, j) = (e / n, e % n);
        let abs = (0..n)
            .map(|k| f64::from(a[i * n + k].to_f32() * b[k * n + j].to_f32()).abs())
            .sum();
        bound(n, 1.0, abs)
    };
    if let Err(why) = both_paths("newton_gemm_wg_tc", product, product_bound, mismatch)? {
        return Ok(Err(why));
    }

    // SYRK Λ = α·SᵀS, S m x n2 with n2 = 131 (ld % 8 != 0: the element-wise loads), m = 77
    // (a partial K slice), ε = 0 (the old Λ is not read).
    let (m, n2) = (77, 131);
    let s = check_values(m * n2, 0x5DEE);
    let sm = dev.upload(m, n2, &s)?;
    let alpha = 1.0 / m as f32;
    let syrk = |path| -> Result<Vec<f32>> {
        let mut l: Matrix = dev.zeros(n2, n2)?;
        forced(path, || super::syrk::syrk_ema_tc(dev, &sm, 0.0, &mut l))?;
        l.to_vec()
    };
    let syrk_bound = |e: usize| {
        let (i, j) = (e / n2, e % n2);
        let abs = (0..m)
            .map(|k| f64::from(s[k * n2 + i].to_f32() * s[k * n2 + j].to_f32()).abs())
            .sum();
        bound(m, f64::from(alpha), abs)
    };
    if let Err(why) = both_paths("syrk_ema_wg_tc", syrk, syrk_bound, false)? {
        return Ok(Err(why));
    }

    // Split3 product C = Aᵀ·B (f32 operands split into bf16 planes, 6 plane products), A
    // 53 x 131 and B 53 x 70 stored row-major: op(A) k-outer, a ragged K of 53 (one partial
    // slice per term) and n = 70, 131 not multiples of 8 (the element-wise loads).
    let (k3, m3, n3) = (53, 131, 70);
    let f32s = |len, seed| -> Vec<f32> {
        check_values(len, seed)
            .iter()
            .map(|v| v.to_f32() * 1.37)
            .collect()
    };
    let (a3, b3) = (f32s(k3 * m3, 0x3C6E), f32s(k3 * n3, 0x2545));
    let (a3m, b3m) = (dev.upload(k3, m3, &a3)?, dev.upload(k3, n3, &b3)?);
    let split = |path| -> Result<Vec<f32>> {
        let mut c: Matrix = dev.zeros(m3, n3)?;
        forced(path, || {
            let p = crate::MatMul::new(Trans::Yes, Trans::No, 1.0, &a3m, &b3m);
            super::gemm::gemm3(dev, p, 0.0, &mut c)
        })?;
        c.to_vec()
    };
    let split_bound = |e: usize| {
        let (i, j) = (e / n3, e % n3);
        let abs = (0..k3)
            .map(|k| (f64::from(a3[k * m3 + i]) * f64::from(b3[k * n3 + j])).abs())
            .sum();
        split3_bound(k3, abs)
    };
    if let Err(why) = both_paths("gemm3_wg_tc", split, split_bound, false)? {
        return Ok(Err(why));
    }

    // Plain bf16 product C = α·Aᵀ·B (Device::gemm on bf16) of the split3 check's shapes: the
    // element-wise loads, op(A) k-outer, a partial K slice.
    let (a5, b5) = (check_values(k3 * m3, 0x1F3D), check_values(k3 * n3, 0x6A09));
    let (a5m, b5m) = (dev.upload(k3, m3, &a5)?, dev.upload(k3, n3, &b5)?);
    let alpha5 = 0.75f32;
    let plain = |path| -> Result<Vec<f32>> {
        let mut c: Matrix = dev.zeros(m3, n3)?;
        forced(path, || {
            let p = crate::MatMul::new(Trans::Yes, Trans::No, alpha5, &a5m, &b5m);
            super::gemm::gemm_tc(dev, p, 0.0, &mut c)
        })?;
        c.to_vec()
    };
    let plain_bound = |e: usize| {
        let (i, j) = (e / n3, e % n3);
        let abs = (0..k3)
            .map(|k| f64::from(a5[k * m3 + i].to_f32() * b5[k * n3 + j].to_f32()).abs())
            .sum();
        bound(k3, f64::from(alpha5), abs)
    };
    if let Err(why) = both_paths("gemm_wg_tc", plain, plain_bound, false)? {
        return Ok(Err(why));
    }

    // Newton's split3 product C = A·B of the first two f32 operands' 53 x 53 leading blocks
    // (n % 8 != 0: the element-wise loads; one partial tile and K slice per term).
    let n4 = k3;
    let (a4, b4) = (&a3[..n4 * n4], &b3[..n4 * n4]);
    let (a4m, b4m) = (dev.upload(n4, n4, a4)?, dev.upload(n4, n4, b4)?);
    let newton3 = |path| -> Result<Vec<f32>> {
        let mut out = dev.zeros(n4, n4)?;
        let mut planes = Planes::new(dev, n4)?;
        let mut unused = Unused::new(dev)?;
        forced(path, || {
            let epi = Epilogue {
                out: Some(&mut out),
                ..Epilogue::new()
            };
            product_f32(dev, &a4m, &b4m, &mut planes, epi, &mut unused)
        })?;
        out.to_vec()
    };
    let newton3_bound = |e: usize| {
        let (i, j) = (e / n4, e % n4);
        let abs = (0..n4)
            .map(|k| (f64::from(a4[i * n4 + k]) * f64::from(b4[k * n4 + j])).abs())
            .sum();
        split3_bound(n4, abs)
    };
    both_paths("newton_gemm3_wg_tc", newton3, newton3_bound, false)
}
