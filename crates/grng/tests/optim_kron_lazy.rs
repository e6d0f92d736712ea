//! RING's lazy steps on the kernel devices (the emulator, and CUDA when a GPU is present):
//! the first-order inverse relative to the formation, `X₀ − (λ − λ₀)·X₀²` (docs/math.md §2), matches
//! the CPU backend from the same state, and costs one axpy per factor and step — the square
//! `X₀²` is one GEMM per formation, not one per step — and none on a step whose target is the
//! last one's (counted kernel launches).

use grng::checkpoint::{Checkpoint, Writer};
use grng::hooks::{record_launches, take_launches};
use grng::optim::kron::{KronConfig, KronFactorState, KronOptimizer};
use grng::optim::KronStats;
use grng::{Device, Matrix};
use rand_chacha::ChaCha8Rng;
use std::sync::{Mutex, PoisonError};

use common::{devices, first_order_scale64, matmul64, vals, U32};
use grng_testkit as common;

/// The launch record is process-wide: tests that read it take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn abs64(m: &Matrix) -> Vec<f64> {
    m.to_vec().unwrap().iter().map(|v| v.abs() as f64).collect()
}

/// The layers of both tests: a 70-wide factor spans two 64-wide GEMM tiles.
const SHAPES: [(usize, usize); 2] = [(9, 70), (3, 6)];
/// Statistics rows per layer.
const M: usize = 5;

/// Statistics `(A, E)` per layer and `steps` sets of gradients, drawn in that order.
struct Case {
    stats: Vec<(Vec<f32>, Vec<f32>)>,
    grads: Vec<Vec<Vec<f32>>>,
}

impl Case {
    fn draw(rng: &mut ChaCha8Rng, steps: usize) -> Self {
        let stats = SHAPES
            .iter()
            .map(|&(o, i)| (vals(rng, M * i), vals(rng, M * o)))
            .collect();
        let grads = (0..steps)
            .map(|_| SHAPES.iter().map(|&(o, i)| vals(rng, o * i)).collect())
            .collect();
        Case { stats, grads }
    }

    /// The statistics on `dev`, `(A, E)` per layer.
    fn stats_on(&self, dev: &Device) -> Vec<(Matrix, Matrix)> {
        SHAPES
            .iter()
            .zip(&self.stats)
            .map(|(&(o, i), (a, e))| (dev.upload(M, i, a).unwrap(), dev.upload(M, o, e).unwrap()))
            .collect()
    }

    /// Step `k`'s gradients on `dev`.
    fn grads_on(&self, dev: &Device, k: usize) -> Vec<Matrix> {
        SHAPES
            .iter()
            .zip(&self.grads[k])
            .map(|(&(o, i), g)| dev.upload(o, i, g).unwrap())
            .collect()
    }
}

/// Zero parameters on `dev`.
fn zeros(dev: &Device) -> Vec<Matrix> {
    SHAPES
        .iter()
        .map(|&(o, i)| dev.zeros(o, i).unwrap())
        .collect()
}

