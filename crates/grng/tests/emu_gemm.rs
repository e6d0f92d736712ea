//! The kernels of `kernels/gemm.cu` — the tiled fp32 GEMM (four transpose cases), the
//! plain bf16 tensor-core GEMM (`Device::gemm` on bf16), the f32-accurate one (`gemm3`) and
//! through it the preconditioning `P = Γ̃⁻¹ G Λ̃⁻¹`
//! and the damped-inverse update; `A + λI`;
//! the trace — run by the emulator through the same launch code as on a GPU (and on CUDA
//! when present), against the CPU backend on random ragged shapes. Outputs are poisoned with
//! NaN before each launch wherever the operation does not read them.

use grng::cuda::gemm;
use grng::{Device, Element, Error, MatMul, Matrix, Trans};
use half::bf16;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use common::{devices, gemm_case, stored_shape, vals, GemmCase, U32};
use grng_testkit as common;

/// 1, small, around the 16-deep k slices and the 64-wide tiles (±1), anything up to 140.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        1 => 1usize..=3,
        1 => prop::sample::select(vec![15usize, 16, 17, 33]),
        2 => prop::sample::select(vec![63usize, 64, 65, 127, 128, 129]),
        2 => 1usize..=140,
    ]
}

fn trans() -> impl Strategy<Value = Trans> {
    prop_oneof![Just(Trans::No), Just(Trans::Yes)]
}

/// `(m, n, k, ta, tb, alpha, beta)` of a GEMM property: ragged shapes (k = 0 included), every
/// transpose case, α = 1 or drawn, β = 0, 1 or drawn.
fn gemm_params() -> impl Strategy<Value = (usize, usize, usize, Trans, Trans, f32, f32)> {
    (
        dim(),
        dim(),
        prop_oneof![1 => Just(0usize), 8 => dim()],
        trans(),
        trans(),
        prop_oneof![1 => Just(1.0f32), 3 => -2.0f32..2.0],
        prop_oneof![2 => Just(0.0f32), 1 => Just(1.0f32), 2 => -2.0f32..2.0],
    )
}

/// Element (i, j) of op(X) for X stored row-major `rows x cols`.
fn op_at(x: &[f32], cols: usize, t: Trans, i: usize, j: usize) -> f32 {
    match t {
        Trans::No => x[i * cols + j],
        Trans::Yes => x[j * cols + i],
    }
}

/// Elementwise `|got − want| ≤ 2·(k + 4)·u·scale`: both the kernel and the CPU GEMM sum k
/// rounded products in f32 (different orders and blockings), each within (k + 2)·u·scale
/// of the exact value after the α/β epilogue.
fn check_close(got: &[f32], want: &[f32], scale: &[f64], k: usize) -> Result<(), TestCaseError> {
    for (idx, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        let tol = 2.0 * (k as f64 + 4.0) * U32 * s + 1e-30;
        prop_assert!(
            ((g - w) as f64).abs() <= tol,
            "element {}: got {} want {} tol {:e}",
            idx,
            g,
            w,
            tol
        );
    }
    Ok(())
}

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

