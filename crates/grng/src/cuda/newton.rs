//! Launchers of `kernels/newton.cu` and the device-side Newton inversion and power iteration
//! behind [`Device::newton_inverse`] and [`Device::spectral_norm`] on
//! [`Device::Emulated`] and [`Device::Cuda`].
//!
//! The iteration control (starts, stop/stall/best-iterate rules, restart, `Bf16` polish,
//! [`NewtonInfo`]) and the power-iteration loop are `crate::iteration`'s, shared
//! with the CPU oracle ([`crate::cpu::newton`]); this module supplies the primitives (the
//! crate-internal traits `NewtonBackend` for the iteration's device buffers and `PowerStep`
//! for the power iteration). Differences from the CPU are rounding-level only: the products
//! accumulate in a different order. The early `F32` steps compute the powers of `E` as
//! mirrored products (lower-triangle tiles only) exactly where the CPU mirrors them. Per
//! iteration one `f32` (the residual) goes to the host for the stop test. The power
//! iteration queues its steps in batches of up to [`PowerOptions::max_batch`] (2, 4, 8, …),
//! each step one launch (the matrix-vector product, whose last block to finish normalizes)
//! writing four floats (the Rayleigh quotient and `‖Av‖` as double-float pairs) into its slot
//! of one buffer, and reads each batch back once; the shared loop applies its
//! stop test to the steps in order, so the result does not depend on the batch size. Setup
//! reads back a few per-block partials (input checks, norms) in one read, and the warm start's
//! test its residual and `E`'s norms in one. Buffer rotation over three
//! iterates keeps the best one without copies.
//!
//! Shapes and options are validated by [`Device::newton_inverse`] and
//! [`Device::spectral_norm`]; the primitives below check only their buffers against the `n`
//! they pass to a kernel and `n ≤ 46340` (the kernels index `n²` elements with `int`): memory
//! safety.
//!
//! Products, on the tensor-core GEMM engine with the epilogue fused: `Bf16` mode runs
//! [`newton_gemm_tc`](product_tc) on the bf16 copies the previous epilogues wrote; `F32` mode
//! (and the `Bf16` run's final `f32` residual and polish) runs `newton_gemm3_tc`
//! ([`product_f32`]) on split3 planes of the f32 operands, f32-accurate. The iteration runs
//! each through the GEMM plan (`cuda::gemm_plan::newton_product`, passed in as a
//! `RunProduct`), which may run cuBLAS instead, followed by the same epilogue as a kernel of
//! its own ([`epilogue`]).

use super::engine::{split3_into, wg_variant, GEMM_SMEM};
use super::launch::{kernel, launch, to_i32, KernelArgs, LaunchConfig};
use super::sm90;
use crate::device::{Device, Matrix};
use crate::driver::kernel::Sm90Variant;
use crate::driver::CudaDevice;
use crate::element::Element;
use crate::error::{check_len, check_shape, Error, Result};
use crate::iteration::{self as driver, check_symmetric, ANorms, NewtonBackend, PowerStep, Start};
use crate::mat::Trans;
use crate::params::newton::{InitialGuess, NewtonInfo, NewtonOptions, NewtonOrder, Precision};
use crate::params::norm::{PowerInfo, PowerOptions};
use half::bf16;

kernel!(pub GEMM_TC = NEWTON::newton_gemm_tc, sm90 = GEMM_WG;);
kernel!(pub GEMM3_TC = NEWTON::newton_gemm3_tc, sm90 = NEWTON_GEMM3_WG;);
kernel!(pub RESIDUAL = NEWTON::newton_residual;);
kernel!(pub SYM_STATS = NEWTON::newton_sym_stats;);
kernel!(pub ABS_NORMS = NEWTON::newton_abs_norms;);

kernel!(WG_GEMM = NEWTON_SM90A::newton_gemm_wg_tc, emu = newton_gemm_tc;);
kernel!(WG_NEWTON3 = NEWTON_SM90A::newton_gemm3_wg_tc, emu = newton_gemm3_tc;);

/// The sm_90a variant of `newton_gemm_tc` ([`GEMM_TC`]).
pub const GEMM_WG: Sm90Variant = wg_variant(WG_GEMM, check_newton_gemm_wg);

/// The sm_90a variant of `newton_gemm3_tc` ([`GEMM3_TC`]): Newton's
/// f32-accurate products (f32 mode, the bf16 run's residual and polish).
pub const NEWTON_GEMM3_WG: Sm90Variant = wg_variant(WG_NEWTON3, check_newton_gemm3_wg);

/// [`GEMM_WG`]'s self-check (`cuda::sm90`): C = A·B for n = 136 (n % 8 == 0: the 16-byte
/// cp.async loads; a partial tile).
fn check_newton_gemm_wg(gpu: Option<&CudaDevice>) -> Result<std::result::Result<(), String>> {
    let n = 136;
    let (a, b) = (
        sm90::check_values(n * n, 0x9E37),
        sm90::check_values(n * n, 0x7F4A),
    );
    let per = |k, abs| sm90::bound(k, 1.0, abs);
    let operands = ((n, n, &a[..]), Trans::No, (n, n, &b[..]));
    sm90::check_product(gpu, WG_GEMM.name, operands, per, |dev, a, b, out| {
        let epi = Epilogue {
            out: Some(out),
            ..Epilogue::new()
        };
        product_tc(dev, a, b, epi, &mut Unused::new(dev)?)
    })
}

/// [`NEWTON_GEMM3_WG`]'s self-check (`cuda::sm90`): the split3 product C = A·B of f32
/// operands, n = 53 (n % 8 != 0: the element-wise loads; one partial tile and K slice per
/// plane product).
fn check_newton_gemm3_wg(gpu: Option<&CudaDevice>) -> Result<std::result::Result<(), String>> {
    let n = 53;
    let a = sm90::check_values_f32(n * n, 0x3C6E);
    let b = sm90::check_values_f32(n * n, 0x2545);
    let operands = ((n, n, &a[..]), Trans::No, (n, n, &b[..]));
    sm90::check_product(
        gpu,
        WG_NEWTON3.name,
        operands,
        sm90::split3_bound,
        |dev, a, b, out| {
            let epi = Epilogue {
                out: Some(out),
                ..Epilogue::new()
            };
            product_f32(
                dev,
                a.into(),
                b.into(),
                &mut Planes::new(n),
                epi,
                &mut Unused::new(dev)?,
            )
        },
    )
}

kernel!(pub EPILOGUE = NEWTON::newton_epilogue;);
kernel!(pub INIT_X = NEWTON::newton_init_x;);
kernel!(pub POWER_STEP = NEWTON::newton_power_step;);

/// Output tile of `newton_gemm_tc` and `newton_gemm3_tc` (rows and columns).
/// The GEMM engine's block tile (kernels/gemm/engine.cuh).
pub const TILE: usize = 128;
/// Largest `n`: the kernels index `n²` elements with `int`.
const MAX_N: usize = 46_340;
/// Blocks of `newton_power_step` (8 rows each, grid-stride beyond).
const MATVEC_MAX_BLOCKS: usize = 2048;

// Epilogue flags of kernels/newton.cu.
const ADD1: i32 = 1;
const ADD2: i32 = 2;
const OUT_F32: i32 = 4;
const OUT_BF16: i32 = 8;
const RESID: i32 = 16;
const MIRROR: i32 = 32;
const OUT_SPLIT3: i32 = 64;

/// Number of residual partials a product of `n x n` matrices writes (one per 128x128 tile).
pub fn partials(n: usize) -> usize {
    n.div_ceil(TILE).pow(2)
}

/// The algebra fused into a Newton product `C = A·B` (`n x n`): per element
/// `v = α·C[r,c] + diag·[r = c] + add1[r,c] + add2[r,c]` (absent terms skipped), written to
/// `out` (`f32`) and/or `out_bf` (`bf16`, round-to-nearest-even); with `partial`, element `b`
/// (row-major over the 128x128 output tiles) receives the tile's `Σ v²`.
///
/// With `mirror` the caller knows `C` is symmetric (`A` and `B` polynomials in one symmetric
/// matrix, e.g. powers of `E = I − AX` while `X` is a polynomial in `A`): only the
/// lower-triangle 128x128 tiles are computed and `C[c, r] = C[r, c]` is mirrored in the
/// epilogue — the additions still read their own positions. About half the tiles; no
/// `partial` with it.
pub struct Epilogue<'a> {
    pub alpha: f32,
    pub diag: f32,
    pub add1: Option<&'a Matrix>,
    pub add2: Option<&'a Matrix>,
    pub out: Option<&'a mut Matrix>,
    pub out_bf: Option<&'a mut Matrix<bf16>>,
    /// `3n x n`: the split3 planes of `v` (hi, mid, lo, `n²` apart), as `gemm_split3` writes
    /// them from the stored `f32` value, which a later f32 product reads
    /// ([`F32Operand::planes`]) instead of splitting the output again. Products of f32
    /// operands ([`product_f32`]) and [`epilogue`] only; not with `out_bf` (the kernels take
    /// either through one pointer).
    pub out_planes: Option<&'a mut Matrix<bf16>>,
    /// At least [`partials`]`(n)` elements.
    pub partial: Option<&'a mut Matrix>,
    /// Lower-triangle tiles only, the product mirrored (see above).
    pub mirror: bool,
}

