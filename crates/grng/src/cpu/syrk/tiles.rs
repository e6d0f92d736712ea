//! Blocked SYRK on the `gemm` crate's micro-kernels: the lower triangle of
//! `C ← α AᵀA + β C`, mirrored into the upper one tile by tile (see [`syrk_lower_mirror`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use crate::element::Element;
use crate::error::{try_with_capacity, Result};
use crate::mat::{MatMut, MatRef};

/// Width of a block column of `C`: the crate's `m`, one strip of its 64-row AVX-512
/// micro-kernel. The diagonal blocks are computed whole, which wastes `BLOCK / 2n` of the
/// work (3% at n = 1024); 32 and 96 measured no better.
const BLOCK: usize = 64;
/// Rows of `C` per task. Tasks of at most `BLOCK x TILE_ROWS` balance any thread count, and
/// each re-packs its block column's `BLOCK x k` operand: one float copied per `2·TILE_ROWS`
/// flops.
const TILE_ROWS: usize = 256;
/// Rows of `A` per panel, whose transposed (and for `bf16` widened) copies take
/// `n x PANEL_ROWS` floats each. Measured as fast as 1024 rows or all of `A` at once.
const PANEL_ROWS: usize = 512;

/// Raw pointer to `C`'s storage or to a panel, shared by the tasks.
#[derive(Clone, Copy)]
struct SharedPtr(*mut f32);
// SAFETY: the tasks only read the panels, and read and write disjoint elements of `C` (see
// `syrk_on_worker`).
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

/// One task: rows `r0..r1` of block column `j0..j0 + w` of the lower triangle of `C`.
#[derive(Clone, Copy)]
struct Tile {
    j0: usize,
    w: usize,
    r0: usize,
    r1: usize,
}

/// `C ← α AᵀA + β C` for `A` `m x n` (`f32` or `bf16`), `C` `n x n`: computes the lower
/// triangle (with the diagonal blocks whole) and mirrors it into the upper one, so `C` ends
/// exactly symmetric and only its old lower triangle matters. With `β = 0` the old `C` is
/// never read. Fails only to allocate the panel buffers, before `C` is touched.
///
/// `A` is taken `PANEL_ROWS` rows at a time (`β` on the first panel, 1 after). Each panel is
/// also copied transposed (from its `f32` widening for `bf16`): one `n x h` pass, which gives
/// the crate a right operand with unit stride along `k`, so of each tile it packs only the
/// `BLOCK x h` left operand, a fifth of what it copies when both come straight from `A` (then
/// the packing took 10–18% of the time, now 4%). `C`'s lower triangle is cut into
/// `BLOCK`-wide block columns of at most `TILE_ROWS` rows, each one `gemm` call
/// (`Parallelism::None`) on one rayon thread; on the last panel each task mirrors its own tile
/// while it is in cache.
pub(super) fn syrk_lower_mirror<T: Element>(
    a: MatRef<'_, T>,
    ab: (f32, f32),
    c: MatMut<'_, f32>,
) -> Result<()> {
    // On a rayon worker, so that the parallel steps below (two per panel) do not each pay for
    // injecting their jobs from outside the pool.
    rayon::scope(|_| syrk_on_worker(a, ab, c))
}

