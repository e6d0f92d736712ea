//! The element types of device matrices, below every other module (devices, backends and
//! the checks of `error` all name it). Depends on nothing of the crate.

use half::bf16;

/// Scalar types a [`Matrix`](crate::Matrix) can hold: `f32`, and `bf16` for GEMM inputs.
pub trait Element:
    Copy
    + Default
    + Send
    + Sync
    + bytemuck::Pod
    + cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
    + 'static
{
    /// Widen to f32 (exact for both types).
    fn to_f32(self) -> f32;
    /// Round from f32 (round-to-nearest-even for bf16).
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
