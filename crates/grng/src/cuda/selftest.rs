//! Launchers of the self-test kernels (`kernels/emu/selftest.cu`): each exercises one CUDA
//! primitive so `tests/emu_primitives.rs` can check the emulator (and, on a GPU, the
//! hardware) against the primitive's definition. Not used by the optimizers, so compiled
//! only with the cargo feature `test-hooks`, which the tests turn on (see `Cargo.toml`).
//!
//! Buffers documented as holding `i32` keep 32-bit integer bit patterns in an `f32` matrix
//! (`f32::from_bits` / `to_bits`): matrices hold `f32` or `bf16` only.

use super::launch::{kernel, launch, KernelArgs, LaunchConfig, MAX_SHARED_MEM};
use crate::device::{Device, Matrix};
use crate::error::{check_len, Error, Result};
use half::bf16;

kernel!(pub TRANSPOSE = SELFTEST::selftest_transpose;);
kernel!(pub DYN_SMEM_REVERSE = SELFTEST::selftest_dyn_smem_reverse;);
kernel!(pub SHFL = SELFTEST::selftest_shfl;);
kernel!(pub VOTE = SELFTEST::selftest_vote;);
kernel!(pub ATOMICS = SELFTEST::selftest_atomics;);
kernel!(pub BF16 = SELFTEST::selftest_bf16;);
kernel!(pub WMMA_TC = SELFTEST::selftest_wmma_tc;);
kernel!(pub BARRIERS = SELFTEST::selftest_barriers;);
kernel!(pub DIMS = SELFTEST::selftest_dims;);
kernel!(pub OVERHEAD = SELFTEST::selftest_overhead;);
kernel!(pub MISUSE = SELFTEST::selftest_misuse;);
kernel!(pub MMA_TC = SELFTEST::selftest_mma_tc;);
kernel!(pub LDMATRIX = SELFTEST::selftest_ldmatrix;);
kernel!(pub CP_ASYNC = SELFTEST::selftest_cp_async;);
kernel!(pub SWIZZLE = SELFTEST::selftest_swizzle;);
kernel!(pub GEMM_TC = SELFTEST::selftest_gemm_tc;);

fn value_err(op: &'static str, arg: &'static str, v: usize, expected: &'static str) -> Error {
    Error::Value {
        op,
        arg,
        value: v as f64,
        expected,
    }
}

fn to_i32(op: &'static str, arg: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| value_err(op, arg, v, "< 2^31"))
}

/// The number of blocks of `block` threads (a multiple of 32 up to 1024) that cover the `n`
/// elements of `arg` exactly, else [`Error::Value`] naming `arg`.
fn whole_blocks(op: &'static str, arg: &'static str, n: usize, block: u32) -> Result<usize> {
    if block == 0
        || !block.is_multiple_of(32)
        || block > 1024
        || n == 0
        || !n.is_multiple_of(block as usize)
    {
        return Err(value_err(
            op,
            arg,
            n,
            "a positive multiple of block (itself of 32)",
        ));
    }
    Ok(n / block as usize)
}

/// `out` (cols x rows) ← `a` (rows x cols)ᵀ through a 32x33 shared tile, blocks of 32x8.
pub fn transpose(dev: &Device, a: &Matrix<f32>, out: &mut Matrix<f32>) -> Result<()> {
    const OP: &str = "selftest::transpose";
    let (rows, cols) = a.shape();
    crate::error::check_shape(OP, "out", out.shape(), (cols, rows))?;
    if a.is_empty() {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid: (
            to_i32(OP, "cols", cols.div_ceil(32))? as u32,
            to_i32(OP, "rows", rows.div_ceil(32))? as u32,
            1,
        ),
        block: (32, 8, 1),
        shared_mem: 0,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, a)?
        .output(OP, out)?
        .scalar(to_i32(OP, "rows", rows)?)
        .scalar(to_i32(OP, "cols", cols)?);
    // SAFETY: selftest_transpose(const float* in, float* out, int rows, int cols): in holds
    // rows*cols and out cols*rows floats (checked above); the kernel bounds-checks r < rows,
    // c < cols.
    unsafe { launch(&TRANSPOSE, cfg, args) }
}