fn syrk_on_worker<T: Element>(
    a: MatRef<'_, T>,
    (alpha, beta): (f32, f32),
    mut c: MatMut<'_, f32>,
) -> Result<()> {
    let (m, n) = a.shape();
    if n == 0 {
        return Ok(());
    }
    let h = PANEL_ROWS.min(m);
    // Padded past a multiple of 16 floats, so that consecutive rows of the transposed panel
    // do not map to the same cache sets when `h` is a power of two.
    let ldt = h.div_ceil(16) * 16 + 16;
    // Both buffers stay empty `Vec`s: their capacity is written (through raw pointers)
    // before it is read, since zero-filling it measured up to a quarter of the time at n = 256.
    let mut at: Vec<f32> = try_with_capacity("host", n, ldt)?;
    let atp = SharedPtr(at.as_mut_ptr());
    let is_f32 = std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>();
    // For bf16, the widened panel, `h x n`. (Padding its rows like `at`'s, or carving both
    // from one allocation, measured 5–20% slower for bf16 at n = 256–1024.)
    let mut wide: Vec<f32> = try_with_capacity("host", if is_f32 { 0 } else { h }, n)?;
    let widep = SharedPtr(wide.as_mut_ptr());
    let tiles = tiles(n);
    let ldc = c.ld();
    let cp = SharedPtr(c.data_mut().as_mut_ptr());
    for (p, s0) in (0..m).step_by(h).enumerate() {
        let hp = h.min(m - s0);
        // The panel as f32: rows s0..s0 + hp of A, in place for f32 (only read), else widened
        // into `wide` by the tasks below, each its own block of columns.
        let (pshare, ldp) = if is_f32 {
            let data: &[f32] = bytemuck::cast_slice(&a.data()[s0 * a.ld()..]);
            (SharedPtr(data.as_ptr() as *mut f32), a.ld())
        } else {
            (widep, n)
        };
        // Transposed panel: row j of `at` is column j of the panel. One task per block of
        // BLOCK columns, which for bf16 first widens its columns of the panel.
        (0..n.div_ceil(BLOCK)).into_par_iter().for_each(|jb| {
            let (panel, at) = (pshare, atp);
            let j0 = jb * BLOCK;
            let w = BLOCK.min(n - j0);
            if !is_f32 {
                for i in 0..hp {
                    for (j, v) in a.row(s0 + i)[j0..j0 + w].iter().enumerate() {
                        // SAFETY: `wide` has room for h ≥ hp rows of n floats; this task alone
                        // writes its columns j0..j0 + w ≤ n.
                        unsafe { panel.0.add(i * n + j0 + j).write(v.to_f32()) };
                    }
                }
            }
            // SAFETY: the panel holds hp rows of n columns `ldp` apart (a view of A, or
            // `wide`, its columns j0..j0 + w written just above); `at` has room for n rows of
            // `ldt ≥ hp` floats, of which this task alone writes rows j0..j0 + w.
            unsafe { transpose(panel.0.add(j0), ldp, at.0.add(j0 * ldt), ldt, hp, w) };
        });
        let beta = if p == 0 { beta } else { 1.0 };
        let last = s0 + hp == m;
        for_each_balanced(&tiles, |t| {
            let (panel, at) = (pshare, atp);
            // lhs(c, k) = panel(k, j0 + c), rhs(k, r) = at(r0 + r, k) = panel(k, r0 + r).
            // SAFETY: lhs is panel columns j0..j0 + w < n (hp rows `ldp` apart), rhs rows
            // r0..r1 ≤ n of `at` (hp ≤ ldt floats each): in bounds, and neither aliases C;
            // `c` is the n x n C (`tile_product`'s contract).
            unsafe {
                tile_product(
                    (cp, ldc),
                    t,
                    hp,
                    (panel.0.add(t.j0), ldp as isize, 1),
                    (at.0.add(t.r0 * ldt), ldt as isize, 1),
                    (alpha, beta),
                    last,
                )
            }
        });
    }
    Ok(())
}

