//! Zero-copy views: a candle tensor's buffer lent to grng as a [`Matrix`] and given back.
//!
//! A [`Matrix`] owns its buffer, so a view *moves* the tensor's buffer — the `Vec` of a CPU
//! tensor, the `CudaSlice` of a CUDA one (feature `cuda`) — into a matrix for the
//! duration of a closure and moves it back afterwards (inside candle's [`InplaceOp1`], which
//! holds the tensor's write lock meanwhile): no element is copied, the pointer is the same, and
//! no other user of the tensor can observe the lent-out state.
//!
//! Without the `cuda` feature, CUDA tensors are refused with
//! [`Error::DeviceUnavailable`] (see the module docs of [`crate::candle`]); Metal tensors
//! always are.

use crate::buffer::{from_candle, to_candle, Buffer};
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor};
use grng::error::{check_len, Error, Result};
use grng::{Device, Matrix};
use std::cell::RefCell;
use std::panic::AssertUnwindSafe;

/// The candle devices whose tensors grng views, for messages.
const VIEWED: &str = if cfg!(feature = "cuda") {
    "CPU and CUDA"
} else {
    "CPU"
};

/// How a tensor is seen as a matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ViewAs {
    /// A rank-2 tensor `(r, c)` as an `r x c` matrix (rank 1 `(n)` as `n x 1`).
    Matrix,
    /// Any tensor of `n` elements as an `n x 1` column (the flat vectors of `AdamW`, `Sgd`,
    /// `Sophia`).
    Column,
}

/// The grng device that works on the buffers of candle `device`: [`Device::Cpu`] for candle's
/// CPU; with the `cuda` feature, for a candle CUDA device, a [`Device::Cuda`] on
/// candle's own context and stream
/// ([`CudaDevice::from_stream`](grng::cuda::CudaDevice::from_stream)), the same one (module
/// cache included) for every call with that candle device.
///
/// # Errors
/// [`Error::DeviceUnavailable`] for a Metal device, and for a CUDA device without the
/// `cuda` feature or when grng's kernels were not built.
pub fn grng_device(device: &candle_core::Device) -> Result<Device> {
    match device {
        candle_core::Device::Cpu => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => super::cuda::grng_device(d).map(Device::Cuda),
        other => Err(Error::DeviceUnavailable(format!(
            "grng_candle views {VIEWED} tensors only, got a tensor on {:?}",
            other.location()
        ))),
    }
}

/// The candle device named `name` that grng can work with (the examples' `--device`):
/// `cpu`; with the `cuda` feature also `cuda` (GPU 0) and `cuda:N`.
///
/// # Errors
/// [`Error::DeviceUnavailable`] for any other name, and for `cuda` without the feature or
/// where candle cannot open the GPU (no driver, no such GPU).
pub fn candle_device(name: &str) -> Result<candle_core::Device> {
    match name {
        "cpu" => Ok(candle_core::Device::Cpu),
        #[cfg(feature = "cuda")]
        cuda if cuda == "cuda" || cuda.starts_with("cuda:") => super::cuda::candle_device(cuda),
        other => Err(Error::DeviceUnavailable(format!(
            "device {other:?}: grng_candle works on candle's {VIEWED} tensors only"
        ))),
    }
}

/// So that `?` carries candle's errors in code returning [`grng::Result`].
/// The `rows x cols` shape `t` is viewed with, after checking dtype, rank, layout and device.
fn check_tensor(op: &'static str, arg: &str, t: &Tensor, how: ViewAs) -> Result<(usize, usize)> {
    let bad = |expected: &'static str, got: String| Error::Tensor {
        op,
        arg: arg.to_string(),
        expected,
        got,
    };
    grng_device(t.device())?;
    if t.dtype() != DType::F32 {
        return Err(bad("f32", format!("{:?}", t.dtype())));
    }
    let dims = t.dims();
    let shape = match (how, dims) {
        (ViewAs::Matrix, [r, c]) => (*r, *c),
        (ViewAs::Matrix, [n]) => (*n, 1),
        (ViewAs::Matrix, _) => {
            return Err(Error::Shape {
                op,
                arg: "tensor (rank 1 or 2 to view as a matrix)",
                expected: "(rows, cols) or (n)".into(),
                got: format!("{dims:?}"),
            })
        }
        (ViewAs::Column, _) => (t.elem_count(), 1),
    };
    if shape.0 * shape.1 == 0 {
        return Err(Error::Shape {
            op,
            arg: "tensor (non-empty)",
            expected: "at least one element".into(),
            got: format!("{dims:?}"),
        });
    }
    let layout = t.layout();
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        return Err(bad(
            "contiguous, starting at offset 0 of its storage",
            format!(
                "strided {:?} from offset {}",
                layout.stride(),
                layout.start_offset()
            ),
        ));
    }
    // The storage must be exactly the tensor: the whole buffer is lent out.
    let Some((len, _)) = f32_buffer(&t.storage_and_layout().0) else {
        let expected = if cfg!(feature = "cuda") {
            "an f32 CPU or CUDA storage"
        } else {
            "an f32 CPU storage"
        };
        return Err(bad(expected, "another storage".into()));
    };
    if len != t.elem_count() {
        return Err(bad(
            "the whole of its storage",
            format!("{} of {len} stored elements", t.elem_count()),
        ));
    }
    Ok(shape)
}