fn widen(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// A GEMM launcher with `gemm::gemm`'s signature (`gemm::gemm_tc`'s for `T = bf16`).
type GemmFn<T> = fn(&Device, MatMul<&Matrix<T>>, f32, &mut Matrix) -> grng::Result<()>;

/// α = 0 through `gemm`: C ← β·C exactly (β = 0 → zeros, C all NaN never read), NaN A and B
/// never read.
fn check_alpha_zero<T: Element>(
    dev: &Device,
    gemm: GemmFn<T>,
    t: &GemmCase,
    (ta, tb): (Trans, Trans),
    beta: f32,
) -> Result<(), TestCaseError> {
    let nan = |(r, c): (usize, usize)| {
        dev.upload(r, c, &vec![T::from_f32(f32::NAN); r * c])
            .unwrap()
    };
    let (an, bn) = (nan(t.a_shape), nan(t.b_shape));
    let rows = if ta == Trans::No {
        t.a_shape.0
    } else {
        t.a_shape.1
    };
    let cols = if tb == Trans::No {
        t.b_shape.1
    } else {
        t.b_shape.0
    };
    let c_in = if beta == 0.0 {
        vec![f32::NAN; rows * cols]
    } else {
        t.c0.clone()
    };
    let mut c = dev.upload(rows, cols, &c_in).unwrap();
    gemm(dev, MatMul::new(ta, tb, 0.0, &an, &bn), beta, &mut c).unwrap();
    for (x, c) in c.to_vec().unwrap().iter().zip(&t.c0) {
        let w = if beta == 0.0 { 0.0 } else { beta * c };
        // Exact, up to the sign of zero: a kernel forming `0 + β·c` turns β·0 = −0 into +0
        // (an exact 0 in C and β < 0: seed 17600098335544061862 drew one).
        prop_assert!(*x == w, "{x} vs {w}");
    }
    Ok(())
}

/// `Device::gemm` on operands `a`, `b` (element type `T`; `af`, `bf` their f32 values) on
/// every device against the CPU's within `check_close`'s bound, β = 0 with C all NaN (not
/// read), and α = 0 through `launcher` with NaN A and B (not read). `t.c0` is C.
#[allow(clippy::too_many_arguments)]
fn gemm_matches_cpu_on<T: Element>(
    t: &GemmCase,
    (m, n, k): (usize, usize, usize),
    (ta, tb): (Trans, Trans),
    alpha: f32,
    beta: f32,
    (a, b): (&[T], &[T]),
    (af, bf): (&[f32], &[f32]),
    launcher: GemmFn<T>,
) -> Result<(), TestCaseError> {
    let ((ar, ac), (br, bc)) = (t.a_shape, t.b_shape);
    let scale = common::abs_gemm((ta, tb), (m, n, k), alpha, af, bf, beta, &t.c0);
    let cpu = Device::Cpu;
    let mut cw = cpu.upload(m, n, &t.c0).unwrap();
    let (cpu_a, cpu_b) = (
        cpu.upload(ar, ac, a).unwrap(),
        cpu.upload(br, bc, b).unwrap(),
    );
    cpu.gemm(ta, tb, alpha, &cpu_a, &cpu_b, beta, &mut cw)
        .unwrap();
    let want = cw.to_vec().unwrap();
    for dev in devices() {
        let am = dev.upload(ar, ac, a).unwrap();
        let bm = dev.upload(br, bc, b).unwrap();
        let c_in = if beta == 0.0 {
            vec![f32::NAN; m * n]
        } else {
            t.c0.clone()
        };
        let mut c = dev.upload(m, n, &c_in).unwrap();
        dev.gemm(ta, tb, alpha, &am, &bm, beta, &mut c).unwrap();
        check_close(&c.to_vec().unwrap(), &want, &scale, k)?;
        check_alpha_zero(&dev, launcher, t, (ta, tb), beta)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(40))]

    /// `Device::gemm` on every transpose case, β = 0 with C all NaN (not read), β ≠ 0 with a
    /// random C, α = 0 through the launcher with NaN A and B (not read).
    #[test]
    fn gemm_matches_cpu(
        (m, n, k, ta, tb, alpha, beta) in gemm_params(),
        seed in any::<u64>(),
    ) {
        let t = gemm_case(seed, (m, n, k), ta, tb);
        let f32s = (&t.a[..], &t.b[..]);
        gemm_matches_cpu_on(&t, (m, n, k), (ta, tb), alpha, beta, f32s, f32s, gemm::gemm)?;
    }

    /// `Device::gemm` on bf16 operands (the tensor-core `gemm_tc` on the kernel
    /// devices, the widened f32 GEMM on the CPU) on every transpose case and ragged shape:
    /// bf16 products are exact in f32, so both sides are f32 GEMMs of the same values and
    /// `check_close`'s bound holds. β = 0 with C all NaN, α = 0 with NaN A and B (not read).
    #[test]
    fn gemm_bf16_matches_cpu(
        (m, n, k, ta, tb, alpha, beta) in gemm_params(),
        seed in any::<u64>(),
    ) {
        let t = gemm_case(seed, (m, n, k), ta, tb);
        let (a, b) = (to_bf16(&t.a), to_bf16(&t.b));
        let (af, bf) = (widen(&a), widen(&b));
        gemm_matches_cpu_on(&t, (m, n, k), (ta, tb), alpha, beta, (&a, &b), (&af, &bf), gemm::gemm_tc)?;
    }

    /// `gemm::gemm3` (split3 planes on the tensor-core engine) is f32-accurate against an
    /// f64 reference on every transpose case and ragged shape: the 6 plane products
    /// represent op(A)·op(B) to within 2·2^-24 of |op(A)||op(B)| (the dropped mid·lo, lo·mid,
    /// lo·lo terms; the splits are exact), the small products are summed first (their
    /// roundings ≤ 2^-24 of a sum ~2^-8 of the final one), then k f32 additions of the
    /// hi·hi products and the α/β epilogue each round by ≤ 2^-24 of the scale: (k + 8)·u
    /// covers it. β = 0 with C all NaN (never read), α = 0 with NaN A and B (never read).
    #[test]
    fn gemm3_is_f32_accurate(
        (m, n, k, ta, tb, alpha, beta) in gemm_params(),
        seed in any::<u64>(),
    ) {
        let t = gemm_case(seed, (m, n, k), ta, tb);
        let (a, b, c0) = (t.a.clone(), t.b.clone(), t.c0.clone());
        let ((ar, ac), (br, bc)) = (t.a_shape, t.b_shape);
        let scale = common::abs_gemm((ta, tb), (m, n, k), alpha, &a, &b, beta, &c0);
        for dev in devices() {
            let am = dev.upload(ar, ac, &a).unwrap();
            let bm = dev.upload(br, bc, &b).unwrap();
            let c_in = if beta == 0.0 { vec![f32::NAN; m * n] } else { c0.clone() };
            let mut c = dev.upload(m, n, &c_in).unwrap();
            gemm::gemm3(&dev, MatMul::new(ta, tb, alpha, &am, &bm), beta, &mut c).unwrap();
            let got = c.to_vec().unwrap();
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0.0f64;
                    for p in 0..k {
                        acc += f64::from(op_at(&a, ac, ta, i, p)) * f64::from(op_at(&b, bc, tb, p, j));
                    }
                    let want = f64::from(alpha) * acc + if beta == 0.0 { 0.0 } else { f64::from(beta) * f64::from(c0[i * n + j]) };
                    let tol = (k as f64 + 8.0) * U32 * scale[i * n + j] + 1e-30;
                    let g = f64::from(got[i * n + j]);
                    prop_assert!((g - want).abs() <= tol, "({}, {}): {} vs {} (tol {:e})", i, j, g, want, tol);
                }
            }
            check_alpha_zero(&dev, gemm::gemm3, &t, (ta, tb), beta)?;
        }
    }

    /// `P = Γ̃⁻¹ G Λ̃⁻¹` (P poisoned). Tolerance: the CPU and the kernels both form
    /// T = G Λ̃⁻¹ then Γ̃⁻¹ T; each product is within (k + 2)·u of its |·|-scale, and T's
    /// error propagates through Γ̃⁻¹, so |ΔP| ≤ 2·(d_in + d_out + 4)·u·(|Γ̃⁻¹| |G| |Λ̃⁻¹|).
    #[test]
    fn precondition_matches_cpu(d_out in dim(), d_in in dim(), seed in any::<u64>()) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let gi = vals(&mut rng, d_out * d_out);
        let g = vals(&mut rng, d_out * d_in);
        let li = vals(&mut rng, d_in * d_in);
        let cpu = Device::Cpu;
        let mut pw = cpu.zeros(d_out, d_in).unwrap();
        cpu.precondition(
            &cpu.upload(d_out, d_out, &gi).unwrap(),
            &cpu.upload(d_out, d_in, &g).unwrap(),
            &cpu.upload(d_in, d_in, &li).unwrap(),
            &mut pw,
        )
        .unwrap();
        let want = pw.to_vec().unwrap();
        // |Γ̃⁻¹| (|G| |Λ̃⁻¹|).
        let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<f32>>();
        let t = common::abs_gemm((Trans::No, Trans::No), (d_out, d_in, d_in), 1.0, &abs(&g), &abs(&li), 0.0, &vec![0.0; d_out * d_in]);
        let t32: Vec<f32> = t.iter().map(|&x| x as f32).collect();
        let scale = common::abs_gemm((Trans::No, Trans::No), (d_out, d_in, d_out), 1.0, &abs(&gi), &t32, 0.0, &vec![0.0; d_out * d_in]);
        for dev in devices() {
            let mut p = dev.upload(d_out, d_in, &vec![f32::NAN; d_out * d_in]).unwrap();
            dev.precondition(
                &dev.upload(d_out, d_out, &gi).unwrap(),
                &dev.upload(d_out, d_in, &g).unwrap(),
                &dev.upload(d_in, d_in, &li).unwrap(),
                &mut p,
            )
            .unwrap();
            check_close(&p.to_vec().unwrap(), &want, &scale, d_in + d_out)?;
        }
    }

    /// `X ← X − dλ·X X` (one fused GEMM) against the CPU; `dλ = 0` leaves X bit-identical.
    #[test]
    fn damped_inverse_update_matches_cpu(
        n in dim(),
        dl in prop_oneof![1 => Just(0.0f32), 4 => -0.3f32..0.3],
        seed in any::<u64>(),
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let x = vals(&mut rng, n * n);
        let cpu = Device::Cpu;
        let mut xw = cpu.upload(n, n, &x).unwrap();
        cpu.damped_inverse_update(&mut xw, dl).unwrap();
        let want = xw.to_vec().unwrap();
        let scale = common::abs_gemm((Trans::No, Trans::No), (n, n, n), -dl, &x, &x, 1.0, &x);
        for dev in devices() {
            let mut xm = dev.upload(n, n, &x).unwrap();
            dev.damped_inverse_update(&mut xm, dl).unwrap();
            let got = xm.to_vec().unwrap();
            if dl == 0.0 {
                prop_assert_eq!(&got, &x);
            }
            check_close(&got, &want, &scale, n)?;
        }
    }

    /// `A + λI` is one f32 addition per diagonal element: bit-identical to the CPU.
    #[test]
    fn add_diagonal_matches_cpu(n in dim(), lambda in -10.0f32..10.0, seed in any::<u64>()) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let a = vals(&mut rng, n * n);
        let cpu = Device::Cpu;
        let mut aw = cpu.upload(n, n, &a).unwrap();
        cpu.add_diagonal(&mut aw, lambda).unwrap();
        for dev in devices() {
            let mut am = dev.upload(n, n, &a).unwrap();
            dev.add_diagonal(&mut am, lambda).unwrap();
            prop_assert_eq!(am.to_vec().unwrap(), aw.to_vec().unwrap());
        }
    }

    /// Trace: both sum the diagonal in f64 (different orders), then round to f32, so they
    /// agree to one f32 rounding plus n·2⁻⁵²·Σ|d| of f64 reordering: |Δ| ≤ 2⁻²³·Σ|d|.
    /// A NaN/Inf on the diagonal is reported at the same (first) index as on the CPU.
    #[test]
    fn trace_matches_cpu(n in prop_oneof![dim(), 250usize..=700], bad in prop::option::of(0.0f64..1.0), seed in any::<u64>()) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut a = vals(&mut rng, n * n);
        for (i, v) in a.iter_mut().enumerate() {
            // Large off-diagonal values must not leak into the sum.
            if i % (n + 1) != 0 {
                *v *= 1e30;
            }
        }
        if let Some(f) = bad {
            let i = ((f * n as f64) as usize).min(n - 1);
            a[i * n + i] = if i.is_multiple_of(2) { f32::NAN } else { f32::NEG_INFINITY };
            let j = (i + 1).min(n - 1);
            a[j * n + j] = f32::INFINITY;
        }
        let want = Device::Cpu.trace(&Device::Cpu.upload(n, n, &a).unwrap());
        let sabs: f64 = (0..n).map(|i| (a[i * n + i] as f64).abs()).sum();
        for dev in devices() {
            let got = dev.trace(&dev.upload(n, n, &a).unwrap());
            match (&got, &want) {
                (Ok(g), Ok(w)) => prop_assert!(((g - w) as f64).abs() <= sabs / (1u64 << 23) as f64, "{} vs {}", g, w),
                (Err(Error::NonFinite { index: gi, value: gv, .. }), Err(Error::NonFinite { index: wi, value: wv, .. })) => {
                    prop_assert_eq!(gi, wi);
                    prop_assert_eq!(gv.to_bits(), wv.to_bits());
                }
                _ => prop_assert!(false, "{:?} vs {:?}", got, want),
            }
        }
    }
}

