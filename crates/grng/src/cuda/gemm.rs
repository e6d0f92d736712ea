//! Launchers of `kernels/gemm.cu`: the tiled fp32 GEMM (all four transpose cases); the
//! f32-accurate tensor-core GEMM [`gemm3`] (bf16 split planes on the GEMM engine), the plain
//! bf16 one [`gemm_tc`], and through [`gemm3`] the Kronecker preconditioning
//! `P = Γ̃⁻¹ G Λ̃⁻¹` and the damped-inverse update `X ← X − dλ·X·X`; `A ← A + λI`; the trace.
//!
//! Every function runs on [`Device::Emulated`] or [`Device::Cuda`] (on the device's stream,
//! asynchronously, except [`trace`], which reads its scalar back). Arguments are validated
//! once, by the ops ([`crate::ops`]: shapes, scalars, finiteness); a launcher checks only what
//! its kernel's memory safety needs (shapes against the dimensions it passes, the kernels'
//! `int` ranges; device placement is checked by [`KernelArgs`]).

use super::deferred::first_flagged;
pub use super::engine::SplitCache;
use super::engine::{split3, split3_cat, wg_variant, GemmInts, Role, GEMM_SMEM};
use super::launch::{kernel, launch, to_i32, Kernel, KernelArgs, LaunchConfig};
use super::sm90;
use crate::device::{Device, Matrix};
use crate::driver::kernel::Sm90Variant;
use crate::driver::CudaDevice;
use crate::error::{check_shape, Error, Result, OVERFLOW};
use crate::mat::Trans;
use crate::shape::{op_shape, MatMul, Shaped};
use half::bf16;

kernel!(pub GEMM_NN = GEMM::gemm_nn;);
kernel!(pub GEMM_NT = GEMM::gemm_nt;);
kernel!(pub GEMM_TN = GEMM::gemm_tn;);
kernel!(pub GEMM_TT = GEMM::gemm_tt;);
kernel!(pub ADD_DIAGONAL = GEMM::gemm_add_diagonal;);
kernel!(pub TRACE = GEMM::gemm_trace;);
kernel!(pub GEMM3_TC = GEMM::gemm3_tc, sm90 = GEMM3_WG;);
kernel!(pub GEMM_TC = GEMM::gemm_tc, sm90 = GEMM_BF16_WG;);

kernel!(WG_GEMM3 = GEMM_SM90A::gemm3_wg_tc, emu = gemm3_tc;);
kernel!(WG_GEMM_BF16 = GEMM_SM90A::gemm_wg_tc, emu = gemm_tc;);

/// The sm_90a variant of `gemm3_tc` ([`GEMM3_TC`]): the split3
/// (f32-accurate) products of the optimizers and the preconditioning.
pub const GEMM3_WG: Sm90Variant = wg_variant(WG_GEMM3, check_gemm3_wg);

/// The sm_90a variant of `gemm_tc` ([`GEMM_TC`]): `Device::gemm` on
/// bf16 operands.
pub const GEMM_BF16_WG: Sm90Variant = wg_variant(WG_GEMM_BF16, check_gemm_bf16_wg);

/// The shapes of this file's self-checks (`cuda::sm90`): `C = α·AᵀB` for `A` k x m and `B`
/// k x n stored row-major: op(A) k-outer, a ragged K (one partial slice per term), m and n
/// not multiples of 8 (the element-wise loads).
const CHECK_KMN: (usize, usize, usize) = (53, 131, 70);

/// [`GEMM3_WG`]'s self-check: [`gemm3`] of f32 operands at [`CHECK_KMN`].
fn check_gemm3_wg(gpu: Option<&CudaDevice>) -> Result<std::result::Result<(), String>> {
    let (k, m, n) = CHECK_KMN;
    let a = sm90::check_values_f32(k * m, 0x3C6E);
    let b = sm90::check_values_f32(k * n, 0x2545);
    let operands = ((k, m, &a[..]), Trans::Yes, (k, n, &b[..]));
    sm90::check_product(
        gpu,
        WG_GEMM3.name,
        operands,
        sm90::split3_bound,
        |dev, a, b, c| gemm3(dev, MatMul::new(Trans::Yes, Trans::No, 1.0, a, b), 0.0, c),
    )
}

