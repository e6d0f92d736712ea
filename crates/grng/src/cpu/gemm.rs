//! Dense `f32` GEMM: `C ← α·op(A)·op(B) + β·C` on row-major host views.
//!
//! The inner kernel is the `gemm` crate (the micro-kernels faer itself builds on), run with
//! rayon parallelism; this module only maps grng's views and BLAS conventions onto it.
//! [`gemm_flops`] counts the work every call of it runs (here and in the SYRK's tiles).

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use super::check_finite_view;
#[cfg(doc)]
use crate::error::Error;
use crate::error::{try_vec, try_with_capacity, Result};
use crate::mat::{Mat, MatMut, MatRef, Trans};
use crate::shape::{check_batch_gradient_args, check_gemm, op_shape, MatMul};

/// `(row stride, column stride)` of `op(X)` for a row-major view with leading dimension `ld`.
pub(crate) fn op_strides(t: Trans, ld: usize) -> (isize, isize) {
    // Row-major: element (i, j) at i*ld + j. Transposing swaps the two strides.
    match t {
        Trans::No => (ld as isize, 1),
        Trans::Yes => (1, ld as isize),
    }
}

/// `C ← α·op(A)·op(B) + β·C` with `op(A)` `m x k`, `op(B)` `k x n` and `C` `m x n`, all
/// row-major views with their own leading dimensions.
///
/// BLAS semantics for the scalars: `β = 0` never reads `C` (it may hold NaN), `α = 0` never
/// reads `A` or `B`. Empty shapes are fine (`k = 0` gives `C ← β·C`).
///
/// # Errors
/// [`Error::Shape`] when the inner or outer dimensions disagree, [`Error::Value`] for a
/// non-finite `α` or `β`. Nothing is written on error.
pub fn gemm(p: MatMul<MatRef<'_, f32>>, beta: f32, mut c: MatMut<'_, f32>) -> Result<()> {
    let (alpha, ops) = (p.alpha, ((p.ta, p.a), (p.tb, p.b)));
    let (m, n, k) = check(ops, (alpha, beta), c.shape())?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 || alpha == 0.0 {
        scale(c.rb(), beta);
        return Ok(());
    }
    // SAFETY: the views were validated at construction to hold every element they address
    // (op(A) spans m x k, op(B) k x n and C m x n with their strides), and `c` is a unique
    // borrow, so C aliases neither A nor B.
    unsafe {
        product(
            ops,
            (m, n, k),
            (alpha, beta),
            (c.data_mut().as_mut_ptr(), c.ld()),
        )
    };
    Ok(())
}

/// `α·op(A)·op(B)` as a new row-major `m x n` matrix, for [`crate::Device`]'s products of
/// validated operands: the result is allocated without the zero-fill a `β = 0` product would
/// overwrite anyway (a pass over `C`, ~3% of a Kronecker step's time in `memset`).
///
/// # Errors
/// As [`gemm()`]; [`Error::OutOfMemory`] when the result cannot be allocated.
pub fn gemm_new(p: MatMul<MatRef<'_, f32>>) -> Result<Mat> {
    let (alpha, ops) = (p.alpha, ((p.ta, p.a), (p.tb, p.b)));
    let ((trans_a, a), (trans_b, b)) = ops;
    let (m, n) = (
        op_shape(trans_a, a.shape()).0,
        op_shape(trans_b, b.shape()).1,
    );
    let (m, n, k) = check(ops, (alpha, 0.0), (m, n))?;
    if m == 0 || n == 0 || k == 0 || alpha == 0.0 {
        return Mat::from_vec(try_vec(m, n, 0.0f32)?, m, n);
    }
    let mut c: Vec<f32> = try_with_capacity("host", m, n)?;
    // SAFETY: A and B as in `gemm`; C is the fresh allocation's `m·n` floats (its capacity),
    // aliasing neither. With `β = 0` the product writes every element of C without reading
    // it, so all `m·n` are initialized when the length is set.
    unsafe {
        product(ops, (m, n, k), (alpha, 0.0), (c.as_mut_ptr(), n));
        c.set_len(m * n);
    }
    Mat::from_vec(c, m, n)
}

