//! Small factors refreshed on the host (`KronConfig::host_refresh_max`): on a kernel device
//! with the default inverse, a factor of dimension `n ≤ host_refresh_max` is read back once,
//! its damping scalar (RING's `‖F‖₂`, NGD's `tr F`) and its inverse are computed as the CPU
//! backend computes them (power iteration, Cholesky), and the results are uploaded; larger
//! factors, and any explicit inverse method, stay on the device (Newton). The emulator runs the
//! kernel-device code path, so these tests pin the route, the values and the read-backs.

use grng::hooks::read_backs;
use grng::ops::newton::NewtonOptions;
use grng::optim::kron::{
    InverseMethod, KronConfig, KronCounters, KronOptimizer, KronState, KronVariant,
    HOST_REFRESH_MAX,
};
use grng::optim::KronStats;
use grng::{Device, Matrix};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use common::vals;
use grng_testkit as common;

/// `steps` refresh steps (`S = 1`) of a `KronOptimizer` on `dev` over layers `shapes` with
/// batch `m`: the state after them, and the read-backs of the last step.
fn refreshed(
    dev: &Device,
    cfg: KronConfig,
    shapes: &[(usize, usize)],
    m: usize,
    steps: usize,
    seed: u64,
) -> (KronState, u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let up =
        |rng: &mut ChaCha8Rng, r: usize, c: usize| dev.upload(r, c, &vals(rng, r * c)).unwrap();
    let cfg = KronConfig { skip: 1, ..cfg };
    let mut opt = KronOptimizer::new(dev, shapes, cfg).unwrap();
    let mut params: Vec<Matrix> = shapes.iter().map(|&(o, i)| up(&mut rng, o, i)).collect();
    let mut reads = 0;
    for _ in 0..steps {
        let batch: Vec<[Matrix; 3]> = shapes
            .iter()
            .map(|&(o, i)| [up(&mut rng, m, i), up(&mut rng, m, o), up(&mut rng, o, i)])
            .collect();
        let stats: Vec<KronStats<'_>> = batch.iter().map(|[a, e, _]| KronStats { a, e }).collect();
        let grads: Vec<&Matrix> = batch.iter().map(|[_, _, g]| g).collect();
        let before = read_backs();
        opt.step(&mut params, &grads, Some(&stats)).unwrap();
        reads = read_backs() - before;
    }
    (opt.state().unwrap(), reads)
}

fn host(m: &Matrix) -> Matrix {
    Device::Cpu
        .upload(m.rows(), m.cols(), &m.to_vec().unwrap())
        .unwrap()
}

