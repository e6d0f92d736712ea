//! The concurrency contract of the crate docs ("Threads"): the public types are `Send + Sync`,
//! and two threads driving two optimizers on one device get bit-for-bit what running them one
//! after the other gets (on the CPU, the emulator and a GPU when present).

use grng_testkit as common;

use grng::cuda::CudaDevice;
use grng::optim::adamw::{AdamW, AdamWConfig};
use grng::optim::kalman::RKalman;
use grng::optim::kron::{KronConfig, KronOptimizer};
use grng::optim::sgd::Sgd;
use grng::optim::sophia::Sophia;
use grng::optim::KronStats;
use grng::{Device, Error, Matrix};
use grng_train::mlp::Mlp;
use grng_train::train::Trainer;
use rand_chacha::ChaCha8Rng;

/// Compiles only if every type named is `Send + Sync`.
#[test]
fn public_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Device>();
    send_sync::<CudaDevice>();
    send_sync::<Matrix>();
    send_sync::<Matrix<half::bf16>>();
    send_sync::<Error>();
    send_sync::<Sgd>();
    send_sync::<AdamW>();
    send_sync::<Sophia>();
    send_sync::<RKalman>();
    send_sync::<KronOptimizer>();
    send_sync::<Mlp>();
    send_sync::<Trainer>();
}

/// Inputs of the two runs, drawn once on the test's thread.
struct Inputs {
    params: Vec<f32>,
    grads: Vec<Vec<f32>>,
    a: Vec<f32>,
    e: Vec<f32>,
}

const N: usize = 777; // ragged on purpose
const STEPS: usize = 3;
// Batch, layer inputs (with the bias column), layer outputs.
const M: usize = 9;
const D_IN: usize = 5;
const D_OUT: usize = 3;

fn inputs(rng: &mut ChaCha8Rng) -> Inputs {
    Inputs {
        params: common::vals(rng, N),
        grads: (0..STEPS).map(|_| common::vals(rng, N)).collect(),
        a: common::vals(rng, M * D_IN),
        e: common::vals(rng, M * D_OUT),
    }
}

/// AdamW over `N` parameters for `STEPS` steps; the final parameter bits.
fn run_adamw(dev: &Device, x: &Inputs) -> Vec<u32> {
    let mut opt = AdamW::new(dev, N, AdamWConfig::default()).unwrap();
    let mut p = dev.upload(N, 1, &x.params).unwrap();
    for g in &x.grads {
        opt.step(&mut p, &dev.upload(N, 1, g).unwrap()).unwrap();
    }
    p.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// RING on one `D_OUT x D_IN` layer for `STEPS` steps; the final weight bits.
fn run_ring(dev: &Device, x: &Inputs) -> Vec<u32> {
    let a = dev.upload(M, D_IN, &x.a).unwrap();
    let e = dev.upload(M, D_OUT, &x.e).unwrap();
    let mut g = dev.zeros(D_OUT, D_IN).unwrap();
    dev.batch_gradient(&e, &a, &mut g).unwrap();
    let mut w = vec![dev.zeros(D_OUT, D_IN).unwrap()];
    let mut opt = KronOptimizer::new(dev, &[(D_OUT, D_IN)], KronConfig::ring()).unwrap();
    for _ in 0..STEPS {
        let stats = opt.needs_stats().then(|| vec![KronStats { a: &a, e: &e }]);
        opt.step(&mut w, &[&g], stats.as_deref()).unwrap();
    }
    w[0].to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn two_threads_on_one_device_match_sequential_runs() {
    let x = inputs(&mut common::seeded_rng());
    let mut devices = vec![Device::Cpu];
    devices.extend(common::devices());
    for dev in &devices {
        let sequential = (run_adamw(dev, &x), run_ring(dev, &x));
        let threaded = std::thread::scope(|s| {
            let adamw = s.spawn(|| run_adamw(dev, &x));
            let ring = s.spawn(|| run_ring(dev, &x));
            (adamw.join().unwrap(), ring.join().unwrap())
        });
        assert!(
            sequential == threaded,
            "{}: threads changed the results",
            dev.name()
        );
    }
}
