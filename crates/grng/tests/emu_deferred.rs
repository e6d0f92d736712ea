//! One read-back per Kronecker step on the kernel devices (the emulator, and CUDA when a GPU
//! is present): inside `KronOptimizer::{step, step_grads, precondition}` every finiteness
//! check and model reduction writes into one device buffer read once at the end of the step
//! (`cuda::deferred`), where each op used to synchronize on its own status. A failed check
//! runs the step again eagerly, so the error is the eager one and nothing changes.
//!
//! The optimizer's products check their results in the GEMM epilogue, in the same pass
//! (`product_epilogue_flags_the_first_overflow`).
//!
//! Counted with `grng::hooks::read_backs` (this thread's `Matrix::to_vec` calls; the
//! steps here are below `cpu::on_pool`'s threshold, so they run on the test's thread).

use grng::cuda::gemm::{product3_checked, Split3};
use grng::hooks::{read_backs, record_launches, take_launches, uploads, zero_fills};
use grng::mat::Trans;
use grng::optim::kron::{KronConfig, KronGrad, KronOptimizer, KronStepInfo, KronVariant};
use grng::optim::KronStats;
use grng::{Device, Error, MatMul, Matrix};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::sync::{Mutex, PoisonError};

use common::{devices, vals};
use grng_testkit as common;

/// The launch record is process-wide: the tests of this file take turns.
static SERIAL: Mutex<()> = Mutex::new(());

/// Ragged layers: a factor spanning two 64-wide tiles, a narrow one, a wide output.
const SHAPES: [(usize, usize); 3] = [(9, 70), (3, 6), (17, 5)];
const M: usize = 5;

fn upload_all(dev: &Device, rng: &mut ChaCha8Rng, dims: &[(usize, usize)]) -> Vec<Matrix> {
    dims.iter()
        .map(|&(r, c)| dev.upload(r, c, &vals(rng, r * c)).unwrap())
        .collect()
}

fn config(variant: KronVariant) -> KronConfig {
    common::drifting_config(common::variant_config(variant))
}

/// Everything a failed step must leave as it was: ρ, the step count, the counters, every
/// factor, inverse, cached square and power-iteration warm start (bits), and the parameters
/// (bits).
fn snapshot(opt: &KronOptimizer, params: &[Matrix]) -> String {
    let st = opt.state().unwrap();
    let bits =
        |m: &Matrix| -> Vec<u32> { m.to_vec().unwrap().iter().map(|v| v.to_bits()).collect() };
    let mut s = format!(
        "{} {} {:?} {:?}",
        st.rho.to_bits(),
        st.steps,
        st.counters,
        st.predicted
    );
    for l in &st.layers {
        for f in [&l.lambda, &l.gamma] {
            let (sq, top) = (f.square().map(bits), f.top().map(bits));
            s += &format!(
                "{:?}{:?}{:?}{:?}{}",
                bits(&f.factor),
                bits(&f.inverse),
                sq,
                top,
                f.damping.to_bits()
            );
        }
    }
    for p in params {
        s += &format!("{:?}", bits(p));
    }
    s
}

/// A refreshed optimizer whose ρ has moved, so the coming lazy steps retarget their
/// inverses by the first-order update (an axpy per factor, all in one launch, and once a
/// square).
fn refreshed(
    dev: &Device,
    rng: &mut ChaCha8Rng,
    variant: KronVariant,
) -> (KronOptimizer, Vec<Matrix>) {
    let mut opt = KronOptimizer::new(dev, &SHAPES, config(variant)).unwrap();
    let a = upload_all(dev, rng, &SHAPES.map(|(_, i)| (M, i)));
    let e = upload_all(dev, rng, &SHAPES.map(|(o, _)| (M, o)));
    let stats: Vec<KronStats> = a.iter().zip(&e).map(|(a, e)| KronStats { a, e }).collect();
    let grads = upload_all(dev, rng, &SHAPES);
    let mut params = upload_all(dev, rng, &SHAPES);
    let g: Vec<&Matrix> = grads.iter().collect();
    opt.step(&mut params, &g, Some(&stats)).unwrap();
    // A good step: ρ ← φρ, so the next step's damping target differs from the formation's.
    opt.observe_loss(1.0, 0.0).unwrap();
    (opt, params)
}

