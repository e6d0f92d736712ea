//! Device selection faults: with no GPU, `Device::auto()` falls back to the CPU (printing one
//! line why) instead of failing, and asking for CUDA explicitly is a typed error.

use grng_testkit as common;

use grng::cuda::CudaDevice;
use grng::{Device, Error};

#[test]
fn auto_falls_back_to_the_cpu_without_a_gpu() {
    // Only meaningful with the selection left to `auto` (CI never sets GRNG_DEVICE).
    if std::env::var_os("GRNG_DEVICE").is_some() {
        return;
    }
    match (CudaDevice::new(0), Device::auto()) {
        (Ok(_), Ok(Device::Cuda(_))) => {}
        (Err(e), Ok(Device::Cpu)) => {
            assert!(matches!(e, Error::DeviceUnavailable(_)), "{e}");
        }
        (gpu, auto) => panic!("CudaDevice::new: {gpu:?}, Device::auto: {auto:?}"),
    }
}

/// Asking for more memory than any device has is a typed error naming the allocation — not an
/// abort — and the device stays usable: an optimizer made before it steps exactly like a twin
/// that never saw the failure (CPU, emulator, and CUDA when present).
#[test]
fn out_of_memory_is_a_typed_error_and_the_device_stays_usable() {
    use grng::optim::adamw::{AdamW, AdamWConfig};
    let mut devices = vec![Device::Cpu, Device::Emulated];
    if let Ok(c) = CudaDevice::new(0) {
        devices.push(Device::Cuda(c));
    }
    let n = 37;
    let grad: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    for dev in devices {
        let step = |opt: &mut AdamW, w: &mut grng::Matrix| {
            let g = dev.upload(n, 1, &grad).unwrap();
            opt.step(w, &g).unwrap();
        };
        let mut twin = AdamW::new(&dev, n, AdamWConfig::default()).unwrap();
        let mut w_twin = dev.zeros(n, 1).unwrap();
        let mut opt = AdamW::new(&dev, n, AdamWConfig::default()).unwrap();
        let mut w = dev.zeros(n, 1).unwrap();
        step(&mut twin, &mut w_twin);
        step(&mut opt, &mut w);

        // 2^40 x 2^20 f32 = 4 EiB: representable, but more than any allocator or GPU can give
        // (the refusal path); and a count that overflows usize (the size check).
        for (rows, cols) in [(1usize << 40, 1usize << 20), (usize::MAX, 2)] {
            match dev.zeros::<f32>(rows, cols) {
                Err(Error::OutOfMemory {
                    rows: r, cols: c, ..
                }) => {
                    assert_eq!((r, c), (rows, cols), "{}", dev.name());
                }
                other => panic!("{}: zeros({rows}, {cols}) gave {other:?}", dev.name()),
            }
            let e = AdamW::new(&dev, rows.saturating_mul(cols), AdamWConfig::default());
            assert!(
                matches!(e, Err(Error::OutOfMemory { .. })),
                "{}: {e:?}",
                dev.name()
            );
        }

        step(&mut twin, &mut w_twin);
        step(&mut opt, &mut w);
        assert_eq!(
            w.to_vec().unwrap(),
            w_twin.to_vec().unwrap(),
            "{}: the step after a refused allocation differs",
            dev.name()
        );
    }
}

/// The library's own data-sized host buffers (here a network's parameter vector, 2^56 f32) are
/// typed `OutOfMemory` errors too, not allocator aborts.
#[test]
fn data_sized_host_buffers_are_typed_out_of_memory() {
    use grng_train::mlp::{Activation, Loss, Mlp, MlpConfig};
    let config = MlpConfig {
        sizes: vec![1 << 28, 1 << 28],
        activation: Activation::Tanh,
        loss: Loss::SoftmaxCrossEntropy,
    };
    match Mlp::new(config, 0) {
        Err(Error::OutOfMemory { device, .. }) => assert_eq!(device, "host"),
        other => panic!("Mlp::new of 2^56 parameters gave {:?}", other.map(|_| ())),
    }
}

/// A GPU device keeps its memory pool's reserve across synchronizations
/// (`CudaDevice::new`: release threshold `u64::MAX`), so the per-op allocations after each
/// status read-back reuse memory instead of mapping it again. CUDA arm only: skipped without
/// a GPU, required under the GPU bundle's `GRNG_REQUIRE_CUDA=1` (`common::gpu`).
#[test]
fn a_gpu_device_keeps_its_pool_reserve() {
    let Some(d) = common::gpu(CudaDevice::new(0)) else {
        return;
    };
    // `None`: a device without stream-ordered allocation, where cudarc uses cuMemAlloc.
    if let Some(t) = d.pool_release_threshold().unwrap() {
        assert_eq!(t, u64::MAX);
    }
}
