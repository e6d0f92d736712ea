//! The launch record (what `benches/gpu.rs` reports as "which kernel ran") and the kernel
//! timing (its per-kernel breakdown of a step). Both are process-wide, so these tests have a
//! binary of their own (in a file with other tests, their concurrent launches would land in
//! the record: a flake hunt caught exactly that) and take turns (`SERIAL`).

use grng_testkit as common;

use std::sync::{Mutex, PoisonError};

use grng::cuda::anatomy::launch_anatomy;
use grng::cuda::timing::{take_kernel_times, time_kernels};
use grng::hooks::{record_launches, take_launches};
use grng::{Device, Error};

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
