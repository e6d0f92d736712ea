//! The Newton-inversion kernels (`kernels/newton.cu`) run by the emulator (and on a GPU when
//! one is present) against the CPU backend: the fused-epilogue products against `f64`
//! references, the whole inversion against `grng::cpu::newton` (same starts, orders,
//! precisions, stop rules), the power iteration against `grng::cpu::spectral_norm`, and the
//! typed errors. Outputs are poisoned with NaN before each launch. Sizes stay below ~100:
//! every emulated thread is a fiber (the CUDA arm's products go up to 4096).

use common::{devices, spd, with_spectrum};
use grng_testkit as common;

use grng::cpu::newton::newton_inverse as cpu_newton;
use grng::cuda::newton::{self as kn, Epilogue, Unused};
use grng::cuda::{gemm_plan, gemm_vendor};
use grng::ops::newton::{
    InitialGuess, NewtonInfo, NewtonOptions, NewtonOrder, NewtonStop, Precision,
};
use grng::ops::norm::PowerOptions;
use grng::{Device, Error, Mat, MatMul, MatRef, Matrix, Trans};
use half::bf16;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sizes around the 128-wide output tile and the 64/32/16/8-wide warp tiles, K slices and
/// load granules, plus anything.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        1 => Just(1usize),
        3 => prop::sample::select(vec![2usize, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 96, 127, 128, 129, 136]),
        4 => 1usize..=100,
    ]
}

fn random(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

/// Reference of a fused product: `(v, scale)` per element, `v` in `f64` from the given
/// (already rounded) operands, `scale` = `Σ|a||b| + |adds| + |diag|` for the error bound.
#[allow(clippy::too_many_arguments)]
fn reference(
    a: &[f32],
    b: &[f32],
    n: usize,
    alpha: f32,
    diag: f32,
    add1: Option<&[f32]>,
    add2: Option<&[f32]>,
) -> (Vec<f64>, Vec<f64>) {
    use rayon::prelude::*;
    let mut v = vec![0.0; n * n];
    let mut sc = vec![0.0; n * n];
    // Row by row in parallel, k outer (the same k order per element): the CUDA arm's n = 4096
    // takes seconds, not minutes.
    v.par_chunks_mut(n)
        .zip(sc.par_chunks_mut(n))
        .enumerate()
        .for_each(|(i, (vr, sr))| {
            for k in 0..n {
                let aik = a[i * n + k] as f64;
                for (j, (x, y)) in vr.iter_mut().zip(sr.iter_mut()).enumerate() {
                    let p = aik * b[k * n + j] as f64;
                    *x += p;
                    *y += p.abs();
                }
            }
            for j in 0..n {
                let o = i * n + j;
                vr[j] *= alpha as f64;
                if i == j {
                    vr[j] += diag as f64;
                    sr[j] += (diag as f64).abs();
                }
                for add in [add1, add2].into_iter().flatten() {
                    vr[j] += add[o] as f64;
                    sr[j] += (add[o] as f64).abs();
                }
            }
        });
    (v, sc)
}

#[derive(Debug)]
struct Flags {
    alpha: f32,
    diag: f32,
    add1: bool,
    add2: bool,
    out: bool,
    out_bf: bool,
    partial: bool,
    /// A symmetric product (`A·A`, `A` symmetric) on the lower-triangle tiles, mirrored.
    mirror: bool,
}

fn flags() -> impl Strategy<Value = Flags> {
    (
        prop::bool::ANY,
        -2.0f32..2.0,
        prop::bool::ANY,
        prop::bool::ANY,
        0u8..3,
        prop::bool::ANY,
        prop::bool::ANY,
    )
        .prop_map(|(neg, diag, add1, add2, outs, partial, mirror)| Flags {
            alpha: if neg { -1.0 } else { 1.0 },
            diag,
            add1,
            add2,
            out: outs != 1,
            out_bf: outs != 0,
            // The residual partials come from full products only.
            partial: partial && !mirror,
            mirror,
        })
}

/// Which candidate of the GEMM plan computes a Newton product in [`check_product`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    /// The fused kernel (`kn::product_tc` / `kn::product_f32`).
    Engine,
    /// cuBLAS, then `kn::epilogue`.
    Vendor,
    /// `gemm_plan::newton_bf16x3`.
    Bf16x3,
}

impl Flags {
    /// `f`'s epilogue over the additions `adds` into the outputs it selects of `outs`
    /// (`out`, `out_bf`, `partial`), mirrored when `mirror`.
    fn epilogue<'a>(
        &self,
        (add1, add2): (&'a Matrix, &'a Matrix),
        (out, out_bf, partial): (&'a mut Matrix, &'a mut Matrix<bf16>, &'a mut Matrix),
        mirror: bool,
    ) -> Epilogue<'a> {
        Epilogue {
            alpha: self.alpha,
            diag: self.diag,
            add1: self.add1.then_some(add1),
            add2: self.add2.then_some(add2),
            out: self.out.then_some(out),
            out_bf: self.out_bf.then_some(out_bf),
            out_planes: None,
            partial: self.partial.then_some(partial),
            mirror,
        }
    }
}

