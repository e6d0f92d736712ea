//! Launchers of `kernels/syrk.cu`: the Kronecker-factor SYRK with its EMA epilogue,
//! `Λ ← ε Λ + (1−ε)/m · AᵀA`, in fp32 (`syrk_ema_f32`) and on bf16 tensor cores
//! (`syrk_ema_tc`), and the rounding of `f32` statistics to bf16 that feeds the latter.
//!
//! Both SYRK kernels compute only the lower-triangle tiles and mirror them, so the
//! result is exactly symmetric; only the lower triangle of the old `Λ` is read, and not at all
//! when `ε = 0`. Arguments are validated once, by [`crate::Device::syrk_ema`] (shapes, `ε`,
//! `m ≥ 1`, finiteness); the launchers check
//! only what the kernels' memory safety needs (shapes against the dimensions passed, `int`
//! ranges; device placement is checked by [`KernelArgs`]).

use super::engine::{wg_variant, GEMM_SMEM};
use super::launch::{kernel, launch, to_i32, KernelArgs, LaunchConfig};
use super::sm90;
use crate::device::{Device, Element, Matrix};
use crate::driver::kernel::Sm90Variant;
use crate::driver::CudaDevice;
use crate::error::{check_shape, Error, Result};
use crate::mat::Trans;
use half::bf16;

kernel!(pub SYRK_EMA_F32 = SYRK::syrk_ema_f32;);
kernel!(pub SYRK_EMA_TC = SYRK::syrk_ema_tc, sm90 = SYRK_EMA_WG;);
kernel!(pub ROUND_BF16 = SYRK::syrk_round_bf16;);

kernel!(WG_SYRK_EMA = SYRK_SM90A::syrk_ema_wg_tc, emu = syrk_ema_tc;);

/// The sm_90a variant of `syrk_ema_tc` ([`SYRK_EMA_TC`]).
pub const SYRK_EMA_WG: Sm90Variant = wg_variant(WG_SYRK_EMA, check_syrk_ema_wg);

/// [`SYRK_EMA_WG`]'s self-check (`cuda::sm90`): Λ = α·SᵀS, S m x n with n = 131 (ld % 8 != 0:
/// the element-wise loads), m = 77 (a partial K slice), ε = 0 (the old Λ is not read).
fn check_syrk_ema_wg(gpu: Option<&CudaDevice>) -> Result<std::result::Result<(), String>> {
    let (m, n) = (77, 131);
    let s = sm90::check_values(m * n, 0x5DEE);
    let per = |k, abs| sm90::bound(k, 1.0 / m as f64, abs);
    let operands = ((m, n, &s[..]), Trans::Yes, (m, n, &s[..]));
    sm90::check_product(gpu, WG_SYRK_EMA.name, operands, per, |dev, a, _, l| {
        syrk_ema_tc(dev, a, 0.0, l)
    })
}

/// Output tile of `syrk_ema_f32`.
const TILE_F32: usize = 64;
/// Output tile of `syrk_ema_tc` (the GEMM engine's block tile, kernels/gemm/engine.cuh).
const TILE_TC: usize = 128;

/// The memory-safety checks of a SYRK-EMA call (`factor` `n x n` for `a` `m x n`, the
/// dimensions and the triangle of `tile x tile` pairs within the kernel's `int`s); returns
/// `(m, n, α, grid)`. `ε` and `m ≥ 1` are the op's to check.
fn check_syrk<T: Element>(
    op: &'static str,
    a: &Matrix<T>,
    eps: f32,
    factor: &Matrix,
    tile: usize,
) -> Result<(i32, i32, f32, u32)> {
    let (m, n) = a.shape();
    check_shape(op, "factor", factor.shape(), (n, n))?;
    let (mi, ni) = (to_i32(op, "m", m)?, to_i32(op, "n", n)?);
    // The kernel forms row * n offsets in 64 bits, but the tile-pair index is an int.
    let nt = n.div_ceil(tile);
    let pairs = u32::try_from(nt * (nt + 1) / 2)
        .ok()
        .filter(|&p| p <= i32::MAX as u32)
        .ok_or(Error::Value {
            op,
            arg: "a",
            value: n as f64,
            expected: "at most 2^31 - 1 lower-triangle tiles",
        })?;
    Ok((mi, ni, (1.0 - eps) / m as f32, pairs))
}