impl<'a> Epilogue<'a> {
    /// `v = C` with nothing written yet.
    pub fn new() -> Self {
        Self {
            alpha: 1.0,
            diag: 0.0,
            add1: None,
            add2: None,
            out: None,
            out_bf: None,
            out_planes: None,
            partial: None,
            mirror: false,
        }
    }
}

impl Epilogue<'_> {
    /// The same epilogue, its outputs borrowed again: for a product run more than once (the
    /// GEMM plan's trial runs each candidate several times).
    pub fn reborrow(&mut self) -> Epilogue<'_> {
        Epilogue {
            alpha: self.alpha,
            diag: self.diag,
            add1: self.add1,
            add2: self.add2,
            out: self.out.as_deref_mut(),
            out_bf: self.out_bf.as_deref_mut(),
            out_planes: self.out_planes.as_deref_mut(),
            partial: self.partial.as_deref_mut(),
            mirror: self.mirror,
        }
    }
}

impl Default for Epilogue<'_> {
    fn default() -> Self {
        Self::new()
    }
}

/// Placeholder buffers passed for the pointers an epilogue does not use (the kernel never
/// touches them), so a product needs no allocation.
pub struct Unused {
    input: Matrix,
    out: Matrix,
    partial: Matrix,
    out_bf: Matrix<bf16>,
}

impl Unused {
    /// One element each on `dev`.
    pub fn new(dev: &Device) -> Result<Self> {
        Ok(Self {
            input: dev.scratch(1, 1)?,
            out: dev.scratch(1, 1)?,
            partial: dev.scratch(1, 1)?,
            out_bf: dev.scratch(1, 1)?,
        })
    }
}

fn value_err(op: &'static str, arg: &'static str, v: f64, expected: &'static str) -> Error {
    Error::Value {
        op,
        arg,
        value: v,
        expected,
    }
}

/// `n` as an `int` kernel parameter, `1 ≤ n ≤ MAX_N`.
fn dim(op: &'static str, n: usize) -> Result<i32> {
    if n == 0 || n > MAX_N {
        return Err(value_err(op, "n", n as f64, "1 <= n <= 46340"));
    }
    to_i32(op, "n", n)
}

/// Checks the epilogue's operands against `n` and pushes its arguments (add1, add2, out,
/// out_bf, partial) after the product's operands; returns the flags.
fn push_epilogue<'a>(
    op: &'static str,
    args: &mut KernelArgs<'a>,
    epi: Epilogue<'a>,
    unused: &'a mut Unused,
    n: usize,
) -> Result<i32> {
    let mut flags = if epi.mirror { MIRROR } else { 0 };
    if epi.mirror && epi.partial.is_some() {
        // The residual partials are indexed over the full tile grid.
        return Err(value_err(
            op,
            "partial",
            1.0,
            "no residual partials from a mirrored product",
        ));
    }
    let Unused {
        input,
        out,
        partial,
        out_bf,
    } = unused;
    let input: &'a Matrix = input;
    let mut add = |m: Option<&'a Matrix>, flag: i32, arg| -> Result<&'a Matrix> {
        match m {
            Some(m) => {
                check_shape(op, arg, m.shape(), (n, n))?;
                flags |= flag;
                Ok(m)
            }
            None => Ok(input),
        }
    };
    let add1 = add(epi.add1, ADD1, "add1")?;
    let add2 = add(epi.add2, ADD2, "add2")?;
    let out = match epi.out {
        Some(m) => {
            check_shape(op, "out", m.shape(), (n, n))?;
            flags |= OUT_F32;
            m
        }
        None => out,
    };
    let out_bf = match (epi.out_bf, epi.out_planes) {
        (Some(_), Some(_)) => {
            return Err(value_err(
                op,
                "out_planes",
                1.0,
                "a bf16 copy or split3 planes, not both",
            ))
        }
        (Some(m), None) => {
            check_shape(op, "out_bf", m.shape(), (n, n))?;
            flags |= OUT_BF16;
            m
        }
        (None, Some(m)) => {
            check_shape(op, "out_planes", m.shape(), (3 * n, n))?;
            flags |= OUT_SPLIT3;
            m
        }
        (None, None) => out_bf,
    };
    let partial = match epi.partial {
        Some(m) => {
            if m.len() < partials(n) {
                return Err(Error::Shape {
                    op,
                    arg: "partial",
                    expected: format!("at least {} elements", partials(n)),
                    got: format!("{}", m.len()),
                });
            }
            flags |= RESID;
            m
        }
        None => partial,
    };
    args.input(op, add1)?
        .input(op, add2)?
        .output(op, out)?
        .output(op, out_bf)?
        .output(op, partial)?
        .scalar(dim(op, n)?)
        .scalar(epi.alpha)
        .scalar(epi.diag)
        .scalar(flags);
    Ok(flags)
}

/// The grid of a product: every tile, or with `mirror` the lower-triangle tile pairs (a 1-D
/// grid, ≤ 363·364/2 blocks for `n ≤ MAX_N`).
fn tile_grid(n: usize, mirror: bool) -> (u32, u32, u32) {
    let t = n.div_ceil(TILE) as u32;
    if mirror {
        (t * (t + 1) / 2, 1, 1)
    } else {
        (t, t, 1)
    }
}

/// `n` of the operands of an `n x n` product: both `n x n`, `1 ≤ n ≤ MAX_N`.
fn square_pair<T: Element>(op: &'static str, a: &Matrix<T>, b: &Matrix<T>) -> Result<usize> {
    let n = a.rows();
    check_shape(op, "a", a.shape(), (n, n))?;
    check_shape(op, "b", b.shape(), (n, n))?;
    dim(op, n)?;
    Ok(n)
}

/// The launch of a product kernel (all share kernels/newton.cu's `NEWTON_GEMM_PARAMS`): the
/// tile grid (lower-triangle tiles under [`Epilogue::mirror`]), block 256, `GEMM_SMEM` bytes,
/// and the arguments `a`, `b`, then `epi`'s.
fn product_launch<'a>(
    op: &'static str,
    dev: &'a Device,
    a: &'a Matrix<bf16>,
    b: &'a Matrix<bf16>,
    epi: Epilogue<'a>,
    unused: &'a mut Unused,
    n: usize,
) -> Result<(LaunchConfig, KernelArgs<'a>)> {
    let cfg = LaunchConfig {
        grid: tile_grid(n, epi.mirror),
        block: (256, 1, 1),
        shared_mem: GEMM_SMEM,
    };
    let mut args = KernelArgs::new(dev);
    args.input(op, a)?.input(op, b)?;
    push_epilogue(op, &mut args, epi, unused, n)?;
    Ok((cfg, args))
}

/// `C = A·B` for `n x n` bf16 `a`, `b` on tensor cores (`newton_gemm_tc`: the GEMM engine of
/// kernels/gemm/engine.cuh, 128x128 tiles, 8 warps of 4x4 mma.sync m16n8k16 accumulators,
/// f32 accumulation), with `epi` fused into the store. Full products only.
///
/// # Errors
/// [`Error::Shape`] (non-square or mismatched operands, short `partial`), [`Error::Value`]
/// (`n` outside `1..=46340`, or [`Epilogue::mirror`]), device mismatch, launch errors.
pub fn product_tc(
    dev: &Device,
    a: &Matrix<bf16>,
    b: &Matrix<bf16>,
    epi: Epilogue<'_>,
    unused: &mut Unused,
) -> Result<()> {
    const OP: &str = "cuda::newton::product_tc";
    let n = square_pair(OP, a, b)?;
    if epi.mirror {
        // newton_gemm_tc has no mirrored epilogue (kernels/newton.cu: it would overflow the
        // kernel's 2-blocks-per-SM register budget); the driver mirrors f32 products only.
        return Err(value_err(
            OP,
            "mirror",
            1.0,
            "full products on bf16 operands (mirrored products: product_f32)",
        ));
    }
    if epi.out_planes.is_some() {
        // Nor split3 planes: bf16 mode's operands are bf16 copies.
        return Err(value_err(
            OP,
            "out_planes",
            1.0,
            "a bf16 copy from bf16 operands (split3 planes: product_f32)",
        ));
    }
    let (cfg, args) = product_launch(OP, dev, a, b, epi, unused, n)?;
    // SAFETY: newton_gemm_tc(const bf16* a, const bf16* b, const float* add1, const float*
    // add2, float* out, bf16* out_bf, float* partial, int n, float alpha, float diag, int
    // flags). a, b and every buffer selected by `flags` are n x n (checked), partial holds
    // one float per block of the ceil(n/128)² grid; unselected pointers are never touched
    // (no MIRROR: refused above). The kernel reads and writes only rows/columns < n
    // (zero-filled tile edges) and uses GEMM_SMEM bytes of dynamic shared memory (3 stages of
    // two 128x32 bf16 tiles); 16-byte cp.async only when n % 8 == 0 and the operand is 16-byte
    // aligned (src-size cut at n).
    unsafe { launch(&GEMM_TC, cfg, args) }
}

