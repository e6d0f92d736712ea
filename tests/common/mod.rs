//! Helpers shared by the integration tests (`mod common;` in each test crate).
// Each test crate compiles its own copy and uses only some of these.
#![allow(dead_code)]

use grng::cuda::CudaDevice;
use grng::Device;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Unit roundoff of f32.
pub const U32: f64 = 1.0 / (1u64 << 24) as f64;

/// The kernel devices to check: always the emulator, plus CUDA when a GPU is present.
pub fn devices() -> Vec<Device> {
    let mut d = vec![Device::Emulated];
    if let Ok(c) = CudaDevice::new(0) {
        d.push(Device::Cuda(c));
    }
    d
}

/// `n` values drawn uniformly from `[lo, hi)`.
pub fn uniform(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// `len` values drawn uniformly from `[-1, 1)`.
pub fn vals(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    uniform(rng, len, -1.0, 1.0)
}
