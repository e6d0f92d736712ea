//! Test and benchmark instrumentation of the kernel devices, behind the cargo feature
//! `test-hooks` (which grng's own tests and benches turn on through their dev-dependency):
//! the launch record (which kernels ran, for benches that must name them and tests of the
//! launch sequence), the per-thread counts of read-backs (the synchronizations an op costs),
//! uploads and zero-filled allocations (the copies and memsets it queues beside its kernels), and
//! the injection of a PTX rejection (a driver that will not load a kernel file). Kernel timing
//! is `cuda::timing`, the emulated sm_90a device `cuda::sm90::inject_sm90`, both behind
//! the same feature.
//!
//! Without the feature the public switches do not exist and the launch path's calls below are
//! empty inline functions: a release build of a user's trainer carries no process-wide test
//! state and reads none per launch.

#[cfg(feature = "test-hooks")]
use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(feature = "test-hooks")]
use std::sync::{Mutex, PoisonError};

/// Whether launches are recorded (one relaxed load per launch).
#[cfg(feature = "test-hooks")]
static RECORDING: AtomicBool = AtomicBool::new(false);
/// Kernels launched since recording was last switched on or drained, in launch order.
#[cfg(feature = "test-hooks")]
static LAUNCHED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// Records `name` when recording is on: every kernel launch, and work that is not a kernel of
/// ours (a cuSOLVER call, a host fallback), so the record shows it beside the kernels.
#[inline(always)]
pub(crate) fn record(name: &'static str) {
    #[cfg(feature = "test-hooks")]
    {
        if RECORDING.load(Ordering::Relaxed) {
            LAUNCHED
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(name);
        }
        HERE.with(|h| {
            if let Some(v) = h.borrow_mut().as_mut() {
                v.push(name);
            }
        });
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = name;
}

#[cfg(feature = "test-hooks")]
thread_local! {
    /// This thread's launches while [`record_launches_here`] is on.
    static HERE: std::cell::RefCell<Option<Vec<&'static str>>> =
        const { std::cell::RefCell::new(None) };
}

/// Switches this thread's own launch record on (cleared) or off: what a test that runs beside
/// others in one process (grng's unit tests) counts, where [`record_launches`] would see every
/// thread's launches. Launches queued from other threads (a pool's tasks) are not in it.
#[cfg(feature = "test-hooks")]
pub fn record_launches_here(on: bool) {
    HERE.with(|h| *h.borrow_mut() = on.then(Vec::new));
}

/// This thread's launches since [`record_launches_here`]`(true)` or the last call, in order,
/// and clears them (empty while it is off).
#[cfg(feature = "test-hooks")]
pub fn take_launches_here() -> Vec<&'static str> {
    HERE.with(|h| {
        h.borrow_mut()
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    })
}

/// Switches the launch record on (clearing it) or off. For benchmarks, which must name the
/// kernels that produced a timing and refuse to time a path that fell back to the host or to
/// another kernel (`benches/gpu.rs`). Process-wide: every thread's launches are recorded.
#[cfg(feature = "test-hooks")]
pub fn record_launches(on: bool) {
    LAUNCHED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clear();
    RECORDING.store(on, Ordering::Relaxed);
}

/// The kernels launched (emulated or on a GPU) since the last call or
/// [`record_launches`]`(true)`, in order, and clears the record.
#[cfg(feature = "test-hooks")]
pub fn take_launches() -> Vec<&'static str> {
    std::mem::take(&mut *LAUNCHED.lock().unwrap_or_else(PoisonError::into_inner))
}

/// What a kernel device queues beside its kernels, counted per thread ([`count`]).
#[derive(Clone, Copy)]
pub(crate) enum Queued {
    /// A `Matrix::to_vec` ([`read_backs`]).
    ReadBack,
    /// A `Device::upload` to a kernel device ([`uploads`]).
    Upload,
    /// A `Device::zeros` on a kernel device ([`zero_fills`]).
    ZeroFill,
}

#[cfg(feature = "test-hooks")]
thread_local! {
    /// This thread's counts, indexed by [`Queued`].
    static COUNTS: std::cell::Cell<[u64; 3]> = const { std::cell::Cell::new([0; 3]) };
}

/// Counts one `what` on this thread.
#[inline(always)]
pub(crate) fn count(what: Queued) {
    #[cfg(feature = "test-hooks")]
    COUNTS.with(|c| {
        let mut counts = c.get();
        counts[what as usize] += 1;
        c.set(counts);
    });
    #[cfg(not(feature = "test-hooks"))]
    let _ = what;
}

#[cfg(feature = "test-hooks")]
fn counted(what: Queued) -> u64 {
    COUNTS.with(|c| c.get()[what as usize])
}

/// How many matrices this thread has read to the host with `Matrix::to_vec` so far: every
/// status, scalar and result read-back of the kernel devices goes through it, and on a GPU
/// each is a device→host copy that waits for the stream. Per thread, so tests running in
/// parallel do not see each other's reads; CPU-device matrices count too (a host copy), so
/// compare counts around work on one kernel device. For tests of the synchronizations an op
/// costs (`tests/emu_deferred.rs`).
#[cfg(feature = "test-hooks")]
pub fn read_backs() -> u64 {
    counted(Queued::ReadBack)
}