/// Runs one fused product (`tc`: bf16 operands on tensor cores, else f32) with NaN-poisoned
/// outputs and checks every output against [`reference`]. `tol_unit` is the relative error
/// of one accumulated product term. A mirrored product (`f.mirror`) is `A·A` for a symmetric
/// `A`, whose f64 reference is exactly symmetric (`v[j,i]` sums the same products in the same
/// order as `v[i,j]`), so the same bounds apply; its lower triangle must also equal the full
/// product's bit for bit (the same tile computations), and a residual with it is refused.
/// The bf16 kernel has no mirror: asked for one, it refuses, and the full product is checked.
/// `Side::Vendor` (a GPU with cuBLAS): the GEMM plan's vendor candidate instead of the fused
/// kernel, cuBLAS into an f32 scratch then `kn::epilogue`, under the same bounds (cuBLAS sums
/// f32 as the engine does, SGEMM with γ_n for f32 operands); it accepts a mirror on bf16 too.
/// `Side::Bf16x3` (f32 operands): the plan's bf16x3 candidate, `gemm_plan::newton_bf16x3`
/// (6n bf16 plane products in one f32 sum: `(6n + 8)·2⁻²⁴` of the scale).
fn check_product(dev: &Device, n: usize, f: &Flags, (tc, side): (bool, Side), seed: u64) {
    let vendor = side != Side::Engine;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut a = random(&mut rng, n * n);
    let mut b = random(&mut rng, n * n);
    if f.mirror {
        for i in 0..n {
            for j in i + 1..n {
                a[i * n + j] = a[j * n + i];
            }
        }
        b = a.clone();
    }
    let add1 = random(&mut rng, n * n);
    let add2 = random(&mut rng, n * n);
    let (ar, br) = if tc {
        (round_bf16(&a), round_bf16(&b))
    } else {
        (a.clone(), b.clone())
    };
    let (v, sc) = reference(
        &ar,
        &br,
        n,
        f.alpha,
        f.diag,
        f.add1.then_some(&add1[..]),
        f.add2.then_some(&add2[..]),
    );
    let up = |x: &[f32]| dev.upload(n, n, x).unwrap();
    let (d_add1, d_add2) = (up(&add1), up(&add2));
    let mut out = up(&vec![f32::NAN; n * n]);
    let mut out_bf: Matrix<bf16> = dev.upload(n, n, &vec![bf16::NAN; n * n]).unwrap();
    let np = kn::partials(n);
    let mut partial = dev.upload(np, 1, &vec![f32::NAN; np]).unwrap();
    let mut unused = Unused::new(dev).unwrap();
    let to_bf = |x: &[f32]| -> Matrix<bf16> {
        let h: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        dev.upload(n, n, &h).unwrap()
    };
    let (a_bf, b_bf) = (to_bf(&a), to_bf(&b));
    let (a_f, b_f) = (up(&a), up(&b));
    let mut planes = kn::Planes::new(n);
    let mut scratch = kn::Scratch::new(dev, n).unwrap();
    let no = Trans::No;
    let mut run = |epi: Epilogue<'_>, unused: &mut Unused| {
        if side == Side::Bf16x3 {
            gemm_plan::newton_bf16x3(dev, (&a_f, &b_f), epi, &mut scratch)
        } else if vendor {
            let mut raw = dev.zeros(n, n)?;
            if tc {
                gemm_vendor::gemm(dev, MatMul::new(no, no, 1.0, &a_bf, &b_bf), 0.0, &mut raw)?;
            } else {
                gemm_vendor::gemm(dev, MatMul::new(no, no, 1.0, &a_f, &b_f), 0.0, &mut raw)?;
            }
            kn::epilogue(dev, &raw, epi, unused)
        } else if tc {
            kn::product_tc(dev, &a_bf, &b_bf, epi, unused)
        } else {
            kn::product_f32(dev, (&a_f).into(), (&b_f).into(), &mut planes, epi, unused)
        }
    };
    if f.mirror && tc && !vendor {
        let refused = run(
            Epilogue {
                mirror: true,
                ..Epilogue::new()
            },
            &mut unused,
        );
        assert!(matches!(refused, Err(Error::Value { .. })), "{refused:?}");
    }
    let mirror = f.mirror && (vendor || !tc);
    if mirror {
        let refused = run(
            Epilogue {
                mirror: true,
                partial: Some(&mut partial),
                ..Epilogue::new()
            },
            &mut unused,
        );
        assert!(matches!(refused, Err(Error::Value { .. })), "{refused:?}");
    }
    let epi = f.epilogue(
        (&d_add1, &d_add2),
        (&mut out, &mut out_bf, &mut partial),
        mirror,
    );
    run(epi, &mut unused).unwrap();
    if mirror && f.out {
        let mut full = up(&vec![f32::NAN; n * n]);
        let epi = Epilogue {
            alpha: f.alpha,
            diag: f.diag,
            add1: f.add1.then_some(&d_add1),
            add2: f.add2.then_some(&d_add2),
            out: Some(&mut full),
            ..Epilogue::new()
        };
        run(epi, &mut unused).unwrap();
        let (full, got) = (full.to_vec().unwrap(), out.to_vec().unwrap());
        for i in 0..n {
            for j in 0..=i {
                let o = i * n + j;
                assert_eq!(
                    got[o].to_bits(),
                    full[o].to_bits(),
                    "lower ({i}, {j}), n = {n}"
                );
            }
        }
    }
    // Products of (bf16-rounded) inputs are exact in f32 and f64; the f32 sums round at most
    // once per term, plus the epilogue's ≤ 3 additions: (n + 4)·2⁻²⁴ relative to the scale.
    // f32 operands (split3 planes): the dropped plane products add 2·2⁻²⁴ and the small
    // products' sums a few more 2⁻²⁴ of the scale (see precond's gemm3 test): (n + 8)·2⁻²⁴.
    let eps = f32::EPSILON as f64 / 2.0;
    let slack = if tc { 4.0 } else { 8.0 };
    let depth = if side == Side::Bf16x3 { 6 * n } else { n };
    let tol = |o: usize| (depth as f64 + slack) * eps * sc[o] + 1e-30;
    if f.out {
        let got = out.to_vec().unwrap();
        for o in 0..n * n {
            let g = got[o] as f64;
            assert!(
                (g - v[o]).abs() <= tol(o),
                "out[{o}] = {g} vs {} (n = {n})",
                v[o]
            );
        }
    }
    if f.out_bf {
        // The f32 value rounded once more to bf16: half an ulp, 2⁻⁹ relative.
        let got = out_bf.to_vec().unwrap();
        for o in 0..n * n {
            let g = got[o].to_f32() as f64;
            assert!(
                (g - v[o]).abs() <= tol(o) + v[o].abs() / 256.0,
                "out_bf[{o}] = {g} vs {} (n = {n})",
                v[o]
            );
        }
    }
    if f.partial {
        let got = partial.to_vec().unwrap();
        let (tile, t) = (kn::TILE, n.div_ceil(kn::TILE));
        for bi in 0..t {
            for bj in 0..t {
                let (mut s, mut e) = (0.0f64, 0.0f64);
                for i in bi * tile..((bi + 1) * tile).min(n) {
                    for j in bj * tile..((bj + 1) * tile).min(n) {
                        s += v[i * n + j] * v[i * n + j];
                        e += 2.0 * v[i * n + j].abs() * tol(i * n + j);
                    }
                }
                let g = got[bi * t + bj] as f64;
                // Each v² carries 2·|v|·δv, the f32 sum of ≤ 4096 squares 4096·2⁻²⁴.
                assert!(
                    (g - s).abs() <= e + 4096.0 * eps * s + 1e-30,
                    "partial[{bi},{bj}] = {g} vs {s}"
                );
            }
        }
    }
}