/// Scratch of [`product_f32`]: the split3 planes of both operands (`3n x n` bf16 each),
/// allocated at the first product that splits an operand (one whose [`F32Operand::planes`]
/// are not given): an inversion whose epilogues write its operands' planes never does.
pub struct Planes {
    n: usize,
    a: Option<Matrix<bf16>>,
    b: Option<Matrix<bf16>>,
}

impl Planes {
    /// Planes for `n x n` operands (`12 n²` bytes once used).
    pub fn new(n: usize) -> Self {
        Self {
            n,
            a: None,
            b: None,
        }
    }
}

/// `slot`, allocated on `dev` for `n x n` operands at its first use.
fn plane_slot<'p>(
    dev: &Device,
    slot: &'p mut Option<Matrix<bf16>>,
    n: usize,
) -> Result<&'p mut Matrix<bf16>> {
    Ok(match slot {
        Some(m) => m,
        empty => empty.insert(dev.scratch(3 * n, n)?),
    })
}

/// An f32 operand of a Newton product: the matrix, and its split3 planes (`3n x n` bf16) where
/// an earlier epilogue wrote them ([`Epilogue::out_planes`]). The engine ([`product_f32`])
/// reads the planes instead of splitting `m`; cuBLAS and bf16x3 read `m`. The planes must be
/// `m`'s as it is now (the caller's invariant: the kernel checks only their shape), or the
/// engine's product is of other values.
#[derive(Clone, Copy)]
pub struct F32Operand<'a> {
    /// The operand.
    pub m: &'a Matrix,
    /// Its split3 planes, if made.
    pub planes: Option<&'a Matrix<bf16>>,
}

impl<'a> From<&'a Matrix> for F32Operand<'a> {
    /// `m` without planes (split by the product that reads it).
    fn from(m: &'a Matrix) -> Self {
        Self { m, planes: None }
    }
}

/// `C = A·B` for `n x n` f32 `a`, `b` with f32 accuracy on the tensor cores: each operand
/// without planes ([`F32Operand`]) is split into three bf16 planes (`gemm_split3`) in
/// `planes`, then `newton_gemm3_tc` (the GEMM engine over the 6 significant plane products,
/// see `precond::gemm3`) applies `epi`.
///
/// [`Epilogue::mirror`] is honoured here (lower-triangle tiles only).
///
/// # Errors
/// As [`product_tc`] (but a mirror is accepted, without `partial`); [`Error::Shape`] for
/// given planes that are not `3n x n`; `planes` must be for `n`.
pub fn product_f32(
    dev: &Device,
    a: F32Operand<'_>,
    b: F32Operand<'_>,
    planes: &mut Planes,
    epi: Epilogue<'_>,
    unused: &mut Unused,
) -> Result<()> {
    const OP: &str = "cuda::newton::product_f32";
    let n = square_pair(OP, a.m, b.m)?;
    for (arg, given) in [("a planes", a.planes), ("b planes", b.planes)] {
        if let Some(p) = given {
            check_shape(OP, arg, p.shape(), (3 * n, n))?;
        }
    }
    let Planes {
        n: pn,
        a: pa,
        b: pb,
    } = planes;
    check_shape(OP, "planes", (*pn, *pn), (n, n))?;
    let a3: &Matrix<bf16> = match a.planes {
        Some(p) => p,
        None => {
            let pa = plane_slot(dev, pa, n)?;
            split3_into(dev, a.m, pa)?;
            pa
        }
    };
    let b3: &Matrix<bf16> = match b.planes {
        Some(p) => p,
        // A square (E·E) is split once.
        None if std::ptr::eq(a.m, b.m) => a3,
        None => {
            let pb = plane_slot(dev, pb, n)?;
            split3_into(dev, b.m, pb)?;
            pb
        }
    };
    let (cfg, args) = product_launch(OP, dev, a3, b3, epi, unused, n)?;
    // SAFETY: newton_gemm3_tc(const bf16* a, const bf16* b, const float* add1, const float*
    // add2, float* out, bf16* out_bf, float* partial, int n, float alpha, float diag, int
    // flags). a, b hold 3 planes of n² bf16 each (split3_into or the check above: 3n x n),
    // read only at rows/columns < n of each plane; every buffer selected by `flags` is n x n
    // (checked), out_bf 3n x n with OUT_SPLIT3 (checked), partial holds one float per block of
    // the ceil(n/128)² grid; unselected pointers are never touched; with MIRROR (no partial)
    // the 1-D grid holds the lower tile pairs, each block writing (r, c) and (c, r) with
    // r, c < n. GEMM_SMEM bytes of dynamic shared memory.
    unsafe { launch(&GEMM3_TC, cfg, args) }
}

/// `epi` applied to `c = A·B` (`n x n`, f32) computed elsewhere — the GEMM plan's vendor
/// candidate, cuBLAS — by `newton_epilogue`: `NewtonEpi`'s algebra, outputs and [`partials`],
/// so the result is [`product_tc`]'s / [`product_f32`]'s with `epi` on the same product. With
/// [`Epilogue::mirror`] only `c`'s lower triangle is read (the upper half takes its mirror
/// image), as the mirrored products compute only that triangle; `c` itself is full.
///
/// # Errors
/// [`Error::Shape`] (`c` not square, an epilogue buffer not `n x n`, a short `partial`),
/// [`Error::Value`] (`n` outside `1..=46340`, a mirror with `partial`), device mismatch,
/// launch errors.
pub fn epilogue(dev: &Device, c: &Matrix, epi: Epilogue<'_>, unused: &mut Unused) -> Result<()> {
    const OP: &str = "cuda::newton::epilogue";
    let n = c.rows();
    check_shape(OP, "c", c.shape(), (n, n))?;
    dim(OP, n)?;
    let cfg = LaunchConfig {
        grid: tile_grid(n, false),
        block: (256, 1, 1),
        shared_mem: 0,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, c)?;
    push_epilogue(OP, &mut args, epi, unused, n)?;
    // SAFETY: newton_epilogue(const float* c, const float* add1, const float* add2, float*
    // out, bf16* out_bf, float* partial, int n, float alpha, float diag, int flags): c and
    // every buffer selected by `flags` are n x n (checked; out_bf 3n x n with OUT_SPLIT3, its
    // planes n² apart), read and written only at rows and
    // columns < n; partial holds one float per block of the ceil(n/128)² grid (checked; never
    // with MIRROR: refused); unselected pointers are never touched; static shared memory.
    unsafe { launch(&EPILOGUE, cfg, args) }
}

/// The operands of one product of the iteration, `A·B` (both `n x n`).
#[derive(Clone, Copy)]
pub enum Operands<'a> {
    /// bf16 copies (`Bf16` mode): [`product_tc`]'s.
    Bf16(&'a Matrix<bf16>, &'a Matrix<bf16>),
    /// f32 operands, the product f32-accurate: [`product_f32`]'s.
    F32(F32Operand<'a>, F32Operand<'a>),
}

impl Operands<'_> {
    /// `n`.
    pub fn n(&self) -> usize {
        match self {
            Self::Bf16(a, _) => a.rows(),
            Self::F32(a, _) => a.m.rows(),
        }
    }
}

/// The scratch of an inversion's products: the engine's split3 planes, the `f32` product a
/// vendor writes before [`epilogue`] (allocated at its first use), the placeholders.
pub struct Scratch {
    planes: Planes,
    product: Option<Matrix>,
    unused: Unused,
}

impl Scratch {
    /// Scratch for `n x n` products on `dev` (the placeholders; the planes and the vendor's
    /// product come later, if ever).
    ///
    /// # Errors
    /// Allocation errors.
    pub fn new(dev: &Device, n: usize) -> Result<Self> {
        Ok(Self {
            planes: Planes::new(n),
            product: None,
            unused: Unused::new(dev)?,
        })
    }