/// A 256 x 256 x 200 GEMM (several tiles in every direction) in each transpose case.
#[test]
fn larger_gemm_matches_cpu() {
    let (m, n, k) = (256usize, 200usize, 230usize);
    let mut rng = common::seeded_rng();
    let a = vals(&mut rng, m * k);
    let b = vals(&mut rng, k * n);
    let c0 = vals(&mut rng, m * n);
    for ta in [Trans::No, Trans::Yes] {
        for tb in [Trans::No, Trans::Yes] {
            let (ar, ac) = stored_shape(ta, (m, k));
            let (br, bc) = stored_shape(tb, (k, n));
            // C ← 0.7·op(A)·op(B) − 0.5·C on `dev`.
            let product = |dev: &Device| {
                let mut c = dev.upload(m, n, &c0).unwrap();
                let (am, bm) = (
                    dev.upload(ar, ac, &a).unwrap(),
                    dev.upload(br, bc, &b).unwrap(),
                );
                dev.gemm(ta, tb, 0.7, &am, &bm, -0.5, &mut c).unwrap();
                c.to_vec().unwrap()
            };
            let cw = product(&Device::Cpu);
            let scale = common::abs_gemm((ta, tb), (m, n, k), 0.7, &a, &b, -0.5, &c0);
            for dev in devices() {
                check_close(&product(&dev), &cw, &scale, k).unwrap();
            }
        }
    }
}