/// How many host-to-device copies (`Device::upload` to the emulator or a GPU) this thread has
/// queued so far. On a GPU each is a driver call and a copy on the stream beside the kernels,
/// from pageable memory, which a stream capture cannot take: a step's work should queue none
/// (`tests/emu_deferred.rs`). Per thread, as [`read_backs`].
#[cfg(feature = "test-hooks")]
pub fn uploads() -> u64 {
    counted(Queued::Upload)
}

/// How many zero-filled allocations (`Device::zeros` on the emulator or a GPU) this thread has
/// made so far. On a GPU each queues a memset beside the allocation: an operation on the
/// stream like a launch, paid for nothing where a kernel writes every element (those take
/// `Device::scratch`). Per thread, as [`read_backs`].
#[cfg(feature = "test-hooks")]
pub fn zero_fills() -> u64 {
    counted(Queued::ZeroFill)
}

/// Whether a PTX rejection is being injected ([`inject_ptx_reject`]): one relaxed load per
/// emulated launch, and per module load on a GPU.
#[cfg(feature = "test-hooks")]
static INJECTING: AtomicBool = AtomicBool::new(false);
/// The kernel file whose module load fails while [`INJECTING`] (`"*"`: every file).
#[cfg(feature = "test-hooks")]
static REJECTED_FILE: Mutex<Option<&'static str>> = Mutex::new(None);

/// Fault injection for tests: from now on, loading the module of kernel file `file` (its PTX
/// constant name, `"KALMAN"` for `kernels/kalman.cu`; `"*"` for every file) fails as a driver
/// that rejects its PTX would, on [`crate::Device::Emulated`] (each launch stands for a module
/// load) and on [`crate::Device::Cuda`] (before the driver is asked); `None` stops it.
/// Process-wide: use it in a test binary whose other tests launch no kernel meanwhile.
#[cfg(feature = "test-hooks")]
pub fn inject_ptx_reject(file: Option<&'static str>) {
    *REJECTED_FILE.lock().unwrap_or_else(PoisonError::into_inner) = file;
    INJECTING.store(file.is_some(), Ordering::Relaxed);
}

/// Whether loading the module of kernel file `file` is to fail: only under
/// [`inject_ptx_reject`] of it (`launch::check_module_load` makes the error).
#[inline(always)]
pub(crate) fn rejection_injected(file: &str) -> bool {
    #[cfg(feature = "test-hooks")]
    if INJECTING.load(Ordering::Relaxed) {
        let rejected = *REJECTED_FILE.lock().unwrap_or_else(PoisonError::into_inner);
        return rejected.is_some_and(|f| f == "*" || f == file);
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = file;
    false
}

/// `Device::dots_deferred` of the `(x, y)` pairs of every group (a group's matrices of one
/// shape; one launch for all) inside one `Device::deferred` scope, resolved by the scope's
/// readout: the deferred reductions of a Kronecker step's model (`optim::kron::factored`),
/// reachable from the tests of their launches, values and failed-check re-run, which the
/// crate-private API hides.
///
/// # Errors
/// As [`crate::Device::dot`]: a non-finite pair fails the scope's check, and the body's eager
/// re-run reports it.
#[cfg(feature = "test-hooks")]
pub fn deferred_dots(
    dev: &crate::Device,
    groups: &[&[(&crate::Matrix, &crate::Matrix)]],
) -> crate::Result<Vec<f32>> {
    let (scalars, readout) = dev.deferred(|| {
        let mut out = vec![Default::default(); groups.iter().map(|g| g.len()).sum()];
        dev.dots_deferred(groups, &mut out)?;
        Ok(out)
    })?;
    // Every scalar is this scope's own, so it resolves; NaN only if that ever broke.
    Ok(scalars
        .into_iter()
        .map(|s| readout.get(s).unwrap_or(f32::NAN))
        .collect())
}

/// A result of [`axpy_new_split_all`]: `y + αx` and, on the kernel devices, the split planes
/// its pass wrote (`3·len` bf16 bits, plane `p` at `p·len`).
#[cfg(feature = "test-hooks")]
pub type AxpyOut = (Vec<f32>, Option<Vec<u16>>);

/// `Device::axpy_new_split_all` of the `(α, x, y)` jobs (a lazy Kronecker step's first-order
/// inverses: on the kernel devices one launch of `elementwise_multi_axpy_new`), inside a
/// `Device::deferred` scope when `deferred`, else eager: each result with its planes.
///
/// # Errors
/// As `Device::axpy_new`, the first failing job's.
#[cfg(feature = "test-hooks")]
pub fn axpy_new_split_all(
    dev: &crate::Device,
    jobs: &[(f32, &crate::Matrix, &crate::Matrix)],
    deferred: bool,
) -> crate::Result<Vec<AxpyOut>> {
    let run = || dev.axpy_new_split_all(jobs);
    let products = if deferred {
        dev.deferred(run)?.0
    } else {
        run()?
    };
    products
        .iter()
        .map(|p| {
            let planes = p
                .planes()
                .planes()
                .map(|m| m.to_vec().map(|v| v.iter().map(|b| b.to_bits()).collect()))
                .transpose()?;
            Ok((p.matrix().to_vec()?, planes))
        })
        .collect()
}