    /// An `n x n` f32 matrix for a product computed outside the engine (made on first use,
    /// then kept) and the placeholders of its [`epilogue`].
    ///
    /// # Errors
    /// Allocation errors.
    pub fn for_epilogue(&mut self, dev: &Device, n: usize) -> Result<(&mut Matrix, &mut Unused)> {
        let product = match self.product.take() {
            Some(p) if p.shape() == (n, n) => p,
            _ => dev.scratch(n, n)?,
        };
        Ok((self.product.insert(product), &mut self.unused))
    }
}

/// One product of the iteration on grng's kernels: [`product_tc`] or [`product_f32`].
///
/// # Errors
/// As those.
pub fn engine_product(
    dev: &Device,
    ops: Operands<'_>,
    epi: Epilogue<'_>,
    scratch: &mut Scratch,
) -> Result<()> {
    match ops {
        Operands::Bf16(a, b) => product_tc(dev, a, b, epi, &mut scratch.unused),
        Operands::F32(a, b) => {
            product_f32(dev, a, b, &mut scratch.planes, epi, &mut scratch.unused)
        }
    }
}

/// Which candidate ran one of the inversion's products (the GEMM plan's
/// `newton_product` says): grng's engine reads the operands' split3 planes
/// ([`F32Operand::planes`]), the others (cuBLAS, bf16x3) the f32 matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ran {
    /// [`engine_product`].
    Engine,
    /// cuBLAS or bf16x3, then [`epilogue`].
    Other,
}

/// How the iteration runs its products: the GEMM plan's choice between [`engine_product`]
/// and cuBLAS (`cuda::gemm_plan::newton_product`), which `Device::newton_inverse` passes in:
/// a launcher names no dispatcher (tests/layering.rs). Says which ran, so the iteration has
/// its epilogues write split planes only while the engine reads them.
pub(crate) type RunProduct = fn(&Device, Operands<'_>, Epilogue<'_>, &mut Scratch) -> Result<Ran>;

/// `res[0] = sqrt(Σ partial[..count] / n)` (one block, fixed-order double sum).
///
/// # Errors
/// [`Error::Shape`] if `partial` holds fewer than `count` or `res` no element;
/// [`Error::Value`] for `n` out of range; launch errors.
pub fn residual(
    dev: &Device,
    partial: &Matrix,
    count: usize,
    n: usize,
    res: &mut Matrix,
) -> Result<()> {
    const OP: &str = "cuda::newton::residual";
    if partial.len() < count || res.is_empty() {
        return Err(Error::Shape {
            op: OP,
            arg: "partial",
            expected: format!("at least {count} partials and a 1-element result"),
            got: format!("{} and {}", partial.len(), res.len()),
        });
    }
    let cfg = LaunchConfig {
        grid: (1, 1, 1),
        block: (256, 1, 1),
        shared_mem: 0,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, partial)?
        .scalar(to_i32(OP, "count", count)?)
        .scalar(dim(OP, n)?)
        .output(OP, res)?;
    // SAFETY: newton_residual(const float* partial, int count, int n, float* res): reads
    // partial[0..count) (checked above), writes res[0] (non-empty); static shared memory.
    unsafe { launch(&RESIDUAL, cfg, args) }
}

/// Input checks and symmetric part of an `n x n` matrix, reduced on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SymStats {
    /// `max |a_ij|` over the finite elements.
    pub max_abs: f32,
    /// `max |a_ij − a_ji|` over the finite elements.
    pub max_asym: f32,
    /// First (row-major) non-finite element: `(flat index, value)`.
    pub non_finite: Option<(usize, f32)>,
    /// The largest finite diagonal element: `(row, value)`, the first row on ties.
    pub top_diagonal: Option<(usize, f32)>,
}

/// Runs `newton_sym_stats` on `a` (`n x n`): optionally writes `(a + aᵀ)/2` to `sym` and its
/// bf16 rounding to `sym_bf`, and returns the stats (one small read-back).
///
/// # Errors
/// [`Error::Shape`] unless all are `n x n`, [`Error::Value`] for `n` out of range, device
/// and launch errors.
pub fn sym_stats(
    dev: &Device,
    a: &Matrix,
    sym: Option<&mut Matrix>,
    sym_bf: Option<&mut Matrix<bf16>>,
    unused: &mut Unused,
) -> Result<SymStats> {
    let mut stats: Matrix = dev.scratch(SymStats::len(a.rows()), 1)?;
    queue_sym_stats(dev, a, (sym, sym_bf), unused, (&mut stats, 0))?;
    Ok(SymStats::of(&stats.to_vec()?))
}

/// [`sym_stats`]' launch, its [`SymStats::len`] floats written to `stats` from float `at`
/// on, for the caller to read with others ([`SymStats::of`]).
fn queue_sym_stats(
    dev: &Device,
    a: &Matrix,
    (sym, sym_bf): (Option<&mut Matrix>, Option<&mut Matrix<bf16>>),
    unused: &mut Unused,
    (stats, at): (&mut Matrix, usize),
) -> Result<()> {
    const OP: &str = "cuda::newton::sym_stats";
    let n = a.rows();
    check_shape(OP, "a", a.shape(), (n, n))?;
    let ni = dim(OP, n)?;
    let bands = n.div_ceil(32);
    let mut flags = 0i32;
    let sym = match sym {
        Some(m) => {
            check_shape(OP, "sym", m.shape(), (n, n))?;
            flags |= 1;
            m
        }
        None => &mut unused.out,
    };
    let sym_bf = match sym_bf {
        Some(m) => {
            check_shape(OP, "sym_bf", m.shape(), (n, n))?;
            flags |= 2;
            m
        }
        None => &mut unused.out_bf,
    };
    let cfg = LaunchConfig {
        grid: (bands as u32, 1, 1),
        block: (32, 8, 1),
        shared_mem: 0,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, a)?
        .scalar(ni)
        .output(OP, sym)?
        .output(OP, sym_bf)?
        .output_at(OP, stats, at, 6 * bands)?
        .scalar(flags);
    // SAFETY: newton_sym_stats(const float* a, int n, float* sym, bf16* sym_bf, float* stats,
    // int flags): a (and sym, sym_bf when flagged) are n x n, touched only at indices < n²;
    // block b of the ceil(n/32) grid writes stats[6b..6b+6) from float `at` of the buffer,
    // inside its 6·bands floats there (`output_at` checks).
    unsafe { launch(&SYM_STATS, cfg, args) }
}

impl SymStats {
    /// Floats of [`sym_stats`]' per-band output for an `n x n` matrix.
    fn len(n: usize) -> usize {
        6 * n.div_ceil(32)
    }

    /// The stats from [`queue_sym_stats`]' per-band output, read back.
    fn of(v: &[f32]) -> Self {
        let mut out = SymStats {
            max_abs: 0.0,
            max_asym: 0.0,
            non_finite: None,
            top_diagonal: None,
        };
        for s in v.chunks_exact(6) {
            let row = s[5].to_bits() as i32;
            // Bands come in row order, so `>` keeps the first row on ties.
            if row != i32::MAX && out.top_diagonal.is_none_or(|(_, d)| s[4] > d) {
                out.top_diagonal = Some((row as usize, s[4]));
            }
            out.max_abs = out.max_abs.max(s[0]);
            out.max_asym = out.max_asym.max(s[1]);
            let idx = s[2].to_bits() as i32;
            let first = match out.non_finite {
                Some((i, _)) => (idx as usize) < i,
                None => true,
            };
            if idx != i32::MAX && first {
                out.non_finite = Some((idx as usize, s[3]));
            }
        }
        out
    }
}

/// `‖m‖∞, ‖m‖₁, ‖m‖_F, tr m` of an `n x n` matrix: `newton_abs_norms` (per-band maxima of
/// the absolute row and column sums, the band's `Σ m²` and diagonal sum, in double) and a
/// read-back of `4·ceil(n/32)` floats.
///
/// # Errors
/// [`Error::Shape`] unless square, [`Error::Value`] for `n` out of range, launch errors.
pub(crate) fn abs_norms(dev: &Device, m: &Matrix) -> Result<ANorms> {
    let mut part: Matrix = dev.scratch(4 * m.rows().div_ceil(32), 1)?;
    queue_abs_norms(dev, m, (&mut part, 0))?;
    Ok(norms_of(&part.to_vec()?))
}