/// `C ← α·op(A)·op(B)` (`f32`, `op(A)` `n x k`, `op(B)` `k x n`, `C` `n x n`) for a product
/// the caller knows to be symmetric, as [`syrk_lower_mirror`] computes `AᵀA`: the lower
/// triangle by tiles (diagonal blocks whole), mirrored, so `C` ends exactly symmetric for
/// ~half a GEMM's flops; `C` is not read. Each tile reads its operands in place (the crate
/// packs them): no copy, no allocation. A tile holds `C(r, j)`, `r ≥ j`, as the product's
/// `(j, r)` element — row `j` of `op(A)` by column `r` of `op(B)` — which is `C(r, j)` when
/// the product is symmetric; for any other the result is its upper triangle, mirrored.
///
/// `(a, rs, cs)`: `op(A)`'s first element and its row and column strides (likewise for `B`),
/// as [`super::super::gemm::op_strides`] gives them for a row-major view.
///
/// # Safety
/// Every element those shapes and strides address must be in bounds of its allocation and
/// only read, `c` must be `n x n` and alias neither operand.
pub(super) unsafe fn symmetric_product_mirror(
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
    k: usize,
    alpha: f32,
    mut c: MatMut<'_, f32>,
) {
    // The tile's lhs runs along op(A)'s rows, its rhs along op(B)'s columns — or, the same
    // tile of a symmetric product, lhs along op(B)'s columns (`Bᵀ`) and rhs along op(A)'s rows
    // (`Aᵀ`). The crate is fastest with a lhs of unit stride along its rows: 0.31 against
    // 0.41 ms for an `E·U` of 256 x 1024 x 256 on 2 cores (a full GEMM 0.40 ms).
    let swap = a_rs != 1 && b_cs == 1;
    let (lhs, rhs) = if swap {
        ((b, b_cs, b_rs), (a, a_cs, a_rs))
    } else {
        ((a, a_rs, a_cs), (b, b_rs, b_cs))
    };
    // From here `lhs(c, i) = L(j0 + c, i)` and `rhs(i, r) = R(i, r0 + r)` with `L` `n x k` at
    // `(pointer, row stride, column stride)` = `lhs`, `R` `k x n` likewise.
    let n = c.rows();
    let tiles = tiles(n);
    let ldc = c.ld();
    let cp = SharedPtr(c.data_mut().as_mut_ptr());
    let (lp, rp) = (SharedPtr(lhs.0 as *mut f32), SharedPtr(rhs.0 as *mut f32));
    rayon::scope(|_| {
        for_each_balanced(&tiles, |t| {
            // The whole `SharedPtr`s moved in (a field of one alone would not be `Sync`).
            let (l, r) = (lp, rp);
            // SAFETY: rows j0..j0 + w of `L` and columns r0..r1 ≤ n of `R` — of op(A) and
            // op(B), or of op(B)ᵀ and op(A)ᵀ: in bounds and only read by the caller's
            // contract, not aliasing C; `c` is the n x n C.
            unsafe {
                tile_product(
                    (cp, ldc),
                    t,
                    k,
                    (l.0.offset(t.j0 as isize * lhs.1), lhs.2, lhs.1),
                    (r.0.offset(t.r0 as isize * rhs.2), rhs.2, rhs.1),
                    (alpha, 0.0),
                    true,
                )
            }
        })
    });
}

/// Copies the strict lower triangle of the `n x n` `c` onto its upper one (exactly symmetric
/// after), by the SYRK's tiles in parallel: cache-sized transposes instead of a strided pass.
pub(crate) fn mirror_lower(mut c: MatMut<'_, f32>) {
    let (n, ldc) = (c.rows(), c.ld());
    let tiles = tiles(n);
    let cp = SharedPtr(c.data_mut().as_mut_ptr());
    rayon::scope(|_| {
        for_each_balanced(&tiles, |t| {
            // The whole `SharedPtr` moved in (a field of it alone would not be `Sync`).
            let whole = cp;
            // SAFETY: `c` is the n x n C (`ldc` apart), borrowed mutably here; the tiles of
            // `tiles(n)` mirror disjoint elements (`tile_product`'s contract).
            unsafe { mirror(whole, ldc, t) }
        })
    });
}