/// Each block of `block` threads reverses a chunk of `chunk` elements of `x` into `out`
/// through `chunk` floats of dynamic shared memory (flat order; last chunk may be short).
pub fn dyn_smem_reverse(
    dev: &Device,
    x: &Matrix<f32>,
    out: &mut Matrix<f32>,
    chunk: usize,
    block: u32,
) -> Result<()> {
    const OP: &str = "selftest::dyn_smem_reverse";
    check_len(OP, "out", out.len(), x.len())?;
    if chunk == 0 || chunk * 4 > MAX_SHARED_MEM as usize {
        return Err(value_err(OP, "chunk", chunk, "1..=58112 floats"));
    }
    if x.is_empty() {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid: (to_i32(OP, "x", x.len().div_ceil(chunk))? as u32, 1, 1),
        block: (block, 1, 1),
        shared_mem: (chunk * 4) as u32,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, x)?
        .output(OP, out)?
        .scalar(to_i32(OP, "x", x.len())?)
        .scalar(chunk as i32);
    // SAFETY: selftest_dyn_smem_reverse(const float* in, float* out, int n, int chunk): in and
    // out hold n floats; block b touches [b*chunk, min((b+1)*chunk, n)) and smem[0..chunk),
    // chunk*4 = shared_mem bytes.
    unsafe { launch(&DYN_SMEM_REVERSE, cfg, args) }
}

/// Shuffle cases over `input` (n i32, n a multiple of `32 * warps_per_block`): `cases` holds
/// i32 triples (op, b, width), see `selftest_shfl`; `out` gets n and `out64` 2 n i32 per
/// case.
pub fn shfl(
    dev: &Device,
    input: &Matrix<f32>,
    cases: &Matrix<f32>,
    out: &mut Matrix<f32>,
    out64: &mut Matrix<f32>,
    warps_per_block: u32,
) -> Result<()> {
    const OP: &str = "selftest::shfl";
    let n = input.len();
    let block = 32 * warps_per_block;
    if warps_per_block == 0 || warps_per_block > 32 || n == 0 || !n.is_multiple_of(block as usize) {
        return Err(value_err(
            OP,
            "input",
            n,
            "a positive multiple of 32 * warps_per_block",
        ));
    }
    if !cases.len().is_multiple_of(3) {
        return Err(value_err(OP, "cases", cases.len(), "a multiple of 3"));
    }
    let ncases = cases.len() / 3;
    check_len(OP, "out", out.len(), n * ncases)?;
    check_len(OP, "out64", out64.len(), 2 * n * ncases)?;
    let cfg = LaunchConfig::linear(to_i32(OP, "input", n / block as usize)? as u32, block);
    let mut args = KernelArgs::new(dev);
    args.input(OP, input)?
        .output(OP, out)?
        .output(OP, out64)?
        .input(OP, cases)?
        .scalar(to_i32(OP, "cases", ncases)?);
    // SAFETY: selftest_shfl(const int* in, int* out, int* out64, const int* cases, int ncases):
    // the grid has exactly n threads; out holds ncases*n, out64 2*ncases*n and cases 3*ncases
    // 4-byte values.
    unsafe { launch(&SHFL, cfg, args) }
}