/// [`abs_norms`]' launch, its `4·ceil(n/32)` per-band floats written to `part` from float
/// `at` on, for the caller to read with others ([`norms_of`]).
fn queue_abs_norms(dev: &Device, m: &Matrix, (part, at): (&mut Matrix, usize)) -> Result<()> {
    const OP: &str = "cuda::newton::abs_norms";
    let n = m.rows();
    check_shape(OP, "m", m.shape(), (n, n))?;
    let ni = dim(OP, n)?;
    let bands = n.div_ceil(32);
    let cfg = LaunchConfig {
        grid: (bands as u32, 1, 1),
        block: (32, 8, 1),
        shared_mem: 0,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, m)?
        .scalar(ni)
        .output_at(OP, part, at, 4 * bands)?;
    // SAFETY: newton_abs_norms(const float* m, int n, float* partial): m is n x n, read at
    // indices < n²; block b of the ceil(n/32) grid writes partial[4b..4b+4) from float `at`
    // of the buffer, inside its 4·bands floats there (`output_at` checks).
    unsafe { launch(&ABS_NORMS, cfg, args) }
}

/// The norms from [`queue_abs_norms`]' per-band output, read back.
fn norms_of(v: &[f32]) -> ANorms {
    let mut norms = ANorms {
        inf: 0.0,
        one: 0.0,
        fro: 0.0,
        trace: 0.0,
    };
    for p in v.chunks_exact(4) {
        norms.inf = norms.inf.max(p[0] as f64);
        norms.one = norms.one.max(p[1] as f64);
        norms.fro += p[2] as f64;
        norms.trace += p[3] as f64;
    }
    norms.fro = norms.fro.sqrt();
    norms
}

/// `x ← f32(alpha·a)` (with `a = Some`) or `x ← c·I`, plus the bf16 copy when `x_bf` is given.
///
/// # Errors
/// [`Error::Shape`] unless all are `n x n`, [`Error::Value`] for `n` out of range, launch
/// errors.
pub fn init_x(
    dev: &Device,
    a: Option<(&Matrix, f64)>,
    c: f32,
    x: &mut Matrix,
    x_bf: Option<&mut Matrix<bf16>>,
    unused: &mut Unused,
) -> Result<()> {
    const OP: &str = "cuda::newton::init_x";
    let n = x.rows();
    check_shape(OP, "x", x.shape(), (n, n))?;
    let ni = dim(OP, n)?;
    let mut flags = 0;
    let (src, alpha) = match a {
        Some((m, alpha)) => {
            check_shape(OP, "a", m.shape(), (n, n))?;
            flags |= 1;
            (m, alpha)
        }
        None => (&unused.input, 0.0),
    };
    let x_bf = match x_bf {
        Some(m) => {
            check_shape(OP, "x_bf", m.shape(), (n, n))?;
            flags |= 2;
            m
        }
        None => &mut unused.out_bf,
    };
    let mut cfg = LaunchConfig::for_elements(n * n, 256)?;
    cfg.grid.0 = cfg.grid.0.min(4096);
    let mut args = KernelArgs::new(dev);
    args.input(OP, src)?
        .output(OP, x)?
        .output(OP, x_bf)?
        .scalar(ni)
        .scalar(alpha)
        .scalar(c)
        .scalar(flags);
    // SAFETY: newton_init_x(const float* a, float* x, bf16* x_bf, int n, double alpha, float
    // c, int flags): grid-stride over i < n²; x is n x n, a and x_bf too when flagged
    // (checked), untouched otherwise.
    unsafe { launch(&INIT_X, cfg, args) }
}

/// The op [`spectral_norm`]'s errors name.
const SPECTRAL_NORM: &str = "Device::spectral_norm";
/// The op [`power_step`] and [`DevicePower`]'s own checks name.
const POWER_STEP_OP: &str = "cuda::newton::power_step";

/// Power steps on an `n x n` device matrix (`f32` iterate).
pub(crate) struct DevicePower<'a> {
    dev: &'a Device,
    a: &'a Matrix,
    /// The unit warm start ([`PowerStep::start_warm`]), `n x 1`.
    warm: Option<&'a Matrix>,
    /// Most steps of one batch (slots of `scal`).
    batch: usize,
    /// [`sym_stats`]' pass over `a`, once the first batch's read brought it back.
    stats: Option<SymStats>,
    v: Matrix,
    w: Matrix,
    /// The step's per-block partials and, after them, its last-block counter (zeroed here,
    /// reset to 0 by each step's last block).
    part: Matrix,
    /// One slot of four floats per step of a batch: `(vᵀw, ‖w‖)` as double-float pairs; then
    /// `a`'s [`SymStats`], read with the first batch.
    scal: Matrix,
}

impl<'a> DevicePower<'a> {
    /// Steps on `a`, in batches of at most `max_batch` (each read back once), from the unit
    /// warm start `warm` when given; `a`'s stats (its finiteness, its top diagonal element)
    /// are queued here and come back with the first batch — one read fewer than their own.
    fn new(
        dev: &'a Device,
        (a, warm): (&'a Matrix, Option<&'a Matrix>),
        max_batch: usize,
        unused: &mut Unused,
    ) -> Result<Self> {
        let n = a.rows();
        let batch = max_batch.max(1);
        let mut scal = dev.scratch(4 * batch + SymStats::len(n), 1)?;
        queue_sym_stats(dev, a, (None, None), unused, (&mut scal, 4 * batch))?;
        Ok(Self {
            dev,
            a,
            warm,
            batch,
            stats: None,
            v: dev.scratch(n, 1)?,
            w: dev.scratch(n, 1)?,
            // Zeroed: the counter after the partials starts at 0.
            part: dev.zeros(4 * n.div_ceil(8).min(MATVEC_MAX_BLOCKS) + 1, 1)?,
            scal,
        })
    }

    /// `a`'s stats from a read of `scal` (`read`, or a read now), checked finite: the CPU's
    /// error for NaN/Inf in `a`, whatever the steps queued before it made of them.
    fn checked_stats(&mut self, read: Option<&[f32]>) -> Result<SymStats> {
        if let Some(st) = self.stats {
            return Ok(st);
        }
        let owned;
        let s = match read {
            Some(s) => s,
            None => {
                owned = self.scal.to_vec()?;
                &owned
            }
        };
        let st = SymStats::of(&s[4 * self.batch..]);
        check_finite_stats((SPECTRAL_NORM, "a"), &st)?;
        self.stats = Some(st);
        Ok(st)
    }
}