/// Lazy steps, dense and factored, and a lazy preconditioning each read back exactly once,
/// with the first-order inverse update in use (counted), for every variant; and queue no
/// copy to the device (the batched kernels' tables are kernel parameters) and allocate
/// nothing zero-filled (on a GPU a memset per allocation: every buffer of a step is written
/// whole by the kernel that makes it).
#[test]
fn lazy_kron_steps_read_back_once() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut rng = common::seeded_rng();
    for dev in devices() {
        for variant in [KronVariant::Ring, KronVariant::Reng, KronVariant::Ngd] {
            let (mut opt, mut params) = refreshed(&dev, &mut rng, variant);
            for k in 0..4 {
                let grads = upload_all(&dev, &mut rng, &SHAPES);
                let e = upload_all(&dev, &mut rng, &SHAPES.map(|(o, _)| (M, o)));
                let a = upload_all(&dev, &mut rng, &SHAPES.map(|(_, i)| (M, i)));
                let kg: Vec<KronGrad> = if k % 2 == 0 {
                    grads.iter().map(KronGrad::Dense).collect()
                } else {
                    e.iter()
                        .zip(&a)
                        .map(|(e, a)| KronGrad::Factored { e, a })
                        .collect()
                };
                let (before, ups, fills) = (read_backs(), uploads(), zero_fills());
                let info = opt.step_grads(&mut params, &kg, None).unwrap();
                let reads = read_backs() - before;
                assert_eq!(
                    (reads, uploads() - ups, zero_fills() - fills),
                    (1, 0, 0),
                    "{} {variant:?} lazy step {k}: {info:?}",
                    dev.name()
                );
                assert!(!info.refreshed);
                assert_eq!(info.first_order_updates, 2 * SHAPES.len() as u32);
                assert!(
                    info.predicted_change.unwrap().is_finite()
                        && info.predicted_change.unwrap() < 0.0
                );
                // ρ moves every step (up: r < 0; down: r = 1), so every step retargets, and
                // stays within one factor φ of the formation's (first-order updates).
                let after = if k % 2 == 0 {
                    2.0
                } else {
                    1.0 + info.predicted_change.unwrap()
                };
                opt.observe_loss(1.0, after).unwrap();
            }
            let grads = upload_all(&dev, &mut rng, &SHAPES);
            let g: Vec<&Matrix> = grads.iter().collect();
            let before = read_backs();
            let ps = opt.precondition(&g, None).unwrap();
            assert_eq!(
                read_backs() - before,
                1,
                "{} {variant:?} precondition",
                dev.name()
            );
            assert_eq!(ps.len(), SHAPES.len());
        }
    }
}

/// A NaN/Inf planted at a random place — a gradient, a factored gradient's rows, or the
/// parameters — on a lazy step: the error is the eager one (the CPU backend's, which checks
/// as it goes: same argument, index and value) and the optimizer and parameters are
/// unchanged bit for bit.
#[test]
fn a_bad_value_in_a_deferred_step_is_the_eager_error_and_changes_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut rng = common::seeded_rng();
    for dev in devices() {
        for case in 0..12 {
            let variant = [KronVariant::Ring, KronVariant::Reng, KronVariant::Ngd][case % 3];
            let (mut opt, mut params) = refreshed(&dev, &mut rng, variant);
            let mut grads = SHAPES.map(|(o, i)| vals(&mut rng, o * i)).to_vec();
            let mut e = SHAPES.map(|(o, _)| vals(&mut rng, M * o)).to_vec();
            let mut a = SHAPES.map(|(_, i)| vals(&mut rng, M * i)).to_vec();
            let mut p = params
                .iter()
                .map(|p| p.to_vec().unwrap())
                .collect::<Vec<_>>();
            let factored = case % 2 == 1;
            let layer = rng.random_range(0..SHAPES.len());
            let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.random_range(0..3)];
            let (target, arg) = match rng.random_range(0..3) {
                0 if factored => (&mut e[layer], "grads.e"),
                1 if factored => (&mut a[layer], "grads.a"),
                0 | 1 => (&mut grads[layer], "grads"),
                _ => (&mut p[layer], "params"),
            };
            let index = rng.random_range(0..target.len());
            target[index] = bad;
            let up = |v: &[Vec<f32>], dims: &[(usize, usize)]| -> Vec<Matrix> {
                v.iter()
                    .zip(dims)
                    .map(|(v, &(r, c))| dev.upload(r, c, v).unwrap())
                    .collect()
            };
            for (w, v) in params.iter_mut().zip(up(&p, &SHAPES)) {
                *w = v;
            }
            let (gm, em, am) = (
                up(&grads, &SHAPES),
                up(&e, &SHAPES.map(|(o, _)| (M, o))),
                up(&a, &SHAPES.map(|(_, i)| (M, i))),
            );
            let kg: Vec<KronGrad> = if factored {
                em.iter()
                    .zip(&am)
                    .map(|(e, a)| KronGrad::Factored { e, a })
                    .collect()
            } else {
                gm.iter().map(KronGrad::Dense).collect()
            };
            let before = snapshot(&opt, &params);
            let err = opt.step_grads(&mut params, &kg, None).unwrap_err();
            match err {
                Error::NonFinite {
                    arg: got,
                    index: i,
                    value,
                    ..
                } => {
                    assert_eq!((got, i), (arg, index), "{} case {case}: {err}", dev.name());
                    assert_eq!(value.to_bits(), bad.to_bits(), "case {case}");
                }
                e => panic!("{} case {case}: {e}", dev.name()),
            }
            assert_eq!(
                snapshot(&opt, &params),
                before,
                "{} case {case}",
                dev.name()
            );
        }
    }
}