/// Votes and warp reductions over `input` (n i32, n a multiple of `block`, itself a
/// multiple of 32): `out` gets 9 n i32 and `blk` 3 i32 per block, see `selftest_vote`.
pub fn vote(
    dev: &Device,
    input: &Matrix<f32>,
    out: &mut Matrix<f32>,
    blk: &mut Matrix<f32>,
    mask: u32,
    block: u32,
) -> Result<()> {
    const OP: &str = "selftest::vote";
    let n = input.len();
    let blocks = whole_blocks(OP, "input", n, block)?;
    check_len(OP, "out", out.len(), 9 * n)?;
    check_len(OP, "blk", blk.len(), 3 * blocks)?;
    let cfg = LaunchConfig::linear(to_i32(OP, "input", blocks)? as u32, block);
    let mut args = KernelArgs::new(dev);
    args.input(OP, input)?
        .output(OP, out)?
        .output(OP, blk)?
        .scalar(mask);
    // SAFETY: selftest_vote(const int* in, int* out, int* blk, unsigned mask): n threads,
    // out holds 9n and blk 3*blocks 4-byte values.
    unsafe { launch(&VOTE, cfg, args) }
}

/// Atomics over x (n f32) and k (n i32) from `(grid, block)` blocks x threads: `acc` (1 f32)
/// += Σx; `iacc` (4 i32): += Σk, max k, min k, count; `slot` (n i32) ← a permutation of 0..n.
pub fn atomics(
    dev: &Device,
    x: &Matrix<f32>,
    k: &Matrix<f32>,
    acc: &mut Matrix<f32>,
    iacc: &mut Matrix<f32>,
    slot: &mut Matrix<f32>,
    (grid, block): (u32, u32),
) -> Result<()> {
    const OP: &str = "selftest::atomics";
    let n = x.len();
    check_len(OP, "k", k.len(), n)?;
    check_len(OP, "acc", acc.len(), 1)?;
    check_len(OP, "iacc", iacc.len(), 4)?;
    check_len(OP, "slot", slot.len(), n)?;
    let cfg = LaunchConfig::linear(grid, block);
    let mut args = KernelArgs::new(dev);
    args.input(OP, x)?
        .input(OP, k)?
        .scalar(to_i32(OP, "x", n)?)
        .output(OP, acc)?
        .output(OP, iacc)?
        .output(OP, slot)?;
    // SAFETY: selftest_atomics(const float* x, const int* k, int n, float* acc, int* iacc,
    // int* slot): x, k, slot hold n, acc 1, iacc 4 values; the grid-stride loop stays below n
    // and slot is written only at indices in [0, n).
    unsafe { launch(&ATOMICS, cfg, args) }
}

/// bf16 conversions of x (n f32): `out` (n bf16) = bf16(x), `back` (n f32) = f32(out),
/// `pair` (2n f32) = (x, -x) through __floats2bfloat162_rn.
pub fn bf16_convert(
    dev: &Device,
    x: &Matrix<f32>,
    out: &mut Matrix<bf16>,
    back: &mut Matrix<f32>,
    pair: &mut Matrix<f32>,
) -> Result<()> {
    const OP: &str = "selftest::bf16_convert";
    let n = x.len();
    check_len(OP, "out", out.len(), n)?;
    check_len(OP, "back", back.len(), n)?;
    check_len(OP, "pair", pair.len(), 2 * n)?;
    if n == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig::for_elements(n, 128)?;
    let mut args = KernelArgs::new(dev);
    args.input(OP, x)?
        .output(OP, out)?
        .output(OP, back)?
        .output(OP, pair)?
        .scalar(to_i32(OP, "x", n)?);
    // SAFETY: selftest_bf16(const float* in, __nv_bfloat16* out, float* back, float* pair,
    // int n): threads i < n touch in/out/back[i] and pair[2i..2i+2]; lengths checked above.
    unsafe { launch(&BF16, cfg, args) }
}

/// The tensor-core self-tests' shape checks: `m, n, k` positive multiples of `step`, at most
/// 4096 (else `expected`), `a` holding `m k`, `b` `k n` and `d` `m n` elements.
fn check_mnk(
    op: &'static str,
    (m, n, k): (usize, usize, usize),
    step: usize,
    expected: &'static str,
    a: &Matrix<bf16>,
    b: &Matrix<bf16>,
    d: &Matrix<f32>,
) -> Result<()> {
    for (arg, v) in [("m", m), ("n", n), ("k", k)] {
        if v == 0 || v % step != 0 || v > 4096 {
            return Err(value_err(op, arg, v, expected));
        }
    }
    check_len(op, "a", a.len(), m * k)?;
    check_len(op, "b", b.len(), k * n)?;
    check_len(op, "d", d.len(), m * n)
}