/// [`GEMM_BF16_WG`]'s self-check: [`gemm_tc`] of bf16 operands at [`CHECK_KMN`], α = 0.75.
fn check_gemm_bf16_wg(gpu: Option<&CudaDevice>) -> Result<std::result::Result<(), String>> {
    let (k, m, n) = CHECK_KMN;
    let (a, b) = (
        sm90::check_values(k * m, 0x1F3D),
        sm90::check_values(k * n, 0x6A09),
    );
    let operands = ((k, m, &a[..]), Trans::Yes, (k, n, &b[..]));
    let per = |k, abs| sm90::bound(k, 0.75, abs);
    sm90::check_product(gpu, WG_GEMM_BF16.name, operands, per, |dev, a, b, c| {
        gemm_tc(dev, MatMul::new(Trans::Yes, Trans::No, 0.75, a, b), 0.0, c)
    })
}

/// Output tile of the GEMM kernels (rows and columns) and its threads per block.
const GEMM_TILE: usize = 64;
const GEMM_THREADS: u32 = 256;
/// Threads of the single-block trace reduction.
const TRACE_THREADS: u32 = 256;

/// `C ← α·op(A)·op(B) + β·C` (the product `p`, [`MatMul`]) with `op(A)` `m x k`, `op(B)`
/// `k x n` and `C` `m x n`, all row-major and contiguous. BLAS semantics: `β = 0` never reads
/// `C` (it may hold NaN), `α = 0` (or `k = 0`) never reads `A` and `B`.
///
/// One launch of `gemm_{nn,nt,tn,tt}`: 64x64 output tiles, 256 threads.
///
/// # Errors
/// [`Error::DeviceMismatch`], [`Error::Shape`] for disagreeing dimensions, [`Error::Value`]
/// for a dimension ≥ 2^31, launch/driver errors. `c` is unchanged on error. `α`, `β` are
/// not checked ([`crate::Device::gemm`] does).
pub fn gemm(dev: &Device, p: MatMul<&Matrix>, beta: f32, c: &mut Matrix) -> Result<()> {
    const OP: &str = "cuda::gemm::gemm";
    // Memory safety: the kernel indexes a, b, c by these dimensions.
    let (m, n, k) = p.dims(OP, c.shape())?;
    let ints = GemmInts::new(OP, (m, n, k), [p.a.cols(), p.b.cols(), c.cols()])?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let kernel = match (p.ta, p.tb) {
        (Trans::No, Trans::No) => &GEMM_NN,
        (Trans::No, Trans::Yes) => &GEMM_NT,
        (Trans::Yes, Trans::No) => &GEMM_TN,
        (Trans::Yes, Trans::Yes) => &GEMM_TT,
    };
    let cfg = LaunchConfig {
        grid: (
            n.div_ceil(GEMM_TILE) as u32,
            m.div_ceil(GEMM_TILE) as u32,
            1,
        ),
        block: (GEMM_THREADS, 1, 1),
        shared_mem: 0,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, p.a)?
        .input(OP, p.b)?
        .output(OP, c)?
        .scalar(ints.m)
        .scalar(ints.n)
        .scalar(ints.k_steps(p.alpha))
        .scalar(ints.lda)
        .scalar(ints.ldb)
        .scalar(ints.ldc)
        .scalar(p.alpha)
        .scalar(beta);
    // SAFETY: gemm_{nn,nt,tn,tt}(const float* A, const float* B, float* C, int M,
    // int N, int K, int lda, int ldb, int ldc, float alpha, float beta). A is stored
    // (M x K, ld K) or, transposed, (K x M, ld M): a.cols() is its row length either way, and
    // the kernel reads op(A)(i, kk) only for i < M, kk < K — inside a's rows*cols floats;
    // likewise B with op(B) K x N, and C (M x N, ld N = c.cols()) only at i < M, j < N.
    // The grid covers ceil(N/64) x ceil(M/64) tiles; the kernel uses static shared memory.
    unsafe { launch(kernel, cfg, args) }
}

