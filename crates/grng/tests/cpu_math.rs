//! The vectorizable `grng::cpu::math` functions against `f64` references, in ulps of the
//! correctly rounded `f32` result.

use grng::cpu::math;

/// Distance in units in the last place between `got` and the `f32` nearest to `want`.
fn ulps(got: f32, want: f64) -> f64 {
    let r = want as f32;
    let ulp = f32::from_bits(r.abs().to_bits() + 1) - r.abs();
    (got as f64 - want).abs() / ulp as f64
}

/// Every `2⁻¹⁶` step of `[lo, hi]` (plus the endpoints): `(x, worst ulps)` over the grid.
fn worst(lo: f32, hi: f32, f: impl Fn(f32) -> f32, r: impl Fn(f64) -> f64) -> (f32, f64) {
    let steps = ((hi - lo) as f64 * 65536.0) as i64;
    (0..=steps)
        .map(|k| lo + (k as f64 / 65536.0) as f32)
        .chain([lo, hi])
        .map(|x| (x, ulps(f(x), r(x as f64))))
        .fold((0.0, 0.0), |a, b| if b.1 > a.1 { b } else { a })
}

#[test]
fn tanh_within_3_ulp() {
    let (x, u) = worst(-12.0, 12.0, math::tanh, f64::tanh);
    eprintln!("tanh: worst {u:.2} ulp at x = {x}");
    assert!(u <= 3.0, "tanh: {u} ulp at x = {x}");
    // Tiny and subnormal arguments: tanh x = x to f32 precision.
    for x in [1e-30f32, 1e-40, 3e-8, 1e-4] {
        assert!(ulps(math::tanh(x), (x as f64).tanh()) <= 1.0, "{x}");
        assert!(ulps(math::tanh(-x), (-x as f64).tanh()) <= 1.0, "-{x}");
    }
}

#[test]
fn tanh_special_values() {
    assert_eq!(math::tanh(0.0).to_bits(), 0.0f32.to_bits());
    assert_eq!(math::tanh(-0.0).to_bits(), (-0.0f32).to_bits());
    assert_eq!(math::tanh(f32::INFINITY), 1.0);
    assert_eq!(math::tanh(f32::NEG_INFINITY), -1.0);
    assert_eq!(math::tanh(f32::MAX), 1.0);
    assert_eq!(math::tanh(-1e30), -1.0);
    assert!(math::tanh(f32::NAN).is_nan());
    let mut v = [0.5f32, f32::NAN, -20.0];
    math::tanh_in_place(&mut v);
    assert!(v[1].is_nan() && v[2] == -1.0 && ulps(v[0], 0.5f64.tanh()) <= 3.0);
}

#[test]
fn exp_within_2_ulp() {
    let (x, u) = worst(-87.0, 88.0, math::exp, f64::exp);
    eprintln!("exp: worst {u:.2} ulp at x = {x}");
    assert!(u <= 2.0, "exp: {u} ulp at x = {x}");
}
