//! One typed error for the whole crate. Every public entry point returns [`Result`];
//! no input, however bad, makes grng panic.

use std::fmt;

/// Crate-wide result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in grng. Messages name the argument and what was expected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument has the wrong shape or length.
    #[error("{op}: `{arg}` has shape {got}, expected {expected}")]
    Shape {
        op: &'static str,
        arg: &'static str,
        expected: String,
        got: String,
    },
    /// An argument holds NaN or ±Inf.
    #[error("{op}: `{arg}` holds a non-finite value ({value}) at flat index {index}")]
    NonFinite {
        op: &'static str,
        arg: &'static str,
        index: usize,
        value: f32,
    },
    /// An argument of a multi-tensor op (a list of tensors, or a state array laid out over
    /// them) holds NaN or ±Inf: `arg` of tensor `tensor` (0-based, in the list's order) at
    /// flat index `index` inside that tensor.
    #[error(
        "{op}: `{arg}` of tensor {tensor} holds a non-finite value ({value}) at flat index {index}"
    )]
    NonFiniteTensor {
        op: &'static str,
        arg: &'static str,
        tensor: usize,
        index: usize,
        value: f32,
    },
    /// A hyperparameter or scalar argument is outside its valid range.
    #[error("{op}: `{arg}` = {value} is invalid, expected {expected}")]
    Value {
        op: &'static str,
        arg: &'static str,
        value: f64,
        expected: &'static str,
    },
    /// A matrix that must be symmetric positive definite is not (Cholesky pivot ≤ 0).
    #[error("{op}: matrix is not symmetric positive definite (pivot {pivot} at index {index})")]
    NotSpd {
        op: &'static str,
        index: usize,
        pivot: f64,
    },
    /// An iteration diverged or stalled above its tolerance.
    #[error("{op}: {reason} after {iterations} iterations (residual {residual:e})")]
    Diverged {
        op: &'static str,
        reason: DivergenceReason,
        iterations: usize,
        residual: f64,
    },
    /// The requested device is not available (no driver, no GPU, kernels not built).
    #[error("device unavailable: {0}")]
    DeviceUnavailable(String),
    /// Operands live on different devices.
    #[error("{op}: operands live on different devices ({a} and {b})")]
    DeviceMismatch {
        op: &'static str,
        a: &'static str,
        b: &'static str,
    },
    /// A matrix could not be allocated on its device: the element count overflows, or the host
    /// allocator or the CUDA driver refused the memory. Nothing was allocated and the device stays
    /// usable.
    #[error("out of {device} memory allocating a {rows}x{cols} matrix ({bytes} bytes): {reason}")]
    OutOfMemory {
        device: &'static str,
        rows: usize,
        cols: usize,
        bytes: u128,
        reason: String,
    },
    /// An error from the CUDA driver or NVRTC.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// A checkpoint could not be read or written.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A candle tensor grng cannot view in place: wrong dtype, strided or offset layout, or
    /// one storage lent twice (raised by `grng-candle`).
    #[error("{op}: tensor `{arg}` is {got}, expected {expected}")]
    Tensor {
        op: &'static str,
        arg: String,
        expected: &'static str,
        got: String,
    },
    /// An error raised by candle itself (through `grng-candle`).
    #[error("candle: {0}")]
    Candle(String),
    /// A pretrained model's folder or files (config, weights, tokenizer) that are missing or
    /// do not fit the model that reads them: a tensor absent or of another shape, an
    /// unsupported architecture, a tokenizer of another vocabulary (raised by `grng-lora`).
    /// `reason` names the tensor, field or token, and says how to get the model where the
    /// folder is missing.
    #[error("{}: {reason}", path.display())]
    Pretrained {
        /// The folder or file that does not fit.
        path: std::path::PathBuf,
        /// What is wrong, naming the tensor, field or token.
        reason: String,
    },
    /// A file-system error, with the path it happened on.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder that could not be read, written or created.
        path: std::path::PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A data-parallel step could not proceed on every rank alike (`grng::dist`): another
    /// rank's inputs failed their checks, or the ranks' shapes differ. Every rank returns an
    /// error, before any payload moved, and nothing changed.
    #[error("{op}: {reason}")]
    Ranks {
        op: &'static str,
        reason: &'static str,
    },
    /// The distributed engine (MPI, NCCL, the thread communicator) failed.
    #[error("communicator: {0}")]
    Communicator(String),
}

impl Error {
    /// [`Error::Io`] naming `path`: every I/O error of grng says where it happened.
    pub fn io(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

impl Error {
    /// Whether the device failed rather than the computation: [`Error::DeviceUnavailable`],
    /// [`Error::OutOfMemory`] and [`Error::Cuda`] (a kernel that does not load or launch, a
    /// driver error). A trainer can retry such a step elsewhere (another device, the CPU);
    /// the other errors say something about the inputs or the numerics, which a retry on
    /// another device reproduces.
    pub fn is_device_fault(&self) -> bool {
        matches!(
            self,
            Error::DeviceUnavailable(_) | Error::OutOfMemory { .. } | Error::Cuda(_)
        )
    }
}

/// Why an iterative method gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DivergenceReason {
    /// The residual became NaN or infinite.
    NonFinite,
    /// The residual grew instead of shrinking.
    Growing,
    /// The iteration budget ran out above the tolerance.
    NotConverged,
}

impl fmt::Display for DivergenceReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NonFinite => "non-finite residual",
            Self::Growing => "residual grew",
            Self::NotConverged => "no convergence",
        })
    }
}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Cuda(e.to_string())
    }
}