/// `bf16x3_product_is_the_engine_at_whole_slices`: the fused f32 product and
/// `gemm_plan::newton_bf16x3` with `f`'s epilogue on the emulator, every output bit for bit.
fn check_bf16x3_is_the_engine(n: usize, f: &Flags, seed: u64) {
    let dev = Device::Emulated;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let up = |x: &[f32]| dev.upload(n, n, x).unwrap();
    let (a, b) = (up(&random(&mut rng, n * n)), up(&random(&mut rng, n * n)));
    let (add1, add2) = (up(&random(&mut rng, n * n)), up(&random(&mut rng, n * n)));
    let np = kn::partials(n);
    let mut scratch = kn::Scratch::new(&dev, n).unwrap();
    let mut outs = Vec::new();
    for side in [Side::Engine, Side::Bf16x3] {
        let mut out = up(&vec![f32::NAN; n * n]);
        let mut out_bf: Matrix<bf16> = dev.upload(n, n, &vec![bf16::NAN; n * n]).unwrap();
        let mut partial = dev.upload(np, 1, &vec![f32::NAN; np]).unwrap();
        let epi = f.epilogue(
            (&add1, &add2),
            (&mut out, &mut out_bf, &mut partial),
            f.mirror,
        );
        let ops = kn::Operands::F32((&a).into(), (&b).into());
        match side {
            Side::Bf16x3 => gemm_plan::newton_bf16x3(&dev, (&a, &b), epi, &mut scratch),
            _ => kn::engine_product(&dev, ops, epi, &mut scratch),
        }
        .unwrap();
        let bits = out.to_vec().unwrap().into_iter().map(f32::to_bits);
        let bf_bits = out_bf.to_vec().unwrap().into_iter().map(bf16::to_bits);
        outs.push((
            (bits.collect::<Vec<_>>(), bf_bits.collect::<Vec<_>>()),
            partial.to_vec().unwrap(),
        ));
    }
    assert!(
        outs[0].0 == outs[1].0,
        "bf16x3 differs from the engine: n = {n}, {f:?}"
    );
    // The residual partials sum the same squares in another order (as in
    // `check_epilogue_kernel`): within 150·2⁻²⁴ of the sum.
    for (t, (&p, &q)) in outs[0].1.iter().zip(&outs[1].1).enumerate() {
        let (p, q) = (f64::from(p), f64::from(q));
        let ok = (p - q).abs() <= 150.0 * common::U32 * p.abs().max(q.abs());
        assert!(
            ok || !f.partial,
            "partial[{t}]: engine {p} vs bf16x3 {q} (n = {n})"
        );
    }
}

/// `newton_epilogue` (`kn::epilogue`, the GEMM plan's vendor side after cuBLAS) against the
/// fused epilogue it stands in for: the engine's bare product `C` (`α = 1`, nothing added) goes
/// through the kernel with `f`'s epilogue, and must give the fused product's outputs with that
/// epilogue. Both read the same accumulators and apply the same `NewtonEpi` code, so on the
/// emulator (no FMA contraction) `out` and `out_bf` are equal bit for bit; on a GPU the
/// compiler may contract `α·C + add` in one kernel and not the other: one rounding, within
/// `2·2⁻²⁴·(|α·C| + |d| + |add1| + |add2|)` (and half a bf16 ulp more for `out_bf`). The
/// residual partials sum the same squares in another order: each side is a recursive f32 sum
/// of ≤ 64 terms per thread and an 8-level tree, so they differ by at most 2·72·2⁻²⁴ of the
/// sum (150 used). With `f.mirror` (f32 operands: the bf16 kernel has none) the operands are
/// not symmetric, so the lower-triangle-only reading is what the comparison checks.
fn check_epilogue_kernel(dev: &Device, n: usize, f: &Flags, tc: bool, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (a, b) = (random(&mut rng, n * n), random(&mut rng, n * n));
    let (add1, add2) = (random(&mut rng, n * n), random(&mut rng, n * n));
    let up = |x: &[f32]| dev.upload(n, n, x).unwrap();
    let to_bf = |x: &[f32]| -> Matrix<bf16> {
        let h: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        dev.upload(n, n, &h).unwrap()
    };
    let (a_bf, b_bf, a_f, b_f) = (to_bf(&a), to_bf(&b), up(&a), up(&b));
    let (d_add1, d_add2) = (up(&add1), up(&add2));
    let mut scratch = kn::Scratch::new(dev, n).unwrap();
    let mut unused = Unused::new(dev).unwrap();
    let ops = if tc {
        kn::Operands::Bf16(&a_bf, &b_bf)
    } else {
        kn::Operands::F32((&a_f).into(), (&b_f).into())
    };
    let mut raw = up(&vec![f32::NAN; n * n]);
    let bare = Epilogue {
        out: Some(&mut raw),
        ..Epilogue::new()
    };
    kn::engine_product(dev, ops, bare, &mut scratch).unwrap();
    let mirror = f.mirror && !tc;
    let np = kn::partials(n);
    // [fused, kernel] outputs, NaN-poisoned.
    let mut outs: Vec<(Matrix, Matrix<bf16>, Matrix)> = (0..2)
        .map(|_| {
            (
                up(&vec![f32::NAN; n * n]),
                to_bf(&vec![f32::NAN; n * n]),
                dev.upload(np, 1, &vec![f32::NAN; np]).unwrap(),
            )
        })
        .collect();
    for (side, (out, out_bf, partial)) in outs.iter_mut().enumerate() {
        let epi = f.epilogue((&d_add1, &d_add2), (out, out_bf, partial), mirror);
        if side == 0 {
            kn::engine_product(dev, ops, epi, &mut scratch).unwrap();
        } else {
            kn::epilogue(dev, &raw, epi, &mut unused).unwrap();
        }
    }
    let exact = matches!(dev, Device::Emulated);
    let c = raw.to_vec().unwrap();
    let at = |r: usize, col: usize| {
        if mirror && col > r {
            c[col * n + r]
        } else {
            c[r * n + col]
        }
    };
    let scale = |o: usize| {
        let (r, col) = (o / n, o % n);
        let mut s = (f.alpha * at(r, col)).abs() + if r == col { f.diag.abs() } else { 0.0 };
        for (on, add) in [(f.add1, &add1), (f.add2, &add2)] {
            if on {
                s += add[o].abs();
            }
        }
        f64::from(s)
    };
    let eps = common::U32;
    let (fused, kernel) = (&outs[0], &outs[1]);
    if f.out {
        let (x, y) = (fused.0.to_vec().unwrap(), kernel.0.to_vec().unwrap());
        for o in 0..n * n {
            let d = (f64::from(x[o]) - f64::from(y[o])).abs();
            let ok = if exact {
                x[o].to_bits() == y[o].to_bits()
            } else {
                d <= 2.0 * eps * scale(o)
            };
            assert!(
                ok,
                "out[{o}]: fused {} vs kernel {} (n = {n}, {f:?}, tc {tc})",
                x[o], y[o]
            );
        }
    }
    if f.out_bf {
        let (x, y) = (fused.1.to_vec().unwrap(), kernel.1.to_vec().unwrap());
        for o in 0..n * n {
            let (p, q) = (f64::from(x[o].to_f32()), f64::from(y[o].to_f32()));
            let ok = if exact {
                x[o].to_bits() == y[o].to_bits()
            } else {
                (p - q).abs() <= 2.0 * eps * scale(o) + p.abs().max(q.abs()) / 256.0
            };
            assert!(
                ok,
                "out_bf[{o}]: fused {p} vs kernel {q} (n = {n}, {f:?}, tc {tc})"
            );
        }
    }
    if f.partial {
        let (x, y) = (fused.2.to_vec().unwrap(), kernel.2.to_vec().unwrap());
        for (t, (&p, &q)) in x.iter().zip(&y).enumerate() {
            let (p, q) = (f64::from(p), f64::from(q));
            assert!(
                (p - q).abs() <= 150.0 * eps * p.abs().max(q.abs()),
                "partial[{t}]: fused {p} vs kernel {q} (n = {n}, tc {tc})"
            );
        }
    }
}