/// The operands of a product: `(op, A)`, `(op, B)`.
type Operands<'a> = ((Trans, MatRef<'a, f32>), (Trans, MatRef<'a, f32>));

/// [`gemm`]'s checks of its operands, `α`, `β` and `C`'s shape ([`check_gemm`]): `(m, n, k)`.
fn check(
    ((trans_a, a), (trans_b, b)): Operands<'_>,
    (alpha, beta): (f32, f32),
    c: (usize, usize),
) -> Result<(usize, usize, usize)> {
    let (sa, sb) = (a.shape(), b.shape());
    check_gemm("cpu::gemm", trans_a, sa, trans_b, sb, alpha, beta, c)
}

/// The product of [`gemm`] after its checks, `m, n, k ≥ 1`, `α ≠ 0`: one call of the crate, or
/// column blocks in parallel ([`column_blocks`]). With `β = 0` every element of C is written
/// and none read.
///
/// # Safety
/// `a` and `b` hold `op(A)` (`m x k`) and `op(B)` (`k x n`); `c` addresses `m` rows of `n`
/// floats `c_ld` apart, valid for writes (and reads when `β ≠ 0`), aliasing neither operand,
/// and no other thread accesses it during the call.
unsafe fn product(
    ((trans_a, a), (trans_b, b)): Operands<'_>,
    (m, n, k): (usize, usize, usize),
    (alpha, beta): (f32, f32),
    (c_ptr, c_ld): (*mut f32, usize),
) {
    // A transposed op(B) is the crate's left operand, packed along a stride (`unaliased`).
    let mut copy = take_scratch();
    let b = match trans_b {
        Trans::Yes => unaliased(b, m, &mut copy),
        Trans::No => b,
    };
    let (a_rs, a_cs) = op_strides(trans_a, a.ld());
    let (b_rs, b_cs) = op_strides(trans_b, b.ld());
    let c_ld = c_ld as isize;
    let read_dst = beta != 0.0;
    let (a_ptr, b_ptr) = (a.data().as_ptr(), b.data().as_ptr());
    let blocks = column_blocks(n, m * n * k, b_cs != 1);
    if blocks <= 1 {
        // SAFETY: the caller's contract, for the whole product.
        unsafe {
            crate_gemm(
                (m, n, k),
                c_ptr,
                c_ld,
                read_dst,
                (a_ptr, a_rs, a_cs),
                (b_ptr, b_rs, b_cs),
                (alpha, beta),
                ::gemm::Parallelism::Rayon(0),
            )
        };
    } else {
        let width = n.div_ceil(blocks).div_ceil(BLOCK_ALIGN) * BLOCK_ALIGN;
        // Raw pointers are not `Send`; the addresses are, and each task rebuilds its own.
        let (a_addr, b_addr, c_addr) = (a_ptr as usize, b_ptr as usize, c_ptr as usize);
        (0..n.div_ceil(width)).into_par_iter().for_each(|blk| {
            let j0 = blk * width;
            let nb = width.min(n - j0);
            // SAFETY: as above for the whole product; task `blk` reads op(B)'s columns
            // `j0..j0 + nb` (offset `j0·b_cs` from its start, in bounds since `j0 < n`) and writes
            // C's columns `j0..j0 + nb` only, so the tasks' writes are disjoint and no task writes
            // what another reads.
            unsafe {
                crate_gemm(
                    (m, nb, k),
                    (c_addr as *mut f32).add(j0),
                    c_ld,
                    read_dst,
                    (a_addr as *const f32, a_rs, a_cs),
                    (
                        (b_addr as *const f32).offset(j0 as isize * b_cs),
                        b_rs,
                        b_cs,
                    ),
                    (alpha, beta),
                    ::gemm::Parallelism::None,
                )
            };
        });
    }
    put_scratch(copy);
}

/// Leading dimensions (in floats) that put the rows of a 64-row panel in a few L1 sets: the
/// `gemm` crate packs its left operand by panels of rows, reading one element of each row per
/// step, and rows a multiple of 2 KiB apart meet in at most two of the cache's 64 sets. Measured
/// on 2 cores (AVX-512), `256 x 256 x k` with `op(B)` transposed: 140–157 GFLOP/s at
/// `ld = k ∈ {512, 1024, 1536, 2048}` against 203–206 with the rows 16 floats further apart
/// (and the symmetric `X·Yᵀ` 1.5–1.7x slower); odd multiples of 256 lose ≤ 10%.
const ALIASED_LD: usize = 256;

/// `x` itself, or — when its leading dimension is a multiple of [`ALIASED_LD`] and each of its
/// elements is read by `reuse ≥ 16` multiply-adds, enough to pay for the copy — a copy of it in
/// `buf` with rows 16 floats further apart. The product reads the same values either way, so
/// the result has the same bits. A copy that cannot be allocated is skipped (the product then
/// reads `x` in place, only slower). `buf` is best a [`take_scratch`] buffer: a fresh one
/// costs its page faults, about as much as the copy.
pub(crate) fn unaliased<'a>(
    x: MatRef<'a, f32>,
    reuse: usize,
    buf: &'a mut Vec<f32>,
) -> MatRef<'a, f32> {
    let (rows, cols, ld) = (x.rows(), x.cols(), x.ld());
    if rows < 2 || reuse < 16 || ld % ALIASED_LD != 0 {
        return x;
    }
    let padded = ld + 16;
    buf.clear();
    if buf.try_reserve_exact(rows * padded).is_err() {
        return x;
    }
    for i in 0..rows {
        buf.extend_from_slice(x.row(i));
        buf.resize((i + 1) * padded, 0.0);
    }
    MatRef::with_ld(buf, rows, cols, padded).unwrap_or(x)
}