/// D = alpha (A B + C) on tensor cores, M, N, K multiples of 16. `layouts` bits: 1 A
/// col-major (A stored K x M), 2 B col-major (stored N x K), 4 C col-major, 8 D col-major
/// (stored N x M); row-major otherwise. Lengths: a M K, b K N, c and d M N.
#[allow(clippy::too_many_arguments)]
pub fn wmma(
    dev: &Device,
    a: &Matrix<bf16>,
    b: &Matrix<bf16>,
    c: &Matrix<f32>,
    d: &mut Matrix<f32>,
    (m, n, k): (usize, usize, usize),
    layouts: u32,
    alpha: f32,
) -> Result<()> {
    const OP: &str = "selftest::wmma";
    check_mnk(
        OP,
        (m, n, k),
        16,
        "a positive multiple of 16, at most 4096",
        a,
        b,
        d,
    )?;
    if layouts > 15 {
        return Err(value_err(OP, "layouts", layouts as usize, "0..=15"));
    }
    check_len(OP, "c", c.len(), m * n)?;
    let cfg = LaunchConfig {
        grid: ((n / 16) as u32, (m / 16) as u32, 1),
        block: (32, 1, 1),
        shared_mem: 0,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, a)?
        .input(OP, b)?
        .input(OP, c)?
        .output(OP, d)?
        .scalar(m as i32)
        .scalar(n as i32)
        .scalar(k as i32)
        .scalar(layouts as i32)
        .scalar(alpha);
    // SAFETY: selftest_wmma_tc(const bf16* a, const bf16* b, const float* c, float* d, int M,
    // int N, int K, int layouts, float alpha): block (x, y) reads the 16-row/column panels of
    // tile (y, x) inside a (M K), b (K N), c (M N) and writes its tile of d (M N); lengths
    // checked above, M, N, K multiples of 16 keep every 16x16 tile inside.
    unsafe { launch(&WMMA_TC, cfg, args) }
}

/// Barrier loop over `x` (blocks * block f32, block a multiple of 32 up to 1024): `out`
/// (same length) gets the values after `iters` stencil steps, `sums` (blocks * iters) the
/// block sums, `wmax` (x.len() / 32) the warp maxima; see `selftest_barriers`.
pub fn barriers(
    dev: &Device,
    x: &Matrix<f32>,
    out: &mut Matrix<f32>,
    sums: &mut Matrix<f32>,
    wmax: &mut Matrix<f32>,
    iters: usize,
    block: u32,
) -> Result<()> {
    const OP: &str = "selftest::barriers";
    let n = x.len();
    let blocks = whole_blocks(OP, "x", n, block)?;
    check_len(OP, "out", out.len(), n)?;
    check_len(OP, "sums", sums.len(), blocks * iters)?;
    check_len(OP, "wmax", wmax.len(), n / 32)?;
    let cfg = LaunchConfig::linear(to_i32(OP, "x", blocks)? as u32, block);
    let mut args = KernelArgs::new(dev);
    args.input(OP, x)?
        .output(OP, out)?
        .output(OP, sums)?
        .output(OP, wmax)?
        .scalar(to_i32(OP, "iters", iters)?);
    // SAFETY: selftest_barriers(const float* x, float* out, float* sums, float* wmax, int
    // iters): block b touches x/out[b*block ..+block], sums[b*iters ..+iters] and its warps'
    // wmax entries; lengths checked above; ring[1024] covers block <= 1024.
    unsafe { launch(&BARRIERS, cfg, args) }
}

/// Scalar parameters of every kind, passed through to a kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DimsParams {
    pub i: i32,
    pub u: u32,
    pub f: f32,
    pub ll: i64,
    pub ull: u64,
    pub d: f64,
}