/// The CUDA arm at the GPU's sizes (m, n, k up to 4096, ragged): `Device::gemm` on f32 and
/// on bf16 operands and `gemm::gemm3`, each transpose case, C all NaN when β = 0, against
/// the CPU GEMM within `check_close`'s bound (its scale from [`common::abs_gemm`]; for gemm3
/// one k more, covering its (k + 8)·u bound plus the CPU's (k + 2)·u); then preconditioning
/// and the damped-inverse update at those sizes.
#[test]
fn cuda_large_products_match_cpu() {
    let Some(dev) = common::cuda() else {
        return;
    };
    let mut rng = common::seeded_rng();
    let cpu = Device::Cpu;
    for (ta, tb) in [
        (Trans::No, Trans::No),
        (Trans::No, Trans::Yes),
        (Trans::Yes, Trans::No),
        (Trans::Yes, Trans::Yes),
    ] {
        let (m, n, k) = (
            common::large_dim(&mut rng),
            common::large_dim(&mut rng),
            common::large_dim(&mut rng),
        );
        let t = gemm_case(rng.random(), (m, n, k), ta, tb);
        let (alpha, beta) = (
            rng.random_range(-2.0f32..2.0),
            [0.0, 0.7][rng.random_range(0..2)],
        );
        let ((ar, ac), (br, bc)) = (t.a_shape, t.b_shape);
        let c_in = if beta == 0.0 {
            vec![f32::NAN; m * n]
        } else {
            t.c0.clone()
        };
        // The CPU's product of f32 values and its error scale.
        let reference = |a: &[f32], b: &[f32]| {
            let mut cw = cpu.upload(m, n, &t.c0).unwrap();
            let (ac_, bc_) = (
                cpu.upload(ar, ac, a).unwrap(),
                cpu.upload(br, bc, b).unwrap(),
            );
            cpu.gemm(ta, tb, alpha, &ac_, &bc_, beta, &mut cw).unwrap();
            let scale = common::abs_gemm((ta, tb), (m, n, k), alpha, a, b, beta, &t.c0);
            (cw.to_vec().unwrap(), scale)
        };
        let (want, scale) = reference(&t.a, &t.b);
        let (am, bm) = (
            dev.upload(ar, ac, &t.a).unwrap(),
            dev.upload(br, bc, &t.b).unwrap(),
        );
        let mut c = dev.upload(m, n, &c_in).unwrap();
        dev.gemm(ta, tb, alpha, &am, &bm, beta, &mut c).unwrap();
        check_close(&c.to_vec().unwrap(), &want, &scale, k).unwrap();
        let mut c = dev.upload(m, n, &c_in).unwrap();
        gemm::gemm3(&dev, MatMul::new(ta, tb, alpha, &am, &bm), beta, &mut c).unwrap();
        check_close(&c.to_vec().unwrap(), &want, &scale, k + 1).unwrap();
        // The same values rounded to bf16: the tensor-core engine's plain product.
        let (a16, b16) = (to_bf16(&t.a), to_bf16(&t.b));
        let (want, scale) = reference(&widen(&a16), &widen(&b16));
        let (am, bm) = (
            dev.upload(ar, ac, &a16).unwrap(),
            dev.upload(br, bc, &b16).unwrap(),
        );
        let mut c = dev.upload(m, n, &c_in).unwrap();
        dev.gemm(ta, tb, alpha, &am, &bm, beta, &mut c).unwrap();
        check_close(&c.to_vec().unwrap(), &want, &scale, k).unwrap();
    }

    // P = Γ̃⁻¹ G Λ̃⁻¹ (P poisoned) and X ← X − dλ·X X, bounds as in the proptests above.
    let (d_out, d_in) = (common::large_dim(&mut rng), common::large_dim(&mut rng));
    let gi = vals(&mut rng, d_out * d_out);
    let g = vals(&mut rng, d_out * d_in);
    let li = vals(&mut rng, d_in * d_in);
    let mut pw = cpu.zeros(d_out, d_in).unwrap();
    let up = |d: &Device, r, c, v: &[f32]| d.upload(r, c, v).unwrap();
    cpu.precondition(
        &up(&cpu, d_out, d_out, &gi),
        &up(&cpu, d_out, d_in, &g),
        &up(&cpu, d_in, d_in, &li),
        &mut pw,
    )
    .unwrap();
    let nn = (Trans::No, Trans::No);
    let zeros = vec![0.0; d_out * d_in];
    let t: Vec<f32> = common::abs_gemm(nn, (d_out, d_in, d_in), 1.0, &g, &li, 0.0, &zeros)
        .into_iter()
        .map(|x| x as f32)
        .collect();
    let scale = common::abs_gemm(nn, (d_out, d_in, d_out), 1.0, &gi, &t, 0.0, &zeros);
    let mut p = up(&dev, d_out, d_in, &vec![f32::NAN; d_out * d_in]);
    dev.precondition(
        &up(&dev, d_out, d_out, &gi),
        &up(&dev, d_out, d_in, &g),
        &up(&dev, d_in, d_in, &li),
        &mut p,
    )
    .unwrap();
    check_close(
        &p.to_vec().unwrap(),
        &pw.to_vec().unwrap(),
        &scale,
        d_in + d_out,
    )
    .unwrap();

    let n = common::large_dim(&mut rng);
    let x = vals(&mut rng, n * n);
    let dl = rng.random_range(-0.3f32..0.3);
    let mut xw = up(&cpu, n, n, &x);
    cpu.damped_inverse_update(&mut xw, dl).unwrap();
    let scale = common::abs_gemm(nn, (n, n, n), -dl, &x, &x, 1.0, &x);
    let mut xm = up(&dev, n, n, &x);
    dev.damped_inverse_update(&mut xm, dl).unwrap();
    check_close(&xm.to_vec().unwrap(), &xw.to_vec().unwrap(), &scale, n).unwrap();
}

