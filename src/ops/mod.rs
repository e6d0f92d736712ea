//! The device-agnostic operations: one file per hot path, each an `impl Device` block whose
//! methods validate their [`Matrix`] operands (device placement, shapes, scalar ranges, and
//! finiteness where cheap) before anything is written, then match on the device.
//!
//! [`Device::Cpu`](crate::Device::Cpu) runs the rayon backend of [`crate::cpu`] on the host
//! storage; [`Device::Emulated`](crate::Device::Emulated) and
//! [`Device::Cuda`](crate::Device::Cuda) run the kernels of `kernels/*.cu` through the
//! launchers of [`crate::cuda`].

pub mod cholesky;
pub mod elementwise;
pub mod gemm;
pub mod kalman;
pub mod kron;
pub mod newton;
pub mod norm;
pub mod precond;

use crate::device::{Element, Matrix};
use crate::error::{Error, Result};
use crate::mat::{MatMut, MatRef};

/// Host view of a matrix already checked to live on a host device.
pub(crate) fn host_ref<T: Element>(m: &Matrix<T>) -> Result<MatRef<'_, T>> {
    let data = m
        .host()
        .ok_or_else(|| Error::DeviceUnavailable("matrix is not in host memory".into()))?;
    MatRef::new(data, m.rows(), m.cols())
}

/// Mutable host view of a matrix already checked to live on a host device.
pub(crate) fn host_mut<T: Element>(m: &mut Matrix<T>) -> Result<MatMut<'_, T>> {
    let (rows, cols) = m.shape();
    let data = m
        .host_mut()
        .ok_or_else(|| Error::DeviceUnavailable("matrix is not in host memory".into()))?;
    MatMut::new(data, rows, cols)
}
