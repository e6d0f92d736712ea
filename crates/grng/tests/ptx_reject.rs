//! A kernel module the driver will not load (a rejected PTX), injected at the launch layer
//! (`grng::hooks::inject_ptx_reject`) so it runs without a GPU: every op that needs the
//! file is a typed `DeviceUnavailable` naming it, the optimizer loses nothing (state and weights
//! bit-for-bit unchanged, and it steps like a twin that never saw the fault), and
//! `Device::auto()` falls back to the CPU with one line saying why.
//!
//! The injection is process-wide, so this binary holds only these tests: the first is the only
//! one launching kernels in this process, the second runs its check in a child process.

use grng_testkit as common;

use grng::checkpoint::{Checkpoint, Writer};
use grng::cuda::CudaDevice;
use grng::hooks::inject_ptx_reject;
use grng::optim::adamw::{AdamW, AdamWConfig};
use grng::optim::kalman::{RKalman, RKalmanConfig};
use grng::optim::kron::{KronConfig, KronOptimizer};
use grng::optim::KronStats;
use grng::{Device, Error, Matrix};
use rand_chacha::ChaCha8Rng;

/// The kernel files the ops use (PTX constant names).
const FILES: [&str; 5] = ["ELEMENTWISE", "KALMAN", "SYRK", "NEWTON", "GEMM"];

/// The probes' sizes, ragged on purpose.
struct Sizes {
    /// One layer of RING: its batch, its inputs (with the bias column), its outputs.
    m: usize,
    d_in: usize,
    d_out: usize,
    /// The flat optimizers' parameter count.
    n: usize,
    /// The Kalman batch.
    d_o: usize,
}
const S: Sizes = Sizes {
    m: 9,
    d_in: 5,
    d_out: 3,
    n: 45,
    d_o: 2,
};

struct Inputs {
    a: Vec<f32>,
    e: Vec<f32>,
    g: Vec<f32>,
    flat: Vec<f32>,
    h: Vec<f32>,
    v: Vec<f32>,
}

fn inputs(rng: &mut ChaCha8Rng) -> Inputs {
    Inputs {
        a: common::vals(rng, S.m * S.d_in),
        e: common::vals(rng, S.m * S.d_out),
        g: common::vals(rng, S.d_out * S.d_in),
        flat: common::vals(rng, S.n),
        h: common::vals(rng, S.d_o * S.n),
        v: common::vals(rng, S.d_o),
    }
}

/// An optimizer with the weights it updates.
enum Opt {
    Ring(KronOptimizer, Matrix),
    Kalman(RKalman),
    AdamW(AdamW, Matrix),
}

impl Opt {
    fn all(dev: &Device) -> [Opt; 3] {
        let ring = KronConfig {
            skip: 1, // every step refreshes: Kronecker factors, inverses, preconditioning
            // On the device (Newton, power iteration), not the host: every kernel file.
            host_refresh_max: 0,
            ..KronConfig::ring()
        };
        [
            Opt::Ring(
                KronOptimizer::new(dev, &[(S.d_out, S.d_in)], ring).unwrap(),
                dev.zeros(S.d_out, S.d_in).unwrap(),
            ),
            Opt::Kalman(RKalman::new(dev, &[0.1; S.n], S.d_o, RKalmanConfig::default()).unwrap()),
            Opt::AdamW(
                AdamW::new(dev, S.n, AdamWConfig::default()).unwrap(),
                dev.zeros(S.n, 1).unwrap(),
            ),
        ]
    }