/// Stored form of an `r x c` row-major `op(X)`: itself, or its transpose (`c x r`).
fn stored(op_x: &[f32], r: usize, c: usize, t: Trans) -> (Vec<f32>, (usize, usize)) {
    match t {
        Trans::No => (op_x.to_vec(), (r, c)),
        Trans::Yes => {
            let mut s = vec![0.0; r * c];
            for i in 0..r {
                for j in 0..c {
                    s[j * r + i] = op_x[i * c + j];
                }
            }
            (s, (c, r))
        }
    }
}

/// The split3 product checks its result in its epilogue (no separate pass over `C`): rows of
/// `op(A)` and columns of `op(B)` set to `1e30` make exactly their crossings overflow, so the
/// first non-finite flat index of `C` is `min(rows)·N + min(cols)`, which the error must
/// name, with a non-finite value; the same product without planted values is `Ok`. Ragged
/// shapes across 128-wide tiles and every transpose; and a pattern whose least index one
/// thread reaches after a larger one. (An epilogue that never flags passes the overflow as
/// `Ok`; one that keeps a thread's first hit instead of its least index fails the pattern.)
#[test]
fn product_epilogue_flags_the_first_overflow() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut rng = common::seeded_rng();
    for dev in devices() {
        for case in 0..10 {
            // Every fifth case plants the crossing pattern below, which needs m ≥ 16, n ≥ 32.
            let crossing = case % 5 == 4;
            let (lo_m, lo_n, lo_k) = if crossing { (16, 32, 2) } else { (1, 1, 1) };
            let (m, n, k) = (
                rng.random_range(lo_m..=160),
                rng.random_range(lo_n..=160),
                rng.random_range(lo_k..=40),
            );
            let (ta, tb) = (
                [Trans::No, Trans::Yes][rng.random_range(0..2)],
                [Trans::No, Trans::Yes][rng.random_range(0..2)],
            );
            let mut opa = vals(&mut rng, m * k);
            let mut opb = vals(&mut rng, k * n);
            let mut expected = None;
            if crossing {
                // Only (r, j + 8) and (r + 8, j) overflow: A[r,0]·B[0,j+8] and
                // A[r+8,1]·B[1,j]; the other products with the huge entries meet entries in
                // [-1, 1] or 0. With r mod 16 < 8 and j mod 32 < 24 both are stored by one
                // thread (the mma fragment's rows r, r+8 and 8-column groups of j, j+8 in one
                // warp tile), which reaches (r + 8, j) first: only the least index is right.
                let r = 16 * rng.random_range(0..(m - 8) / 16 + usize::from((m - 8) % 16 > 0))
                    + rng.random_range(0..8);
                let j = 32 * rng.random_range(0..(n - 8) / 32 + usize::from((n - 8) % 32 > 0))
                    + rng.random_range(0..24);
                let (r, j) = (r.min(m - 9), j.min(n - 9));
                for (row, kk) in [(r, 0), (r + 8, 1)] {
                    opa[row * k..(row + 1) * k].fill(0.0);
                    opa[row * k + kk] = 1e30;
                }
                for (kk, col, zero) in [(0, j + 8, j), (1, j, j + 8)] {
                    opb[kk * n + col] = 1e30;
                    opb[kk * n + zero] = 0.0;
                }
                expected = Some(r * n + j + 8);
            } else if case % 5 != 0 {
                let rows: Vec<usize> = (0..rng.random_range(1..=3))
                    .map(|_| rng.random_range(0..m))
                    .collect();
                let cols: Vec<usize> = (0..rng.random_range(1..=3))
                    .map(|_| rng.random_range(0..n))
                    .collect();
                for &r in &rows {
                    opa[r * k..(r + 1) * k].fill(1e30);
                }
                for &c in &cols {
                    for kk in 0..k {
                        opb[kk * n + c] = 1e30;
                    }
                }
                let (r0, c0) = (rows.iter().min().unwrap(), cols.iter().min().unwrap());
                expected = Some(r0 * n + c0);
            }
            let (sa, sha) = stored(&opa, m, k, ta);
            let (sb, shb) = stored(&opb, k, n, tb);
            let a = dev.upload(sha.0, sha.1, &sa).unwrap();
            let b = dev.upload(shb.0, shb.1, &sb).unwrap();
            let mut c = dev.zeros(m, n).unwrap();
            let (a, b) = (Split3::new(&a), Split3::new(&b));
            let r = product3_checked(
                &dev,
                "test",
                MatMul::new(ta, tb, 1.0, &a, &b),
                &mut c,
                Default::default(),
            );
            let what = format!("{} case {case}: {m}x{n}x{k} {ta:?}{tb:?}", dev.name());
            match (r, expected) {
                (Ok(()), None) => {}
                (
                    Err(Error::NonFinite {
                        arg, index, value, ..
                    }),
                    Some(first),
                ) => {
                    assert_eq!((arg, index), ("result (overflow)", first), "{what}");
                    // Inf, or NaN where split3's plane products overflow with both signs.
                    assert!(!value.is_finite(), "{what}: {value}");
                }
                (r, e) => panic!("{what}: {r:?}, expected first overflow {e:?}"),
            }
        }
    }
}