/// `a ← a + λ I` for a square `a`.
///
/// # Errors
/// [`Error::DeviceMismatch`], [`Error::Shape`] unless square, launch errors. `a` is unchanged
/// on error. `λ` is not checked ([`crate::Device::add_diagonal`] does).
pub fn add_diagonal(dev: &Device, a: &mut Matrix, lambda: f32) -> Result<()> {
    const OP: &str = "cuda::gemm::add_diagonal";
    // Memory safety: the kernel writes the n = rows diagonal entries of an n x n matrix.
    check_shape(OP, "a", a.shape(), (a.rows(), a.rows()))?;
    let n = a.rows();
    let ni = to_i32(OP, "a", n)?;
    if n == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig::for_elements(n, 256)?;
    let mut args = KernelArgs::new(dev);
    args.output(OP, a)?.scalar(ni).scalar(ni).scalar(lambda);
    // SAFETY: gemm_add_diagonal(float* a, int n, int ld, float lambda): a is n x n with
    // ld = n, and the kernel touches a[i * (ld + 1)] for i < n only, the last at n*n − 1.
    unsafe { launch(&ADD_DIAGONAL, cfg, args) }
}

/// Trace of a square matrix: finite diagonal entries summed in `f64` on the device, rounded
/// to `f32`; one 3-float read-back (this call synchronizes with the device's stream).
///
/// # Errors
/// [`Error::DeviceMismatch`], [`Error::Shape`] unless square, [`Error::NonFinite`] for a
/// NaN/Inf diagonal entry (the first, flat index `i·n + i`), launch/driver errors.
pub fn trace(dev: &Device, a: &Matrix) -> Result<f32> {
    const OP: &str = "cuda::gemm::trace";
    // Memory safety: the kernel reads the n = rows diagonal entries of an n x n matrix.
    check_shape(OP, "a", a.shape(), (a.rows(), a.rows()))?;
    let n = a.rows();
    let ni = to_i32(OP, "a", n)?;
    if n == 0 {
        return Ok(0.0);
    }
    let mut out = dev.zeros::<f32>(3, 1)?;
    let cfg = LaunchConfig::linear(1, TRACE_THREADS);
    let mut args = KernelArgs::new(dev);
    args.input(OP, a)?
        .scalar(ni)
        .scalar(ni)
        .output(OP, &mut out)?;
    // SAFETY: gemm_trace(const float* a, int n, int ld, float* out): a is n x n with
    // ld = n and the kernel reads a[i * (ld + 1)] for i < n only; out holds 3 floats and
    // thread 0 writes out[0..3]. One block of 256 threads (a multiple of 32, ≤ 1024), as the
    // kernel's warp reduction requires; static shared memory only.
    unsafe { launch(&TRACE, cfg, args) }?;
    let r = out.to_vec()?;
    let bad = r[1].to_bits() as i32;
    if bad >= 0 {
        let i = bad as usize;
        return Err(Error::NonFinite {
            op: OP,
            arg: "a",
            index: i * n + i,
            value: r[2],
        });
    }
    Ok(r[0])
}

/// `C ← α·op(A)·op(B) + β·C` like [`gemm()`], with f32 accuracy on the bf16 tensor cores: `A` and
/// `B` are split into three bf16 planes each (`gemm_split3`, exact for normal floats) and
/// `gemm3_tc` sums the 6 plane products above `2^-24` relative on the GEMM engine
/// (kernels/gemm/engine.cuh, 128x128 tiles, f32 accumulation, small products first). Same
/// BLAS semantics as [`gemm()`] (`β = 0` never reads `C`, `α = 0` never reads `A`, `B`). `C` may
/// be `A` or `B`'s source: the product reads only the planes.
///
/// # Errors
/// As [`gemm()`], plus allocation errors (the planes: 6 bytes per element of `A` and `B`). `c`
/// is unchanged on error.
pub fn gemm3(dev: &Device, p: MatMul<&Matrix>, beta: f32, c: &mut Matrix) -> Result<()> {
    const OP: &str = "cuda::gemm::gemm3";
    // Memory safety: the kernel indexes the planes and c by these dimensions.
    p.dims(OP, c.shape())?;
    let (ap, bp) = (
        operand_planes(dev, p.alpha, p.a)?,
        operand_planes(dev, p.alpha, p.b)?,
    );
    let planes = p.with((p.a.shape(), &ap), (p.b.shape(), &bp));
    launch_engine(dev, OP, &GEMM3_TC, planes, beta, c, Out::default())
}

