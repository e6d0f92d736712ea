//! `cpu::syrk_ema`'s blocked SYRK (`src/cpu/syrk/tiles.rs`) on the shapes its blocking makes
//! special, against an `f64` reference written here: `n` on and off the multiples of its
//! 64-wide block columns and 256-row tasks, `m` from 1 row to several 512-row panels, `ε` 0
//! and 0.95, `f32` rows (with and without padding) and `bf16` rows. Random cases are drawn from
//! `common::seeded_rng` (replay with `GRNG_TEST_SEED`).
//!
//! Tolerance: each element is `ε·Λᵢⱼ + α·Σₖ aₖᵢaₖⱼ`, a length-`m` dot product accumulated in
//! f32 (in any order, with or without FMA) and then scaled and added to `ε·Λᵢⱼ`. Higham
//! (Thm 3.5) bounds the dot product's error by `γ_m·Σₖ|aₖᵢ||aₖⱼ|`, `γ_m = m·u/(1 − m·u)`,
//! `u = 2⁻²⁴`; the scaling by α, the product ε·Λ and the final sum add at most 3 more roundings.
//! We allow `(m + 4)·f32::EPSILON·(|ε·Λᵢⱼ| + α·Σₖ|aₖᵢ||aₖⱼ|)`, about a 2x margin over
//! `γ_{m+4}` (`f32::EPSILON = 2u`). The inputs are exact in f32 (bf16 widens exactly), so the
//! reference uses the same values.

use grng_testkit as common;

use grng::{cpu, MatMut, MatRef};
use half::bf16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

const EPS: f64 = f32::EPSILON as f64;

/// `m x n` values in `[-1, 1)` (row-major), rounded to bf16 when `bf16` is set.
fn random_a(rng: &mut ChaCha8Rng, m: usize, n: usize, bf16: bool) -> Vec<f64> {
    (0..m * n)
        .map(|_| {
            let x = rng.random_range(-1.0f32..1.0);
            if bf16 {
                half::bf16::from_f32(x).to_f64()
            } else {
                x as f64
            }
        })
        .collect()
}

/// Lower triangle of `AᵀA` and of `|A|ᵀ|A|` in f64 (row-major `n x n`, upper part zero).
fn reference(a: &[f64], m: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut ata, mut abs) = (vec![0.0; n * n], vec![0.0; n * n]);
    for row in a.chunks(n).take(m) {
        for i in 0..n {
            let x = row[i];
            for j in 0..=i {
                ata[i * n + j] += x * row[j];
                abs[i * n + j] += (x * row[j]).abs();
            }
        }
    }
    (ata, abs)
}

/// One case: runs `syrk_ema` on `A` (`f32` rows `pad` floats apart beyond `n`, or `bf16`) and
/// checks every element against the reference and the exact symmetry of the result.
///
/// The old factor is finite junk: its upper triangle differs from the lower one (only the
/// lower one may matter), and with `ε = 0` it is all NaN (it must not be read).
fn check(rng: &mut ChaCha8Rng, m: usize, n: usize, eps: f32, pad: usize, use_bf16: bool) {
    let a = random_a(rng, m, n, use_bf16);
    let (ata, abs) = reference(&a, m, n);
    let mut old = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            old[i * n + j] = if eps == 0.0 {
                f32::NAN
            } else {
                rng.random_range(-1.0f32..1.0)
            };
        }
    }
    let mut factor = old.clone();
    let what = format!("m={m} n={n} eps={eps} pad={pad} bf16={use_bf16}");
    let view = MatMut::new(&mut factor, n, n).unwrap();
    if use_bf16 {
        let ab: Vec<bf16> = a.iter().map(|&x| bf16::from_f64(x)).collect();
        cpu::syrk_ema(MatRef::new(&ab, m, n).unwrap(), eps, view).unwrap();
    } else {
        let ld = n + pad;
        let mut stored = vec![f32::NAN; (m - 1) * ld + n];
        for k in 0..m {
            for j in 0..n {
                stored[k * ld + j] = a[k * n + j] as f32;
            }
        }
        // The padding is NaN: reading it would show.
        cpu::syrk_ema(MatRef::with_ld(&stored, m, n, ld).unwrap(), eps, view).unwrap();
    }
    let (e, w) = (eps as f64, (1.0 - eps as f64) / m as f64);
    for i in 0..n {
        for j in 0..=i {
            let old_term = if eps == 0.0 {
                0.0
            } else {
                e * old[i * n + j] as f64
            };
            let want = old_term + w * ata[i * n + j];
            let bound = (m + 4) as f64 * EPS * (old_term.abs() + w * abs[i * n + j]);
            let got = factor[i * n + j];
            let err = (got as f64 - want).abs();
            assert!(
                err <= bound,
                "{what}: ({i}, {j}): got {got}, want {want}, error {err:e} > bound {bound:e}"
            );
            assert_eq!(
                got.to_bits(),
                factor[j * n + i].to_bits(),
                "{what}: ({i}, {j}) not mirrored"
            );
        }
    }
}

/// The blocking's edges, each for `ε` ∈ {0, 0.95} and f32 (padded or not) and bf16 rows:
/// `n` around the 64-wide block columns and the 256-row tasks, `m` = 1 and around the
/// 512-row panels; then random ragged shapes.
#[test]
fn syrk_ema_blocking_edges_match_reference() {
    let mut rng = common::seeded_rng();
    let mut shapes = vec![
        (1, 1),
        (1, 65),
        (1, 300),
        (2, 17),
        (3, 63),
        (40, 64),
        (64, 129),
        (100, 255),
        (77, 257),
        (511, 80),
        (512, 33),
        (513, 191),
        (1030, 70),
        (1100, 300),
    ];
    for _ in 0..6 {
        shapes.push((rng.random_range(1..=1200), rng.random_range(1..=330)));
    }
    for (m, n) in shapes {
        for eps in [0.0, 0.95] {
            let pad = rng.random_range(1..=3);
            check(&mut rng, m, n, eps, 0, false);
            check(&mut rng, m, n, eps, pad, false);
            check(&mut rng, m, n, eps, 0, true);
        }
    }
}

/// The result does not depend on the number of threads: every tile is one sequential GEMM,
/// whichever thread runs it. Pools of 1, 2 and 3 threads give the same bits.
#[test]
fn syrk_ema_is_deterministic_across_thread_counts() {
    let mut rng = common::seeded_rng();
    let (m, n) = (rng.random_range(513..=800), rng.random_range(257..=400));
    let a: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let old: Vec<f32> = (0..n * n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut f = old.clone();
        pool.install(|| {
            cpu::syrk_ema(
                MatRef::new(&a, m, n).unwrap(),
                0.5,
                MatMut::new(&mut f, n, n).unwrap(),
            )
        })
        .unwrap();
        f
    };
    let one = run(1);
    for threads in [2, 3] {
        let got = run(threads);
        assert!(
            one.iter()
                .zip(&got)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "m={m} n={n}: {threads} threads differ from 1"
        );
    }
}