/// Bad inputs are typed errors on the emulated device and leave the outputs unchanged.
#[test]
fn bad_inputs_are_errors() {
    let dev = Device::Emulated;
    let fill = vec![3.0f32; 6];
    let mut c = dev.upload(2, 3, &fill).unwrap();
    let unchanged = |m: &Matrix, v: &[f32]| assert_eq!(m.to_vec().unwrap(), v);
    let a = dev.upload(2, 4, &[1.0f32; 8]).unwrap();
    let b = dev.upload(4, 3, &[1.0f32; 12]).unwrap();

    let r = dev.gemm(Trans::Yes, Trans::No, 1.0, &a, &b, 0.0, &mut c);
    assert!(matches!(r, Err(Error::Shape { arg: "b", .. })), "{r:?}");
    let r = dev.gemm(Trans::No, Trans::Yes, 1.0, &a, &b, 0.0, &mut c);
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    let mut c_wrong = dev.upload(3, 2, &fill).unwrap();
    let r = gemm::gemm(
        &dev,
        MatMul::new(Trans::No, Trans::No, 1.0, &a, &b),
        0.0,
        &mut c_wrong,
    );
    assert!(matches!(r, Err(Error::Shape { arg: "c", .. })), "{r:?}");
    for bad in [f32::NAN, f32::INFINITY] {
        let r = dev.gemm(Trans::No, Trans::No, bad, &a, &b, 0.0, &mut c);
        assert!(matches!(r, Err(Error::Value { arg: "alpha", .. })), "{r:?}");
        let r = dev.gemm(Trans::No, Trans::No, 1.0, &a, &b, bad, &mut c);
        assert!(matches!(r, Err(Error::Value { arg: "beta", .. })), "{r:?}");
    }
    let mut bv = vec![1.0f32; 12];
    bv[11] = f32::NAN;
    // A NaN/Inf in `b` at `at`: an error naming `b` and that index.
    let b_non_finite_at = |r: grng::Result<()>, at: usize| {
        assert!(
            matches!(r, Err(Error::NonFinite { arg: "b", index, .. }) if index == at),
            "{r:?}"
        );
    };
    let bn = dev.upload(4, 3, &bv).unwrap();
    let r = dev.gemm(Trans::No, Trans::No, 1.0, &a, &bn, 0.0, &mut c);
    b_non_finite_at(r, 11);
    // bf16 operands go through the same checks.
    let mut bh = vec![bf16::ONE; 12];
    bh[7] = bf16::INFINITY;
    let (ah, bh) = (
        dev.upload(2, 4, &[bf16::ONE; 8]).unwrap(),
        dev.upload(4, 3, &bh).unwrap(),
    );
    let r = dev.gemm(Trans::No, Trans::No, 1.0, &ah, &bh, 0.0, &mut c);
    b_non_finite_at(r, 7);
    let mut cn = dev
        .upload(2, 3, &[1.0, 2.0, f32::NAN, 4.0, 5.0, 6.0])
        .unwrap();
    let r = dev.gemm(Trans::No, Trans::No, 1.0, &a, &b, 1.0, &mut cn);
    assert!(
        matches!(
            r,
            Err(Error::NonFinite {
                arg: "c",
                index: 2,
                ..
            })
        ),
        "{r:?}"
    );
    unchanged(&c, &fill);

    let sq = vec![1.0f32; 9];
    let mut x = dev.upload(3, 3, &sq).unwrap();
    let mut rect = dev.upload(2, 3, &fill).unwrap();
    assert!(matches!(
        dev.add_diagonal(&mut rect, 1.0),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        dev.add_diagonal(&mut x, f32::NAN),
        Err(Error::Value { .. })
    ));
    assert!(matches!(
        dev.damped_inverse_update(&mut rect, 0.1),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        dev.damped_inverse_update(&mut x, f32::INFINITY),
        Err(Error::Value { .. })
    ));
    assert!(matches!(dev.trace(&rect), Err(Error::Shape { .. })));
    assert!(matches!(gemm::trace(&dev, &rect), Err(Error::Shape { .. })));
    unchanged(&x, &sq);
    unchanged(&rect, &fill);

    let g = dev.upload(2, 3, &fill).unwrap();
    let gi = dev.upload(2, 2, &[1.0f32; 4]).unwrap();
    let li = dev.upload(3, 3, &sq).unwrap();
    let mut p = dev.upload(2, 3, &fill).unwrap();
    assert!(matches!(
        dev.precondition(&li, &g, &li, &mut p),
        Err(Error::Shape {
            arg: "gamma_inv",
            ..
        })
    ));
    assert!(matches!(
        dev.precondition(&gi, &g, &gi, &mut p),
        Err(Error::Shape {
            arg: "lambda_inv",
            ..
        })
    ));
    let mut p_wrong = dev.upload(3, 2, &fill).unwrap();
    assert!(matches!(
        dev.precondition(&gi, &g, &li, &mut p_wrong),
        Err(Error::Shape { arg: "p", .. })
    ));
    let mut gv = fill.clone();
    gv[4] = f32::NEG_INFINITY;
    let r = dev.precondition(&gi, &dev.upload(2, 3, &gv).unwrap(), &li, &mut p);
    assert!(
        matches!(
            r,
            Err(Error::NonFinite {
                arg: "g",
                index: 4,
                ..
            })
        ),
        "{r:?}"
    );
    unchanged(&p, &fill);

    // Empty operands are fine: nothing to launch (k = 0 still scales C).
    let e0 = dev.zeros::<f32>(0, 0).unwrap();
    assert_eq!(dev.trace(&e0).unwrap(), 0.0);
    let a0 = dev.zeros::<f32>(2, 0).unwrap();
    let b0 = dev.zeros::<f32>(0, 3).unwrap();
    let mut c2 = dev.upload(2, 3, &fill).unwrap();
    dev.gemm(Trans::No, Trans::No, 1.0, &a0, &b0, 0.5, &mut c2)
        .unwrap();
    unchanged(&c2, &[1.5; 6]);

    // A CPU device cannot launch kernels.
    let cpu = Device::Cpu;
    let mut xc = cpu.upload(3, 3, &sq).unwrap();
    let r = gemm::add_diagonal(&cpu, &mut xc, 1.0);
    assert!(matches!(r, Err(Error::DeviceUnavailable(_))), "{r:?}");
    unchanged(&xc, &sq);
}

