//! The launch record (what `benches/gpu.rs` reports as "which kernel ran") and the kernel
//! timing (its per-kernel breakdown of a step). Both are process-wide, so these tests have a
//! binary of their own (in a file with other tests, their concurrent launches would land in
//! the record: a flake hunt caught exactly that) and take turns (`SERIAL`).

use grng_testkit as common;

use rand::Rng;
use std::sync::{Mutex, PoisonError};

use grng::cuda::anatomy::launch_anatomy;
use grng::cuda::timing::{take_kernel_times, time_kernels};
use grng::hooks::{record_launches, take_launches};
use grng::optim::kron::{KronConfig, KronGrad, KronOptimizer, KronVariant};
use grng::optim::KronStats;
use grng::{Device, Error, Matrix};

/// Held by each test: the record and the timing see every thread's launches.
static SERIAL: Mutex<()> = Mutex::new(());

/// The record names the kernels an op launched, and nothing for the CPU backend; switched
/// off, it stays empty.
#[test]
fn launch_record_names_the_kernels_run() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    for dev in common::devices() {
        let mut x = dev.upload(3, 1, &[1.0, 2.0, 3.0]).unwrap();
        record_launches(true);
        dev.scale(2.0, &mut x).unwrap();
        let on = take_launches();
        record_launches(false);
        dev.scale(2.0, &mut x).unwrap();
        assert!(on.contains(&"elementwise_scale"), "{}: {on:?}", dev.name());
        assert!(take_launches().is_empty(), "{}", dev.name());
    }
    let mut x = Device::Cpu.upload(1, 1, &[1.0]).unwrap();
    record_launches(true);
    Device::Cpu.scale(2.0, &mut x).unwrap();
    let cpu = take_launches();
    record_launches(false);
    assert!(cpu.is_empty(), "the CPU backend launched {cpu:?}");
}

/// Timed launches are summed by kernel (GPU events on CUDA, the host clock around the
/// emulated launch), the most time first; switched off, nothing is timed.
#[test]
fn kernel_times_sum_the_launches_by_kernel() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    for dev in common::devices() {
        let mut x = dev.upload(3, 1, &[1.0, 2.0, 3.0]).unwrap();
        let y = dev.upload(3, 1, &[1.0, 1.0, 1.0]).unwrap();
        time_kernels(true);
        dev.scale(2.0, &mut x).unwrap();
        dev.axpy(0.5, &y, &mut x).unwrap();
        dev.scale(2.0, &mut x).unwrap();
        let times = take_kernel_times().unwrap();
        time_kernels(false);
        let scale = times.iter().find(|k| k.name == "elementwise_scale");
        let scale = scale.unwrap_or_else(|| panic!("{}: {times:?}", dev.name()));
        assert_eq!(scale.launches, 2, "{}: {times:?}", dev.name());
        assert!(
            times.iter().all(|k| k.secs > 0.0 && k.secs.is_finite()),
            "{}: {times:?}",
            dev.name()
        );
        assert!(
            times.windows(2).all(|w| w[0].secs >= w[1].secs),
            "{times:?}"
        );
        dev.scale(2.0, &mut x).unwrap();
        let off = take_kernel_times().unwrap();
        assert!(off.is_empty(), "{}: {off:?}", dev.name());
    }
}

/// The launch taken apart (`launch_anatomy`, the bench's `launch-anatomy` rows): every part
/// timed and positive, a graph's per-node time only where graphs exist (a GPU), and the CPU
/// backend and `n = 0` refused.
#[test]
fn launch_anatomy_times_each_part() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    for dev in common::devices() {
        let a = launch_anatomy(&dev, 20).unwrap();
        for (part, secs) in [
            ("queued", a.queued),
            ("waited", a.waited),
            ("read_back", a.read_back),
            ("zeroed", a.zeroed),
            ("unset", a.unset),
            ("upload", a.upload),
        ] {
            assert!(
                secs > 0.0 && secs.is_finite(),
                "{}: {part} {a:?}",
                dev.name()
            );
        }
        let on_gpu = matches!(dev, Device::Cuda(_));
        assert_eq!(a.graph.is_some(), on_gpu, "{}: {a:?}", dev.name());
        assert!(a.graph.is_none_or(|s| s > 0.0 && s.is_finite()), "{a:?}");
        let zero = launch_anatomy(&dev, 0);
        assert!(
            matches!(zero, Err(Error::Value { arg: "n", .. })),
            "{zero:?}"
        );
    }
    let cpu = launch_anatomy(&Device::Cpu, 1);
    assert!(matches!(cpu, Err(Error::DeviceUnavailable(_))), "{cpu:?}");
}