/// A factored lazy step splits nothing: the 9 products of a factored layer (3 for `P`, 6 for
/// the model's terms) read 10 distinct operands (`E`, `A`, `Γ̃⁻¹`, `Λ̃⁻¹`, `U`, `W`, `Γ`, `Λ`,
/// `ΓU`, `WΛ`), of which `E` and `A` come with the planes their check wrote
/// (`KronOptimizer::check_inputs`), the factors `Γ`, `Λ`, and `X₀` on a side that applies it
/// by products, keep their planes from an earlier step (`KronFactorState`'s split caches), the
/// first-order inverses this step formed (one axpy pass for them all, besides the weights'
/// update; which sides do depends on the drawn data) come with the planes that pass wrote,
/// and `U`, `W`, `ΓU`, `WΛ` with the planes their products' epilogues wrote
/// (`Device::product_split_of`): no `gemm_split3` launch, where splitting per product took 18.
/// One layer the cost model sends down the factored route (`m = 5`, `9 x 70`), squares
/// already cached, so the step's only other launches are element-wise.
#[test]
fn factored_lazy_step_splits_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut rng = common::seeded_rng();
    let shape = [(9usize, 70usize)];
    for dev in devices() {
        let mut opt = KronOptimizer::new(&dev, &shape, config(KronVariant::Ring)).unwrap();
        let a = upload_all(&dev, &mut rng, &[(M, 70)]);
        let e = upload_all(&dev, &mut rng, &[(M, 9)]);
        let stats = [KronStats { a: &a[0], e: &e[0] }];
        let mut params = upload_all(&dev, &mut rng, &shape);
        let mut step =
            |opt: &mut KronOptimizer, rng: &mut ChaCha8Rng, stats: Option<&[KronStats]>| {
                let (e, a) = (
                    upload_all(&dev, rng, &[(M, 9)]),
                    upload_all(&dev, rng, &[(M, 70)]),
                );
                let kg = [KronGrad::Factored { e: &e[0], a: &a[0] }];
                record_launches(true);
                let info = opt.step_grads(&mut params, &kg, stats).unwrap();
                let launched = take_launches();
                record_launches(false);
                // Up, then down: ρ moves every step, within the first-order range.
                let after = if opt.steps().is_multiple_of(2) {
                    2.0
                } else {
                    1.0 + info.predicted_change.unwrap()
                };
                opt.observe_loss(1.0, after).unwrap();
                launched
            };
        step(&mut opt, &mut rng, Some(&stats));
        step(&mut opt, &mut rng, None); // forms and caches the squares
        let launched = step(&mut opt, &mut rng, None);
        let count = |f: &dyn Fn(&str) -> bool| launched.iter().filter(|n| f(n)).count();
        assert_eq!(
            count(&|n| n.starts_with("gemm3")),
            9,
            "{}: {launched:?}",
            dev.name()
        );
        assert_eq!(
            count(&|n| n == "gemm_split3"),
            0,
            "{}: {launched:?}",
            dev.name()
        );
    }
}

