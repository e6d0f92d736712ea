//! The launch side of the tensor-core GEMM engine (`kernels/gemm/*.cuh`), shared by every
//! launcher whose kernels are built on it (`gemm`, `newton`, `syrk`): the engine's shared
//! memory, the sm_90a block shape, and the split of `f32` operands into the three bf16
//! planes its f32-accurate products read (kernel `gemm_split3` of `kernels/gemm.cu`); and
//! the `int` sizes every GEMM launch passes (`GemmInts`: the engine's, the SIMT GEMM's,
//! cuBLAS's).

use super::launch::{kernel, launch, to_i32, Kernel, KernelArgs, LaunchConfig};
use crate::device::{Device, Matrix};
use crate::driver::kernel::{SelfCheck, Sm90Variant};
use crate::error::{check_shape, Result};
use crate::mat::Trans;
use half::bf16;
use std::sync::OnceLock;

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

/// The largest matrix whose planes are kept beside it (`2048²` elements:
/// `Device::kept_operand`, the gradients' check): there a split (a launch and 10 bytes per
/// element) is a large share of a product's time, and the kept planes (6 bytes per element,
/// 12 per concatenation of the bf16x3 candidate) are a few tens of MB at most; above it a
/// split is a few per cent of its `O(n³)` product and the memory grows with `n²`.
pub(crate) const KEEP_MAX_ELEMENTS: usize = 1 << 22;

/// The split3 planes and concatenations of one `f32` matrix, each made at the first product
/// that reads it (`cuda::gemm::Split3`). Owned by a `Split3` for one call's products, or kept
/// beside a matrix that outlives the call (the optimizer's inverse and factor,
/// `Split3::kept`), so that later calls split nothing; whoever keeps it drops it (or makes a
/// new one) when the matrix changes. Also filled by a product's epilogue for its result, and
/// by the gradients' check (`cuda::elementwise::check_finite_split`).
#[derive(Debug, Default)]
pub struct SplitCache {
    /// The engine's planes ([`split3`]'s layout).
    pub(crate) planes: OnceLock<Matrix<bf16>>,
    /// The concatenated operands ([`split3_cat`]) by role and transpose.
    pub(crate) cat: [OnceLock<Matrix<bf16>>; 4],
}

impl SplitCache {
    /// Whether the engine's planes are here: a product reading the matrix splits nothing.
    pub fn has_planes(&self) -> bool {
        self.planes.get().is_some()
    }

    /// The engine's planes of the matrix (`3r x c` bf16: hi, mid, lo, plane `p` at element
    /// offset `p·r·c`, `gemm_split3`'s layout), if made.
    pub fn planes(&self) -> Option<&Matrix<bf16>> {
        self.planes.get()
    }

    /// Keeps `planes` (`3r x c` bf16, `gemm_split3`'s layout), written for the matrix this
    /// cache is of, when it has none (the caller made them for an empty cache; a cache that
    /// has planes keeps its own, of the same matrix).
    pub(crate) fn keep(&self, planes: Matrix<bf16>) {
        let _ = self.planes.set(planes);
    }

    /// The planes a pass that stores or reads `m` writes for `cache` (`3r x c` bf16, to pass
    /// to its kernel), where the caller keeps them: a cache without planes, and `m` non-empty
    /// and up to [`KEEP_MAX_ELEMENTS`] (the gradients' check, the first-order inverse's
    /// axpy); else `None`.
    pub(crate) fn planes_to_write(
        dev: &Device,
        cache: Option<&SplitCache>,
        m: &Matrix,
    ) -> Result<Option<Matrix<bf16>>> {
        match cache {
            Some(c) if c.wants_planes(m) => dev.scratch::<bf16>(3 * m.rows(), m.cols()).map(Some),
            _ => Ok(None),
        }
    }

    /// Whether a pass over `m` writes planes for this cache ([`SplitCache::planes_to_write`]):
    /// it has none yet, and `m` is non-empty and up to [`KEEP_MAX_ELEMENTS`].
    pub(crate) fn wants_planes(&self, m: &Matrix) -> bool {
        !self.has_planes() && !m.is_empty() && m.len() <= KEEP_MAX_ELEMENTS
    }