/// The result's planes into `cache`, no mirror.
fn into(cache: &gemm::SplitCache) -> gemm::Epilogue3<'_> {
    gemm::Epilogue3 {
        planes: Some(cache),
        mirror: false,
    }
}

/// The split3 planes an engine product's epilogue writes for its result (`out`, issue 36: a
/// product reading that result next splits nothing): the planes of `C` as stored, bit for bit
/// (modelled on the host), after `gemm3_split` (any α ≠ 0, β, transposes, ragged shapes) and
/// after the checked product; a product reading them is the product that splits `C` itself,
/// bit for bit (the same planes, the same kernel: on a GPU too).
fn check_result_planes(
    dev: &Device,
    (m, n, k, ta, tb, alpha, beta): (usize, usize, usize, Trans, Trans, f32, f32),
    seed: u64,
) -> Result<(), TestCaseError> {
    let t = gemm_case(seed, (m, n, k), ta, tb);
    let ((ar, ac), (br, bc)) = (t.a_shape, t.b_shape);
    let am = dev.upload(ar, ac, &t.a).unwrap();
    let bm = dev.upload(br, bc, &t.b).unwrap();
    let (sa, sb) = (gemm::Split3::new(&am), gemm::Split3::new(&bm));
    let p = MatMul::new(ta, tb, alpha, &sa, &sb);
    let mut c = dev.upload(m, n, &t.c0).unwrap();
    let planes = gemm::SplitCache::default();
    gemm::gemm3_split(dev, p, beta, &mut c, Some(&planes)).unwrap();
    let mut checked = dev.zeros(m, n).unwrap();
    let checked_planes = gemm::SplitCache::default();
    let p1 = MatMul::new(ta, tb, 1.0, &sa, &sb);
    gemm::product3_checked(dev, "test", p1, &mut checked, into(&checked_planes)).unwrap();
    for (c, cache, what) in [
        (&c, &planes, "gemm3_split"),
        (&checked, &checked_planes, "checked"),
    ] {
        let (v, pl) = (
            c.to_vec().unwrap(),
            cache.planes().unwrap().to_vec().unwrap(),
        );
        prop_assert_eq!(pl.len(), 3 * m * n);
        for (i, &x) in v.iter().enumerate() {
            let got = [pl[i], pl[m * n + i], pl[2 * m * n + i]].map(bf16::to_bits);
            prop_assert_eq!(
                got,
                common::host_split3(x),
                "{} element {} = {}",
                what,
                i,
                x
            );
        }
    }
    // `C·Cᵀ`-shaped product reading C: through the kept planes, and splitting C itself.
    let read = |s: &gemm::Split3<'_>| {
        let mut out = dev.zeros(m, m).unwrap();
        gemm::gemm3_split(
            dev,
            MatMul::new(Trans::No, Trans::Yes, 1.0, s, s),
            0.0,
            &mut out,
            None,
        )
        .unwrap();
        out.to_vec()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect::<Vec<_>>()
    };
    let kept = read(&gemm::Split3::kept(&c, &planes));
    prop_assert_eq!(kept, read(&gemm::Split3::new(&c)));
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(24))]

    #[test]
    fn result_planes_are_the_split_of_the_stored_result(
        (m, n, k, ta, tb, alpha, beta) in gemm_params(),
        seed in any::<u64>(),
    ) {
        // α = 0 runs no K slice and writes no planes (below); a product needs one.
        let alpha = if alpha == 0.0 { 1.0 } else { alpha };
        for dev in devices() {
            check_result_planes(&dev, (m, n, k, ta, tb, alpha, beta), seed)?;
        }
    }
}