/// Built-in variables over a 3-D launch: `out` (8 per thread) and `params` (6) as documented
/// on `selftest_dims`.
pub fn dims(
    dev: &Device,
    out: &mut Matrix<f32>,
    params: &mut Matrix<f32>,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    p: DimsParams,
) -> Result<()> {
    const OP: &str = "selftest::dims";
    let cfg = LaunchConfig {
        grid,
        block,
        shared_mem: 0,
    };
    cfg.validate(OP)?;
    let threads = [grid.0, grid.1, grid.2, block.0, block.1, block.2]
        .iter()
        .map(|&v| v as usize)
        .product::<usize>();
    check_len(OP, "out", out.len(), 8 * threads)?;
    check_len(OP, "params", params.len(), 6)?;
    let mut args = KernelArgs::new(dev);
    args.output(OP, out)?
        .output(OP, params)?
        .scalar(p.i)
        .scalar(p.u)
        .scalar(p.f)
        .scalar(p.ll)
        .scalar(p.ull)
        .scalar(p.d);
    // SAFETY: selftest_dims(float* out, float* params, int, unsigned, float, long long,
    // unsigned long long, double): thread g writes out[8g..8g+8] for g < threads, thread 0
    // params[0..6]; lengths checked above.
    unsafe { launch(&DIMS, cfg, args) }
}

/// `blocks` blocks of `block` threads each storing one float into `out` (blocks * block),
/// after `barriers` __syncthreads: measures the emulator's per-launch and per-thread cost.
pub fn overhead(
    dev: &Device,
    out: &mut Matrix<f32>,
    blocks: u32,
    block: u32,
    barriers: u32,
) -> Result<()> {
    const OP: &str = "selftest::overhead";
    check_len(OP, "out", out.len(), blocks as usize * block as usize)?;
    let cfg = LaunchConfig::linear(blocks, block);
    let mut args = KernelArgs::new(dev);
    args.output(OP, out)?
        .scalar(to_i32(OP, "barriers", barriers as usize)?);
    // SAFETY: selftest_overhead(float* out, int barriers): thread g < blocks*block writes
    // out[g]; length checked above.
    unsafe { launch(&OVERHEAD, cfg, args) }
}

/// Launches `selftest_misuse` in `mode` (0..=3) on one block of 32 threads, `out` 256 f32.
/// On the emulator every mode aborts the process with a message (tested in a child
/// process); on a GPU the behaviour is undefined, so it is refused there.
pub fn misuse(dev: &Device, out: &mut Matrix<f32>, mode: i32) -> Result<()> {
    const OP: &str = "selftest::misuse";
    if !matches!(dev, Device::Emulated) {
        return Err(Error::DeviceUnavailable(
            "selftest::misuse runs only on the emulator".into(),
        ));
    }
    if !(0..=3).contains(&mode) {
        return Err(value_err(OP, "mode", mode as usize, "0..=3"));
    }
    check_len(OP, "out", out.len(), 256)?;
    let cfg = LaunchConfig::linear(1, 32);
    let mut args = KernelArgs::new(dev);
    args.output(OP, out)?.scalar(mode);
    // SAFETY: selftest_misuse(float* out, int mode): 32 threads write out[0..32) or, through
    // one 16x16 store, out[0..256); length checked above. The misuse itself is caught by the
    // emulator, which aborts before anything undefined happens.
    unsafe { launch(&MISUSE, cfg, args) }
}