/// The CUDA arm at the GPU's sizes: both fused products (bf16 `newton_gemm_tc`, f32
/// `newton_gemm3_tc`, mirrored and full) and, where cuBLAS loads, the GEMM plan's vendor
/// candidate of each (cuBLAS, then `newton_epilogue`) at n up to 4096, ragged, every output on
/// and NaN-poisoned, against the f64 reference with [`check_product`]'s bounds (which grow
/// with n as the f32 sums do).
#[test]
fn cuda_large_products() {
    let Some(dev) = common::cuda() else {
        return;
    };
    let mut rng = common::seeded_rng();
    for tc in [true, false] {
        let f = Flags {
            alpha: if rng.random() { -1.0 } else { 1.0 },
            diag: rng.random_range(-2.0..2.0),
            add1: true,
            add2: rng.random(),
            out: true,
            out_bf: true,
            partial: false,
            mirror: true,
        };
        // And the GEMM plan's vendor candidate where cuBLAS loads.
        let sides: &[Side] = if gemm_vendor::available() {
            &[Side::Engine, Side::Vendor]
        } else {
            &[Side::Engine]
        };
        for &vendor in sides {
            let full = Flags {
                partial: true,
                mirror: false,
                ..f
            };
            for f in [&f, &full] {
                let n = common::large_dim(&mut rng);
                check_product(&dev, n, f, (tc, vendor), rng.random());
            }
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(48))]

    /// newton_gemm_tc: every epilogue combination, ragged n, against f64 on bf16 inputs.
    #[test]
    fn tensor_core_product_and_epilogue(n in size(), f in flags(), seed: u64) {
        for dev in devices() {
            check_product(&dev, n, &f, (true, Side::Engine), seed);
        }
    }

    /// The f32 product (precond GEMM) + newton_epilogue_f32, against f64.
    #[test]
    fn f32_product_and_epilogue(n in size(), f in flags(), seed: u64) {
        for dev in devices() {
            check_product(&dev, n, &f, (false, Side::Engine), seed);
        }
    }

    /// The GEMM plan's bf16x3 candidate for f32 Newton products (`gemm_plan::newton_bf16x3`:
    /// the concatenated product, then `newton_epilogue`) against f64, every epilogue.
    #[test]
    fn bf16x3_product_and_epilogue(n in size(), f in flags(), seed: u64) {
        for dev in devices() {
            check_product(&dev, n, &f, (false, Side::Bf16x3), seed);
        }
    }

    /// On the emulator, at `n` a multiple of `gemm_tc`'s 32-deep K slice, the bf16x3 Newton
    /// product runs the split3 engine's slices in its order and `newton_epilogue` is the fused
    /// epilogue's algebra: every output equals `product_f32`'s bit for bit.
    #[test]
    fn bf16x3_product_is_the_engine_at_whole_slices(k in 1usize..=4, f in flags(), seed: u64) {
        check_bf16x3_is_the_engine(32 * k, &f, seed);
    }

    /// `newton_epilogue` over the engine's bare product equals the fused epilogue, for both
    /// operand kinds ([`check_epilogue_kernel`]).
    #[test]
    fn epilogue_kernel_equals_the_fused_epilogue(n in size(), f in flags(), tc: bool, seed: u64) {
        for dev in devices() {
            check_epilogue_kernel(&dev, n, &f, tc, seed);
        }
    }
}

fn order_of(i: u8) -> NewtonOrder {
    match i % 3 {
        0 => NewtonOrder::Quadratic,
        1 => NewtonOrder::Cubic,
        _ => NewtonOrder::Quartic,
    }
}

fn init_of(i: u8) -> InitialGuess {
    match i % 3 {
        0 => InitialGuess::Paper,
        1 => InitialGuess::ScaledIdentity,
        _ => InitialGuess::Warm,
    }
}

fn run_device(
    dev: &Device,
    a: &[f32],
    n: usize,
    warm: Option<&[f32]>,
    opts: &NewtonOptions,
) -> grng::Result<(Vec<f32>, NewtonInfo)> {
    let da = dev.upload(n, n, a).unwrap();
    let dw = warm.map(|w| dev.upload(n, n, w).unwrap());
    let (x, info) = dev.newton_inverse(&da, dw.as_ref(), opts)?;
    Ok((x.to_vec().unwrap(), info))
}

fn run_cpu(
    a: &[f32],
    n: usize,
    warm: Option<&[f32]>,
    opts: &NewtonOptions,
) -> grng::Result<(Mat, NewtonInfo)> {
    let w = warm.map(|w| MatRef::new(w, n, n).unwrap());
    cpu_newton(MatRef::new(a, n, n).unwrap(), w, opts)
}