/// One tile of a SYRK: `dst ← β·dst + α·lhs·rhs` for the tile `t` of the `n x n` `C` at `c`
/// (`ldc` apart), `dst(c, r) = C(r0 + r, j0 + c)`, `lhs` `w x k` and `rhs` `k x (r1 − r0)`
/// given as (pointer, column stride, row stride); `dst` is read only when `β ≠ 0`. With
/// `mirror`, the tile's strictly-lower elements are then copied to their mirror images.
///
/// The crate computes `dst ← α_crate·dst + β_crate·lhs·rhs` (its names are swapped against
/// BLAS's) for a column-major `m x n` dst: here the tile's width by its rows, unit stride along
/// a row of C.
///
/// # Safety
/// `lhs` and `rhs` must be in bounds for those shapes and strides and not alias `C`; `c` must
/// address the `n x n` C holding the tile. Tiles are disjoint, and the mirror writes C(j, i),
/// j < i, only from the tile's own C(i, j): upper-triangle elements no other tile computes or
/// mirrors into (the upper half of a diagonal block belongs to the one tile holding that
/// block), so tiles of one [`tiles`] list may run concurrently.
unsafe fn tile_product(
    (c, ldc): (SharedPtr, usize),
    t: Tile,
    k: usize,
    lhs: (*const f32, isize, isize),
    rhs: (*const f32, isize, isize),
    (alpha, beta): (f32, f32),
    mirror_after: bool,
) {
    crate::cpu::gemm::count_flops(t.w, t.r1 - t.r0, k);
    ::gemm::gemm(
        t.w,
        t.r1 - t.r0,
        k,
        c.0.add(t.r0 * ldc + t.j0),
        ldc as isize,
        1,
        beta != 0.0,
        lhs.0,
        lhs.1,
        lhs.2,
        rhs.0,
        rhs.1,
        rhs.2,
        beta,
        alpha,
        false,
        false,
        false,
        ::gemm::Parallelism::None,
    );
    if mirror_after {
        mirror(c, ldc, t);
    }
}

/// The lower triangle's block columns cut into tasks of at most `TILE_ROWS` rows, largest
/// first (for [`for_each_balanced`]). The first task of a block column holds its whole
/// diagonal block (`TILE_ROWS ≥ BLOCK`), upper half included.
fn tiles(n: usize) -> Vec<Tile> {
    const _: () = assert!(TILE_ROWS >= BLOCK);
    let mut tiles = Vec::new();
    for j0 in (0..n).step_by(BLOCK) {
        let w = BLOCK.min(n - j0);
        for r0 in (j0..n).step_by(TILE_ROWS) {
            tiles.push(Tile {
                j0,
                w,
                r0,
                r1: (r0 + TILE_ROWS).min(n),
            });
        }
    }
    tiles.sort_by_key(|t| std::cmp::Reverse((t.r1 - t.r0) * t.w));
    tiles
}

/// Runs `f` on every tile, each thread taking the next one in order: with the tiles largest
/// first, the longest-processing-time rule, whose threads finish within one tile of each other.
/// Which thread runs a tile does not change its result.
fn for_each_balanced(tiles: &[Tile], f: impl Fn(Tile) + Sync) {
    let next = AtomicUsize::new(0);
    let work = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        match tiles.get(i) {
            Some(&t) => f(t),
            None => break,
        }
    };
    let threads = rayon::current_num_threads().min(tiles.len());
    rayon::scope(|s| {
        for _ in 1..threads {
            s.spawn(|_| work());
        }
        work();
    });
}

/// Copies the strictly-lower elements of tile `t` of `C` to their mirror images.
///
/// # Safety
/// `p` must address an `n x n` matrix (`ldc` apart) holding the tile, with no other thread
/// touching the tile or its mirror image.
unsafe fn mirror(p: SharedPtr, ldc: usize, t: Tile) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx") {
            return mirror_avx(p, ldc, t);
        }
    }
    mirror_scalar(p, ldc, t, (t.r0, t.r1), (0, t.w));
}

