//! The exact SPD inverse on a GPU through cuSOLVER (`potrf` + `potri`, `f32`), loaded
//! dynamically by cudarc, and the counted host fallback of [`crate::Device::cholesky_inverse`].
//!
//! cuSOLVER is column-major: the row-major lower triangle grng reads is its upper triangle,
//! so both calls run with `CUBLAS_FILL_MODE_UPPER`; `potri` leaves the inverse in that
//! triangle and `newton_mirror_lower` (kernels/newton.cu) copies it onto the other, so the
//! result is exactly symmetric, as on the CPU.
//!
//! Where cuSOLVER cannot run — always on [`Device::Emulated`], and on [`Device::Cuda`] when
//! `libcusolver` (or a library it needs) does not load — the inverse is computed on the host
//! (`f64` Cholesky, download and upload around it). Every such call is counted
//! ([`host_fallbacks`]), recorded in the launch record as `"host:cholesky_inverse"`
//! (`grng::hooks::take_launches`, feature `test-hooks`) and said once per process on stderr: never a silent
//! slow path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

use cudarc::cusolver::sys::{
    self as cs, cublasFillMode_t::CUBLAS_FILL_MODE_UPPER, cusolverStatus_t,
};
use cudarc::driver::DevicePtrMut;

use super::launch::{kernel, launch, to_i32, KernelArgs, LaunchConfig};
use crate::device::{Device, Matrix, Storage};
use crate::error::{check_shape, Error, Result};

kernel!(pub MIRROR_LOWER = NEWTON::newton_mirror_lower;);

/// Host fallbacks of [`crate::Device::cholesky_inverse`] so far, in this process.
static HOST_FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// How many [`crate::Device::cholesky_inverse`] calls on a kernel device ran on the host
/// instead of cuSOLVER since the process started (every call on [`Device::Emulated`]; on
/// [`Device::Cuda`] the calls made while `libcusolver` is absent, and those whose `f32`
/// factorization hit a non-positive pivot and were settled by the `f64` host path).
pub fn host_fallbacks() -> u64 {
    HOST_FALLBACKS.load(Ordering::Relaxed)
}

/// Counts and records one host fallback; the first one of the process is said on stderr.
pub(crate) fn note_host_fallback(why: &str) {
    HOST_FALLBACKS.fetch_add(1, Ordering::Relaxed);
    crate::hooks::record("host:cholesky_inverse");
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        eprintln!("grng: Device::cholesky_inverse runs on the host (counted in grng::cuda::cholesky::host_fallbacks): {why}");
    });
}

/// Whether `libcusolver` loads (with the cuBLAS/cuSPARSE libraries it links): cudarc's
/// dynamically loaded bindings would panic on the first call otherwise. Probed once, by
/// cudarc's own probe, which tries exactly the names its loader tries (a list of our own
/// once held `libcusolver.so.13`, which cudarc built for CUDA 12 never loads: "available",
/// then a panic on the first call). Under candle's CUDA build cudarc links libcusolver
/// (`dynamic-linking`), so a running program has it.
pub fn available() -> bool {
    #[cfg(feature = "cuda-linked")]
    {
        true
    }
    #[cfg(not(feature = "cuda-linked"))]
    {
        static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        // SAFETY: loading libcusolver runs only its (and its dependencies') initialisers, as
        // cudarc's loader does on first use.
        *PRESENT.get_or_init(|| unsafe { cs::is_culib_present() })
    }
}

/// The shared signature of `cusolverDnSpotrf` and `cusolverDnSpotri`: handle, fill mode, n,
/// A, lda, workspace, lwork, info.
type Factor = unsafe fn(
    cs::cusolverDnHandle_t,
    cs::cublasFillMode_t,
    i32,
    *mut f32,
    i32,
    *mut f32,
    i32,
    *mut i32,
) -> cusolverStatus_t;

fn status(op: &'static str, call: &str, s: cusolverStatus_t) -> Result<()> {
    s.result()
        .map_err(|e| Error::Cuda(format!("{op}: {call}: {e}")))
}