/// A reduction is ONE kernel launch, eager or deferred (`elementwise_dot`: the last block to
/// finish sums the per-block partials): `Device::dot` and `Device::norm2` launch nothing else,
/// and in a deferred scope the only other launch is the ledger chunk's preset
/// (`elementwise_fill`, once per scope); up to three deferred dots of one length share one
/// `elementwise_dot`, and more (or several groups) one `elementwise_multi_dot`: three are two
/// launches with the fill, and four too. At one block (`n` = 3) and at several.
#[test]
fn a_dot_is_one_launch() {
    fn launched<R>(f: impl FnOnce() -> R) -> Vec<&'static str> {
        record_launches(true);
        f();
        let launched = take_launches();
        record_launches(false);
        launched
    }
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut rng = common::seeded_rng();
    for dev in devices() {
        for n in [3, 5000] {
            let [x, y] = [0, 1].map(|_| dev.upload(n, 1, &vals(&mut rng, n)).unwrap());
            let dot = "elementwise_dot";
            let name = dev.name();
            assert_eq!(launched(|| dev.dot(&x, &y).unwrap()), [dot], "{name}");
            assert_eq!(launched(|| dev.norm2(&x).unwrap()), [dot], "{name}");
            let deferred = |pairs: &[(&Matrix, &Matrix)]| {
                launched(|| grng::hooks::deferred_dots(&dev, &[pairs]).unwrap())
            };
            let fill = "elementwise_fill";
            assert_eq!(deferred(&[(&x, &y)]), [fill, dot], "{name}");
            let three = deferred(&[(&x, &y), (&y, &y), (&x, &x)]);
            assert_eq!(three, [fill, dot], "{name}");
            let four = deferred(&[(&x, &y), (&y, &y), (&x, &x), (&y, &x)]);
            assert_eq!(four, [fill, "elementwise_multi_dot"], "{name}");
        }
    }
}

/// One step of `opt` on a fresh batch of dense gradients (`M` rows of statistics where it
/// refreshes), with the kernels it launched.
fn recorded_step(
    dev: &Device,
    rng: &mut ChaCha8Rng,
    opt: &mut KronOptimizer,
    params: &mut [Matrix],
    shapes: &[(usize, usize)],
) -> (KronStepInfo, Vec<&'static str>) {
    let dims: Vec<(usize, usize)> = shapes.iter().flat_map(|&(o, i)| [(M, i), (M, o)]).collect();
    let batch = upload_all(dev, rng, &dims);
    let stats: Vec<KronStats<'_>> = batch
        .chunks(2)
        .map(|ae| KronStats {
            a: &ae[0],
            e: &ae[1],
        })
        .collect();
    let grads = upload_all(dev, rng, shapes);
    let grads: Vec<&Matrix> = grads.iter().collect();
    let need = opt.needs_stats();
    record_launches(true);
    let info = opt
        .step(params, &grads, need.then_some(&stats[..]))
        .unwrap();
    let launched = take_launches();
    record_launches(false);
    (info, launched)
}