/// RING keeps each formed factor's last power iterate (`KronFactorState::top`, `n x 1`,
/// unit) and starts the next refresh's iteration there: on statistics moved by 1e-3 the
/// second refresh launches fewer power steps (`newton_power_step`) than the first, which
/// started from the fixed vector. RENG and NGD keep none. Ragged layers, every side at most
/// `m` (the CPU would form them all too).
#[test]
fn ring_refreshes_warm_start_their_power_iterations() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut rng = common::seeded_rng();
    let shapes = [(6usize, 9usize), (4, 13), (11, 5)];
    let m = 16;
    let dev = Device::Emulated;
    let up = |rows: usize, cols: usize, v: &[f32]| dev.upload(rows, cols, v).unwrap();
    let draw = |rng: &mut rand_chacha::ChaCha8Rng, len: usize| common::vals(rng, len);
    let a0: Vec<Vec<f32>> = shapes.iter().map(|&(_, i)| draw(&mut rng, m * i)).collect();
    let e0: Vec<Vec<f32>> = shapes.iter().map(|&(o, _)| draw(&mut rng, m * o)).collect();
    let nudge = |v: &[f32], rng: &mut rand_chacha::ChaCha8Rng| -> Vec<f32> {
        v.iter()
            .map(|x| x + 1e-3 * rng.random_range(-1.0..1.0f32))
            .collect()
    };
    let a1: Vec<Vec<f32>> = a0.iter().map(|v| nudge(v, &mut rng)).collect();
    let e1: Vec<Vec<f32>> = e0.iter().map(|v| nudge(v, &mut rng)).collect();
    let grads: Vec<Matrix> = shapes
        .iter()
        .map(|&(o, i)| up(o, i, &draw(&mut rng, o * i)))
        .collect();
    let g: Vec<&Matrix> = grads.iter().collect();
    for variant in [KronVariant::Ring, KronVariant::Reng, KronVariant::Ngd] {
        let cfg = KronConfig {
            skip: 1,
            // The device's power iteration: these factors are small enough for the host.
            host_refresh_max: 0,
            ..common::variant_config(variant)
        };
        let mut opt = KronOptimizer::new(&dev, &shapes, cfg).unwrap();
        let mut params: Vec<Matrix> = shapes
            .iter()
            .map(|&(o, i)| dev.zeros(o, i).unwrap())
            .collect();
        let mut power_steps = vec![];
        for (a, e) in [(&a0, &e0), (&a1, &e1)] {
            let am: Vec<Matrix> = a
                .iter()
                .zip(&shapes)
                .map(|(v, &(_, i))| up(m, i, v))
                .collect();
            let em: Vec<Matrix> = e
                .iter()
                .zip(&shapes)
                .map(|(v, &(o, _))| up(m, o, v))
                .collect();
            let stats: Vec<KronStats> = am
                .iter()
                .zip(&em)
                .map(|(a, e)| KronStats { a, e })
                .collect();
            record_launches(true);
            let info = opt.step(&mut params, &g, Some(&stats)).unwrap();
            let launched = take_launches();
            record_launches(false);
            assert!(info.refreshed);
            opt.observe_loss(1.0, 0.5).unwrap();
            let steps = launched
                .iter()
                .filter(|k| **k == "newton_power_step")
                .count();
            power_steps.push(steps);
        }
        let st = opt.state().unwrap();
        for (l, layer) in st.layers.iter().enumerate() {
            for (f, n) in [(&layer.lambda, shapes[l].1), (&layer.gamma, shapes[l].0)] {
                match (variant, f.top()) {
                    (KronVariant::Ring, Some(top)) => {
                        assert_eq!(top.shape(), (n, 1));
                        let v = top.to_vec().unwrap();
                        let norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
                        assert!((norm - 1.0).abs() <= 1e-5, "layer {l}: |top| = {norm}");
                    }
                    (KronVariant::Ring, None) => panic!("layer {l}: RING kept no warm start"),
                    (_, top) => assert!(top.is_none(), "{variant:?} layer {l} kept one"),
                }
            }
        }
        if variant == KronVariant::Ring {
            assert!(
                power_steps[1] < power_steps[0],
                "power steps of the two refreshes: {power_steps:?}"
            );
        } else {
            assert_eq!(power_steps, [0, 0], "{variant:?}");
        }
    }
}

