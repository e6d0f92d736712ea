//! `cpu::gemm::gemm_flops` (`src/cpu/gemm.rs`), the count behind `benches/step.rs`'s flop
//! floors: `2·m·n·k` for every product of `cpu::gemm` on ragged shapes, transposed or not,
//! through each of its paths (one call of the `gemm` crate; a transposed `op(B)` copied to an
//! unaliased stride; column blocks in parallel), nothing for a product with no work or one
//! that fails its checks, and for a SYRK (`cpu::syrk_ema`) the work of its tiles: at least its
//! lower triangle's `n(n+1)·m`, at most the full product's `2n²·m`. The count is process-wide,
//! so this file holds one test: no other test of its binary runs products beside it.
//! Shapes are drawn from `common::seeded_rng` (replay with `GRNG_TEST_SEED`).

use grng_testkit as common;

use grng::cpu::gemm::gemm_flops;
use grng::MatMul;
use grng::{cpu, Mat, MatRef, Trans};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// An `r x c` matrix of values in `[-1, 1)`.
fn random(rng: &mut ChaCha8Rng, r: usize, c: usize) -> Mat {
    Mat::from_vec(common::uniform(rng, r * c, -1.0, 1.0), r, c).expect("sized")
}

/// `C = op(A)·op(B)` (`m x n`, inner `k`), with `B` stored `ld_b` floats apart; the count's
/// change.
fn counted_product(
    rng: &mut ChaCha8Rng,
    (ta, tb): (Trans, Trans),
    (m, n, k): (usize, usize, usize),
    ld_b: usize,
) -> u64 {
    let a = match ta {
        Trans::No => random(rng, m, k),
        Trans::Yes => random(rng, k, m),
    };
    let (br, bc) = match tb {
        Trans::No => (k, n),
        Trans::Yes => (n, k),
    };
    let ld = ld_b.max(bc);
    let stored = random(rng, br, ld);
    let b = MatRef::with_ld(stored.as_slice(), br, bc, ld).expect("strided view");
    let mut c = Mat::zeros(m, n);
    let before = gemm_flops();
    cpu::gemm(MatMul::new(ta, tb, 1.0, a.as_ref(), b), 0.0, c.as_mut()).expect("valid product");
    gemm_flops() - before
}

#[test]
fn counts_the_work_of_every_product_and_syrk() {
    let mut rng = common::seeded_rng();
    let both = [Trans::No, Trans::Yes];
    // Ragged shapes, every transpose pair, rows packed or padded.
    for _ in 0..24 {
        let (m, n, k) = (
            rng.random_range(1..=200),
            rng.random_range(1..=200),
            rng.random_range(1..=200),
        );
        let ts = (both[rng.random_range(0..2)], both[rng.random_range(0..2)]);
        let pad = rng.random_range(0..=3);
        let bc = if ts.1 == Trans::Yes { k } else { n };
        let got = counted_product(&mut rng, ts, (m, n, k), bc + pad);
        assert_eq!(got, 2 * (m * n * k) as u64, "{ts:?} {m}x{n}x{k} pad {pad}");
    }
    // A transposed `op(B)` with rows 512 floats apart, read by enough multiply-adds to be
    // copied first (`unaliased`), and one with enough work for column blocks (on ≥ 2 threads).
    for (m, n, k) in [(64, 96, 512), (256, 1024, 300)] {
        let got = counted_product(&mut rng, (Trans::No, Trans::Yes), (m, n, k), k.max(512));
        assert_eq!(got, 2 * (m * n * k) as u64, "NoYes {m}x{n}x{k}");
    }
    // No work: an empty inner dimension, α = 0, and a product that fails its shape check
    // (`op(A)` 3x5 against a 3x7 `B`).
    let (a0, b0) = (random(&mut rng, 5, 0), random(&mut rng, 0, 7));
    let (a, b) = (random(&mut rng, 5, 3), random(&mut rng, 3, 7));
    let mut c = Mat::zeros(5, 7);
    let before = gemm_flops();
    for (ta, alpha, (a, b), valid) in [
        (Trans::No, 1.0, (&a0, &b0), true),
        (Trans::No, 0.0, (&a, &b), true),
        (Trans::Yes, 1.0, (&a, &b), false),
    ] {
        let r = cpu::gemm(
            MatMul::new(ta, Trans::No, alpha, a.as_ref(), b.as_ref()),
            0.0,
            c.as_mut(),
        );
        assert_eq!(r.is_ok(), valid, "{ta:?} α = {alpha}: {r:?}");
    }
    assert_eq!(gemm_flops(), before, "work counted where none ran");
    // SYRK: between the lower triangle and the full product, on sizes on and off its 64-wide
    // block columns.
    for n in [1, 63, 64, 65, rng.random_range(66..=300)] {
        let m = rng.random_range(1..=100);
        let a = random(&mut rng, m, n);
        let mut f = Mat::zeros(n, n);
        let before = gemm_flops();
        cpu::syrk_ema(a.as_ref(), 0.0, f.as_mut()).expect("valid SYRK");
        let got = gemm_flops() - before;
        let (lower, full) = ((n * (n + 1) * m) as u64, (2 * n * n * m) as u64);
        assert!(
            (lower..=full).contains(&got),
            "SYRK of {m}x{n}: {got} flops outside [{lower}, {full}]"
        );
    }
}
