//! The vendor candidate of the GEMM plan ([`super::gemm_plan`]): cuBLAS's `cublasGemmEx`,
//! loaded dynamically by cudarc like cuSOLVER (nothing to link; [`available`] says whether the
//! library loads).
//!
//! cuBLAS is column-major. A row-major `m x n` matrix with leading dimension `n` is the
//! column-major `n x m` matrix of its transpose, so the row-major product
//! `C = α·op(A)·op(B) + β·C` is the column-major `Cᵀ = α·op(B)ᵀ·op(A)ᵀ + β·Cᵀ`: the operands
//! swap places and keep their own transpose flags and row lengths as leading dimensions. No
//! copy, no transpose pass.

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasFillMode_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::engine::GemmInts;
use super::launch::to_i32;
use super::CudaDevice;
use crate::device::{Device, Element, Matrix, Storage};
use crate::error::{check_shape, Error, Result};
use crate::mat::Trans;
use crate::shape::MatMul;

/// Whether `libcublas` loads: cudarc's dynamically loaded bindings would panic on the first
/// call otherwise. Probed once, by cudarc's own probe (the names its loader tries). Under
/// candle's CUDA build cudarc links libcublas, so a running program has it.
pub fn available() -> bool {
    #[cfg(feature = "cuda-linked")]
    {
        true
    }
    #[cfg(not(feature = "cuda-linked"))]
    {
        static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        // SAFETY: loading libcublas runs only its (and its dependencies') initialisers, as
        // cudarc's loader does on first use.
        *PRESENT.get_or_init(|| unsafe { cudarc::cublas::sys::is_culib_present() })
    }
}

/// The element types cuBLAS reads as operands, with their `cudaDataType`.
pub trait VendorElement: Element {
    /// cuBLAS's name of the type.
    const DATA_TYPE: cudaDataType_t;
}

impl VendorElement for f32 {
    const DATA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
}

impl VendorElement for bf16 {
    const DATA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
}

/// The GPU of `dev` with its cuBLAS handle, the device's context bound to this thread:
/// cuBLAS's calls run in the calling thread's current context, which cudarc makes current only
/// inside its own calls.
fn bound_handle<'d>(op: &str, dev: &'d Device) -> Result<(&'d CudaDevice, Arc<CudaBlas>)> {
    let Device::Cuda(cuda) = dev else {
        return Err(Error::DeviceUnavailable(format!(
            "{op}: cuBLAS runs on a CUDA device only"
        )));
    };
    let blas = cuda.cublas_handle()?;
    cuda.stream().context().bind_to_thread()?;
    Ok((cuda, blas))
}

/// The GPU memory of `m`.
fn slice<'m, T: Element>(op: &str, m: &'m Matrix<T>) -> Result<&'m CudaSlice<T>> {
    match &m.storage {
        Storage::Cuda(s) => Ok(s),
        Storage::Host(_) => Err(not_on_gpu(op)),
    }
}

/// The GPU memory of `m`, to write.
fn slice_mut<'m, T: Element>(op: &str, m: &'m mut Matrix<T>) -> Result<&'m mut CudaSlice<T>> {
    match &mut m.storage {
        Storage::Cuda(s) => Ok(s),
        Storage::Host(_) => Err(not_on_gpu(op)),
    }
}

fn not_on_gpu(op: &str) -> Error {
    Error::DeviceUnavailable(format!("{op}: an operand is not in GPU memory"))
}

fn op(t: Trans) -> cublasOperation_t {
    match t {
        Trans::No => cublasOperation_t::CUBLAS_OP_N,
        Trans::Yes => cublasOperation_t::CUBLAS_OP_T,
    }
}