/// `‖x − y‖_F / √n`.
fn rms_diff(x: &[f32], y: &[f32], n: usize) -> f64 {
    (x.iter()
        .zip(y)
        .map(|(&p, &q)| (p as f64 - q as f64).powi(2))
        .sum::<f64>()
        / n as f64)
        .sqrt()
}

/// The emulated inversion against the CPU backend on one SPD matrix.
fn compare_newton(n: usize, kappa: f64, opts: &NewtonOptions, warm_kind: u8, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (a, _) = spd(&mut rng, n, kappa);
    // Warm starts: a perturbed inverse (accepted) or a scaled identity far too large
    // (rejected: the fallback runs).
    let warm = (opts.init == InitialGuess::Warm).then(|| {
        let (x, _) = run_cpu(&a, n, None, &NewtonOptions::default()).unwrap();
        if warm_kind == 0 {
            x.as_slice()
                .iter()
                .enumerate()
                .map(|(k, &v)| {
                    let (i, j) = (k / n, k % n);
                    let sym = ((i * 7 + j * 7 + i * j) % 13) as f32 / 13.0 - 0.5;
                    v * (1.0 + 0.05 * sym)
                })
                .collect::<Vec<f32>>()
        } else {
            (0..n * n)
                .map(|k| {
                    if k / n == k % n {
                        10.0 * kappa as f32
                    } else {
                        0.0
                    }
                })
                .collect()
        }
    });
    let cpu = run_cpu(&a, n, warm.as_deref(), opts);
    for dev in devices() {
        let got = run_device(&dev, &a, n, warm.as_deref(), opts);
        match (&cpu, got) {
            (Ok((x, i)), Ok((xg, ig))) => {
                check_agreement(&a, n, kappa, opts, x.as_slice(), i, &xg, &ig);
            }
            (Err(e), Err(g)) => {
                assert_eq!(
                    std::mem::discriminant(e),
                    std::mem::discriminant(&g),
                    "cpu {e} vs {} {g}",
                    dev.name()
                );
            }
            (c, g) => panic!(
                "n = {n}, κ = {kappa:.1}, {opts:?}: cpu {:?} vs {} {:?}",
                c.as_ref().map(|r| &r.1),
                dev.name(),
                g.map(|r| r.1)
            ),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn check_agreement(
    a: &[f32],
    n: usize,
    kappa: f64,
    opts: &NewtonOptions,
    x_cpu: &[f32],
    i_cpu: &NewtonInfo,
    x: &[f32],
    info: &NewtonInfo,
) {
    let ctx = format!("n = {n}, κ = {kappa:.1}, {opts:?}\n cpu {i_cpu:?}\n dev {info:?}");
    assert_eq!(info.init_used, i_cpu.init_used, "{ctx}");
    match opts.precision {
        // The products round differently, so a residual landing near tol may take one step
        // more or less.
        Precision::F32 => {
            assert!(
                info.iterations.abs_diff(i_cpu.iterations) <= 1,
                "iterations: {ctx}"
            );
            // Same X₀: the start's scalar comes from A's norms (for the scaled identity
            // `newton_abs_norms`' ‖A‖∞, ‖A‖_F and trace), summed from f32 partials on the
            // device, so c agrees to ~1e-6 relative (moving r₀ by ≤ 2e-6, as c·λ_max ≤ 2); the
            // f32-accurate products add ≤ (n + 4)·2⁻²⁴·‖A‖‖X₀‖ ≲ 3e-5 at n ≤ 200. 1e-4.
            let (r0, r0_cpu) = (info.residual_history[0], i_cpu.residual_history[0]);
            assert!((r0 - r0_cpu).abs() <= 1e-4, "X₀ residual: {ctx}");
        }
        // bf16 returns the best iterate of its noise plateau, and which of the plateau's
        // iterates is lowest is rounding noise (seen: CPU 13, device 11, residuals within
        // 10%). What must agree is the step that reaches the plateau (first residual within
        // 2x of the history's minimum), and the reported step must be the history's argmin.
        Precision::Bf16 => {
            let entry = |h: &[f32]| {
                let min = h.iter().copied().fold(f32::INFINITY, f32::min);
                h.iter().position(|&r| r <= 2.0 * min).unwrap_or(0)
            };
            let (h, hc) = (&info.residual_history, &i_cpu.residual_history);
            assert!(entry(h).abs_diff(entry(hc)) <= 1, "plateau entry: {ctx}");
            let argmin = (0..h.len())
                .filter(|&k| h[k].is_finite())
                .min_by(|&i, &j| h[i].total_cmp(&h[j]))
                .unwrap_or(0);
            assert_eq!(info.iterations, argmin, "{ctx}");
        }
    }
    assert!(x.iter().all(|v| v.is_finite()), "{ctx}");
    // The reported residual is an f32 product's: within its own noise of the f64 one
    // (f32: (n + 4)·2⁻²⁴·‖A‖‖X‖ per element, ‖X‖ ≤ κ — so 2e-7·κ·√n is a generous bound).
    let r64 = common::residual64(a, x, n);
    let noise = 2e-7 * kappa * (n as f64).sqrt();
    assert!(
        (r64 - info.residual as f64).abs() <= noise + 0.05 * r64,
        "reported {} vs f64 {r64:e}: {ctx}",
        info.residual
    );
    let r_cpu = common::residual64(a, x_cpu, n);
    match opts.precision {
        // The floor rule returns the f32 floor (as on the CPU: cpu_newton's `f32_floor`, the
        // products' rounding differing by a few 1e-8), the tolerance rule anything below tol.
        Precision::F32 if opts.stop == NewtonStop::Floor => {
            let floor = 4e-8 * kappa + 1e-6;
            assert!(r64 <= floor, "floor {floor:e}: {ctx}");
        }
        Precision::F32 => {
            assert!(r64 <= opts.tol as f64 + noise, "{ctx}");
        }
        Precision::Bf16 => {
            // Both at the bf16 floor, which the rounding noise moves: the documented bound
            // 4e-3·κ^0.55 (cpu::newton, n ≥ 48; small n reach further, e.g. 0.17 at
            // κ = 836, n = 16), or within 4x of the CPU's own result.
            let floor = 4e-3 * kappa.powf(0.55);
            assert!(
                r64 <= floor.max(4.0 * r_cpu),
                "r {r64:e} cpu {r_cpu:e}: {ctx}"
            );
        }
    }
    // X − A⁻¹ = A⁻¹(AX − I), ‖A⁻¹‖₂ = κ: two results each within κ·‖E‖_F of A⁻¹ are within
    // the sum of both of each other (1% for the f32 rounding of A's spectrum).
    let diff = rms_diff(x, x_cpu, n);
    assert!(
        diff <= 1.01 * kappa * (r64 + r_cpu) + 1e-12,
        "‖X − X_cpu‖ {diff:e}: {ctx}"
    );
}

proptest! {
    #![proptest_config(common::proptest_config(40))]

    /// All orders, starts, precisions and stops on SPD matrices with κ up to 1e3.
    #[test]
    fn newton_matches_cpu(
        n in prop_oneof![1 => Just(1usize), 1 => Just(65usize), 6 => 2usize..=100],
        log_kappa in 0.0f64..=3.0,
        order in 0u8..3,
        init in 0u8..3,
        bf in prop::bool::ANY,
        polish in prop::bool::ANY,
        low in prop::bool::ANY,
        warm_kind in 0u8..2,
        tol_stop in prop::bool::ANY,
        seed: u64,
    ) {
        let kappa = 10f64.powf(log_kappa);
        let opts = NewtonOptions {
            stop: if tol_stop { NewtonStop::Tol } else { NewtonStop::Floor },
            order: order_of(order),
            init: init_of(init),
            precision: if bf { Precision::Bf16 } else { Precision::F32 },
            polish,
            lambda_low: if low { (1.0 / kappa) as f32 } else { 0.0 },
            ..NewtonOptions::default()
        };
        compare_newton(n, kappa, &opts, warm_kind, seed);
    }

    /// Indefinite symmetric input diverges: an error on the device as on the CPU.
    #[test]
    fn indefinite_input_is_an_error(n in 4usize..=48, negatives in 1usize..=3, order in 0u8..3, bf in prop::bool::ANY, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut d: Vec<f64> = (0..n).map(|i| 10f64.powf(-2.0 * i as f64 / (n - 1) as f64)).collect();
        for v in d.iter_mut().skip(1).take(negatives) {
            *v = -0.5;
        }
        let a = with_spectrum(&mut rng, &d);
        let opts = NewtonOptions {
            order: order_of(order),
            precision: if bf { Precision::Bf16 } else { Precision::F32 },
            ..NewtonOptions::default()
        };
        prop_assert!(run_cpu(&a, n, None, &opts).is_err());
        for dev in devices() {
            let err = run_device(&dev, &a, n, None, &opts).unwrap_err();
            prop_assert!(matches!(err, Error::Diverged { .. }), "{err}");
        }
    }

    /// Power iteration: same iteration count (±1) and value as the CPU backend.
    #[test]
    fn spectral_norm_matches_cpu(n in size(), log_kappa in 0.0f64..=3.0, tol_exp in 2i32..=4, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let scale = rng.random_range(0.1f32..10.0);
        // λ₁ = 1 over the rest log-spaced in [0.6/κ, 0.6]: an eigen-gap λ₂/λ₁ ≤ 0.6 bounds how
        // far rounding noise can move the step where the iteration stops (below).
        let kappa = 10f64.powf(log_kappa);
        let d: Vec<f64> = (0..n)
            .map(|i| if i == 0 { 1.0 } else { 0.6 * kappa.powf(-((i - 1) as f64) / n.saturating_sub(2).max(1) as f64) })
            .collect();
        let a: Vec<f32> = with_spectrum(&mut rng, &d).iter().map(|v| v * scale).collect();
        let opts = PowerOptions { tol: 10f32.powi(-tol_exp), max_iter: 200, ..PowerOptions::default() };
        let cpu = grng::cpu::spectral_norm(MatRef::new(&a, n, n).unwrap(), &opts).unwrap();
        for dev in devices() {
            let got = dev.spectral_norm(&dev.upload(n, n, &a).unwrap(), &opts).unwrap();
            // The device keeps v in f32 (CPU: f64): the Rayleigh quotients differ by ~1e-7
            // relative. The relative change shrinks by (λ₂/λ₁)² ≤ 0.36 per step, so that noise
            // moves the step where it crosses tol by ≈ (1e-7/tol)/ln(1/0.36) ≤ 1e-3 of a step
            // for tol ≥ 1e-4, so the two stop at most one step apart. Without the gap (up to
            // 100 eigenvalues clustered in [1/κ, 1]) the shift could be several steps.
            prop_assert!(got.iterations.abs_diff(cpu.iterations) <= 1, "{got:?} vs {cpu:?}");
            prop_assert_eq!(got.converged, cpu.converged);
            // Both within their own relative tolerance of the converged value.
            let rel = (got.value - cpu.value).abs() / cpu.value;
            prop_assert!(rel <= 4.0 * opts.tol + 1e-6, "{got:?} vs {cpu:?}");
        }
    }
}

/// Too few iterations and a tolerance below the f32 floor are `Diverged` errors with the CPU's
/// reason on every kernel device. With `max_iter = 2` both stop at the budget: the same count.
/// Below the floor, where each side stalls is noise-driven (the device's f32 products are
/// split3 tensor-core sums with 128-tile mirrors in the early phase, the CPU's SIMD dot
/// products with block mirrors: measured over 200 seeds the stall iterations differed by 0–5),
/// so instead of the count: each side must have reached the f32 floor before stalling — its
/// best residual `≤ n·u·κ` (the attainable residual of f32 Newton is about `u·κ` per entry,
/// `‖·‖_F/√n` of `n²` such entries is `≤ √n·u·κ`; `n` for margin: 2.4e-4 here, where the
/// seeds inspected stalled at 4e-7–7e-7) after at least `log₃κ + 1` steps (fewer cannot get there from the scaled identity).
#[test]
fn too_few_iterations_and_tight_tolerance_are_errors() {
    let mut rng = common::seeded_rng();
    let (n, kappa) = (40, 100.0);
    let (a, _) = spd(&mut rng, n, kappa);
    let budget = NewtonOptions {
        max_iter: 2,
        ..NewtonOptions::default()
    };
    // Below the f32 floor (≈ 5e-9·κ): stalls, an error in f32 mode.
    let tight = NewtonOptions {
        tol: 1e-9,
        ..NewtonOptions::default()
    };
    let floor = n as f64 * common::U32 * kappa;
    let min_steps = (kappa.ln() / 3f64.ln()) as usize + 1;
    for (opts, exact_count) in [(budget, true), (tight, false)] {
        let e_cpu = run_cpu(&a, n, None, &opts).unwrap_err();
        for dev in devices() {
            let e = run_device(&dev, &a, n, None, &opts).unwrap_err();
            let (
                Error::Diverged {
                    reason: rc,
                    iterations: kc,
                    ..
                },
                Error::Diverged {
                    reason,
                    iterations,
                    residual,
                    ..
                },
            ) = (&e_cpu, &e)
            else {
                panic!("cpu {e_cpu} vs {e}");
            };
            assert_eq!(rc, reason, "cpu {e_cpu} vs {e}");
            if exact_count {
                assert_eq!(kc, iterations, "cpu {e_cpu} vs {e}");
            } else {
                for (k, r) in [(*kc, residual_of(&e_cpu)), (*iterations, *residual)] {
                    assert!(r <= floor && k >= min_steps, "cpu {e_cpu} vs {e}");
                }
            }
        }
    }
}

fn residual_of(e: &Error) -> f64 {
    match e {
        Error::Diverged { residual, .. } => *residual,
        _ => f64::NAN,
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let opts = NewtonOptions::default();
    for dev in devices() {
        let up = |x: &[f32], r, c| dev.upload(r, c, x).unwrap();
        let a = up(&[2.0, 0.5, 0.5, 1.0], 2, 2);
        // Empty, non-square, bad options, wrong warm shape.
        let empty = up(&[], 0, 0);
        assert!(matches!(
            dev.newton_inverse(&empty, None, &opts),
            Err(Error::Shape { .. })
        ));
        let rect = up(&[1.0; 6], 2, 3);
        assert!(matches!(
            dev.newton_inverse(&rect, None, &opts),
            Err(Error::Shape { .. })
        ));
        let bad = NewtonOptions {
            tol: f32::NAN,
            ..opts
        };
        assert!(matches!(
            dev.newton_inverse(&a, None, &bad),
            Err(Error::Value { .. })
        ));
        let warm_opts = NewtonOptions {
            init: InitialGuess::Warm,
            ..opts
        };
        let w3 = up(&[1.0; 9], 3, 3);
        assert!(matches!(
            dev.newton_inverse(&a, Some(&w3), &warm_opts),
            Err(Error::Shape { .. })
        ));
        // Non-finite: the first offending index and value, as on the CPU.
        let mut v = vec![1.0f32; 25];
        v[13] = f32::INFINITY;
        v[7] = f32::NAN;
        let cpu = run_cpu(&v, 5, None, &opts).unwrap_err();
        let got = dev.newton_inverse(&up(&v, 5, 5), None, &opts).unwrap_err();
        match (cpu, got) {
            (
                Error::NonFinite {
                    index: ic, arg: ac, ..
                },
                Error::NonFinite {
                    index, arg, value, ..
                },
            ) => {
                assert_eq!((ic, ac), (index, arg));
                assert!(value.is_nan());
            }
            (c, g) => panic!("cpu {c} vs {g}"),
        }
        let mut w = vec![0.0f32; 4];
        w[3] = f32::NEG_INFINITY;
        match dev.newton_inverse(&a, Some(&up(&w, 2, 2)), &warm_opts) {
            Err(Error::NonFinite {
                arg: "warm",
                index: 3,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        // Asymmetric, zero, and asymmetric warm (accepted).
        let asym = up(&[2.0, 0.5, 0.4, 1.0], 2, 2);
        assert!(matches!(
            dev.newton_inverse(&asym, None, &opts),
            Err(Error::Value { arg: "a", .. })
        ));
        for init in [InitialGuess::Paper, InitialGuess::ScaledIdentity] {
            let zero = up(&[0.0; 9], 3, 3);
            let o = NewtonOptions { init, ..opts };
            assert!(matches!(
                dev.newton_inverse(&zero, None, &o),
                Err(Error::Value { arg: "a", .. })
            ));
        }
        // An asymmetric warm start is only a hint: its symmetric part is used (and accepted or
        // replaced by the scaled identity through its residual), never an error.
        let (_, info) = dev.newton_inverse(&a, Some(&asym), &warm_opts).unwrap();
        assert!(info.residual <= warm_opts.tol, "{info:?}");
        // Negative definite: no positive eigenvalue.
        let neg = up(&[-1.0, 0.0, 0.0, -2.0], 2, 2);
        assert!(dev.newton_inverse(&neg, None, &opts).is_err());

        // Spectral norm: shapes, options, NaN, n = 0.
        let p = PowerOptions::default();
        assert!(matches!(
            dev.spectral_norm(&rect, &p),
            Err(Error::Shape { .. })
        ));
        assert!(matches!(
            dev.spectral_norm(&a, &PowerOptions { max_iter: 0, ..p }),
            Err(Error::Value { .. })
        ));
        assert!(matches!(
            dev.spectral_norm(&up(&v, 5, 5), &p),
            Err(Error::NonFinite { index: 7, .. })
        ));
        let z = dev.spectral_norm(&empty, &p).unwrap();
        assert_eq!((z.value, z.iterations, z.converged), (0.0, 0, true));
        let zero = dev.spectral_norm(&up(&[0.0; 4], 2, 2), &p).unwrap();
        assert_eq!(zero.value, 0.0);
    }
}

/// The inversion's synchronizations on the emulator (`grng::hooks::read_backs`, this
/// thread's): the setup reads `A`'s stats together with the warm start's, or without one with
/// `A`'s norms (one read), the warm start's first residual comes back with `E`'s norms (one
/// read), and each later residual is one read: `1 + residual_history.len()` in all, with or
/// without a warm start (f32, the optimizers' default). Before, `A`'s norms (a cold start),
/// the warm start's stats and `E`'s norms were reads of their own.
#[test]
fn inversion_reads_back_once_per_residual() {
    let dev = Device::Emulated;
    let mut rng = common::seeded_rng();
    let n = 40;
    let (a, _) = spd(&mut rng, n, 50.0);
    let da = dev.upload(n, n, &a).unwrap();
    let opts = NewtonOptions {
        init: InitialGuess::Warm,
        ..NewtonOptions::default()
    };
    let (x, _) = dev.newton_inverse(&da, None, &opts).unwrap();
    for warm in [None, Some(&x)] {
        let before = grng::hooks::read_backs();
        let (_, info) = dev.newton_inverse(&da, warm, &opts).unwrap();
        let reads = grng::hooks::read_backs() - before;
        let expected = warm.map_or(InitialGuess::ScaledIdentity, |_| InitialGuess::Warm);
        assert_eq!(info.init_used, expected, "{info:?}");
        assert_eq!(
            reads,
            1 + info.residual_history.len() as u64,
            "warm {}: {info:?}",
            warm.is_some()
        );
    }
}

/// [`Epilogue::out_planes`] of an f32 product (`kn::product_f32`) and of the vendor side's
/// epilogue kernel (`kn::epilogue`) over the same random operands, additions, `α`, diagonal
/// and mirror: the planes are those of the stored `out`, bit for bit (hi, mid, lo `n²`
/// apart, modelled on the host); and a product reading them (`F32Operand::planes`) is the
/// product that splits that operand itself, bit for bit (on a GPU too: the same planes, the
/// same kernel).
fn check_out_planes(dev: &Device, n: usize, (alpha, diag, mirror): (f32, f32, bool), seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let up = |x: &[f32]| dev.upload(n, n, x).unwrap();
    let (a, b, add) = (
        up(&random(&mut rng, n * n)),
        up(&random(&mut rng, n * n)),
        up(&random(&mut rng, n * n)),
    );
    let mut scratch = kn::Scratch::new(dev, n).unwrap();
    let mut unused = Unused::new(dev).unwrap();
    let mut raw = up(&vec![f32::NAN; n * n]);
    let bare = Epilogue {
        out: Some(&mut raw),
        ..Epilogue::new()
    };
    kn::engine_product(
        dev,
        kn::Operands::F32((&a).into(), (&b).into()),
        bare,
        &mut scratch,
    )
    .unwrap();
    let mut kept = None;
    for fused in [true, false] {
        let mut out = up(&vec![f32::NAN; n * n]);
        let mut planes: Matrix<bf16> = dev.upload(3 * n, n, &vec![bf16::NAN; 3 * n * n]).unwrap();
        let epi = Epilogue {
            alpha,
            diag,
            add1: Some(&add),
            out: Some(&mut out),
            out_planes: Some(&mut planes),
            mirror,
            ..Epilogue::new()
        };
        if fused {
            let mut p = kn::Planes::new(n);
            kn::product_f32(dev, (&a).into(), (&b).into(), &mut p, epi, &mut unused).unwrap();
        } else {
            kn::epilogue(dev, &raw, epi, &mut unused).unwrap();
        }
        let (o, p) = (out.to_vec().unwrap(), planes.to_vec().unwrap());
        for (i, &v) in o.iter().enumerate() {
            let got = [p[i], p[n * n + i], p[2 * n * n + i]].map(bf16::to_bits);
            assert_eq!(
                got,
                common::host_split3(v),
                "n = {n}, fused {fused}, element {i} = {v}"
            );
        }
        kept.get_or_insert((out, planes));
    }
    let (out, planes) = kept.unwrap();
    let products: Vec<Vec<u32>> = [Some(&planes), None]
        .into_iter()
        .map(|given| {
            let mut c = up(&vec![f32::NAN; n * n]);
            let epi = Epilogue {
                out: Some(&mut c),
                ..Epilogue::new()
            };
            let read = kn::F32Operand {
                m: &out,
                planes: given,
            };
            let mut p = kn::Planes::new(n);
            kn::product_f32(dev, read, (&b).into(), &mut p, epi, &mut unused).unwrap();
            c.to_vec().unwrap().into_iter().map(f32::to_bits).collect()
        })
        .collect();
    assert!(
        products[0] == products[1],
        "n = {n}: the given planes differ"
    );
}

proptest! {
    #![proptest_config(common::proptest_config(12))]

    /// [`check_out_planes`] at ragged `n` (partial tiles, odd sizes), on every device.
    #[test]
    fn epilogue_planes_are_the_split_of_the_output(
        n in 1usize..=140,
        neg in any::<bool>(),
        diag in -2.0f32..2.0,
        mirror in any::<bool>(),
        seed in any::<u64>(),
    ) {
        for dev in devices() {
            check_out_planes(&dev, n, (if neg { -1.0 } else { 1.0 }, diag, mirror), seed);
        }
    }
}

/// Planes are refused where they cannot be written or read: from the bf16 kernel (its
/// operands are bf16 copies), beside a bf16 copy (one pointer carries either), of the wrong
/// shape as an output or as an operand; each a typed error before any launch.
#[test]
fn planes_out_of_place_are_typed_errors() {
    for dev in devices() {
        let n = 9;
        let f = dev.zeros::<f32>(n, n).unwrap();
        let h = dev.zeros::<bf16>(n, n).unwrap();
        let mut unused = Unused::new(&dev).unwrap();
        let mut planes = dev.zeros::<bf16>(3 * n, n).unwrap();
        let mut copy = dev.zeros::<bf16>(n, n).unwrap();
        let mut short = dev.zeros::<bf16>(n, n).unwrap();
        fn with(p: &mut Matrix<bf16>) -> Epilogue<'_> {
            Epilogue {
                out_planes: Some(p),
                ..Epilogue::new()
            }
        }
        let e = kn::product_tc(&dev, &h, &h, with(&mut planes), &mut unused).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Value {
                    arg: "out_planes",
                    ..
                }
            ),
            "{e}"
        );
        let mut p = kn::Planes::new(n);
        let both = Epilogue {
            out_bf: Some(&mut copy),
            ..with(&mut planes)
        };
        let e =
            kn::product_f32(&dev, (&f).into(), (&f).into(), &mut p, both, &mut unused).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Value {
                    arg: "out_planes",
                    ..
                }
            ),
            "{e}"
        );
        let e = kn::product_f32(
            &dev,
            (&f).into(),
            (&f).into(),
            &mut p,
            with(&mut short),
            &mut unused,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Shape {
                    arg: "out_planes",
                    ..
                }
            ),
            "{e}"
        );
        let bad = kn::F32Operand {
            m: &f,
            planes: Some(&short),
        };
        let e = kn::product_f32(&dev, bad, (&f).into(), &mut p, Epilogue::new(), &mut unused)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Shape {
                    arg: "a planes",
                    ..
                }
            ),
            "{e}"
        );
    }
}