/// [`mirror`] of the tile's part in rows `ra..rb` and columns `t.j0 + ca..t.j0 + cb`, element
/// by element (same contract).
unsafe fn mirror_scalar(
    p: SharedPtr,
    ldc: usize,
    t: Tile,
    (ra, rb): (usize, usize),
    (ca, cb): (usize, usize),
) {
    for i in ra..rb {
        for j in t.j0 + ca..(t.j0 + cb).min(i) {
            *p.0.add(j * ldc + i) = *p.0.add(i * ldc + j);
        }
    }
}

/// [`mirror`] by 16 x 16 blocks (two 8 x 8 AVX transposes per half), walking down each
/// 16-column strip so every destination row is written as consecutive 64-byte runs: with a
/// power-of-two `ldc`, column-wise stores would all land in the same cache sets (3–8x slower).
/// Same contract as [`mirror`], on a CPU with AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn mirror_avx(p: SharedPtr, ldc: usize, t: Tile) {
    let w16 = t.w / 16 * 16;
    for cb in (0..w16).step_by(16) {
        let j = t.j0 + cb;
        // The first row whose 16 x 16 block lies strictly below the diagonal.
        let full = t.r0.max(j + 16);
        let rows16 = (t.r1.saturating_sub(full)) / 16 * 16;
        mirror_scalar(p, ldc, t, (t.r0, full.min(t.r1)), (cb, cb + 16));
        for i in (full..full + rows16).step_by(16) {
            tr16x16(p.0.add(i * ldc + j), ldc, p.0.add(j * ldc + i), ldc);
        }
        mirror_scalar(p, ldc, t, ((full + rows16).min(t.r1), t.r1), (cb, cb + 16));
    }
    mirror_scalar(p, ldc, t, (t.r0, t.r1), (w16, t.w));
}