/// [`gemm3`] of operands split once ([`Split3`]: planes made at the first product that reads
/// them, or kept from an earlier call): the same product, the same bits. With `out` (an
/// empty cache, `c`'s), the epilogue also writes the split planes of `c` as stored into it
/// (except for `α = 0`), so that a product reading `c` next splits nothing.
///
/// # Errors
/// As [`gemm3`]; [`Error::Value`] for an `out` that holds planes already. `c` is unchanged
/// on error.
pub fn gemm3_split(
    dev: &Device,
    p: MatMul<&Split3<'_>>,
    beta: f32,
    c: &mut Matrix,
    out: Option<&SplitCache>,
) -> Result<()> {
    const OP: &str = "cuda::gemm::gemm3";
    // Memory safety: the kernel indexes the planes and c by these dimensions.
    p.dims(OP, c.shape())?;
    if p.alpha == 0.0 {
        // No K slice runs: nothing to split (gemm3's placeholders); `out` stays empty.
        return gemm3(dev, p.map(Split3::matrix), beta, c);
    }
    let planes = p.with(p.a.planes(dev)?, p.b.planes(dev)?);
    let mut result = SplitCache::result_planes(dev, OP, out, c)?;
    let into = Out {
        planes: result.as_mut(),
        ..Out::default()
    };
    launch_engine(dev, OP, &GEMM3_TC, planes, beta, c, into)?;
    SplitCache::keep_written(out, result);
    Ok(())
}

/// What [`SplitCache`] does for a product's result in this file: the planes an engine
/// product's epilogue writes (kept by [`SplitCache::keep_written`]).
impl SplitCache {
    /// The planes an engine product's epilogue writes for its result `c` (`3r x c` bf16)
    /// when `out` asks for them; `None` without `out` or for an empty `c` (nothing to read).
    ///
    /// # Errors
    /// [`Error::Value`] naming `op` for an `out` that holds planes already (another matrix's,
    /// or this one's before the product), allocation errors.
    fn result_planes(
        dev: &Device,
        op: &'static str,
        out: Option<&SplitCache>,
        c: &Matrix,
    ) -> Result<Option<Matrix<bf16>>> {
        match out {
            Some(o) if o.has_planes() => Err(Error::Value {
                op,
                arg: "out planes",
                value: f64::NAN,
                expected: "an empty split cache for the product's new result",
            }),
            Some(_) if !c.is_empty() => Ok(Some(dev.scratch::<bf16>(3 * c.rows(), c.cols())?)),
            _ => Ok(None),
        }
    }
}

/// A [`Split3`]'s cache: its own, or one kept beside the matrix.
enum Cache<'a> {
    Own(Box<SplitCache>),
    Kept(&'a SplitCache),
}

/// An `f32` matrix with its split3 planes (`gemm_split3`), made at the first product that
/// reads them ([`product3_checked`]) and kept, so that several products reading it do not
/// split it again, and a product the GEMM plan gives to cuBLAS (which reads the matrix)
/// splits nothing.
pub struct Split3<'a> {
    m: &'a Matrix,
    cache: Cache<'a>,
}

impl<'a> Split3<'a> {
    /// `m`, not split yet.
    pub fn new(m: &'a Matrix) -> Self {
        Self {
            m,
            cache: Cache::Own(Box::default()),
        }
    }

    /// `m` with the planes kept in `cache`, which must be `m`'s (made by `Split3`s of `m` as
    /// it is now, or empty): the caller's invariant, as the planes are read without a check
    /// of their values.
    pub fn kept(m: &'a Matrix, cache: &'a SplitCache) -> Self {
        Self {
            m,
            cache: Cache::Kept(cache),
        }
    }

    fn cache(&self) -> &SplitCache {
        match &self.cache {
            Cache::Own(c) => c,
            Cache::Kept(c) => c,
        }
    }

    /// `m` as the stored operand `role` (transpose flag `t`) of a bf16 product with `K`
    /// concatenated over the six plane products ([`split3_cat`]), made on `dev` on first use
    /// and kept.
    pub(crate) fn concatenated(&self, dev: &Device, role: Role, t: Trans) -> Result<&Matrix<bf16>> {
        let slot = &self.cache().cat[Self::cat_slot(role, t)];
        Ok(match slot.get() {
            Some(x) => x,
            None => {
                let x = split3_cat(dev, self.m, role, t)?;
                slot.get_or_init(|| x)
            }
        })
    }