fn bits(m: &Matrix) -> Vec<u32> {
    m.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

fn variant(k: usize) -> KronConfig {
    [KronConfig::ring(), KronConfig::reng(), KronConfig::ngd()][k]
}

/// `(Newton, Cholesky)` inversions counted.
fn routes(c: &KronCounters) -> (u64, u64) {
    (c.newton_inversions, c.cholesky_inversions)
}

proptest! {
    #![proptest_config(common::proptest_config(10))]

    /// Every factor of a first refresh (all of them small) holds what the CPU backend makes of
    /// the factor the device formed: the inverse of `F + λI` by the CPU's Cholesky at the
    /// state's damping, bit for bit; RING's norm by the CPU's power iteration from the same
    /// cold start, and NGD's trace, bit for bit. No Newton inversion is counted. A second
    /// refresh (RING: warm-started from the uploaded iterate) does the same with the state's
    /// damping; its norm is the CPU's cold one within the iteration's stop tolerance.
    /// Ragged sizes: factors of 1 to 40 rows, batches narrower and wider than them.
    #[test]
    fn small_factors_are_refreshed_as_the_cpu_refreshes_them(
        o in 1usize..=24,
        i in 1usize..=40,
        m in 1usize..=48,
        k in 0usize..3,
        steps in 1usize..=2,
        seed in any::<u64>(),
    ) {
        let cfg = variant(k);
        for dev in common::devices() {
            let (st, _) = refreshed(&dev, cfg, &[(o, i)], m, steps, seed);
            prop_assert_eq!(routes(&st.counters), (0, 2 * steps as u64));
            for f in [&st.layers[0].lambda, &st.layers[0].gamma] {
                let fh = host(&f.factor);
                let mut damped = fh.try_clone().unwrap();
                Device::Cpu.add_diagonal(&mut damped, f.damping).unwrap();
                let want = Device::Cpu.cholesky_inverse(&damped).unwrap();
                prop_assert_eq!(bits(&f.inverse), bits(&want), "inverse, n = {}", fh.rows());
                match cfg.variant {
                    KronVariant::Ring => {
                        let cpu = Device::Cpu.spectral_norm(&fh, &cfg.power).unwrap().value;
                        if steps == 1 {
                            prop_assert_eq!(f.norm.to_bits(), cpu.to_bits());
                        } else {
                            // Each run stops once its Rayleigh quotient moves by `≤ tol` of
                            // itself in a step, so within about `tol/(1 − r²)` of ‖F‖₂ from
                            // below (`r = λ₂/λ₁`): twice that allowed (optim_kron's rule), and
                            // f32 rounding.
                            let n = fh.rows();
                            let f64s: Vec<f64> = fh.to_vec().unwrap().iter().map(|&v| v as f64).collect();
                            let ev = common::eigs64(&f64s, n);
                            let r = if n > 1 && ev[0] > 0.0 { ev[1] / ev[0] } else { 0.0 };
                            let tol = 2.0 * cfg.power.tol as f64 / (1.0 - r * r).max(1e-12) + 1e-6;
                            let rel = ((f.norm - cpu) as f64 / cpu as f64).abs();
                            prop_assert!(rel <= tol, "{} vs {}, r = {}", f.norm, cpu, r);
                        }
                        prop_assert!(f.top().is_some());
                    }
                    KronVariant::Ngd => {
                        prop_assert_eq!(f.trace.to_bits(), Device::Cpu.trace(&fh).unwrap().to_bits());
                    }
                    KronVariant::Reng => {}
                }
            }
        }
    }
}

/// The route follows each factor's dimension: at `host_refresh_max = 8` a `8 x 9` layer's
/// output factor (8) is inverted on the host and its input factor (9, the bias column) by
/// Newton on the device; `0` keeps both on the device, and an explicit inverse method is
/// honoured whatever the size. The default is [`HOST_REFRESH_MAX`].
#[test]
fn the_route_follows_the_factor_size() {
    assert_eq!(KronConfig::ring().host_refresh_max, HOST_REFRESH_MAX);
    let newton = InverseMethod::Newton(NewtonOptions::default());
    for (max, inverse, want) in [
        (8, InverseMethod::Auto, (1, 1)),
        (7, InverseMethod::Auto, (2, 0)),
        (9, InverseMethod::Auto, (0, 2)),
        (0, InverseMethod::Auto, (2, 0)),
        (HOST_REFRESH_MAX, newton, (2, 0)),
        (HOST_REFRESH_MAX, InverseMethod::Cholesky, (0, 2)),
    ] {
        for base in [KronConfig::ring(), KronConfig::ngd()] {
            let cfg = KronConfig {
                host_refresh_max: max,
                inverse,
                ..base
            };
            for dev in common::devices() {
                let (st, _) = refreshed(&dev, cfg, &[(8, 9)], 6, 1, common::seed());
                let name = dev.name();
                assert_eq!(routes(&st.counters), want, "{name}: max {max}, {inverse:?}");
            }
        }
    }
}

/// What a refresh of small factors reads back: RING each factor and its last power iterate
/// (a warm refresh), NGD and RENG each factor, plus the step's one deferred read — where the
/// device route read each Newton residual and each power batch (tens per factor). On the
/// emulator only: on a GPU the GEMM plan's first trials read back too.
#[test]
fn a_small_refresh_reads_each_factor_back_once() {
    let dev = Device::Emulated;
    let shapes = [(9, 70), (3, 6), (17, 5)];
    let factors = 2 * shapes.len() as u64;
    for (k, per_factor) in [(0, 2), (1, 1), (2, 1)] {
        let cfg = variant(k);
        let (_, reads) = refreshed(&dev, cfg, &shapes, 5, 2, common::seed());
        assert_eq!(reads, per_factor * factors + 1, "{:?}", cfg.variant);
        let device = KronConfig {
            host_refresh_max: 0,
            ..cfg
        };
        let (_, on_device) = refreshed(&dev, device, &shapes, 5, 2, common::seed());
        assert!(
            on_device > 2 * reads,
            "{:?}: {on_device} vs {reads}",
            cfg.variant
        );
    }
}
