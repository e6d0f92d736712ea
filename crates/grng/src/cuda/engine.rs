//! The launch side of the tensor-core GEMM engine (`kernels/gemm/*.cuh`), shared by every
//! launcher whose kernels are built on it (`gemm`, `newton`, `syrk`): the engine's shared
//! memory, the sm_90a block shape, and the split of `f32` operands into the three bf16
//! planes its f32-accurate products read (kernel `gemm_split3` of `kernels/gemm.cu`).

use super::launch::{kernel, launch, Kernel, KernelArgs, LaunchConfig};
use crate::device::{Device, Matrix};
use crate::driver::kernel::{SelfCheck, Sm90Variant};
use crate::error::{check_shape, Result};
use half::bf16;

/// Dynamic shared memory of every GEMM-engine kernel (`syrk_ema_tc`, `newton_gemm_tc`):
/// `GRNG_GEMM_SMEM` of kernels/gemm/engine.cuh, 3 stages of two 128x32 bf16 tiles.
pub(crate) const GEMM_SMEM: u32 = 3 * 2 * 128 * 32 * 2;

/// Threads of an sm_90a GEMM block: a producer and two consumer warpgroups
/// (`GRNG_WG_THREADS`).
pub const WG_THREADS: u32 = 384;
/// Dynamic shared memory of an sm_90a GEMM block (`GRNG_WG_SMEM`): 4 stages of two 128x64
/// bf16 tiles, plus 1 KiB to align them to the 1024-byte swizzle atom.
pub const WG_SMEM: u32 = 4 * 2 * 128 * 64 * 2 + 1024;

/// The sm_90a variant `kernel` of an engine kernel: [`WG_THREADS`] threads, [`WG_SMEM`] bytes,
/// run where `check` passes.
pub(crate) const fn wg_variant(kernel: Kernel, check: SelfCheck) -> Sm90Variant {
    Sm90Variant {
        kernel,
        block: WG_THREADS,
        shared_mem: WG_SMEM,
        check,
    }
}

kernel!(pub SPLIT3 = GEMM::gemm_split3;);

/// The three bf16 planes (`hi + mid + lo = x`, see `grng_split3`) of `x` (`r x c`) as one
/// `3r x c` bf16 matrix, plane `p` at element offset `p·r·c`; a 1x1 placeholder for an
/// empty `x` (a product with `K = 0` or an empty output reads nothing).
pub(crate) fn split3(dev: &Device, x: &Matrix) -> Result<Matrix<bf16>> {
    if x.is_empty() {
        return dev.zeros::<bf16>(1, 1);
    }
    let mut planes = dev.zeros::<bf16>(3 * x.rows(), x.cols())?;
    split3_into(dev, x, &mut planes)?;
    Ok(planes)
}

/// Writes the three bf16 planes of a non-empty `x` (`r x c`) into `planes` (`3r x c`), plane
/// `p` at element offset `p·r·c`: one launch of `gemm_split3`.
///
/// # Errors
/// [`Error::Shape`] unless `planes` is `3r x c`, device mismatch, launch errors.
pub(crate) fn split3_into(dev: &Device, x: &Matrix, planes: &mut Matrix<bf16>) -> Result<()> {
    const OP: &str = "cuda::engine::split3";
    // Memory safety: the kernel writes 3·len(x) planes elements.
    check_shape(OP, "planes", planes.shape(), (3 * x.rows(), x.cols()))?;
    if x.is_empty() {
        return Ok(());
    }
    let cfg = LaunchConfig::for_elements(x.len().min(1 << 20), 256)?;
    let mut args = KernelArgs::new(dev);
    args.input(OP, x)?
        .output(OP, planes)?
        .scalar(x.len() as i64);
    // SAFETY: gemm_split3(const float* x, bf16* planes, long long count): grid-stride over
    // i < count = x.len(), reading x[i] and writing planes[p·count + i] for p < 3; planes holds
    // 3·count bf16 (checked).
    unsafe { launch(&SPLIT3, cfg, args) }
}