    /// The matrix that was split.
    pub fn matrix(&self) -> &'a Matrix {
        self.m
    }

    /// Whether the engine's planes are made: a product reading them now splits nothing.
    pub(crate) fn has_planes(&self) -> bool {
        self.cache().has_planes()
    }

    /// Whether the concatenated operand `role` (transpose `t`) is made
    /// ([`Split3::concatenated`]).
    pub(crate) fn has_concatenated(&self, role: Role, t: Trans) -> bool {
        self.cache().cat[Self::cat_slot(role, t)].get().is_some()
    }

    fn cat_slot(role: Role, t: Trans) -> usize {
        2 * usize::from(role == Role::B) + usize::from(t == Trans::Yes)
    }

    /// The planes as [`launch_engine`] reads them, split on `dev` on first use (one launch,
    /// 6 bytes written per element).
    fn planes(&self, dev: &Device) -> Result<Planes<'_>> {
        let cache = self.cache();
        let planes = match cache.planes.get() {
            Some(p) => p,
            None => {
                let p = split3(dev, self.m)?;
                cache.planes.get_or_init(|| p)
            }
        };
        Ok((self.m.shape(), planes))
    }
}

impl Shaped for Split3<'_> {
    fn stored_shape(&self) -> (usize, usize) {
        self.m.shape()
    }
}

/// `α·op(A)·op(B)` into `c` (zeros of the product's shape; `β = 0`) like [`gemm3`], from
/// operands split once ([`Split3`]), with the result check in the same pass: the epilogue
/// flags the first NaN/Inf it writes, into the ledger of an enclosing `Device::deferred`
/// scope (no read-back), or else into a status read here. `Err(Error::NonFinite)` names `op`
/// and `"result (overflow)"` at that index — what a separate finiteness check of `c` would
/// report, without its pass over `c`. What the epilogue does besides: `epi`.
///
/// # Errors
/// As [`gemm3_split`], plus that [`Error::NonFinite`]; `c` holds the (rejected) product
/// then, and `epi.planes` stays empty; [`Error::Shape`] for `epi.mirror` on a product that
/// is not square.
pub fn product3_checked(
    dev: &Device,
    op: &'static str,
    p: MatMul<&Split3<'_>>,
    c: &mut Matrix,
    epi: Epilogue3<'_>,
) -> Result<()> {
    let (m, n, _) = p.dims(op, c.shape())?;
    if epi.mirror {
        check_shape(op, "c (mirrored: symmetric)", (m, n), (m, m))?;
    }
    if c.is_empty() {
        return Ok(());
    }
    let planes = p.with(p.a.planes(dev)?, p.b.planes(dev)?);
    let mut result = SplitCache::result_planes(dev, op, epi.planes, c)?;
    let flagged = first_flagged(dev, |status, at| {
        let out = Out {
            status: Some((status, at)),
            planes: result.as_mut(),
            mirror: epi.mirror,
        };
        launch_engine(dev, op, &GEMM3_TC, planes, 0.0, c, out)
    })?;
    match flagged {
        None => {
            SplitCache::keep_written(epi.planes, result);
            Ok(())
        }
        Some(index) => Err(Error::NonFinite {
            op,
            arg: OVERFLOW,
            index,
            value: c.to_vec()?[index],
        }),
    }
}

/// What the f32-accurate product's epilogue does besides storing `C` ([`product3_checked`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Epilogue3<'o> {
    /// An empty cache for `C`'s split3 planes, written as `C` is stored
    /// ([`gemm3_split`]'s `out`), so that a product reading `C` next splits nothing.
    pub planes: Option<&'o SplitCache>,
    /// The product is symmetric in exact arithmetic (`M = N`: a Gram `AᵀA`, `E·Γ̃⁻¹·Eᵀ`, …):
    /// only the lower-triangle tile pairs run (`⌈n/128⌉(⌈n/128⌉+1)/2` of `⌈n/128⌉²`) and each
    /// value computed at `(i, j)`, `j ≤ i`, is stored at `(i, j)` and `(j, i)`: `C` is
    /// exactly symmetric, as the CPU's SYRK makes it.
    pub mirror: bool,
}

/// The split3 planes of a product's operand, or a placeholder element when `α = 0` (no K
/// slice runs, so the planes are never read).
fn operand_planes(dev: &Device, alpha: f32, x: &Matrix) -> Result<Matrix<bf16>> {
    if alpha == 0.0 {
        dev.zeros::<bf16>(1, 1)
    } else {
        split3(dev, x)
    }
}