/// `count` independent `mma.m16n8k16` (bf16, f32 accumulate), one warp each, fragments built
/// per lane by the PTX ISA layout: `d_b = a_b · b_b + c_b` with `a_b` 16x16 row-major (`a`
/// holds `256 count` bf16), `b_b` 16x8 stored `B[k][n]` at `8k + n` (`128 count`), `c_b`, `d_b`
/// 16x8 row-major f32 (`128 count`).
pub fn mma(
    dev: &Device,
    a: &Matrix<bf16>,
    b: &Matrix<bf16>,
    c: &Matrix<f32>,
    d: &mut Matrix<f32>,
    count: usize,
) -> Result<()> {
    const OP: &str = "selftest::mma";
    if count == 0 || count > 65_535 {
        return Err(value_err(OP, "count", count, "1..=65535"));
    }
    check_len(OP, "a", a.len(), 256 * count)?;
    check_len(OP, "b", b.len(), 128 * count)?;
    check_len(OP, "c", c.len(), 128 * count)?;
    check_len(OP, "d", d.len(), 128 * count)?;
    let cfg = LaunchConfig::linear(count as u32, 32);
    let mut args = KernelArgs::new(dev);
    args.input(OP, a)?
        .input(OP, b)?
        .input(OP, c)?
        .output(OP, d)?;
    // SAFETY: selftest_mma_tc(const bf16* a, const bf16* b, const float* c, float* d): block
    // b touches a[256b..256b+256), b, c, d [128b..128b+128); lengths checked above.
    unsafe { launch(&MMA_TC, cfg, args) }
}

/// `ldmatrix.x4` without and with `.trans` on one warp: `input` (512 bf16) is 64 rows of 8,
/// lane `l` reads row `rows[l]` (< 64); `out` (256 u32 as f32 bits) gets register `j` of lane
/// `l` at `4l + j` (plain) and `128 + 4l + j` (`.trans`).
pub fn ldmatrix(
    dev: &Device,
    input: &Matrix<bf16>,
    rows: &[usize; 32],
    out: &mut Matrix<f32>,
) -> Result<()> {
    const OP: &str = "selftest::ldmatrix";
    check_len(OP, "input", input.len(), 512)?;
    check_len(OP, "out", out.len(), 256)?;
    if let Some(&r) = rows.iter().find(|&&r| r >= 64) {
        return Err(value_err(OP, "rows", r, "row indices below 64"));
    }
    let bits: Vec<f32> = rows.iter().map(|&r| f32::from_bits(r as u32)).collect();
    let rows_m = dev.upload(32, 1, &bits)?;
    let cfg = LaunchConfig {
        grid: (1, 1, 1),
        block: (32, 1, 1),
        shared_mem: 1024,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, input)?.input(OP, &rows_m)?.output(OP, out)?;
    // SAFETY: selftest_ldmatrix(const bf16* in, const int* rows, unsigned* out): 32 threads
    // read in[0..512), rows[0..32) (each < 64, so row addresses stay in the 1024 bytes of
    // shared memory) and write out[0..256); lengths checked above.
    unsafe { launch(&LDMATRIX, cfg, args) }
}

/// `cp.async` groups on one block of `threads` (1..=1024): `src` holds `12 threads` f32
/// (`3 threads` chunks of 16 bytes), chunk `i` copies `bytes[i]` (0..=16) source bytes and
/// zero-fills the rest; `out` (`12 threads` f32) gets the shared copy after the waits,
/// `early` (`4 threads` f32) group 2 read while still in flight (see `selftest_cp_async`).
pub fn cp_async(
    dev: &Device,
    src: &Matrix<f32>,
    bytes: &[i32],
    out: &mut Matrix<f32>,
    early: &mut Matrix<f32>,
    threads: u32,
) -> Result<()> {
    const OP: &str = "selftest::cp_async";
    if !(1..=1024).contains(&threads) {
        return Err(value_err(OP, "threads", threads as usize, "1..=1024"));
    }
    let t = threads as usize;
    check_len(OP, "src", src.len(), 12 * t)?;
    check_len(OP, "bytes", bytes.len(), 3 * t)?;
    check_len(OP, "out", out.len(), 12 * t)?;
    check_len(OP, "early", early.len(), 4 * t)?;
    if let Some(&b) = bytes.iter().find(|&&b| !(0..=16).contains(&b)) {
        return Err(value_err(OP, "bytes", b as usize, "0..=16 per chunk"));
    }
    let bits: Vec<f32> = bytes.iter().map(|&b| f32::from_bits(b as u32)).collect();
    let bytes_m = dev.upload(3 * t, 1, &bits)?;
    let cfg = LaunchConfig {
        grid: (1, 1, 1),
        block: (threads, 1, 1),
        shared_mem: 48 * threads,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, src)?
        .input(OP, &bytes_m)?
        .output(OP, out)?
        .output(OP, early)?;
    // SAFETY: selftest_cp_async(const uint4* src, const int* bytes, uint4* out, uint4* early):
    // thread t touches chunks t + T q (q < 3) of src/out (3T chunks = 12T floats), bytes[0..3T)
    // (each ≤ 16), early chunk t, and shared chunks < 3T (48T bytes); lengths checked above.
    unsafe { launch(&CP_ASYNC, cfg, args) }
}

