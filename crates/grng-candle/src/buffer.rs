//! What both kinds of storage share when a candle tensor is lent to grng: the [`Buffer`] a
//! storage's elements move in (the host `Vec`, here; the `CudaSlice`, in `cuda.rs`) and the
//! conversions between the two crates' errors. Below `view.rs` and `cuda.rs`.

use grng::error::{Error, Result};
use grng::Matrix;

/// The candle error of a grng one, for the `candle_nn::Optimizer` interface.
pub(crate) fn to_candle(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// The grng error of a candle one.
pub(crate) fn from_candle(e: candle_core::Error) -> Error {
    Error::Candle(e.to_string())
}

/// A storage's f32 buffer as `view::Lend` moves it: the `Vec` of candle's CPU storage, the
/// `CudaSlice` of its CUDA one (feature `cuda`).
pub(crate) trait Buffer: Sized {
    fn len(&self) -> usize;
    /// `len` zeros on the device of `self`, in place of a buffer the body did not give back.
    fn zeros(&self, len: usize) -> Result<Self>;
    fn into_matrix(self, rows: usize, cols: usize) -> Result<Matrix>;
    /// The matrix's buffer, when it is of this kind (a download for a GPU matrix into a `Vec`).
    fn from_matrix(m: Matrix) -> Result<Self>;
}

impl Buffer for Vec<f32> {
    fn len(&self) -> usize {
        Vec::len(self)
    }
    fn zeros(&self, len: usize) -> Result<Self> {
        Ok(vec![0.0; len])
    }
    fn into_matrix(self, rows: usize, cols: usize) -> Result<Matrix> {
        Matrix::from_host_vec(rows, cols, self)
    }
    fn from_matrix(m: Matrix) -> Result<Self> {
        m.into_host_vec()
    }
}