/// `t` itself when it can be viewed in place, else a copy on its device that can (a strided or
/// offset gradient, a view into a larger storage): for statistics and gradients, which grng
/// only reads.
pub(crate) fn owned(t: &Tensor) -> Result<Tensor> {
    if check_tensor("grng_candle::owned", "t", t, ViewAs::Column).is_ok() {
        return Ok(t.clone());
    }
    (|| Ok(t.force_contiguous()?.detach()))().map_err(from_candle)
}

/// Element count and address of the f32 buffer a storage holds — the `Vec` of a CPU storage,
/// the device allocation of a CUDA one (feature `cuda`) — or `None` for any other storage.
fn f32_buffer(storage: &Storage) -> Option<(usize, u64)> {
    match storage {
        Storage::Cpu(CpuStorage::F32(v)) => Some((v.len(), v.as_ptr() as u64)),
        #[cfg(feature = "cuda")]
        Storage::Cuda(s) => super::cuda::f32_buffer(s),
        _ => None,
    }
}

/// The address of `t`'s f32 buffer (CPU or CUDA), the identity [`with_matrices`] refuses
/// twice; `None` for other storages.
pub(crate) fn storage_addr(t: &Tensor) -> Option<u64> {
    f32_buffer(&t.storage_and_layout().0).map(|(_, addr)| addr)
}

/// [`Error::DeviceMismatch`] unless every tensor is on the device of the first (candle's
/// `same_device`: one CPU, one CUDA device object), checked before anything is lent: grng's
/// own check of a launch's operands sees only CPU against CUDA.
pub(crate) fn check_same_device(op: &'static str, tensors: &[&Tensor]) -> Result<()> {
    let Some((first, rest)) = tensors.split_first() else {
        return Ok(());
    };
    match rest
        .iter()
        .find(|t| !t.device().same_device(first.device()))
    {
        None => Ok(()),
        Some(t) => Err(Error::DeviceMismatch {
            op,
            a: device_name(first.device()),
            b: device_name(t.device()),
        }),
    }
}

fn device_name(device: &candle_core::Device) -> &'static str {
    match device {
        candle_core::Device::Cpu => "cpu",
        candle_core::Device::Cuda(_) => "cuda",
        candle_core::Device::Metal(_) => "metal",
    }
}

/// Runs `f` on grng matrices that *are* the buffers of `tensors` (no copy; same pointers), in
/// order, each seen as `how`. The tensors are locked for writing meanwhile. Whatever buffer a
/// matrix holds when `f` returns is moved back into its tensor, also when `f` fails (grng's
/// operations leave their outputs unchanged on error). grng's in-place operations commit by
/// swapping in the buffer they computed, so after one the tensor owns that new buffer (moved,
/// not copied).
///
/// # Errors
/// [`Error::Tensor`] for a non-f32, strided, offset or partial-storage tensor or one storage
/// passed twice; [`Error::Shape`] for a rank above 2 with [`ViewAs::Matrix`], an empty tensor,
/// or when `f` replaced a matrix by one of another shape or device (the tensor is zero-filled
/// then); [`Error::DeviceUnavailable`] for a tensor on a device grng does not view (see
/// [`grng_device`]); [`Error::DeviceMismatch`] for tensors on different devices; whatever `f`
/// returns. Nothing is lent when a check fails.
pub fn with_matrices<R>(
    tensors: &[&Tensor],
    how: ViewAs,
    f: impl FnOnce(&mut [Matrix]) -> Result<R>,
) -> Result<R> {
    const OP: &str = "grng_candle::with_matrices";
    let mut shapes = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        shapes.push(check_tensor(OP, &format!("tensors[{i}]"), t, how)?);
    }
    check_same_device(OP, tensors)?;
    let mut addrs: Vec<u64> = tensors.iter().filter_map(|t| storage_addr(t)).collect();
    addrs.sort_unstable();
    if let Some(w) = addrs.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::Tensor {
            op: OP,
            arg: "tensors".into(),
            expected: "distinct storages",
            got: format!("one storage (at {:#x}) passed twice", w[0]),
        });
    }
    let mut f = Some(f);
    let mut call = |ms: &mut [Matrix]| match f.take() {
        Some(f) => f(ms),
        None => Err(Error::Candle("the innermost lend ran twice".into())),
    };
    let mut lent = Vec::with_capacity(tensors.len());
    lend_rec(tensors, &shapes, &mut lent, &mut call)
}

/// One tensor: [`with_matrices`] with a single operand.
///
/// # Errors
/// As [`with_matrices`].
pub fn with_matrix<R>(
    t: &Tensor,
    how: ViewAs,
    f: impl FnOnce(&mut Matrix) -> Result<R>,
) -> Result<R> {
    with_matrices(&[t], how, |ms| f(&mut ms[0]))
}