/// The split planes a Kronecker optimizer keeps beside its factors and inverses on the kernel
/// devices (`KronFactorState`'s split caches: the factors `F` of the model's products, `X₀`
/// while a lazy step applies it as formed or by products) change no bit: an optimizer whose
/// caches are dropped before every step (restored from its own `state()`, which copies no
/// cache) makes the same steps, bit for bit, over refreshes, lazy steps and the
/// Levenberg–Marquardt rule moving the damping, every variant, dense and factored gradients;
/// and it splits more (`gemm_split3`): on the dense route a factor per layer and lazy step at
/// least, where the caches hold them. Mutation check: without the reset of the inverse's
/// cache when a lazy step recomputes `X₀` (`InverseUpdate::apply`), the next lazy step reads
/// the old `X₀`'s planes and the factored RING run differs.
#[test]
fn kept_planes_change_no_bit_and_spare_the_splits() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let mut rng = common::seeded_rng();
    // Batches much smaller than the layers: the factored gradients take the factored route.
    let shapes = [(40usize, 33usize), (24, 41), (11, 30)];
    let m = 4;
    let dev = Device::Emulated;
    let up = |rows: usize, cols: usize, v: &[f32]| dev.upload(rows, cols, v).unwrap();
    let steps: usize = 7;
    let batches: Vec<Vec<[Matrix; 3]>> = (0..steps)
        .map(|_| {
            shapes
                .iter()
                .map(|&(o, i)| {
                    [
                        up(m, i, &common::vals(&mut rng, m * i)),
                        up(m, o, &common::vals(&mut rng, m * o)),
                        up(o, i, &common::vals(&mut rng, o * i)),
                    ]
                })
                .collect()
        })
        .collect();
    let init: Vec<Vec<f32>> = shapes
        .iter()
        .map(|&(o, i)| common::vals(&mut rng, o * i))
        .collect();
    let cases = [KronVariant::Ring, KronVariant::Reng, KronVariant::Ngd]
        .into_iter()
        .flat_map(|v| [(v, false), (v, true)]);
    for (variant, factored) in cases {
        // `φ = 0.5`: while the loss rises ρ doubles every step, so lazy steps recompute their
        // inverses (`|λ − λ₀|·‖X₀‖ > 1/2`), replacing `X₀` between refreshes.
        let cfg = KronConfig {
            skip: 4,
            phi: 0.5,
            ..common::variant_config(variant)
        };
        let run = |drop_caches: bool| {
            let mut opt = KronOptimizer::new(&dev, &shapes, cfg).unwrap();
            let mut params: Vec<Matrix> = shapes
                .iter()
                .zip(&init)
                .map(|(&(o, i), w)| up(o, i, w))
                .collect();
            let mut bits = Vec::new();
            let (mut splits, mut recomputes) = (0, 0);
            for (k, batch) in batches.iter().enumerate() {
                if drop_caches {
                    let st = opt.state().unwrap();
                    opt.restore(st).unwrap();
                }
                let stats: Vec<KronStats<'_>> =
                    batch.iter().map(|[a, e, _]| KronStats { a, e }).collect();
                // Dense gradients, or the batch factors (the factored route, where `X₀` is
                // an operand of its own products).
                let grads: Vec<KronGrad<'_>> = batch
                    .iter()
                    .map(|[a, e, g]| match factored {
                        true => KronGrad::Factored { e, a },
                        false => KronGrad::Dense(g),
                    })
                    .collect();
                let need = opt.needs_stats();
                record_launches(true);
                opt.step_grads(&mut params, &grads, need.then_some(&stats[..]))
                    .unwrap();
                let launched = take_launches();
                record_launches(false);
                if !need {
                    splits += launched.iter().filter(|&&l| l == "gemm_split3").count();
                }
                if let Some(q) = opt.pending_prediction() {
                    // ρ doubles (the loss rose) after steps 0 and 1, so lazy step 2 recomputes
                    // the inverses; then it stays (the loss fell by half the prediction) and
                    // lazy step 3 applies the recomputed `X₀` as formed.
                    let after = if k < 2 { 2.0 } else { 1.0 + 0.5 * q };
                    opt.observe_loss(1.0, after).unwrap();
                }
                recomputes += opt.counters().lazy_recomputes;
                for p in &params {
                    bits.extend(p.to_vec().unwrap().into_iter().map(f32::to_bits));
                }
            }
            (bits, splits, recomputes)
        };
        let (kept, kept_splits, recomputes) = run(false);
        let (dropped, dropped_splits, _) = run(true);
        assert!(
            recomputes > 0,
            "{variant:?}: no lazy step recomputed an inverse"
        );
        assert!(
            kept == dropped,
            "{variant:?}, factored {factored}: the kept planes changed the steps"
        );
        // 5 lazy steps of 3 layers; on the dense route each reads at least `Λ`'s factor per
        // layer (the model's `ΓPΛ`); on the factored route what is kept depends on the data
        // (`X₀` where a side applies it by products, the factors where the model reads them).
        let lazy = steps - steps.div_ceil(4);
        let least = if factored { 0 } else { shapes.len() * lazy };
        assert!(
            kept_splits + least <= dropped_splits,
            "{variant:?}, factored {factored}: {kept_splits} splits kept vs {dropped_splits}"
        );
    }
}