/// `C ← α·op(A)·op(B) + β·C` for bf16 `A`, `B` and f32 `C` on the tensor-core GEMM engine
/// (`gemm_tc`: kernels/gemm/engine.cuh, 128x128 tiles, `mma.sync` bf16, f32
/// accumulation, ragged `m`, `n`, `k`). Each product of two bf16 values is exact in f32, so
/// the result is an f32 GEMM of the widened operands. Same BLAS semantics as [`gemm()`].
///
/// # Errors
/// As [`gemm()`]. `c` is unchanged on error.
pub fn gemm_tc(dev: &Device, p: MatMul<&Matrix<bf16>>, beta: f32, c: &mut Matrix) -> Result<()> {
    const OP: &str = "cuda::gemm::gemm_tc";
    // Memory safety: the kernel indexes a, b and c by these dimensions.
    p.dims(OP, c.shape())?;
    let p = p.map(|x| (x.shape(), x));
    launch_engine(dev, OP, &GEMM_TC, p, beta, c, Out::default())
}

/// An operand of [`launch_engine`]: the shape of the matrix it holds (for split3 planes: of
/// the f32 matrix they were split from) and its bf16 data (the planes, or a placeholder when
/// `α = 0`).
type Planes<'a> = ((usize, usize), &'a Matrix<bf16>);

/// What [`launch_engine`]'s epilogue writes besides `C`.
#[derive(Default)]
struct Out<'s> {
    /// A buffer and the float offset of an int preset to `NONE`: the kernel flags the first
    /// flat index of a NaN/Inf it writes into C there.
    status: Option<(&'s mut Matrix, usize)>,
    /// `3m x n` bf16 (`gemm3_tc` only): the split3 planes of C as stored.
    planes: Option<&'s mut Matrix<bf16>>,
    /// `gemm3_tc` only: [`Epilogue3::mirror`].
    mirror: bool,
}

/// Launches `gemm3_tc` (split operands) or `gemm_tc` (bf16 operands, which ignores the plane
/// offsets and `out.planes`) for `C ← p + β·C` on operands whose shapes passed
/// [`MatMul::dims`], with the epilogue's extra writes `out`.
fn launch_engine(
    dev: &Device,
    op: &'static str,
    kernel: &Kernel,
    p: MatMul<Planes<'_>>,
    beta: f32,
    c: &mut Matrix,
    out: Out<'_>,
) -> Result<()> {
    let MatMul {
        ta,
        tb,
        alpha,
        a: (a_shape, ap),
        b: (b_shape, bp),
    } = p;
    let (m, n) = c.shape();
    let k = op_shape(ta, a_shape).1;
    let ints = GemmInts::new(op, (m, n, k), [a_shape.1, b_shape.1, n])?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let grid = if out.mirror {
        // The lower-triangle tile pairs, one block each (1-D grid, grng_tri_tile).
        check_shape(op, "c (mirrored: symmetric)", (m, n), (m, m))?;
        if kernel.name != GEMM3_TC.name {
            return Err(Error::Value {
                op,
                arg: "mirror",
                value: 1.0,
                expected: "the split3 product (gemm3_tc) only",
            });
        }
        let nt = m.div_ceil(128);
        let pairs = u32::try_from(nt * (nt + 1) / 2).map_err(|_| Error::Value {
            op,
            arg: "m",
            value: m as f64,
            expected: "fewer than 2^32 lower-triangle tile pairs",
        })?;
        (pairs, 1, 1)
    } else {
        let grid_y = u32::try_from(m.div_ceil(128))
            .ok()
            .filter(|&y| y <= 65_535)
            .ok_or(Error::Value {
                op,
                arg: "m",
                value: m as f64,
                expected: "at most 65535 128-row tiles",
            })?;
        (n.div_ceil(128) as u32, grid_y, 1)
    };
    let cfg = LaunchConfig {
        grid,
        block: (256, 1, 1),
        shared_mem: GEMM_SMEM,
    };
    if out.status.is_some() {
        // The flagged index i·N + j must fit the kernel's int.
        to_i32(op, "c", c.len())?;
    }
    if let Some(planes) = &out.planes {
        // Memory safety: the epilogue writes 3 planes of C's m·n elements.
        check_shape(op, "out planes", planes.shape(), (3 * m, n))?;
    }
    let trans = i32::from(ta == Trans::Yes)
        | (i32::from(tb == Trans::Yes) << 1)
        | (i32::from(out.mirror) << 2);
    let plane = |s: (usize, usize)| (s.0 * s.1) as i64;
    let mut args = KernelArgs::new(dev);
    args.input(op, ap)?
        .scalar(ints.lda)
        .scalar(plane(a_shape))
        .input(op, bp)?
        .scalar(ints.ldb)
        .scalar(plane(b_shape))
        .output(op, c)?
        .scalar(ints.ldc)
        .scalar(ints.m)
        .scalar(ints.n)
        .scalar(ints.k_steps(alpha))
        .scalar(alpha)
        .scalar(beta)
        .scalar(trans);
    match out.status {
        Some((s, at)) => args.output_at(op, s, at, 1)?,
        None => args.scalar(0u64),
    };
    match out.planes {
        Some(planes) => args.output(op, planes)?,
        None => args.scalar(0u64),
    };
    // SAFETY: gemm3_tc and gemm_tc(const bf16* a, int lda, long long
    // a_plane, const bf16* b, int ldb, long long b_plane, float* c, int ldc, int M, int N, int
    // K, float alpha, float beta, int trans, int* status, bf16* planes); status is null (0u64,
    // the 8-byte pointer slot: the kernel then flags nothing) or one int inside its buffer
    // (`output_at`), written by atomicMin only; planes is null or 3·M·N bf16 (checked), of
    // which the epilogue writes element p·M·N + i·N + j for i < M, j < N, p < 3. trans bit 2
    // (mirror, gemm3_tc only, M = N: checked) runs the nt(nt+1)/2 lower-triangle tile pairs
    // of a 1-D grid, whose epilogue writes (i, j) and (j, i) for j ≤ i < M: inside C. When K > 0 (α ≠ 0) ap holds an a_shape matrix
    // (gemm_tc) or its 3 split3 planes a_plane elements apart (gemm3_tc), each
    // stored like A: (M x K, ld K) or transposed (K x M, ld M), so lda = a_shape.1 and the
    // engine's reads of op(A)(i, kk), i < M, kk < K stay inside each plane (cp.async src-size
    // cut at the row end); likewise bp. With K = 0 nothing is read. C (M x N, ld N) is
    // touched only at i < M, j < N. Grid ceil(N/128) x ceil(M/128), block 256, GEMM_SMEM
    // bytes of dynamic shared memory.
    unsafe { launch(kernel, cfg, args) }
}