/// The engine's shared-memory swizzle: `out` (4096 i32 as f32 bits) gets, at
/// `(k 64 + row) 16 + chunk`, the element offset of `(row, chunk)` in a tile of `2^(k+1)`
/// chunks per row (`k < 4`, `row < 64`, `chunk < 2^(k+1)`; other slots are not written).
pub fn swizzle(dev: &Device, out: &mut Matrix<f32>) -> Result<()> {
    const OP: &str = "selftest::swizzle";
    check_len(OP, "out", out.len(), 4096)?;
    let cfg = LaunchConfig::linear(1, 1024);
    let mut args = KernelArgs::new(dev);
    args.output(OP, out)?;
    // SAFETY: selftest_swizzle(int* out): thread (row, chunk) writes out[(k 64 + row) 16 +
    // chunk] for k < 4, all < 4096; length checked above.
    unsafe { launch(&SWIZZLE, cfg, args) }
}

/// The GEMM engine (kernels/gemm/engine.cuh) with a plain store: `d` (`m x n` row-major f32)
/// `= op(A)·op(B)`, `op(A)` `m x k`, `op(B)` `k x n`. `a_k_outer`: `a` holds `A` as `k x m`
/// (element `(i, l)` at `a[l·m + i]`), else `m x k`; `b_k_inner`: `b` holds `B` as `n x k`
/// (element `(l, j)` at `b[j·k + l]`), else `k x n`. Leading dimensions are the stored row
/// lengths; `m, n, k ≥ 1`.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    dev: &Device,
    a: &Matrix<bf16>,
    b: &Matrix<bf16>,
    d: &mut Matrix<f32>,
    (m, n, k): (usize, usize, usize),
    a_k_outer: bool,
    b_k_inner: bool,
) -> Result<()> {
    const OP: &str = "selftest::gemm";
    check_mnk(OP, (m, n, k), 1, "1..=4096", a, b, d)?;
    let lda = if a_k_outer { m } else { k };
    let ldb = if b_k_inner { k } else { n };
    let cfg = LaunchConfig {
        grid: (n.div_ceil(128) as u32, m.div_ceil(128) as u32, 1),
        block: (256, 1, 1),
        shared_mem: super::engine::GEMM_SMEM,
    };
    let mut args = KernelArgs::new(dev);
    args.input(OP, a)?
        .scalar(lda as i32)
        .input(OP, b)?
        .scalar(ldb as i32)
        .output(OP, d)?
        .scalar(m as i32)
        .scalar(n as i32)
        .scalar(k as i32)
        .scalar(i32::from(a_k_outer) | (i32::from(b_k_inner) << 1));
    // SAFETY: selftest_gemm_tc(const bf16* a, int lda, const bf16* b, int ldb, float* d, int
    // M, int N, int K, int layouts): the engine reads a and b only at stored (row, column)
    // inside the m x k / k x n extents with the leading dimensions above (lengths checked;
    // cp.async src-size cut at the row end) and writes d (m x n) only at i < m, j < n; block
    // 256 and GEMM_SMEM bytes of dynamic shared memory as the engine needs.
    unsafe { launch(&GEMM_TC, cfg, args) }
}