/// From the same state (a CPU refresh, moved to each device through a checkpoint, so `X₀`,
/// `λ₀`, `‖F‖₂` and ρ are the same bits), six lazy steps with ρ moving every step (down,
/// down, up, up, up, up by φ = 0.8) precondition alike on the CPU and on the device, and on
/// the device each step launches exactly the preconditioning's and the quadratic model's GEMMs
/// (4 per layer), plus one GEMM per factor on the first drift (its square `X₀²`), and one axpy
/// per drifting factor (plus the parameter update's, one per layer) — the former rule ran a
/// GEMM per factor every step.
///
/// Tolerance, per entry of `P`, with `A = |X₀| + |Δ||X₀|²` per factor: each side is within
/// `(2(d_in + d_out) + 9)u·A_Γ|G|A_Λ` of the exact `X_Γ(λ_Γ)·G·X_Λ(λ_Λ)` on the shared `X₀`
/// (the square's GEMM and the axpy `(n + 4)u·A`, two preconditioning products, the update's
/// rounding: `optim_kron::lazy_steps_use_the_first_order_inverse_of_the_formation`; the
/// device's split-bf16 products are f32-accurate, `docs/gpu.md`); allowed: twice
/// `(2(d_in + d_out) + 16)·2u` of it. The cached squares agree within `2·(n + 4)·2u·|X₀||X₀|`
/// (two GEMMs of one product).
#[test]
fn lazy_steps_match_cpu_with_one_axpy_per_factor() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let moves = [1.0f32, 0.0, 0.0, 0.0, 0.0, 0.0];
    let case = Case::draw(&mut common::seeded_rng(), moves.len());
    let (shapes, grads) = (SHAPES, &case.grads);
    let cpu = Device::Cpu;
    let cfg = common::drifting_config(KronConfig::ring());
    // The refresh on the CPU, and a good step: ρ ← φρ.
    let mut base = KronOptimizer::new(&cpu, &shapes, cfg).unwrap();
    let st = case.stats_on(&cpu);
    let ks: Vec<KronStats<'_>> = st.iter().map(|(a, e)| KronStats { a, e }).collect();
    let g0 = case.grads_on(&cpu, 0);
    let g0: Vec<&Matrix> = g0.iter().collect();
    let q = base
        .step(&mut zeros(&cpu), &g0, Some(&ks))
        .unwrap()
        .predicted_change
        .unwrap();
    base.observe_loss(1.0, 1.0 + q).unwrap();
    let mut saved = Writer::new();
    base.save(&mut saved).unwrap();

    for dev in devices() {
        let mut on_cpu = KronOptimizer::new(&cpu, &shapes, cfg).unwrap();
        let mut on_dev = KronOptimizer::new(&dev, &shapes, cfg).unwrap();
        on_cpu.load(&saved.to_reader().unwrap()).unwrap();
        on_dev.load(&saved.to_reader().unwrap()).unwrap();
        let mut worst = 0.0f64;
        let mut squared = [[false; 2]; 2];
        for (k, &r) in moves.iter().enumerate() {
            let (gc, gd) = (case.grads_on(&cpu, k), case.grads_on(&dev, k));
            let (mut wc, mut wd) = (zeros(&cpu), zeros(&dev));
            let ic = on_cpu
                .step(&mut wc, &gc.iter().collect::<Vec<_>>(), None)
                .unwrap();
            record_launches(true);
            let id = on_dev
                .step(&mut wd, &gd.iter().collect::<Vec<_>>(), None)
                .unwrap();
            let launched = take_launches();
            record_launches(false);
            assert_eq!(ic.rho, id.rho, "step {k}: ρ must move alike");
            assert_eq!(ic.first_order_updates, id.first_order_updates, "step {k}");
            assert_eq!(id.lazy_recomputes, 0, "step {k}");
            let sc = on_cpu.state().unwrap();
            let sd = on_dev.state().unwrap();
            let target = |s: &KronFactorState| {
                ((ic.rho as f64).sqrt() * s.norm as f64).max(cfg.damping_floor as f64) as f32
            };
            let (mut drifting, mut new_squares) = (0, 0);
            for (l, &(o, i)) in shapes.iter().enumerate() {
                let (cl, cg) = (&sc.layers[l].lambda, &sc.layers[l].gamma);
                let (dl, dg) = (&sd.layers[l].lambda, &sd.layers[l].gamma);
                for (side, (c, d)) in [(cl, dl), (cg, dg)].into_iter().enumerate() {
                    assert_eq!(c.inverse.to_vec().unwrap(), d.inverse.to_vec().unwrap());
                    assert_eq!(c.damping, d.damping);
                    if target(c) == c.damping {
                        continue;
                    }
                    drifting += 1;
                    if !squared[l][side] {
                        squared[l][side] = true;
                        new_squares += 1;
                    }
                    let n = c.inverse.rows();
                    let x = abs64(&c.inverse);
                    let bound = matmul64(&x, &x, n, n, n);
                    let (sqc, sqd) = (c.square().unwrap(), d.square().unwrap());
                    let tol = 2.0 * (n as f64 + 4.0) * 2.0 * U32;
                    for ((a, b), s) in sqc
                        .to_vec()
                        .unwrap()
                        .iter()
                        .zip(sqd.to_vec().unwrap())
                        .zip(&bound)
                    {
                        assert!(
                            (*a as f64 - b as f64).abs() <= tol * s,
                            "{}: step {k} layer {l}: square {a} vs {b}",
                            dev.name()
                        );
                    }
                }
                let ga: Vec<f64> = grads[k][l].iter().map(|v| v.abs() as f64).collect();
                let scale = matmul64(
                    &matmul64(&first_order_scale64(cg, target(cg)), &ga, o, o, i),
                    &first_order_scale64(cl, target(cl)),
                    o,
                    i,
                    i,
                );
                let c = 2.0 * (2 * (o + i) + 16) as f64 * 2.0 * U32;
                let eta = ic.lr as f64;
                for ((a, b), s) in wc[l]
                    .to_vec()
                    .unwrap()
                    .iter()
                    .zip(wd[l].to_vec().unwrap())
                    .zip(&scale)
                {
                    let ratio = (*a as f64 - b as f64).abs() / eta / (c * s);
                    worst = worst.max(ratio);
                    assert!(
                        ratio <= 1.0,
                        "{}: step {k} layer {l}: P {} vs {}",
                        dev.name(),
                        -a / ic.lr,
                        -b / ic.lr
                    );
                }
            }
            assert_eq!(id.first_order_updates as usize, drifting, "step {k}");
            let count = |f: &dyn Fn(&str) -> bool| launched.iter().filter(|n| f(n)).count();
            let layers = shapes.len();
            assert_eq!(
                count(&|n| common::is_product(n)),
                4 * layers + new_squares,
                "{}: step {k}: GEMM launches {launched:?}",
                dev.name()
            );
            // The first-order inverses together, then the layers' updates together.
            assert_eq!(
                common::axpy_launches(&launched),
                common::add2(
                    common::batched_axpy_launches(drifting),
                    common::batched_axpy_launches(layers)
                ),
                "{}: step {k}: axpy launches {launched:?}",
                dev.name()
            );
            on_cpu
                .observe_loss(1.0, 1.0 + r * ic.predicted_change.unwrap())
                .unwrap();
            on_dev
                .observe_loss(1.0, 1.0 + r * id.predicted_change.unwrap())
                .unwrap();
        }
        assert_eq!(squared, [[true; 2]; 2], "every factor drifted");
        eprintln!(
            "{}: lazy P vs CPU, worst difference / tolerance {worst:.3}",
            dev.name()
        );
    }
}