/// Where no planes are written the cache stays empty, and a cache that holds planes already
/// (another matrix's) is a typed error before any launch, `C` unchanged: `α = 0` (no K slice
/// runs, nothing is split), an empty product, a filled cache.
#[test]
fn result_planes_only_where_written() {
    let mut rng = common::seeded_rng();
    for dev in devices() {
        let (a, b) = (
            dev.upload(7, 5, &vals(&mut rng, 35)).unwrap(),
            dev.upload(5, 6, &vals(&mut rng, 30)).unwrap(),
        );
        let (sa, sb) = (gemm::Split3::new(&a), gemm::Split3::new(&b));
        let no = Trans::No;
        let mut c = dev.zeros(7, 6).unwrap();
        let cache = gemm::SplitCache::default();
        gemm::gemm3_split(
            &dev,
            MatMul::new(no, no, 0.0, &sa, &sb),
            0.0,
            &mut c,
            Some(&cache),
        )
        .unwrap();
        assert!(!cache.has_planes(), "{}: α = 0", dev.name());
        let mut empty = dev.zeros(7, 0).unwrap();
        let e0 = dev.zeros(5, 0).unwrap();
        let se = gemm::Split3::new(&e0);
        gemm::product3_checked(
            &dev,
            "test",
            MatMul::new(no, no, 1.0, &sa, &se),
            &mut empty,
            into(&cache),
        )
        .unwrap();
        assert!(!cache.has_planes(), "{}: empty product", dev.name());
        gemm::gemm3_split(
            &dev,
            MatMul::new(no, no, 1.0, &sa, &sb),
            0.0,
            &mut c,
            Some(&cache),
        )
        .unwrap();
        assert!(cache.has_planes(), "{}", dev.name());
        let before = c.to_vec().unwrap();
        let p = MatMul::new(no, no, 2.0, &sa, &sb);
        for e in [
            gemm::gemm3_split(&dev, p, 0.0, &mut c, Some(&cache)).unwrap_err(),
            gemm::product3_checked(&dev, "test", p, &mut c, into(&cache)).unwrap_err(),
        ] {
            assert!(
                matches!(
                    e,
                    Error::Value {
                        arg: "out planes",
                        ..
                    }
                ),
                "{e}"
            );
        }
        assert_eq!(c.to_vec().unwrap(), before, "{}", dev.name());
    }
}

