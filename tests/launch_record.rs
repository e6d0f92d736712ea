//! The launch record (what `benches/gpu.rs` reports as "which kernel ran"). It is
//! process-wide, so this test has a binary of its own: in a file with other tests, their
//! concurrent launches would land in its record (a flake hunt caught exactly that).

mod common;

use grng::cuda::launch::{record_launches, take_launches};
use grng::Device;

/// The record names the kernels an op launched, and nothing for the CPU backend; switched
/// off, it stays empty.
#[test]
fn launch_record_names_the_kernels_run() {
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