/// `dst ← srcᵀ` for `src` `rows x cols` (`lds` apart), `dst` `cols x rows` (`ldd` apart): its
/// whole 16 x 16 blocks by [`transpose_blocks_avx`] on a CPU with AVX, the rest (all of it
/// elsewhere) element by element.
///
/// # Safety
/// Both ranges must be in bounds and disjoint.
unsafe fn transpose(
    src: *const f32,
    lds: usize,
    dst: *mut f32,
    ldd: usize,
    rows: usize,
    cols: usize,
) {
    #[cfg(target_arch = "x86_64")]
    let (r16, c16) = if std::arch::is_x86_feature_detected!("avx") {
        let blocks = (rows / 16 * 16, cols / 16 * 16);
        transpose_blocks_avx(src, lds, dst, ldd, blocks);
        blocks
    } else {
        (0, 0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (r16, c16) = (0, 0);
    transpose_scalar(src, lds, dst, ldd, (0, r16), (c16, cols));
    transpose_scalar(src, lds, dst, ldd, (r16, rows), (0, cols));
}

unsafe fn transpose_scalar(
    src: *const f32,
    lds: usize,
    dst: *mut f32,
    ldd: usize,
    (ra, rb): (usize, usize),
    (ca, cb): (usize, usize),
) {
    for r in ra..rb {
        for c in ca..cb {
            *dst.add(c * ldd + r) = *src.add(r * lds + c);
        }
    }
}

/// [`transpose`] of the source's first `r16` rows and `c16` columns (multiples of 16) by
/// 16 x 16 blocks, 16-row bands of the source at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_blocks_avx(
    src: *const f32,
    lds: usize,
    dst: *mut f32,
    ldd: usize,
    (r16, c16): (usize, usize),
) {
    for rb in (0..r16).step_by(16) {
        for cb in (0..c16).step_by(16) {
            tr16x16(src.add(rb * lds + cb), lds, dst.add(cb * ldd + rb), ldd);
        }
    }
}

/// The 8 x 8 block at `src` (`lds` apart) transposed, row `k` of the result in register `k`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx")]
unsafe fn tr8x8(src: *const f32, lds: usize) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let r = |k: usize| _mm256_loadu_ps(src.add(k * lds));
    let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
    let (r4, r5, r6, r7) = (r(4), r(5), r(6), r(7));
    // Interleave pairs of rows, then pairs of pairs, then swap 128-bit halves.
    let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
    let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
    let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
    let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// 16 x 16 transposed copy from `src` to `dst`: four [`tr8x8`], each destination row written
/// as one 16-float run (two adjacent stores) so it fills a cache line at once.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx")]
unsafe fn tr16x16(src: *const f32, lds: usize, dst: *mut f32, ldd: usize) {
    use std::arch::x86_64::*;
    for h in 0..2 {
        let top = tr8x8(src.add(h * 8), lds);
        let bottom = tr8x8(src.add(8 * lds + h * 8), lds);
        for k in 0..8 {
            let d = dst.add((h * 8 + k) * ldd);
            _mm256_storeu_ps(d, top[k]);
            _mm256_storeu_ps(d.add(8), bottom[k]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distinct, exactly representable values, so any misplaced copy shows.
    fn numbered(len: usize) -> Vec<f32> {
        (0..len).map(|i| i as f32).collect()
    }

    /// The tiles cover the lower triangle (diagonal blocks whole) exactly once each.
    #[test]
    fn tiles_cover_the_lower_triangle_once() {
        for n in [1, 2, 63, 64, 65, 255, 256, 257, 300, 513] {
            let mut hits = vec![0u8; n * n];
            for t in tiles(n) {
                assert!(t.r0 >= t.j0 && t.r1 <= n && t.j0 + t.w <= n && t.r1 - t.r0 <= TILE_ROWS);
                for i in t.r0..t.r1 {
                    for j in t.j0..t.j0 + t.w {
                        hits[i * n + j] += 1;
                    }
                }
            }
            for i in 0..n {
                for j in 0..n {
                    let lower = j <= i || j / BLOCK == i / BLOCK;
                    assert_eq!(hits[i * n + j], lower as u8, "n={n} ({i}, {j})");
                }
            }
        }
    }

    /// The AVX transposes (16 x 16 blocks, the rest element by element) and mirrors match
    /// the element-by-element fallbacks (which are what a CPU without AVX runs) on ragged
    /// shapes and strides.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx_paths_match_scalar_fallbacks() {
        if !std::arch::is_x86_feature_detected!("avx") {
            return;
        }
        for (rows, cols, pad) in [(1, 1, 0), (7, 9, 3), (16, 16, 0), (17, 33, 1), (64, 48, 16)] {
            let (lds, ldd) = (cols + pad, rows + 2 * pad);
            let src = numbered(rows * lds);
            let mut want = vec![-1.0f32; cols * ldd];
            let mut got = want.clone();
            // SAFETY: both buffers hold the shapes and strides passed.
            unsafe {
                transpose_scalar(
                    src.as_ptr(),
                    lds,
                    want.as_mut_ptr(),
                    ldd,
                    (0, rows),
                    (0, cols),
                );
                transpose(src.as_ptr(), lds, got.as_mut_ptr(), ldd, rows, cols);
            }
            assert_eq!(got, want, "transpose {rows}x{cols} pad {pad}");
        }
        for (n, pad) in [(1, 0), (17, 1), (64, 0), (100, 3), (300, 0), (530, 5)] {
            let ldc = n + pad;
            let mut want = numbered(n * ldc);
            let mut got = want.clone();
            for t in tiles(n) {
                // SAFETY: n x n matrices `ldc` apart; one tile at a time.
                unsafe {
                    mirror_scalar(SharedPtr(want.as_mut_ptr()), ldc, t, (t.r0, t.r1), (0, t.w));
                    mirror_avx(SharedPtr(got.as_mut_ptr()), ldc, t);
                }
            }
            assert_eq!(got, want, "mirror n={n} pad {pad}");
            for i in 0..n {
                for j in 0..i {
                    assert_eq!(got[j * ldc + i], (i * ldc + j) as f32, "n={n} ({j}, {i})");
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(crate::testing::proptest_config(64))]

        /// `α·op(A)·op(B)` of the symmetric product `X·(S·Xᵀ)` (`S` symmetric; `S = I`
        /// through `gram_rows`, whose `op(B)` is `X` itself), in every transpose layout, on
        /// ragged shapes (`n` on and off the 64-wide block columns and 256-row tasks, padded
        /// rows, and rows a multiple of 256 floats apart, which the product copies first:
        /// `gemm::unaliased`), equals the product computed here, exactly: the entries are small
        /// integers and `α` a power of two, so every partial sum is exact in `f32` (at most
        /// `k·3·(k·2·3) < 2²⁴`) in any order. `C` starts as NaN: it is never read, and both
        /// triangles are written (so the result is exactly symmetric).
        #[test]
        fn symmetric_product_is_exact_on_integers(
            n in 1usize..=300,
            k in 1usize..=140,
            pad in 0usize..4,
            (ta, tb, gram) in (proptest::bool::ANY, proptest::bool::ANY, proptest::bool::ANY),
            seed in proptest::prelude::any::<u64>(),
        ) {
            use crate::mat::Trans;
            use rand::{Rng, SeedableRng};
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-3i8..=3) as f32).collect();
            let mut s = vec![0.0f32; k * k];
            for i in 0..k {
                for j in 0..=i {
                    let v = if gram { (i == j) as u8 as f32 } else { rng.random_range(-2i8..=2) as f32 };
                    (s[i * k + j], s[j * k + i]) = (v, v);
                }
            }
            // Y = S·Xᵀ (k x n), exact.
            let y: Vec<f32> = (0..k * n)
                .map(|e| (0..k).map(|p| s[(e / n) * k + p] * x[(e % n) * k + p]).sum())
                .collect();
            // A matrix stored as itself or transposed, with padded rows.
            let store = |v: &[f32], (r, c): (usize, usize), t: bool| {
                let (rows, cols) = if t { (c, r) } else { (r, c) };
                let ld = if pad == 3 { cols.next_multiple_of(256) } else { cols + pad };
                let mut out = vec![f32::NAN; rows * ld];
                for i in 0..rows {
                    for j in 0..cols {
                        out[i * ld + j] = if t { v[j * c + i] } else { v[i * c + j] };
                    }
                }
                (out, rows, cols, ld)
            };
            let trans = |t: bool| if t { Trans::Yes } else { Trans::No };
            let (ldc, alpha) = (n + pad, 0.5f32);
            let mut c = vec![f32::NAN; n * ldc];
            let cv = MatMut::with_ld(&mut c, n, n, ldc).unwrap();
            let (xs, xr, xc, ldx) = store(&x, (n, k), ta);
            let xv = MatRef::with_ld(&xs, xr, xc, ldx).unwrap();
            if gram {
                let (xs, _, _, ldx) = store(&x, (n, k), false);
                crate::cpu::syrk::gram_rows(MatRef::with_ld(&xs, n, k, ldx).unwrap(), alpha, cv)
                    .unwrap();
            } else {
                let (ys, yr, yc, ldy) = store(&y, (k, n), tb);
                let yv = MatRef::with_ld(&ys, yr, yc, ldy).unwrap();
                crate::cpu::syrk::symmetric_product((trans(ta), xv), (trans(tb), yv), alpha, cv)
                    .unwrap();
            }
            for i in 0..n {
                for j in 0..n {
                    let dot: f32 = (0..k).map(|p| x[i * k + p] * y[p * n + j]).sum();
                    proptest::prop_assert_eq!(c[i * ldc + j], alpha * dot, "({}, {})", i, j);
                }
            }
        }
    }
}