    /// Keeps in `cache` the planes a pass wrote for its matrix, once that pass is queued or
    /// has passed: from here on they are the matrix's.
    pub(crate) fn keep_written(cache: Option<&SplitCache>, planes: Option<Matrix<bf16>>) {
        if let (Some(c), Some(p)) = (cache, planes) {
            c.keep(p);
        }
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
    let mut planes = dev.scratch::<bf16>(3 * x.rows(), x.cols())?;
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

kernel!(pub SPLIT3_CAT = GEMM::gemm_split3_cat;);

/// Which operand of a product a concatenated split3 operand ([`split3_cat`]) is: the two
/// take their planes in the orders that pair them term by term.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// `A`: planes hi, mid, lo in the order `GRNG_SPLIT3_A_PLANES`.
    A,
    /// `B`: `GRNG_SPLIT3_B_PLANES`.
    B,
}

/// The six plane products of a split3 product of `x` (`r x c`, the stored operand `role` of a
/// product with transpose flag `t`) as one bf16 operand with `K` concatenated six times, in
/// the term order of `gemm3_tc` (small products first): the stored operand of a plain bf16
/// product whose `K` is `6K` (kernel `gemm_split3_cat`). `K` runs along the stored rows for
/// `Aᵀ` and `B` (then `6r x c`), along the columns for `A` and `Bᵀ` (`r x 6c`). A 1x1
/// placeholder for an empty `x`. One launch, 12 bytes written per element.
///
/// # Errors
/// Device mismatch, allocation and launch errors.
pub(crate) fn split3_cat(dev: &Device, x: &Matrix, role: Role, t: Trans) -> Result<Matrix<bf16>> {
    const OP: &str = "cuda::engine::split3_cat";
    if x.is_empty() {
        return dev.zeros::<bf16>(1, 1);
    }
    let (r, c) = x.shape();
    let k_rows = (role == Role::A) == (t == Trans::Yes);
    let mut out = if k_rows {
        dev.zeros::<bf16>(6 * r, c)?
    } else {
        dev.zeros::<bf16>(r, 6 * c)?
    };
    let cfg = LaunchConfig::for_elements(x.len().min(1 << 20), 256)?;
    let mut args = KernelArgs::new(dev);
    args.input(OP, x)?
        .output(OP, &mut out)?
        .scalar(r as i64)
        .scalar(c as i64)
        .scalar(i32::from(role == Role::B))
        .scalar(i32::from(k_rows));
    // SAFETY: gemm_split3_cat(const float* x, bf16* out, long long rows, long long cols,
    // int role_b, int k_rows): grid-stride over i < rows·cols = x.len(), reading x[i] and
    // writing 6 elements of out inside 6·rows·cols, which out holds (allocated above in the
    // shape k_rows selects).
    unsafe { launch(&SPLIT3_CAT, cfg, args) }?;
    Ok(out)
}

/// A GEMM's sizes as its kernel's `int` arguments (and cuBLAS's): `m`, `n`, `k` and the
/// leading dimensions (row lengths) of the stored `A`, `B`, `C`, each checked to fit an `int`
/// ([`to_i32`]) in that order, so that an error names the first that does not.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmInts {
    /// Rows of `op(A)` and `C`.
    pub m: i32,
    /// Columns of `op(B)` and `C`.
    pub n: i32,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: i32,
    /// Row length of the stored `A`.
    pub lda: i32,
    /// Row length of the stored `B`.
    pub ldb: i32,
    /// Row length of `C`.
    pub ldc: i32,
}

impl GemmInts {
    /// The sizes of an `(m, n, k)` product ([`crate::Gemm`]'s dimensions) whose stored `A`,
    /// `B`, `C` have rows of `lda`, `ldb`, `ldc` elements.
    ///
    /// # Errors
    /// [`crate::Error::Value`] naming `op` and the first size of 2^31 or more.
    pub(crate) fn new(
        op: &'static str,
        (m, n, k): (usize, usize, usize),
        [lda, ldb, ldc]: [usize; 3],
    ) -> Result<Self> {
        Ok(Self {
            m: to_i32(op, "m", m)?,
            n: to_i32(op, "n", n)?,
            k: to_i32(op, "k", k)?,
            lda: to_i32(op, "a", lda)?,
            ldb: to_i32(op, "b", ldb)?,
            ldc: to_i32(op, "c", ldc)?,
        })
    }

    /// The `K` a GEMM kernel runs: `k`, or no k step at all for `α = 0`, so that `A` and `B`
    /// are never read (`C ← β·C`).
    pub(crate) fn k_steps(&self, alpha: f32) -> i32 {
        if alpha == 0.0 {
            0
        } else {
            self.k
        }
    }
}