/// A lazy step at the same damping target as the step before reuses that step's first-order
/// inverse: no axpy for the factors (only the parameter updates', one launch for the layers) and no GEMM
/// beyond the preconditioning's and the model's, still counted as first-order updates, and
/// the same bits as an optimizer without the cache (loaded from a checkpoint, which does not
/// store it), on the CPU and on each kernel device.
#[test]
fn unchanged_target_reuses_the_first_order_inverse() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let case = Case::draw(&mut common::seeded_rng(), 3);
    let shapes = SHAPES;
    let cfg = common::drifting_config(KronConfig::ring());
    let layers = shapes.len();
    let mut all = vec![Device::Cpu];
    all.extend(devices());
    for dev in all {
        let name = dev.name();
        let mut opt = KronOptimizer::new(&dev, &shapes, cfg).unwrap();
        let st = case.stats_on(&dev);
        let ks: Vec<KronStats<'_>> = st.iter().map(|(a, e)| KronStats { a, e }).collect();
        // The refresh, a good step (ρ ← φρ: every target moves), then a lazy step at the new
        // target whose ratio leaves ρ alone.
        let step = |opt: &mut KronOptimizer, k: usize, ks: Option<&[KronStats<'_>]>, r: f32| {
            let g = case.grads_on(&dev, k);
            let mut w = zeros(&dev);
            record_launches(true);
            let info = opt.step(&mut w, &g.iter().collect::<Vec<_>>(), ks).unwrap();
            let launched = take_launches();
            record_launches(false);
            opt.observe_loss(1.0, 1.0 + r * info.predicted_change.unwrap())
                .unwrap();
            let w: Vec<Vec<f32>> = w.iter().map(|w| w.to_vec().unwrap()).collect();
            (info, launched, w)
        };
        step(&mut opt, 0, Some(&ks), 1.0);
        let (first, launched, _) = step(&mut opt, 1, None, 0.5);
        assert_eq!(first.first_order_updates, 4, "{name}: every factor drifted");
        let axpys = |l: &[&str]| common::axpy_launches(l);
        // The factors' first-order inverses formed together (4), the layers' updates together.
        let (factors, updates) = (
            common::batched_axpy_launches(4),
            common::batched_axpy_launches(layers),
        );
        let gemms = |l: &[&str]| l.iter().filter(|n| common::is_product(n)).count();
        if !matches!(dev, Device::Cpu) {
            let both = common::add2(factors, updates);
            assert_eq!(axpys(&launched), both, "{name}: {launched:?}");
        }
        let mut saved = Writer::new();
        opt.save(&mut saved).unwrap();
        let mut fresh = KronOptimizer::new(&dev, &shapes, cfg).unwrap();
        fresh.load(&saved.to_reader().unwrap()).unwrap();
        let (cached, launched, w) = step(&mut opt, 2, None, 0.5);
        let (uncached, launched_fresh, w_fresh) = step(&mut fresh, 2, None, 0.5);
        assert_eq!(cached.rho, first.rho, "{name}: ρ must not move");
        assert_eq!(
            w, w_fresh,
            "{name}: the cached inverses must give the same step"
        );
        assert_eq!(cached.predicted_change, uncached.predicted_change, "{name}");
        assert_eq!(cached.first_order_updates, 4, "{name}");
        assert_eq!(uncached.first_order_updates, 4, "{name}");
        if !matches!(dev, Device::Cpu) {
            assert_eq!(axpys(&launched), updates, "{name}: {launched:?}");
            assert_eq!(gemms(&launched), 4 * layers, "{name}: {launched:?}");
            // Without the cache: the factors' axpys, and the squares again (not stored).
            assert_eq!(
                axpys(&launched_fresh),
                common::add2(factors, updates),
                "{name}: {launched_fresh:?}"
            );
            assert_eq!(
                gemms(&launched_fresh),
                4 * layers + 4,
                "{name}: {launched_fresh:?}"
            );
        }
    }
}