/// `a⁻¹` of the SPD `n x n` `a` on `dev` by cuSOLVER (`a` itself is not written): `Ok(None)`
/// when `a` is not positive definite in `f32` (`potrf`'s `info > 0`), for the caller to
/// settle on the host, which gives the CPU's exact error — or, for a matrix that is SPD in
/// `f64` but not in `f32`, the exact inverse. The caller checked that `a` is square, on `dev`
/// and finite, and that cuSOLVER is [`available`].
///
/// # Errors
/// [`Error::Cuda`] for a cuSOLVER failure, allocation and launch errors.
pub(crate) fn cholesky_inverse(dev: &Device, a: &Matrix) -> Result<Option<Matrix>> {
    const OP: &str = "cuda::cholesky::cholesky_inverse";
    let Device::Cuda(cuda) = dev else {
        return Err(Error::DeviceUnavailable(format!(
            "{OP}: cuSOLVER runs on a CUDA device only"
        )));
    };
    let n = a.rows();
    check_shape(OP, "a", a.shape(), (n, n))?;
    let ni = to_i32(OP, "n", n)?;
    let mut x = a.try_clone()?;
    if n == 0 {
        return Ok(Some(x));
    }
    let stream = cuda.stream();
    let handle = cuda.cusolver_handle()?;
    // The raw cuSOLVER calls below run in the calling thread's current context, which cudarc
    // makes current only inside its own calls: bind it here, whatever thread this is (a rayon
    // worker under `cpu::on_pool`, a user's thread).
    stream.context().bind_to_thread()?;
    let mut info = stream.alloc_zeros::<i32>(1)?;
    {
        let Storage::Cuda(xs) = &mut x.storage else {
            return Err(Error::DeviceUnavailable(format!(
                "{OP}: a is not in GPU memory"
            )));
        };
        let (xp, _x_guard) = xs.device_ptr_mut(stream);
        let xp = xp as *mut f32;
        let (mut l_potrf, mut l_potri) = (0i32, 0i32);
        // SAFETY: handle is a live cuSOLVER handle on `stream`; xp points to n·n floats (a
        // copy of `a`, lda = n) that `_x_guard` keeps alive and ordered on `stream`; the
        // bufferSize calls only write the i32 they are given.
        unsafe {
            status(
                OP,
                "potrf_bufferSize",
                cs::cusolverDnSpotrf_bufferSize(
                    handle.cu(),
                    CUBLAS_FILL_MODE_UPPER,
                    ni,
                    xp,
                    ni,
                    &mut l_potrf,
                ),
            )?;
            status(
                OP,
                "potri_bufferSize",
                cs::cusolverDnSpotri_bufferSize(
                    handle.cu(),
                    CUBLAS_FILL_MODE_UPPER,
                    ni,
                    xp,
                    ni,
                    &mut l_potri,
                ),
            )?;
        }
        let lwork = l_potrf.max(l_potri).max(1);
        let mut work = stream.alloc_zeros::<f32>(lwork as usize)?;
        let (wp, _w_guard) = work.device_ptr_mut(stream);
        // potrf and potri take the same arguments; `call` runs one of them (named `name`) in
        // place on xp and says whether its info is 0.
        let mut call = |name: &'static str, record: &'static str, f: Factor| -> Result<bool> {
            let (ip, i_guard) = info.device_ptr_mut(stream);
            // SAFETY: f is cusolverDnSpotrf or cusolverDnSpotri; handle and xp as above (for
            // potri xp holds potrf's Cholesky factor in its upper, column-major, triangle,
            // which potri overwrites with the inverse's); wp holds lwork ≥ both workspace
            // sizes floats, ip one i32, all alive and stream-ordered by their guards until
            // the info read below.
            unsafe {
                status(
                    OP,
                    name,
                    f(
                        handle.cu(),
                        CUBLAS_FILL_MODE_UPPER,
                        ni,
                        xp,
                        ni,
                        wp as *mut f32,
                        lwork,
                        ip as *mut i32,
                    ),
                )?;
            }
            crate::hooks::record(record);
            drop(i_guard);
            Ok(stream.clone_dtoh(&info)?[0] == 0)
        };
        if !call("potrf", "cusolverDnSpotrf", cs::cusolverDnSpotrf)? {
            return Ok(None);
        }
        // potri's info > 0 means a zero diagonal of the factor, which potrf just ruled out.
        if !call("potri", "cusolverDnSpotri", cs::cusolverDnSpotri)? {
            return Ok(None);
        }
    }
    mirror_lower(dev, &mut x)?;
    Ok(Some(x))
}

/// `a[j, i] ← a[i, j]` for every `i > j` of the square `a` (row-major lower triangle copied
/// onto the upper one): one launch of `newton_mirror_lower`.
///
/// # Errors
/// [`Error::Shape`] unless `a` is square, [`Error::Value`] for `n ≥ 2^31`, device mismatch,
/// launch errors.
pub fn mirror_lower(dev: &Device, a: &mut Matrix) -> Result<()> {
    const OP: &str = "cuda::cholesky::mirror_lower";
    let n = a.rows();
    // Memory safety: the kernel touches n·n elements.
    check_shape(OP, "a", a.shape(), (n, n))?;
    let ni = to_i32(OP, "n", n)?;
    if n == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig::for_elements((n * n).min(1 << 20), 256)?;
    let mut args = KernelArgs::new(dev);
    args.output(OP, a)?.scalar(ni);
    // SAFETY: newton_mirror_lower(float* a, int n): grid-stride over e < n·n, reading and
    // writing a[e] only there; a holds n·n floats (checked).
    unsafe { launch(&MIRROR_LOWER, cfg, args) }
}