    fn step(&mut self, dev: &Device, x: &Inputs) -> grng::Result<()> {
        match self {
            Opt::Ring(opt, w) => {
                let a = dev.upload(S.m, S.d_in, &x.a)?;
                let e = dev.upload(S.m, S.d_out, &x.e)?;
                let g = dev.upload(S.d_out, S.d_in, &x.g)?;
                let stats = opt.needs_stats().then(|| vec![KronStats { a: &a, e: &e }]);
                opt.step(std::slice::from_mut(w), &[&g], stats.as_deref())?;
            }
            Opt::Kalman(opt) => {
                opt.step(&dev.upload(S.d_o, S.n, &x.h)?, &dev.upload(S.d_o, 1, &x.v)?)?;
            }
            Opt::AdamW(opt, w) => opt.step(w, &dev.upload(S.n, 1, &x.flat)?)?,
        }
        Ok(())
    }

    /// Every byte of the optimizer's checkpoint, then the weights' bits.
    fn snapshot(&self) -> Vec<u8> {
        let (ck, w): (&dyn Checkpoint, Option<&Matrix>) = match self {
            Opt::Ring(o, w) => (o, Some(w)),
            Opt::Kalman(o) => (o, None),
            Opt::AdamW(o, w) => (o, Some(w)),
        };
        let mut wr = Writer::new();
        ck.save(&mut wr).unwrap();
        let mut bytes = wr.to_bytes();
        for v in w.map(|w| w.to_vec().unwrap()).unwrap_or_default() {
            bytes.extend(v.to_bits().to_le_bytes());
        }
        bytes
    }
}

#[test]
fn a_rejected_ptx_is_a_typed_error_and_loses_nothing() {
    let dev = Device::Emulated;
    let x = inputs(&mut common::seeded_rng());
    for file in FILES {
        let mut rejected = 0;
        for (mut opt, mut twin) in Opt::all(&dev).into_iter().zip(Opt::all(&dev)) {
            // A step first, so the state the fault must not touch is not the initial one.
            opt.step(&dev, &x).unwrap();
            twin.step(&dev, &x).unwrap();
            let before = opt.snapshot();
            inject_ptx_reject(Some(file));
            let r = opt.step(&dev, &x);
            inject_ptx_reject(None);
            match r {
                // This optimizer does not use the file: keep the twin in step.
                Ok(()) => twin.step(&dev, &x).unwrap(),
                Err(Error::DeviceUnavailable(msg)) => {
                    assert!(msg.contains(&format!("kernel file {file}:")), "{msg}");
                    assert!(
                        opt.snapshot() == before,
                        "{file}: the failed step changed state"
                    );
                    rejected += 1;
                }
                Err(e) => panic!("{file}: expected DeviceUnavailable, got {e:?}"),
            }
            // Nothing lost: the next step is the twin's, bit for bit.
            opt.step(&dev, &x).unwrap();
            twin.step(&dev, &x).unwrap();
            assert!(
                opt.snapshot() == twin.snapshot(),
                "{file}: differs from its twin"
            );
        }
        assert!(rejected > 0, "no optimizer launched a kernel of {file}");
    }
}

/// Set in the child process that [`auto_falls_back_to_the_cpu_when_the_ptx_is_rejected`] runs.
const CHILD: &str = "GRNG_PTX_REJECT_CHILD";

#[test]
fn auto_falls_back_to_the_cpu_when_the_ptx_is_rejected() {
    if std::env::var_os(CHILD).is_some() {
        // The child: every module load fails; `auto` must still give a device, the CPU.
        inject_ptx_reject(Some("*"));
        assert!(matches!(Device::auto(), Ok(Device::Cpu)));
        return;
    }
    let stderr = common::run_child(
        "auto_falls_back_to_the_cpu_when_the_ptx_is_rejected",
        &[(CHILD, Some("1")), ("GRNG_DEVICE", None)],
    );
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("grng: using the CPU: device unavailable: "))
        .collect();
    assert_eq!(lines.len(), 1, "one fallback line expected:\n{stderr}");
    // With a GPU the driver opens, so the reason must be the rejected module; without one the
    // line names the missing driver or kernels instead.
    if CudaDevice::new(0).is_ok() {
        assert!(
            lines[0].contains("rejected the PTX of kernel file"),
            "{}",
            lines[0]
        );
    }
}