thread_local! {
    /// This thread's buffer for [`unaliased`] copies, kept between products.
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Largest buffer (in floats, 4 MiB) [`put_scratch`] keeps for the thread's next product.
const SCRATCH_KEEP: usize = 1 << 20;

/// The thread's scratch buffer, taken: a product nested on the same thread (rayon runs other
/// tasks while it waits) finds none and allocates its own.
pub(crate) fn take_scratch() -> Vec<f32> {
    SCRATCH.with(|s| s.take())
}

/// Gives `buf` back for the thread's next product, unless it is larger than [`SCRATCH_KEEP`]
/// or smaller than the one kept.
pub(crate) fn put_scratch(buf: Vec<f32>) {
    if buf.capacity() <= SCRATCH_KEEP {
        SCRATCH.with(|s| {
            let kept = s.take();
            s.set(if kept.capacity() > buf.capacity() {
                kept
            } else {
                buf
            });
        });
    }
}

/// Column blocks of C are multiples of this (the AVX-512 micro-kernel's f32 width).
const BLOCK_ALIGN: usize = 16;

/// Products below this many multiply-adds run as one call: the crate decides its threading.
const SPLIT_MIN_WORK: usize = 1 << 21;

/// How many column blocks of C to compute as independent single-threaded products (≤ 1: one
/// call, the crate's own parallelism). The `gemm` crate packs a transposed `op(B)` (`b_cs ≠ 1`,
/// e.g. the weights in a forward pass `A·Wᵀ`) on the calling thread before its parallel loop,
/// while the other threads wait: 303–353 GFLOP/s on the `256 x 1024 x 1024` class of `A·Wᵀ`
/// shapes on 2 cores, against 390–440 with blocks that each pack their own slice (measured by
/// `benches/gemm.rs`'s `A·Bᵀ` rows). About four blocks per thread balance the load; blocks
/// keep ≥ 64 columns so each still fills its micro-kernel.
fn column_blocks(n: usize, work: usize, transposed_b: bool) -> usize {
    let threads = rayon::current_num_threads();
    if !transposed_b || threads < 2 || work < SPLIT_MIN_WORK {
        return 1;
    }
    (4 * threads).min(n / 64)
}

/// Floating-point operations (`2·m·n·k` a call) the `gemm` crate has run for grng in this
/// process ([`count_flops`]).
static FLOPS: AtomicU64 = AtomicU64::new(0);

/// How many `f32` floating-point operations grng's CPU GEMM engine has run since the process
/// started: `2·m·n·k` for every call of the `gemm` crate — the products of [`gemm()`] (and of
/// [`crate::Device::Cpu`]'s matrix ops), and each tile of the SYRK, whose diagonal blocks are
/// computed whole (so a SYRK counts a little more than its lower triangle). Not counted: the
/// `f64` Cholesky and Woodbury work (faer's and our own), and element-wise passes. The
/// difference over a span of work is that work's GEMM cost: e.g. `benches/step.rs` prints it
/// per training step, the flop floor of a method against another. A process-wide count:
/// concurrent work on other threads adds to it.
pub fn gemm_flops() -> u64 {
    FLOPS.load(Ordering::Relaxed)
}

/// Adds one `m x n x k` call of the crate to [`gemm_flops`].
pub(crate) fn count_flops(m: usize, n: usize, k: usize) {
    let flops = 2u64
        .saturating_mul(m as u64)
        .saturating_mul(n as u64)
        .saturating_mul(k as u64);
    FLOPS.fetch_add(flops, Ordering::Relaxed);
}

/// One call of the `gemm` crate on row-major C: `C ← α·op(A)·op(B) + β·C` with `op(A)`
/// `m x k` at `(ptr, row stride, column stride)`, `op(B)` `k x n` likewise and C `m x n` with
/// leading dimension `c_ld`.
///
/// # Safety
/// Every element the dimensions and strides address must be in bounds of its allocation, C
/// must alias neither A nor B, and no other thread may access C's addressed elements during
/// the call. The crate's naming is swapped against BLAS: it computes
/// `dst := alpha·dst + beta·lhs·rhs`, and ignores dst when `read_dst` is false, which is how
/// `β = 0` avoids reading a NaN-poisoned C.
#[allow(clippy::too_many_arguments)]
unsafe fn crate_gemm(
    (m, n, k): (usize, usize, usize),
    c: *mut f32,
    c_ld: isize,
    read_dst: bool,
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
    (alpha, beta): (f32, f32),
    par: ::gemm::Parallelism,
) {
    count_flops(m, n, k);
    ::gemm::gemm(
        m, n, k, c, 1, c_ld, read_dst, a, a_cs, a_rs, b, b_cs, b_rs, beta, alpha, false, false,
        false, par,
    );
}

/// `C ← β·C`, with `β = 0` writing zeros without reading `C`.
fn scale(mut c: MatMut<'_, f32>, beta: f32) {
    for i in 0..c.rows() {
        let row = c.row_mut(i);
        if beta == 0.0 {
            row.fill(0.0);
        } else if beta != 1.0 {
            row.iter_mut().for_each(|x| *x *= beta);
        }
    }
}

/// Batch gradient `G = (1/m) Eᵀ A` for `E` of shape `m x d_out` (per-sample output gradients,
/// not divided by m) and `A` of shape `m x d_in`; `G` is `d_out x d_in`.
///
/// # Errors
/// [`Error::Shape`] when `m = 0` or the shapes disagree; [`Error::NonFinite`] for NaN/Inf in
/// `E` or `A`. `g` is unchanged on error.
pub fn batch_gradient(e: MatRef<'_, f32>, a: MatRef<'_, f32>, g: MatMut<'_, f32>) -> Result<()> {
    const OP: &str = "cpu::batch_gradient";
    let m = e.rows();
    check_batch_gradient_args(OP, e.shape(), a.shape(), g.shape())?;
    check_finite_view(OP, "e", e)?;
    check_finite_view(OP, "a", a)?;
    gemm(
        MatMul::new(Trans::Yes, Trans::No, 1.0 / m as f32, e, a),
        0.0,
        g,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `unaliased` copies an operand whose rows are a multiple of 256 floats apart, and only
    /// one that enough multiply-adds read, with the same elements.
    #[test]
    fn unaliased_copies_aliased_rows_only() {
        let v: Vec<f32> = (0..3 * 512).map(|i| i as f32).collect();
        for (ld, reuse, copied) in [
            (512, 16, true),
            (256, 64, true),
            (512, 15, false),
            (520, 64, false),
        ] {
            let x = MatRef::with_ld(&v, 3, 200, ld).unwrap();
            let mut buf = Vec::new();
            let y = unaliased(x, reuse, &mut buf);
            assert_eq!(y.ld() != ld, copied, "ld {ld}, reuse {reuse}");
            assert_eq!(y.shape(), (3, 200));
            for i in 0..3 {
                assert_eq!(y.row(i), x.row(i));
            }
        }
    }

    /// Shapes `(m, n, k)` from the ranges, or past them by `grow` where `big` (a size class
    /// whose transposed `B` takes the column-block path), both transpositions, and the seed of
    /// the values ([`uniform`]).
    fn cases(
        m: std::ops::Range<usize>,
        n: std::ops::Range<usize>,
        k: std::ops::Range<usize>,
        grow: (usize, usize, usize),
    ) -> impl proptest::strategy::Strategy<Value = ((usize, usize, usize), Trans, Trans, u64)> {
        use proptest::prelude::{any, Strategy};
        let t = |yes| if yes { Trans::Yes } else { Trans::No };
        (m, n, k, any::<bool>(), any::<[bool; 2]>(), any::<u64>()).prop_map(
            move |(m, n, k, big, [ta, tb], seed)| {
                let dims = if big {
                    (m + grow.0, n + grow.1, k + grow.2)
                } else {
                    (m, n, k)
                };
                (dims, t(ta), t(tb), seed)
            },
        )
    }

    /// `len` values drawn from `U(±1)`.
    fn uniform(rng: &mut rand_chacha::ChaCha8Rng, len: usize) -> Vec<f32> {
        use rand::Rng;
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    proptest::proptest! {
        #![proptest_config(crate::testing::proptest_config(64))]

        /// A transposed `op(B)` whose rows are a multiple of 256 floats apart (copied first by
        /// `unaliased`) gives the bits of the same values stored 8 floats further apart, on
        /// ragged shapes and one size class that takes the column-block path.
        #[test]
        fn aliased_transposed_b_gives_the_same_bits(
            ((m, n, k), ta, _, seed) in cases(16..80, 1..40, 1..300, (64, 256, 0)),
        ) {
            use rand::SeedableRng;
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let av = uniform(&mut rng, m * k);
            let sa = op_shape(ta, (m, k));
            let a = MatRef::new(&av, sa.0, sa.1).unwrap();
            // `B` stored `n x k`: at an aliased leading dimension and 8 floats further apart.
            let ld = k.next_multiple_of(256);
            let vals = uniform(&mut rng, n * k);
            let stored = |ld: usize| {
                let mut out = vec![f32::NAN; n * ld];
                for (i, row) in vals.chunks(k).enumerate() {
                    out[i * ld..i * ld + k].copy_from_slice(row);
                }
                out
            };
            let (bv, bw) = (stored(ld), stored(ld + 8));
            let b = MatRef::with_ld(&bv, n, k, ld).unwrap();
            let b_far = MatRef::with_ld(&bw, n, k, ld + 8).unwrap();
            let got = gemm_new(MatMul::new(ta, Trans::Yes, 0.75, a, b)).unwrap();
            let want = gemm_new(MatMul::new(ta, Trans::Yes, 0.75, a, b_far)).unwrap();
            proptest::prop_assert_eq!(bits(got.as_slice()), bits(want.as_slice()));
        }

        /// `gemm_new` (no zero-fill) gives the bits of `gemm` into a NaN-poisoned `C` with
        /// `β = 0`, for every transposition, ragged shapes (`k = 0` included: zeros) and one
        /// size class whose transposed `B` takes the column-block path (`m·n·k ≥ 2²¹`).
        #[test]
        fn gemm_new_matches_gemm(
            ((m, n, k), ta, tb, seed) in cases(1..40, 1..40, 0..40, (64, 256, 128)),
        ) {
            use rand::SeedableRng;
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let (sa, sb) = (op_shape(ta, (m, k)), op_shape(tb, (k, n)));
            let (av, bv) = (uniform(&mut rng, m * k), uniform(&mut rng, k * n));
            let a = MatRef::new(&av, sa.0, sa.1).unwrap();
            let b = MatRef::new(&bv, sb.0, sb.1).unwrap();
            let got = gemm_new(MatMul::new(ta, tb, 0.75, a, b)).unwrap();
            let mut want = vec![f32::NAN; m * n];
            gemm(MatMul::new(ta, tb, 0.75, a, b), 0.0, MatMut::new(&mut want, m, n).unwrap()).unwrap();
            proptest::prop_assert_eq!(got.shape(), (m, n));
            proptest::prop_assert_eq!(bits(got.as_slice()), bits(&want));
        }
    }
}