impl PowerStep for DevicePower<'_> {
    fn start(&mut self, v0: &[f64]) -> Result<()> {
        let v0: Vec<f32> = v0.iter().map(|&x| x as f32).collect();
        self.v = self.dev.upload(self.a.rows(), 1, &v0)?;
        Ok(())
    }

    fn start_warm(&mut self) -> Result<bool> {
        match self.warm {
            Some(w) => {
                check_len(POWER_STEP_OP, "warm", w.len(), self.a.rows())?;
                // A device-to-device copy: no read-back, no launch.
                self.v = w.try_clone()?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The `k ≤ batch` steps queued back to back, step `j`'s results into slot `j` of
    /// `scal`, then one read of the batch (and, the first time, of `a`'s stats).
    fn steps(&mut self, k: usize) -> Result<Vec<(f64, f64)>> {
        if k > self.batch {
            return Err(value_err(
                POWER_STEP_OP,
                "k",
                k as f64,
                "at most the batch the buffers were made for",
            ));
        }
        for slot in 0..k {
            power_step(
                self.dev,
                self.a,
                &mut self.v,
                &mut self.w,
                &mut self.part,
                (&mut self.scal, slot),
            )?;
        }
        let s = self.scal.to_vec()?;
        self.checked_stats(Some(&s))?;
        Ok(s.chunks_exact(4)
            .take(k)
            .map(|p| (p[0] as f64 + p[1] as f64, p[2] as f64 + p[3] as f64))
            .collect())
    }

    fn top_diagonal(&mut self) -> Result<Option<(usize, f64)>> {
        let st = self.checked_stats(None)?;
        Ok(st.top_diagonal.map(|(k, d)| (k, d as f64)))
    }
}

/// One power-iteration step on the device, one launch: `w = A v`, then `v ← w/‖w‖` (when
/// `‖w‖ > 0`) by the launch's last block to finish; writes `(vᵀAv, ‖Av‖)` (the `v` before the
/// step, summed in double) as double-float pairs to `scal[4·slot..4·slot + 4)`. `part` holds
/// the per-block partials and, after them, the counter of finished blocks: `0` at the launch
/// (a zeroed buffer, and every step's last block resets it).
fn power_step(
    dev: &Device,
    a: &Matrix,
    v: &mut Matrix,
    w: &mut Matrix,
    part: &mut Matrix,
    (scal, slot): (&mut Matrix, usize),
) -> Result<()> {
    const OP: &str = POWER_STEP_OP;
    let n = a.rows();
    let ni = dim(OP, n)?;
    check_len(OP, "v", v.len(), n)?;
    check_len(OP, "w", w.len(), n)?;
    let blocks = n.div_ceil(8).min(MATVEC_MAX_BLOCKS);
    check_len(OP, "partial", part.len(), 4 * blocks + 1)?;
    let cfg = LaunchConfig {
        grid: (blocks as u32, 1, 1),
        block: (256, 1, 1),
        shared_mem: 0,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, a)?
        .output(OP, v)?
        .output(OP, w)?
        .output(OP, part)?
        .output_at(OP, scal, 4 * slot, 4)?
        .scalar(ni);
    // SAFETY: newton_power_step(const float* a, float* v, float* w, float* partial, float*
    // scal, int n): a is n x n, v and w hold n floats (checked); rows r < n only; block b
    // writes partial[4b..4b+4) and counts in partial[4·blocks] (4·blocks + 1 floats,
    // checked; 0 at the launch: zeroed at allocation, reset by every step's last block); the
    // last block reads partial[..4·blocks) and w, writes v and scal's 4 floats (slot `slot`,
    // inside the buffer: `output_at` checks), after every block's reads of v; block 256 = the
    // kernel's 8 warps.
    unsafe { launch(&POWER_STEP, cfg, args) }
}

/// [`Device::spectral_norm`] on [`Device::Emulated`] / [`Device::Cuda`]: the CPU backend's
/// power iteration with the matrix-vector products and normalization on the device, queued
/// in batches of up to `opts.max_batch` steps whose Rayleigh quotients are read back once per
/// batch for the stop test, from the unit warm start `warm` (`n x 1`, the last iterate of an
/// earlier call; the fixed start without one). Returns the last iterate too (`n x 1`, unit to
/// `f32` rounding: the next call's warm start; it ran to the end of the stop's batch).
/// Shapes and options are validated by the caller.
///
/// # Errors
/// [`Error::NonFinite`] for NaN/Inf in `a`, [`Error::Value`] for `n > 46340`,
/// [`Error::Shape`] for a warm start of another length, device errors.
pub(crate) fn spectral_norm(
    dev: &Device,
    a: &Matrix,
    opts: &PowerOptions,
    warm: Option<&Matrix>,
) -> Result<(PowerInfo, Matrix)> {
    let n = a.rows();
    if n == 0 {
        let info = PowerInfo {
            value: 0.0,
            iterations: 0,
            converged: true,
        };
        return Ok((info, dev.zeros(0, 1)?));
    }
    // No batch is longer than the whole run.
    let max_batch = opts.max_batch.min(opts.max_iter);
    let mut steps = DevicePower::new(dev, (a, warm), max_batch, &mut Unused::new(dev)?)?;
    let info = driver::power_iteration(&mut steps, n, opts)?;
    Ok((info, steps.v))
}

/// The CPU's `check_finite_view` on stats of `op`'s argument `arg`: its first non-finite
/// element, if any.
fn check_finite_stats((op, arg): (&'static str, &'static str), st: &SymStats) -> Result<()> {
    match st.non_finite {
        Some((index, value)) => Err(Error::NonFinite {
            op,
            arg,
            index,
            value,
        }),
        None => Ok(()),
    }
}

/// The f32 products' operands' split3 planes (`3n x n` bf16 each, allocated at first use): of
/// `a` (split once per inversion: it does not change) and of the outputs `x[i]`, `e`, `f`,
/// `g`, which the epilogues write ([`Epilogue::out_planes`]) while the products run on the
/// engine, which reads them instead of splitting its operands (per cubic step, five split
/// launches and `50 n²` bytes of traffic less). A slot is valid while it holds its matrix's
/// planes as the matrix is now. While the plan runs the products elsewhere ([`Ran::Other`],
/// which reads the f32 matrices) no planes are written, so none are allocated after the first
/// product: memory is spent only where the engine uses it (up to `42 n²` bytes).
struct PlaneSet {
    n: usize,
    slots: [Option<Matrix<bf16>>; PLANE_SLOTS],
    valid: [bool; PLANE_SLOTS],
    /// Whether the last product ran the engine (at the start: planes are tried).
    wanted: bool,
}

/// A product's planes ([`PlaneSet::io`]): its operands' (where valid), its output's (where
/// wanted).
type PlanesIo<'p> = ([Option<&'p Matrix<bf16>>; 2], Option<&'p mut Matrix<bf16>>);

/// [`PlaneSet`]'s slots: `a`, `x[0..3]`, `e`, `f`, `g`.
const PLANE_SLOTS: usize = 7;
const PL_A: usize = 0;
const PL_X: usize = 1;
const PL_E: usize = 4;
const PL_F: usize = 5;
const PL_G: usize = 6;

impl PlaneSet {
    fn new(n: usize) -> Self {
        Self {
            n,
            slots: Default::default(),
            valid: [false; PLANE_SLOTS],
            wanted: true,
        }
    }

    /// Slot `i` on `dev`, allocated at first use.
    fn slot(&mut self, dev: &Device, i: usize) -> Result<&mut Matrix<bf16>> {
        plane_slot(dev, &mut self.slots[i], self.n)
    }

    /// Slot `i`'s planes made from its matrix `m`, if planes are wanted and not valid: for
    /// `a` (set before the first product, never written after) and a start `x` (`init_x` or
    /// a warm start, which no epilogue wrote), each read by several products.
    fn split(&mut self, dev: &Device, i: usize, m: &Matrix) -> Result<()> {
        if self.wanted && !self.valid[i] {
            split3_into(dev, m, self.slot(dev, i)?)?;
            self.valid[i] = true;
        }
        Ok(())
    }

    /// Slot `i`'s matrix written without its planes.
    fn invalidate(&mut self, i: usize) {
        self.valid[i] = false;
    }

    /// For a product reading slots `reads` (`None`: not valid) and writing slot `write`
    /// (`write` not in `reads`): their planes, and the planes to write (`None` where none are
    /// wanted; `write` is valid after the product exactly when they are given).
    fn io(&mut self, dev: &Device, reads: [usize; 2], write: usize) -> Result<PlanesIo<'_>> {
        if self.wanted {
            self.slot(dev, write)?;
        }
        self.valid[write] = self.wanted;
        let valid = self.valid;
        let (mut read, mut out) = ([None, None], None);
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if i == write {
                out = slot.as_mut().filter(|_| valid[i]);
                continue;
            }
            let slot: &Option<Matrix<bf16>> = slot;
            for (r, &j) in read.iter_mut().zip(&reads) {
                if j == i && valid[i] {
                    *r = slot.as_ref();
                }
            }
        }
        Ok((read, out))
    }

    /// Runs the f32 product of `a` and `b` (held in slots `reads`) with `epi`, whose output
    /// is slot `write`: reading the operands' planes where valid, writing the output's where
    /// wanted, and noting whether the engine ran it.
    fn product(
        &mut self,
        (dev, run): (&Device, RunProduct),
        [(ia, a), (ib, b)]: [(usize, &Matrix); 2],
        write: usize,
        epi: Epilogue<'_>,
        scratch: &mut Scratch,
    ) -> Result<()> {
        let ([pa, pb], out_planes) = self.io(dev, [ia, ib], write)?;
        let ops = Operands::F32(
            F32Operand { m: a, planes: pa },
            F32Operand { m: b, planes: pb },
        );
        let ran = run(dev, ops, Epilogue { out_planes, ..epi }, scratch)?;
        self.wanted = ran == Ran::Engine;
        Ok(())
    }
}

/// The iteration's device buffers (`n x n` unless noted; bf16 copies are 1x1 placeholders in
/// `F32` mode, `g` in non-quartic runs).
struct Work<'d> {
    dev: &'d Device,
    n: usize,
    /// Products in bf16 (tensor cores) now; false in `F32` mode and for the `Bf16` run's
    /// final f32 check and polish.
    bf16: bool,
    a: Matrix,
    a_bf: Matrix<bf16>,
    /// Iterates (three, so the current, the best and the next never collide).
    x: [Matrix; 3],
    x_bf: [Matrix<bf16>; 3],
    cur: usize,
    best: Option<usize>,
    /// `E = I − AX`.
    e: Matrix,
    e_bf: Matrix<bf16>,
    /// `E²` (quartic).
    g: Matrix,
    g_bf: Matrix<bf16>,
    /// The correction `F` (f32 mode: `f`, bf16 mode: `f_bf`).
    f: Matrix,
    f_bf: Matrix<bf16>,
    /// The products' scratch (split planes, the vendor's product, placeholders).
    scratch: Scratch,
    /// The f32 products' operands' planes.
    planes: PlaneSet,
    /// Runs each product (the GEMM plan's dispatcher).
    run: RunProduct,
    partial: Matrix,
    res: Matrix,
    /// `A`'s norms, read back with the setup's stats where no warm start was given.
    a_norms: Option<ANorms>,
}