/// Lazy-Fisher damped-inverse update `X ← X − dλ · X X` for a square `X`: one f32-accurate
/// tensor-core product ([`gemm3`], `α = −dλ`, `β = 1`, the fused epilogue) reading the split
/// planes of the old `X`, so it can update `X` in place.
/// `dλ = 0` leaves `X` as it is.
///
/// # Errors
/// [`Error::DeviceMismatch`], [`Error::Shape`] unless square, allocation/launch errors. `inv`
/// is unchanged on error. `dλ` is not checked ([`crate::Device::damped_inverse_update`]
/// does).
pub fn damped_inverse_update(dev: &Device, inv: &mut Matrix, dlambda: f32) -> Result<()> {
    const OP: &str = "cuda::gemm::damped_inverse_update";
    // Memory safety: the product reads and writes inv as n x n.
    check_shape(OP, "inv", inv.shape(), (inv.rows(), inv.rows()))?;
    if dlambda == 0.0 || inv.is_empty() {
        return Ok(());
    }
    let planes = split3(dev, inv)?;
    let x = (inv.shape(), &planes);
    let p = MatMul::new(Trans::No, Trans::No, -dlambda, x, x);
    launch_engine(dev, OP, &GEMM3_TC, p, 1.0, inv, Out::default())
}

/// Batch gradient `G = (1/m) Eᵀ A` for `E` `m x d_out` (`m ≥ 1`), `A` `m x d_in`, `G`
/// `d_out x d_in`: the `gemm_tn` kernel with `α = 1/m`, `β = 0` (`G` is not read).
///
/// # Errors
/// [`Error::DeviceMismatch`], [`Error::Shape`] (the GEMM's own checks), launch errors. `g`
/// is unchanged on error.
pub fn batch_gradient(dev: &Device, e: &Matrix, a: &Matrix, g: &mut Matrix) -> Result<()> {
    let m = e.rows();
    let p = MatMul::new(Trans::Yes, Trans::No, 1.0 / m as f32, e, a);
    gemm(dev, p, 0.0, g)
}
