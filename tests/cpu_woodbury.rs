//! The low-rank (Woodbury) damped inverse `(XᵀX/m + λI)⁻¹` on the CPU
//! (`grng::cpu::low_rank_damped_inverse`) against an `f64` Cholesky reference, its `bf16`
//! input and its typed errors.
//!
//! # Tolerance
//! The result is rounded once from `f64`: `2⁻²⁴·|Z_ij| ≤ 2⁻²⁴/λ` per entry. Before that, the
//! `f64` Woodbury path is exact for a perturbed `XXᵀ + mλI + E` with `‖E‖ ≲ (m + n)·ε_f64·
//! ‖|X||X|ᵀ‖` (Gram, Cholesky and triangular solve are backward stable; the absolute values
//! because the Gram sums signed products), which moves `Z` by `≲ (m + n)·ε_f64·κ/λ` with
//! `κ = (λ + ‖X‖_F²/m)/λ ≥ (λ + ‖|X||X|ᵀ‖₂/m)/λ` (the `f64` reference's own error is of the
//! same form). The bound below takes four times that constant and twice the sum, so it does
//! not fail by chance: worst-case rounding bounds are far from the typical `√n`-sized errors.

mod common;

use grng::{Error, MatRef};
use half::bf16;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const U64: f64 = f64::EPSILON / 2.0;

/// `(XᵀX/m + λI)⁻¹` in f64 for row-major `m x n` `x`.
fn reference(x: &[f32], m: usize, n: usize, lambda: f32) -> Vec<f64> {
    let mut a = common::gram64(x, m, n);
    (0..n).for_each(|i| a[i * n + i] += lambda as f64);
    common::spd_inverse64(&a, n)
}

/// The per-entry error bound of the module docs for `x` (`m x n`) and `λ`.
fn tolerance(x: &[f32], m: usize, n: usize, lambda: f32) -> f64 {
    let l = lambda as f64;
    let trace = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / m as f64;
    let kappa = (l + trace) / l;
    2.0 * (common::U32 + 4.0 * (m + n) as f64 * U64 * kappa) / l
}

/// Largest `|Z_ij − R_ij| / tol`; also asserts `Z` is exactly symmetric.
fn worst_ratio(z: &[f32], r: &[f64], n: usize, tol: f64) -> f64 {
    common::assert_symmetric(z, n);
    z.iter()
        .zip(r)
        .map(|(a, b)| (*a as f64 - b).abs() / tol)
        .fold(0.0, f64::max)
}

proptest! {
    #![proptest_config(common::proptest_config(64))]

    /// Ragged sizes with `m` below and above `n`, entries spanning four decades of scale,
    /// `λ` over six decades relative to it, `f32` rows stored `pad` floats apart: the inverse
    /// matches the f64 reference within the module-docs bound, and `bf16` rows give the
    /// bits of their widened `f32` copy.
    #[test]
    fn matches_f64_reference(
        seed in any::<u64>(),
        n in 1usize..=200,
        m_frac in 0.0f64..1.3,
        log_scale in -2.0f64..2.0,
        log_lambda in -5.0f64..1.0,
        pad in 0usize..3,
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let m = ((m_frac * n as f64).round() as usize).max(1);
        let scale = 10f64.powf(log_scale) as f32;
        let x: Vec<f32> = common::vals(&mut rng, m * n).iter().map(|v| v * scale).collect();
        let lambda = (10f64.powf(log_lambda) * (scale as f64).powi(2)) as f32;

        let ld = n + pad;
        let mut padded = vec![f32::NAN; m * ld];
        for i in 0..m {
            padded[i * ld..i * ld + n].copy_from_slice(&x[i * n..(i + 1) * n]);
        }
        let view = MatRef::with_ld(&padded, m, n, ld).unwrap();
        let z = grng::cpu::low_rank_damped_inverse(view, lambda).unwrap();
        prop_assert_eq!(z.shape(), (n, n));
        let r = reference(&x, m, n, lambda);
        let worst = worst_ratio(z.as_slice(), &r, n, tolerance(&x, m, n, lambda));
        prop_assert!(worst <= 1.0, "m {} n {} λ {:e}: error {}x the bound", m, n, lambda, worst);

        let h: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let widened: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        let zb = grng::cpu::low_rank_damped_inverse(MatRef::new(&h, m, n).unwrap(), lambda).unwrap();
        let zw = grng::cpu::low_rank_damped_inverse(MatRef::new(&widened, m, n).unwrap(), lambda)
            .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(zb.as_slice()), bits(zw.as_slice()));
    }
}

/// NaN/Inf in `x` (f32 or bf16) are `NonFinite` at their flat index; `λ` that is not a
/// normal positive number is `Value`; no rows is `Shape` (no columns: the empty inverse); a
/// `K = XXᵀ + mλI` that rounding left singular is `NotSpd`.
#[test]
fn bad_inputs_are_typed_errors() {
    let mut rng = common::seeded_rng();
    let (m, n) = (rng.random_range(1..20), rng.random_range(1..40));
    let x = common::vals(&mut rng, m * n);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let at = rng.random_range(0..m * n);
        let mut y = x.clone();
        y[at] = bad;
        let h: Vec<bf16> = y.iter().map(|&v| bf16::from_f32(v)).collect();
        let errs = [
            grng::cpu::low_rank_damped_inverse(MatRef::new(&y, m, n).unwrap(), 0.1),
            grng::cpu::low_rank_damped_inverse(MatRef::new(&h, m, n).unwrap(), 0.1),
        ];
        for e in errs {
            match e {
                Err(Error::NonFinite {
                    arg, index, value, ..
                }) => {
                    assert_eq!((arg, index), ("x", at));
                    assert_eq!(value.to_bits(), bad.to_bits());
                }
                other => panic!("{bad} at {at}: {other:?}"),
            }
        }
    }
    let good = MatRef::new(&x, m, n).unwrap();
    for lambda in [0.0, -1.0, f32::NAN, f32::INFINITY, f32::MIN_POSITIVE / 2.0] {
        assert!(
            matches!(
                grng::cpu::low_rank_damped_inverse(good, lambda),
                Err(Error::Value { arg: "lambda", .. })
            ),
            "λ = {lambda}"
        );
    }
    // Two equal rows of ones (n = 4): `XXᵀ` is all 4s, and `mλ = 2·f32::MIN_POSITIVE` is far
    // below the f64 rounding of 4, so the second Cholesky pivot is exactly `4 − 2·2 = 0`
    // (every operation exact on these powers of two).
    let ones = [1.0f32; 8];
    assert!(matches!(
        grng::cpu::low_rank_damped_inverse(MatRef::new(&ones, 2, 4).unwrap(), f32::MIN_POSITIVE),
        Err(Error::NotSpd { index: 1, .. })
    ));
    // Rows of no column: the 0 x 0 inverse.
    let empty = grng::cpu::low_rank_damped_inverse(MatRef::<f32>::new(&[], 3, 0).unwrap(), 1.0);
    assert_eq!(empty.unwrap().shape(), (0, 0));
    let none: [f32; 0] = [];
    assert!(matches!(
        grng::cpu::low_rank_damped_inverse(MatRef::new(&none, 0, 3).unwrap(), 1.0),
        Err(Error::Shape { arg: "x", .. })
    ));
}