/// [`Error::OutOfMemory`] for a `rows x cols` matrix of `T` on `device`.
pub(crate) fn out_of_memory<T>(
    device: &'static str,
    rows: usize,
    cols: usize,
    reason: String,
) -> Error {
    Error::OutOfMemory {
        device,
        rows,
        cols,
        bytes: rows as u128 * cols as u128 * std::mem::size_of::<T>() as u128,
        reason,
    }
}

/// An empty host vector with room for `rows * cols` elements, or [`Error::OutOfMemory`] (on
/// `device`) when the count overflows or the allocator refuses: the refusal is returned, not
/// an abort, so a data-sized host allocation fails like a device one and changes nothing.
///
/// Host allocations of a size fixed by the code or bounded by a validated small dimension
/// (a few scalars, per-layer lists, `d_o x d_o` Kalman matrices with `d_o` ≤ its limit,
/// checkpoint record names) are left to `Vec`: they cannot grow with the data.
pub(crate) fn try_with_capacity<T>(
    device: &'static str,
    rows: usize,
    cols: usize,
) -> Result<Vec<T>> {
    let len = rows
        .checked_mul(cols)
        .filter(|n| n.checked_mul(std::mem::size_of::<T>()).is_some())
        .ok_or_else(|| out_of_memory::<T>(device, rows, cols, "size overflows usize".into()))?;
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|e| out_of_memory::<T>(device, rows, cols, e.to_string()))?;
    Ok(v)
}

/// `vec![fill; rows * cols]` on the host, or [`Error::OutOfMemory`] (as `try_with_capacity`).
pub fn try_vec<T: Clone>(rows: usize, cols: usize, fill: T) -> Result<Vec<T>> {
    let mut v = try_with_capacity("host", rows, cols)?;
    v.resize(rows * cols, fill);
    Ok(v)
}

/// `xs.to_vec()`, or [`Error::OutOfMemory`] (as `try_with_capacity`).
pub(crate) fn try_to_vec<T: Clone>(xs: &[T]) -> Result<Vec<T>> {
    let mut v = try_with_capacity("host", xs.len(), 1)?;
    // A slice copy (memcpy for `Copy` types), not an element-by-element extend.
    v.extend_from_slice(xs);
    Ok(v)
}

/// Collects an iterator of known length into a host vector, or [`Error::OutOfMemory`]
/// ([`try_with_capacity`]).
pub(crate) fn try_collect<T>(it: impl ExactSizeIterator<Item = T>) -> Result<Vec<T>> {
    let mut v = try_with_capacity("host", it.len(), 1)?;
    v.extend(it);
    Ok(v)
}

/// `Err(Error::Shape)` with both sides written by `show` unless `got == expected`.
fn check_eq<V: PartialEq>(
    op: &'static str,
    arg: &'static str,
    got: V,
    expected: V,
    show: impl Fn(&V) -> String,
) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::Shape {
            op,
            arg,
            expected: show(&expected),
            got: show(&got),
        })
    }
}

/// Shape check helper: `Err(Error::Shape)` unless `got == expected`.
pub fn check_shape(
    op: &'static str,
    arg: &'static str,
    got: (usize, usize),
    expected: (usize, usize),
) -> Result<()> {
    check_eq(op, arg, got, expected, |s| format!("{}x{}", s.0, s.1))
}

/// Length check helper for flat vectors.
pub fn check_len(op: &'static str, arg: &'static str, got: usize, expected: usize) -> Result<()> {
    check_eq(op, arg, got, expected, |n| format!("length {n}"))
}

crate::simd::multiversion! {
    /// Index of the first NaN/Inf of `xs`: the one host finiteness scan of the crate (slices here,
    /// row-major views in `cpu::check_finite_view`, host-resident matrices in
    /// [`crate::Device::check_finite`]).
    ///
    /// A branch-free exponent test over blocks of 64 elements vectorizes; the culprit is located
    /// only in a block that holds one, so a clean scan costs one pass at memory speed.
    pub fn first_non_finite<T: crate::element::Element>(xs: &[T]) -> Option<usize> {
        // NaN and ±Inf are exactly the values whose f32 exponent bits are all ones (bf16 widens
        // exactly, so the same test holds for it).
        const EXP: u32 = 0x7f80_0000;
        const BLOCK: usize = 64;
        xs.chunks(BLOCK).enumerate().find_map(|(b, blk)| {
            let bad = blk
                .iter()
                .fold(false, |bad, v| bad | (v.to_f32().to_bits() & EXP == EXP));
            bad.then(|| {
                b * BLOCK
                    + blk
                        .iter()
                        .position(|v| !v.to_f32().is_finite())
                        .unwrap_or(0)
            })
        })
    }
}

/// Finiteness check: the first NaN/Inf is reported with its index.
pub fn check_finite(op: &'static str, arg: &'static str, xs: &[f32]) -> Result<()> {
    match first_non_finite(xs) {
        None => Ok(()),
        Some(index) => Err(Error::NonFinite {
            op,
            arg,
            index,
            value: xs[index],
        }),
    }
}

/// Range check for scalars: `Err(Error::Value)` unless `ok`.
pub fn check_value(
    op: &'static str,
    arg: &'static str,
    value: f64,
    ok: bool,
    expected: &'static str,
) -> Result<()> {
    if ok && value.is_finite() {
        Ok(())
    } else {
        Err(Error::Value {
            op,
            arg,
            value,
            expected,
        })
    }
}

/// The `arg` of the error an op returns when finite inputs give a non-finite result.
pub(crate) const OVERFLOW: &str = "result (overflow)";