/// `(&v[i], &mut v[j])` for `i ≠ j`.
fn two<T>(v: &mut [T], i: usize, j: usize) -> (&T, &mut T) {
    if i < j {
        let (lo, hi) = v.split_at_mut(j);
        (&lo[i], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(i);
        (&hi[0], &mut lo[j])
    }
}

impl<'d> Work<'d> {
    fn new(
        dev: &'d Device,
        n: usize,
        (bf16, quartic): (bool, bool),
        run: RunProduct,
    ) -> Result<Self> {
        let sq = |on: bool| if on { n } else { 1 };
        let f = |on: bool| dev.scratch::<f32>(sq(on), sq(on));
        let b = |on: bool| dev.scratch::<bf16>(sq(on), sq(on));
        Ok(Self {
            dev,
            n,
            bf16,
            a: f(true)?,
            a_bf: b(bf16)?,
            x: [f(true)?, f(true)?, f(true)?],
            x_bf: [b(bf16)?, b(bf16)?, b(bf16)?],
            cur: 0,
            best: None,
            e: f(true)?,
            e_bf: b(bf16)?,
            g: f(quartic)?,
            g_bf: b(quartic && bf16)?,
            f: f(true)?,
            f_bf: b(bf16)?,
            scratch: Scratch::new(dev, n)?,
            planes: PlaneSet::new(n),
            run,
            partial: dev.scratch(partials(n), 1)?,
            // The residual, then room for `E`'s norms read with it
            // ([`NewtonBackend::product_t_and_e_norms`]).
            res: dev.scratch(1 + 4 * n.div_ceil(32), 1)?,
            a_norms: None,
        })
    }
    /// [`NewtonBackend::product_t`]'s launches: the product into `E` (and its residual
    /// partials), then the residual into `res[0]`.
    fn queue_t(&mut self) -> Result<()> {
        let epi = Epilogue {
            alpha: -1.0,
            diag: 1.0,
            out: Some(&mut self.e),
            partial: Some(&mut self.partial),
            ..Epilogue::new()
        };
        if self.bf16 {
            let epi = Epilogue {
                out_bf: Some(&mut self.e_bf),
                ..epi
            };
            let ops = Operands::Bf16(&self.a_bf, &self.x_bf[self.cur]);
            (self.run)(self.dev, ops, epi, &mut self.scratch)?;
            // bf16 mode writes no planes of `E`.
            self.planes.invalidate(PL_E);
        } else {
            let (pl, cur) = (&mut self.planes, self.cur);
            pl.split(self.dev, PL_A, &self.a)?;
            pl.split(self.dev, PL_X + cur, &self.x[cur])?;
            let reads = [(PL_A, &self.a), (PL_X + cur, &self.x[cur])];
            pl.product((self.dev, self.run), reads, PL_E, epi, &mut self.scratch)?;
        }
        residual(
            self.dev,
            &self.partial,
            partials(self.n),
            self.n,
            &mut self.res,
        )?;
        Ok(())
    }
}

impl NewtonBackend for Work<'_> {
    const OP: &'static str = "Device::newton_inverse";
    type Out = Matrix;
    fn n(&self) -> usize {
        self.n
    }

    fn a_norms(&mut self) -> Result<ANorms> {
        match self.a_norms {
            Some(norms) => Ok(norms),
            None => abs_norms(self.dev, &self.a),
        }
    }

    /// Into the current buffer (and its bf16 copy).
    fn set_x(&mut self, start: Start) -> Result<()> {
        let (src, c) = match start {
            Start::ScaledA(alpha) => (Some((&self.a, alpha)), 0.0),
            Start::Identity(c) => (None, c),
        };
        let xb = self.bf16.then_some(&mut self.x_bf[self.cur]);
        self.planes.invalidate(PL_X + self.cur);
        init_x(
            self.dev,
            src,
            c,
            &mut self.x[self.cur],
            xb,
            &mut self.scratch.unused,
        )
    }

    /// [`Work::product_t`]'s launches, then `E`'s norms into the residual's buffer after it:
    /// one read-back for both.
    fn product_t_and_e_norms(&mut self) -> Result<(f32, (f64, f64))> {
        self.queue_t()?;
        queue_abs_norms(self.dev, &self.e, (&mut self.res, 1))?;
        let v = self.res.to_vec()?;
        let e = norms_of(&v[1..]);
        Ok((v[0], (e.inf, e.one)))
    }

    fn mark_best(&mut self) {
        self.best = Some(self.cur);
    }

    fn clear_best(&mut self) {
        self.best = None;
    }

    fn use_best(&mut self) {
        self.cur = self.best.unwrap_or(self.cur);
    }

    fn products_f32(&mut self) {
        self.bf16 = false;
    }

    fn into_x(self) -> Result<Matrix> {
        let cur = self.cur;
        let Work {
            x: [x0, x1, x2], ..
        } = self;
        Ok(match cur {
            0 => x0,
            1 => x1,
            _ => x2,
        })
    }

    /// `E ← I − A X` (bf16 operands in bf16 mode, with E's bf16 copy) and its residual
    /// `‖E‖_F/√n`, the one value read back.
    fn product_t(&mut self) -> Result<f32> {
        self.queue_t()?;
        Ok(self.res.to_vec()?[0])
    }

    /// `X ← X + X·F` (into a buffer other than the current and the best iterate), with
    /// `F = E`, `E + E²`, `E + E² + E³` formed in fused epilogues from the current `E`. With
    /// `sym` (the driver's promise that `X` is a polynomial in `A` — scaled-identity or `αA`
    /// start, no warm start — so the powers of `E` are symmetric) `E²` and `E³` run as
    /// mirrored products: lower-triangle tiles only ([`Epilogue::mirror`]).
    fn step(&mut self, order: NewtonOrder, sym: bool) -> Result<()> {
        let (dev, bf, run) = (self.dev, self.bf16, self.run);
        let sc = &mut self.scratch;
        let pl = &mut self.planes;
        // In bf16 mode F is read as its bf16 copy only; its f32 copy is written all the same,
        // because the plan compares candidates on a product's f32 output (one store per
        // element more than the bf16 copy's, in the F products only). In f32 mode each
        // product reads its operands' planes where valid and writes its output's where wanted
        // ([`PlaneSet`]); bf16 mode writes none.
        match order {
            NewtonOrder::Quadratic => {}
            NewtonOrder::Cubic => {
                let epi = Epilogue {
                    add1: Some(&self.e),
                    out: Some(&mut self.f),
                    out_bf: bf.then_some(&mut self.f_bf),
                    mirror: sym && !bf,
                    ..Epilogue::new()
                };
                if bf {
                    run(dev, Operands::Bf16(&self.e_bf, &self.e_bf), epi, sc)?;
                    pl.invalidate(PL_F);
                } else {
                    let e = [(PL_E, &self.e), (PL_E, &self.e)];
                    pl.product((dev, run), e, PL_F, epi, sc)?;
                }
            }
            NewtonOrder::Quartic => {
                let epi = Epilogue {
                    out: Some(&mut self.g),
                    out_bf: bf.then_some(&mut self.g_bf),
                    mirror: sym && !bf,
                    ..Epilogue::new()
                };
                if bf {
                    run(dev, Operands::Bf16(&self.e_bf, &self.e_bf), epi, sc)?;
                    pl.invalidate(PL_G);
                } else {
                    let e = [(PL_E, &self.e), (PL_E, &self.e)];
                    pl.product((dev, run), e, PL_G, epi, sc)?;
                }
                let epi = Epilogue {
                    add1: Some(&self.g),
                    add2: Some(&self.e),
                    out: Some(&mut self.f),
                    out_bf: bf.then_some(&mut self.f_bf),
                    mirror: sym && !bf,
                    ..Epilogue::new()
                };
                if bf {
                    run(dev, Operands::Bf16(&self.g_bf, &self.e_bf), epi, sc)?;
                    pl.invalidate(PL_F);
                } else {
                    let ge = [(PL_G, &self.g), (PL_E, &self.e)];
                    pl.product((dev, run), ge, PL_F, epi, sc)?;
                }
            }
        }
        let quad = order == NewtonOrder::Quadratic;
        let next = (0..3)
            .find(|&i| i != self.cur && Some(i) != self.best)
            .unwrap_or((self.cur + 1) % 3);
        let (x, x_next) = two(&mut self.x, self.cur, next);
        if bf {
            let (xb, xb_next) = two(&mut self.x_bf, self.cur, next);
            let epi = Epilogue {
                add1: Some(x),
                out: Some(x_next),
                out_bf: Some(xb_next),
                ..Epilogue::new()
            };
            let f = if quad { &self.e_bf } else { &self.f_bf };
            run(dev, Operands::Bf16(xb, f), epi, sc)?;
            pl.invalidate(PL_X + next);
        } else {
            let (f, f_slot) = if quad {
                (&self.e, PL_E)
            } else {
                (&self.f, PL_F)
            };
            let epi = Epilogue {
                add1: Some(x),
                out: Some(x_next),
                ..Epilogue::new()
            };
            let xf = [(PL_X + self.cur, x), (f_slot, f)];
            pl.product((dev, run), xf, PL_X + next, epi, sc)?;
        }
        self.cur = next;
        Ok(())
    }
}