/// `C ← α·op(A)·op(B) + β·C` (the product `p`, [`MatMul`]; row-major, contiguous; `f32` or
/// `bf16` operands, `f32` `C`) through `cublasGemmEx` on the device's stream, asynchronously,
/// computing in f32 (`CUBLAS_COMPUTE_32F`: SGEMM for `f32` operands, never TF32; each product
/// of two bf16 values is exact in f32). BLAS semantics: `β = 0` never reads `C`. The caller
/// (the plan) routes `α = 0` and `k = 0` to the engine, which never reads `A` and `B` then.
///
/// # Errors
/// [`Error::DeviceUnavailable`] off a CUDA device, [`Error::Shape`] for disagreeing
/// dimensions, [`Error::Value`] for a dimension ≥ 2^31, [`Error::Cuda`] for a cuBLAS status.
/// `c` is unchanged on error.
pub fn gemm<T: VendorElement>(
    dev: &Device,
    p: MatMul<&Matrix<T>>,
    beta: f32,
    c: &mut Matrix,
) -> Result<()> {
    const OP: &str = "cuda::gemm_vendor::gemm";
    let (m, n, k) = p.dims(OP, c.shape())?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let ints = GemmInts::new(OP, (m, n, k), [p.a.cols(), p.b.cols(), c.cols()])?;
    let (cuda, blas) = bound_handle(OP, dev)?;
    let stream = cuda.stream();
    let (ap, _a_guard) = slice(OP, p.a)?.device_ptr(stream);
    let (bp, _b_guard) = slice(OP, p.b)?.device_ptr(stream);
    let (cp, _c_guard) = slice_mut(OP, c)?.device_ptr_mut(stream);
    // SAFETY: `blas` is a live handle on `stream` (set at its creation), bound to this thread's
    // context above. In column-major terms (module doc) the call computes the n x m matrix
    // Cᵀ (ldc = n = c.cols()) from op(B)ᵀ (n x k: b's storage, ld = b.cols()) and op(A)ᵀ
    // (k x m: a's storage, ld = a.cols()); gemm_dims checked that these dimensions are the
    // operands' own, so cuBLAS reads inside a's, b's rows·cols elements and writes inside
    // c's m·n floats. The guards keep the three buffers alive and ordered on `stream` until
    // the call is queued. α and β are host f32 scalars (the handle's default host pointer
    // mode), as CUBLAS_COMPUTE_32F requires.
    let status = unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            op(p.tb),
            op(p.ta),
            ints.n,
            ints.m,
            ints.k,
            (&p.alpha as *const f32).cast(),
            bp as *const _,
            T::DATA_TYPE,
            ints.ldb,
            ap as *const _,
            T::DATA_TYPE,
            ints.lda,
            (&beta as *const f32).cast(),
            cp as *mut _,
            cudaDataType_t::CUDA_R_32F,
            ints.ldc,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    crate::hooks::record("cublas:gemm_ex");
    status.map_err(|e| Error::Cuda(format!("{OP}: cublasGemmEx: {e}")))
}

/// `Λ ← ε·Λ + (1−ε)/m·AᵀA` on the lower triangle of the row-major `Λ` (`n x n`; `A` `m x n`,
/// `m ≥ 1`), which is the only part of the old `Λ` read: `cublasSsyrk` (`f32` `A`; the
/// row-major lower triangle is its column-major upper one, and `A` stored row-major is the
/// column-major `Aᵀ`, so the call is `C = X·Xᵀ` with `X = Aᵀ`, `n x m`) or, for `bf16` `A`
/// (cuBLAS has no real bf16 SYRK), the full `AᵀA` by `cublasGemmEx` with `β = ε`, whose
/// lower triangle reads only `Λ`'s. The upper triangle is left for the caller to mirror.
///
/// # Errors
/// As [`gemm()`]. `factor` is unchanged on error.
pub fn syrk_ema<T: VendorElement>(
    dev: &Device,
    a: &Matrix<T>,
    eps: f32,
    factor: &mut Matrix,
) -> Result<()> {
    const OP: &str = "cuda::gemm_vendor::syrk_ema";
    let (m, n) = a.shape();
    check_shape(OP, "factor", factor.shape(), (n, n))?;
    let alpha = (1.0 - eps) / m as f32;
    if T::DATA_TYPE != cudaDataType_t::CUDA_R_32F {
        let p = MatMul::new(Trans::Yes, Trans::No, alpha, a, a);
        return gemm(dev, p, eps, factor);
    }
    if n == 0 {
        return Ok(());
    }
    let (mi, ni) = (to_i32(OP, "m", m)?, to_i32(OP, "n", n)?);
    let (cuda, blas) = bound_handle(OP, dev)?;
    let stream = cuda.stream();
    let (ap, _a_guard) = slice(OP, a)?.device_ptr(stream);
    let (fp, _f_guard) = slice_mut(OP, factor)?.device_ptr_mut(stream);
    // SAFETY: as in `gemm`: a live handle on `stream`, bound; X = Aᵀ is a's storage read as
    // column-major n x m with ld n = a.cols() (T is f32 here: DATA_TYPE checked above), C is
    // factor's n x n floats with ld n (checked), of which only the column-major upper triangle
    // is read and written; the guards keep both buffers alive and ordered on `stream`; α, ε
    // are host scalars.
    let status = unsafe {
        cudarc::cublas::sys::cublasSsyrk_v2(
            *blas.handle(),
            cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
            cublasOperation_t::CUBLAS_OP_N,
            ni,
            mi,
            &alpha,
            ap as *const f32,
            ni,
            &eps,
            fp as *mut f32,
            ni,
        )
    };
    crate::hooks::record("cublas:ssyrk");
    status
        .result()
        .map_err(|e| Error::Cuda(format!("{OP}: cublasSsyrk: {e}")))
}