/// The mirrored product (`Epilogue3::mirror`: the lower-triangle tile pairs only, each value
/// stored at `(i, j)` and `(j, i)`) of `A·B` (`n x k` by `k x n`, not symmetric: the mirror's
/// mechanics, whatever the operands) and of the Gram `A·Aᵀ`: exactly symmetric; each element
/// of the lower triangle within split3's `(k + 8)·2⁻²⁴·Σ|a||b|` of the `f64` product; the
/// planes of every stored value bit for bit, the mirrored ones included; one to three
/// 128-wide tiles (off-diagonal tile pairs from `n = 129`). A product that is not square is
/// an [`Error::Shape`].
fn check_mirrored(
    dev: &Device,
    n: usize,
    k: usize,
    gram: bool,
    seed: u64,
) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let a = vals(&mut rng, n * k);
    let b = if gram {
        a.clone()
    } else {
        vals(&mut rng, k * n)
    };
    let am = dev.upload(n, k, &a).unwrap();
    let bm = if gram {
        dev.upload(n, k, &b)
    } else {
        dev.upload(k, n, &b)
    }
    .unwrap();
    let (sa, sb) = (gemm::Split3::new(&am), gemm::Split3::new(&bm));
    let (q, tb) = if gram {
        (&sa, Trans::Yes)
    } else {
        (&sb, Trans::No)
    };
    let p = MatMul::new(Trans::No, tb, 1.0, &sa, q);
    let cache = gemm::SplitCache::default();
    let epi = gemm::Epilogue3 {
        planes: Some(&cache),
        mirror: true,
    };
    let mut c = dev.upload(n, n, &vec![f32::NAN; n * n]).unwrap();
    gemm::product3_checked(dev, "test", p, &mut c, epi).unwrap();
    let (v, pl) = (
        c.to_vec().unwrap(),
        cache.planes().unwrap().to_vec().unwrap(),
    );
    // B's element (p, j) of op(B): B[p, j], or for the Gram A[j, p].
    let b_at = |p: usize, j: usize| if gram { a[j * k + p] } else { b[p * n + j] };
    for i in 0..n {
        for j in 0..n {
            prop_assert_eq!(
                v[i * n + j].to_bits(),
                v[j * n + i].to_bits(),
                "({}, {})",
                i,
                j
            );
            let (r, s) = (i.max(j), i.min(j));
            let (mut want, mut abs) = (0.0f64, 0.0f64);
            for p in 0..k {
                let t = f64::from(a[r * k + p]) * f64::from(b_at(p, s));
                (want, abs) = (want + t, abs + t.abs());
            }
            let tol = (k as f64 + 8.0) * U32 * abs + 1e-30;
            prop_assert!(
                (f64::from(v[i * n + j]) - want).abs() <= tol,
                "({}, {}): {} vs {}",
                i,
                j,
                v[i * n + j],
                want
            );
            let o = i * n + j;
            let got = [pl[o], pl[n * n + o], pl[2 * n * n + o]].map(bf16::to_bits);
            prop_assert_eq!(got, common::host_split3(v[o]));
        }
    }
    let wide = dev.zeros(k, n + 1).unwrap();
    let sw = gemm::Split3::new(&wide);
    let mut out = dev.zeros(n, n + 1).unwrap();
    let mirror = gemm::Epilogue3 {
        planes: None,
        mirror: true,
    };
    let e = gemm::product3_checked(
        dev,
        "test",
        MatMul::new(Trans::No, Trans::No, 1.0, &sa, &sw),
        &mut out,
        mirror,
    );
    prop_assert!(matches!(e, Err(Error::Shape { .. })), "{:?}", e);
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(16))]

    #[test]
    fn mirrored_products_are_exactly_symmetric(
        n in prop_oneof![1usize..=70, 120usize..=290],
        k in 1usize..=90,
        gram in any::<bool>(),
        seed in any::<u64>(),
    ) {
        for dev in devices() {
            check_mirrored(&dev, n, k, gram, seed)?;
        }
    }
}