/// A dense lazy step splits nothing: per layer the four products of `P` and the model's
/// `Γ·P·Λ` (`G·Λ̃⁻¹`, `Γ̃⁻¹·T`, `Γ·P`, `ΓP·Λ`) read `G` (split by its check: one launch for
/// up to four gradients of any shapes, here the three), the inverses and the factors (their planes
/// kept in the state), and `T`, `P`, `ΓP`, which come with the planes their products'
/// epilogues wrote. Three layers, RING (the model formed); the loss falling by half the
/// prediction so `ρ` stays, and falling by twice the prediction so `ρ ← φρ` at every step:
/// each inverse then is the first-order `X₀ − (λ − λ₀)·S₀` of a new target, formed with its
/// planes by one `elementwise_multi_axpy_new` for every factor. The layers' updates
/// `W − ηP` take one more: two launches of axpys in all, whatever the number of layers.
#[test]
fn dense_lazy_step_splits_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut rng = common::seeded_rng();
    let shapes = [(12usize, 17usize), (7, 12), (3, 7)];
    let cfg = KronConfig {
        skip: 8,
        ..common::variant_config(KronVariant::Ring)
    };
    // (the loss after as a multiple of the prediction, axpy launches: the updates, and the
    // first-order inverses when ρ moves).
    for (gain, axpys) in [(0.5f32, 1), (2.0, 2)] {
        for dev in devices() {
            let mut opt = KronOptimizer::new(&dev, &shapes, cfg).unwrap();
            let mut params = upload_all(&dev, &mut rng, &shapes);
            let mut last = Vec::new();
            // Step 1 forms the squares `S₀` of the first-order inverses (from the inverses'
            // kept planes: no split either); step 2 reuses them.
            for k in 0..3 {
                assert_eq!(opt.needs_stats(), k == 0, "{}", dev.name());
                let info;
                (info, last) = recorded_step(&dev, &mut rng, &mut opt, &mut params, &shapes);
                if k == 1 {
                    let splits = last.iter().filter(|&&l| l == "gemm_split3").count();
                    assert_eq!(splits, 0, "{}: {last:?}", dev.name());
                }
                if k == 2 {
                    let moved = u32::from(gain != 0.5);
                    assert_eq!(info.first_order_updates, 2 * 3 * moved, "{}", dev.name());
                }
                let q = info.predicted_change.unwrap();
                opt.observe_loss(1.0, 1.0 + gain * q).unwrap();
            }
            let count = |k: &str| last.iter().filter(|&&l| l == k).count();
            let name = dev.name();
            assert_eq!(count("gemm3_tc"), 4 * shapes.len(), "{name}: {last:?}");
            assert_eq!(count("elementwise_check"), 1, "{name}: {last:?}");
            assert_eq!(count("gemm_split3"), 0, "{name}: {last:?}");
            assert_eq!(count("elementwise_axpy_new"), 0, "{name}: {last:?}");
            let axpy = count("elementwise_multi_axpy_new");
            assert_eq!(axpy, axpys, "{name}: {last:?}");
        }
    }
}

/// Inverses formed without planes — a refresh's (by the host route's upload, or by Newton),
/// a lazy step's recomputed one — and a refresh's factors where the model reads them are split
/// together by one checking pass (`Ctx::split_formed`: up to four per `elementwise_check`)
/// and keep their planes: on the host route (the layers below, all small) neither the refresh
/// step nor a recomputing lazy step nor the step after it launches a `gemm_split3`, where each
/// product's first read split its operand (12 per refresh of 3 layers: the 6 inverses and the
/// 6 factors the model's products read; 6 per recomputing step). `φ = 0.5` and a rising loss
/// double ρ, so lazy step 2 recomputes its inverses. Mutation check: without the refresh's
/// split, 12 splits; without the recompute's, 6.
#[test]
fn formed_inverses_come_with_their_planes() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut rng = common::seeded_rng();
    let shapes = [(12usize, 17usize), (7, 12), (3, 7)];
    for variant in [KronVariant::Ring, KronVariant::Ngd] {
        let cfg = KronConfig {
            skip: 4,
            phi: 0.5,
            ..common::variant_config(variant)
        };
        for dev in devices() {
            let name = dev.name();
            let mut opt = KronOptimizer::new(&dev, &shapes, cfg).unwrap();
            let mut params = upload_all(&dev, &mut rng, &shapes);
            let mut recomputed = false;
            for k in 0..4 {
                let (info, launched) =
                    recorded_step(&dev, &mut rng, &mut opt, &mut params, &shapes);
                recomputed |= info.lazy_recomputes > 0;
                // Step 1 forms the squares `X₀·X₀` of the first-order inverses, whose product
                // splits `X₀` as its own input (not from the state's planes).
                if k != 1 {
                    let splits = launched.iter().filter(|&&l| l == "gemm_split3").count();
                    assert_eq!(splits, 0, "{name}, {variant:?}, step {k}: {launched:?}");
                }
                // The loss rises after steps 0 and 1 (ρ doubles twice), then falls by half
                // the prediction (ρ stays).
                let q = info.predicted_change.unwrap();
                let after = if k < 2 { 2.0 } else { 1.0 + 0.5 * q };
                opt.observe_loss(1.0, after).unwrap();
            }
            assert!(recomputed, "{name}, {variant:?}: no lazy step recomputed");
        }
    }
}