/// The launch shared by both SYRK kernels: one block per lower-triangle tile pair.
///
/// # Safety
/// `kernel` is `syrk_ema_f32` with `T = f32` or `syrk_ema_tc` with `T = bf16`,
/// `threads` and `shared_mem` its block size and dynamic shared memory, and the arguments
/// passed `check_syrk` with its tile.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_syrk<T: Element>(
    op: &'static str,
    kernel: &super::launch::Kernel,
    (threads, shared_mem): (u32, u32),
    dev: &Device,
    a: &Matrix<T>,
    factor: &mut Matrix,
    (m, n, alpha, pairs): (i32, i32, f32, u32),
    eps: f32,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid: (pairs, 1, 1),
        block: (threads, 1, 1),
        shared_mem,
    };
    let mut args = KernelArgs::new(dev);
    args.input(op, a)?
        .output(op, factor)?
        .scalar(m)
        .scalar(n)
        .scalar(alpha)
        .scalar(eps);
    // SAFETY: see the callers (kernel signature and bounds).
    unsafe { launch(kernel, cfg, args) }
}

/// `Λ ← ε Λ + (1−ε)/m · AᵀA` for an `f32` `A` (`m x n`, `m ≥ 1`) and `factor` `n x n`:
/// one launch of `syrk_ema_f32` (256 threads per lower-triangle 64x64 tile).
///
/// # Errors
/// [`Error::DeviceMismatch`], [`Error::Shape`] (also `m = 0`), [`Error::Value`] unless
/// `0 ≤ ε < 1` or for dimensions ≥ 2^31, launch errors. `factor` is unchanged on error.
pub fn syrk_ema_f32(dev: &Device, a: &Matrix<f32>, eps: f32, factor: &mut Matrix) -> Result<()> {
    const OP: &str = "cuda::syrk::syrk_ema_f32";
    let checked = check_syrk(OP, a, eps, factor, TILE_F32)?;
    // SAFETY: syrk_ema_f32(const float* A, float* L, int m, int n, float alpha,
    // float eps) with block 256 and one block per tile pair (bi ≥ bj) of ceil(n/64) tiles.
    // A holds m*n floats and is read at (s, c) only for s < m, c < n; L holds n*n floats and
    // is touched at (i, j) only for i, j < n. Static shared memory only.
    unsafe { launch_syrk(OP, &SYRK_EMA_F32, (256, 0), dev, a, factor, checked, eps) }
}

/// `Λ ← ε Λ + (1−ε)/m · AᵀA` for a `bf16` `A` (`m x n`, `m ≥ 1`) and an `f32` `factor`
/// `n x n`: one launch of `syrk_ema_tc`, the tensor-core GEMM engine
/// (kernels/gemm/engine.cuh: mma.sync m16n8k16 bf16, f32 accumulation) on the lower-triangle
/// 128x128 tiles, 256 threads each.
///
/// # Errors
/// As [`syrk_ema_f32`]. `factor` is unchanged on error.
pub fn syrk_ema_tc(dev: &Device, a: &Matrix<bf16>, eps: f32, factor: &mut Matrix) -> Result<()> {
    const OP: &str = "cuda::syrk::syrk_ema_tc";
    let checked = check_syrk(OP, a, eps, factor, TILE_TC)?;
    // SAFETY: syrk_ema_tc(const __nv_bfloat16* A, float* L, int m, int n, float alpha,
    // float eps) with block 256 (8 full warps, as mma.sync needs), one block per 128x128 tile
    // pair and GEMM_SMEM bytes of dynamic shared memory (3 stages of two 128x32 bf16 tiles).
    // A holds m*n bf16 and is read at (s, c) only for s < m, c < n (16-byte cp.async only when
    // n % 8 == 0 and A is 16-byte aligned, with src-size cut at column n); L holds n*n floats,
    // touched at (i, j) only for i, j < n.
    unsafe {
        launch_syrk(
            OP,
            &SYRK_EMA_TC,
            (256, GEMM_SMEM),
            dev,
            a,
            factor,
            checked,
            eps,
        )
    }
}

/// `y = bf16(x)` (round-to-nearest-even) for `x` and `y` of the same shape: one launch of
/// `syrk_round_bf16`.
///
/// # Errors
/// [`Error::Shape`] unless the shapes match, device mismatch, launch errors. `y` is
/// unchanged on error.
pub fn round_bf16(dev: &Device, x: &Matrix, y: &mut Matrix<bf16>) -> Result<()> {
    const OP: &str = "cuda::syrk::round_bf16";
    // Memory safety: the kernel writes len(x) elements of y.
    check_shape(OP, "y", y.shape(), x.shape())?;
    if x.is_empty() {
        return Ok(());
    }
    let cfg = LaunchConfig::for_elements(x.len().min(1 << 20), 256)?;
    let mut args = KernelArgs::new(dev);
    args.input(OP, x)?.output(OP, y)?.scalar(x.len() as i64);
    // SAFETY: syrk_round_bf16(const float* x, bf16* y, long long count): grid-stride over
    // i < count = x.len(), reading x[i] and writing y[i]; y holds count bf16 (checked).
    unsafe { launch(&ROUND_BF16, cfg, args) }
}