/// [`Device::newton_inverse`] on [`Device::Emulated`] / [`Device::Cuda`]; see the module
/// docs. `a` (and `warm`) are on `dev` with shapes and options already validated; `run` runs
/// each product (the GEMM plan's `newton_product`).
///
/// # Errors
/// As [`crate::cpu::newton::newton_inverse`], plus [`Error::Value`] for `n > 46340` and
/// device errors.
pub(crate) fn newton_inverse(
    dev: &Device,
    a: &Matrix,
    warm: Option<&Matrix>,
    opts: &NewtonOptions,
    run: RunProduct,
) -> Result<(Matrix, NewtonInfo)> {
    const OP: &str = Work::OP;
    let n = a.rows();
    dim(OP, n)?;
    let bf16 = opts.precision == Precision::Bf16;
    let quartic = opts.order == NewtonOrder::Quartic;
    let mut it = Work::new(dev, n, (bf16, quartic), run)?;
    // The symmetric part of `a` with its stats, and either the warm start's (a hint: checked
    // finite, its symmetry not) or, without one, `a`'s norms (the cold starts scale by them),
    // read back together: one synchronization for the setup, the CPU's checks in its order.
    let len = SymStats::len(n);
    let warm = warm.filter(|_| opts.init == InitialGuess::Warm);
    let mut stats: Matrix = dev.scratch(2 * len, 1)?;
    let a_bf = bf16.then_some(&mut it.a_bf);
    let unused = &mut it.scratch.unused;
    queue_sym_stats(dev, a, (Some(&mut it.a), a_bf), unused, (&mut stats, 0))?;
    match warm {
        // The warm start goes to buffer 0, the current.
        Some(w) => {
            let xb = bf16.then_some(&mut it.x_bf[0]);
            queue_sym_stats(dev, w, (Some(&mut it.x[0]), xb), unused, (&mut stats, len))?;
        }
        // `4·ceil(n/32)` floats, inside the second `len = 6·ceil(n/32)`.
        None => queue_abs_norms(dev, &it.a, (&mut stats, len))?,
    }
    let v = stats.to_vec()?;
    let st = SymStats::of(&v[..len]);
    check_finite_stats((OP, "a"), &st)?;
    check_symmetric(OP, "a", st.max_asym, st.max_abs)?;
    match warm {
        Some(_) => check_finite_stats((OP, "warm"), &SymStats::of(&v[len..]))?,
        None => it.a_norms = Some(norms_of(&v[len..len + 4 * n.div_ceil(32)])),
    }
    driver::newton_inverse(it, warm.is_some(), opts)
}

#[cfg(all(test, feature = "test-hooks"))]
mod tests {
    use super::*;
    use crate::hooks::{record_launches_here, take_launches_here};
    use rand::{Rng, SeedableRng};

    /// Each product on the engine with no planes read or written: every operand split by its
    /// product, as before the epilogues wrote planes.
    fn split_each(
        d: &Device,
        ops: Operands<'_>,
        mut epi: Epilogue<'_>,
        s: &mut Scratch,
    ) -> Result<Ran> {
        epi.out_planes = None;
        let ops = match ops {
            Operands::F32(a, b) => Operands::F32(a.m.into(), b.m.into()),
            bf => bf,
        };
        engine_product(d, ops, epi, s)?;
        Ok(Ran::Other)
    }

    fn engine(d: &Device, ops: Operands<'_>, epi: Epilogue<'_>, s: &mut Scratch) -> Result<Ran> {
        engine_product(d, ops, epi, s)?;
        Ok(Ran::Engine)
    }

    thread_local! {
        static ASKED: std::cell::RefCell<Vec<bool>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// The engine, reported as another candidate, noting whether each product was asked for
    /// planes.
    fn elsewhere(d: &Device, ops: Operands<'_>, epi: Epilogue<'_>, s: &mut Scratch) -> Result<Ran> {
        ASKED.with(|a| a.borrow_mut().push(epi.out_planes.is_some()));
        engine_product(d, ops, epi, s)?;
        Ok(Ran::Other)
    }

    /// `M·Mᵀ/n + I`, `n x n`, from a seeded generator: SPD, `κ` a few units.
    fn spd(dev: &Device, n: usize, seed: u64) -> Matrix {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let m: Vec<f64> = (0..n * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut a = vec![0.0f32; n * n];
        for i in 0..n {
            for j in 0..n {
                let s: f64 = (0..n).map(|k| m[i * n + k] * m[j * n + k]).sum();
                a[i * n + j] = (s / n as f64 + f64::from(u8::from(i == j))) as f32;
            }
        }
        dev.upload(n, n, &a).unwrap()
    }

    /// An f32 inversion whose products read the planes their producers' epilogues wrote is
    /// the inversion whose products split their operands themselves, bit for bit (the planes
    /// are `grng_split3` of the stored values either way), with the same info; it splits `a`
    /// and each start where the other splits about five matrices per step. Ragged `n`,
    /// every order, cold and warm starts. Mutation check: an epilogue that skips the `lo`
    /// plane changes the bits.
    #[test]
    fn planes_from_the_epilogues_change_no_bit_and_save_the_splits() {
        let dev = Device::Emulated;
        let cases = [
            (37, NewtonOrder::Cubic, false),
            (70, NewtonOrder::Quartic, false),
            (65, NewtonOrder::Quadratic, true),
            (130, NewtonOrder::Cubic, true),
        ];
        for (k, (n, order, warm)) in cases.into_iter().enumerate() {
            let a = spd(&dev, n, k as u64);
            let start = spd(&dev, n, 100 + k as u64);
            let mut opts = NewtonOptions {
                order,
                precision: Precision::F32,
                ..NewtonOptions::default()
            };
            if warm {
                opts.init = InitialGuess::Warm;
            }
            // A warm start near A⁻¹ would stop at once: this one (≈ (A + B)/n) takes steps.
            let start = warm.then(|| {
                let mut s = start.to_vec().unwrap();
                s.iter_mut().for_each(|v| *v /= n as f32);
                dev.upload(n, n, &s).unwrap()
            });
            let run = |f: RunProduct| {
                record_launches_here(true);
                let r = newton_inverse(&dev, &a, start.as_ref(), &opts, f).unwrap();
                let l = take_launches_here();
                record_launches_here(false);
                (r.0.to_vec().unwrap(), r.1, l)
            };
            let (x, info, launches) = run(engine);
            let (y, info_y, launches_y) = run(split_each);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&x), bits(&y), "n = {n}, {order:?}");
            assert_eq!(info, info_y);
            let count = |l: &[&str], name: &str| l.iter().filter(|&&k| k == name).count();
            let splits = |l: &[&str]| count(l, "gemm_split3");
            // `a`, and each start: the warm one, and each `init_x` (after a rejected warm
            // start, or a restart).
            let starts = count(&launches, "newton_init_x") + usize::from(warm);
            assert_eq!(splits(&launches), 1 + starts, "n = {n}: {launches:?}");
            assert!(info.iterations >= 2, "n = {n}: {info:?}");
            assert!(
                splits(&launches_y) >= 2 + 2 * info.iterations,
                "{launches_y:?}"
            );
        }
    }

    /// While the products run elsewhere ([`Ran::Other`]: they read the f32 matrices), no
    /// epilogue after the first is asked for planes.
    #[test]
    fn no_planes_are_written_for_products_run_elsewhere() {
        let dev = Device::Emulated;
        let a = spd(&dev, 40, 7);
        let opts = NewtonOptions {
            precision: Precision::F32,
            ..NewtonOptions::default()
        };
        ASKED.with(|a| a.borrow_mut().clear());
        let (_, info) = newton_inverse(&dev, &a, None, &opts, elsewhere).unwrap();
        let asked = ASKED.with(|a| a.take());
        assert!(
            info.iterations >= 2 && asked.len() > 3,
            "{info:?} {asked:?}"
        );
        assert!(asked[0], "{asked:?}");
        assert!(asked[1..].iter().all(|&x| !x), "{asked:?}");
    }
}