/// Lends `tensors[0]`, then the rest inside it, then calls `f` on all of them.
fn lend_rec<R>(
    tensors: &[&Tensor],
    shapes: &[(usize, usize)],
    lent: &mut Vec<Matrix>,
    f: &mut dyn FnMut(&mut [Matrix]) -> Result<R>,
) -> Result<R> {
    let (Some((t, rest)), Some((&(rows, cols), rest_shapes))) =
        (tensors.split_first(), shapes.split_first())
    else {
        return f(lent);
    };
    let op = Lend {
        rows,
        cols,
        body: RefCell::new(Some(|m: Matrix| {
            lent.push(m);
            let r = lend_rec(rest, rest_shapes, lent, f);
            match lent.pop() {
                Some(m) => (m, r),
                None => unreachable!("`lent` holds the matrix pushed above"),
            }
        })),
        out: RefCell::new(None),
    };
    t.inplace_op1(&op).map_err(from_candle)?;
    op.out
        .into_inner()
        .unwrap_or_else(|| Err(Error::Candle("the in-place op did not run".into())))
}

/// The [`InplaceOp1`] that moves the storage's buffer into a matrix, runs `body` and moves the
/// (possibly replaced) buffer back.
struct Lend<B, R> {
    rows: usize,
    cols: usize,
    body: RefCell<Option<B>>,
    out: RefCell<Option<Result<R>>>,
}

impl<B: FnOnce(Matrix) -> (Matrix, Result<R>), R> Lend<B, R> {
    /// Moves `buf` into a matrix, `placeholder` (a buffer on its device, never read: the tensor
    /// is locked) holding its place, runs the body, and moves back whatever buffer the matrix
    /// then holds: the body may have swapped in a new one. Returns the placeholder. A buffer of
    /// another length or kind is not taken back: `buf` becomes zeros of its length and the
    /// body's result this error. A body that panics leaves zeros too, before the panic goes on
    /// (and where no zeros can be allocated, this panics). Runs the body once: later calls
    /// (candle calls an op once) return `placeholder`.
    pub(super) fn lend<Buf: Buffer>(
        &self,
        buf: &mut Buf,
        placeholder: Buf,
    ) -> candle_core::Result<Buf> {
        const OP: &str = "grng_candle::with_matrices";
        let Some(body) = self.body.borrow_mut().take() else {
            return Ok(placeholder);
        };
        let len = buf.len();
        // Checked before locking; checked again here, before `buf` is taken, so that the
        // matrix below cannot fail to be made with the placeholder left in the tensor.
        check_len(OP, "storage", len, self.rows * self.cols).map_err(to_candle)?;
        let lent = std::mem::replace(buf, placeholder)
            .into_matrix(self.rows, self.cols)
            .map_err(to_candle)?;
        // A tensor left holding the placeholder would be read past its end (candle's storage
        // lock does not poison): where the body panics, dropping the buffer with the matrix,
        // or hands back one that cannot be taken back, the tensor gets zeros of its length.
        let refill = |buf: &mut Buf| {
            let zeros = buf.zeros(len).unwrap_or_else(|e| {
                // Not even zeros can be had: the GPU's memory is exhausted on top of that.
                panic!("{OP}: no memory to restore a tensor whose buffer is lost: {e}")
            });
            std::mem::replace(buf, zeros)
        };
        let (m, mut r) = match std::panic::catch_unwind(AssertUnwindSafe(|| body(lent))) {
            Ok(out) => out,
            Err(panic) => {
                refill(buf);
                std::panic::resume_unwind(panic)
            }
        };
        let shape = m.shape();
        let back = match Buf::from_matrix(m) {
            Ok(back) if back.len() == len => Some(back),
            Ok(_) => {
                if let (Ok(_), Err(e)) = (&r, check_len(OP, "lent matrix", shape.0 * shape.1, len))
                {
                    r = Err(e);
                }
                None
            }
            Err(e) => {
                r = Err(e);
                None
            }
        };
        *self.out.borrow_mut() = Some(r);
        Ok(match back {
            Some(back) => std::mem::replace(buf, back),
            // The body broke the contract: keep the tensor valid and say so (above).
            None => refill(buf),
        })
    }
}

impl<B: FnOnce(Matrix) -> (Matrix, Result<R>), R> InplaceOp1 for Lend<B, R> {
    fn name(&self) -> &'static str {
        "grng-lend"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(v) = storage else {
            // Checked before locking; a dtype change in between is candle's bug, not ours.
            return Err(candle_core::Error::Msg(
                "grng_candle::with_matrices: storage is not f32".into(),
            ));
        };
        self.lend(v, Vec::new()).map(drop)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        _layout: &Layout,
    ) -> candle_core::Result<()> {
        super::cuda::lend_storage(storage, |buf, spare| self.lend(buf, spare))
    }
}
