//! Zero-copy views: a candle tensor's buffer lent to grng as a [`Matrix`] and given back.
//!
//! A [`Matrix`] owns its buffer, so a view *moves* the tensor's `Vec` into a matrix for the
//! duration of a closure and moves it back afterwards (inside candle's [`InplaceOp1`], which
//! holds the tensor's write lock meanwhile): no element is copied, the pointer is the same, and
//! no other user of the tensor can observe the lent-out state.
//!
//! Only candle's CPU tensors are viewed today (grng's [`Device::Cpu`]); CUDA tensors are
//! refused with [`Error::DeviceUnavailable`] (see the module docs of [`crate::candle`]).

use crate::error::{check_len, Error, Result};
use crate::{Device, Matrix};
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor};
use std::cell::RefCell;

/// How a tensor is seen as a matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ViewAs {
    /// A rank-2 tensor `(r, c)` as an `r x c` matrix (rank 1 `(n)` as `n x 1`).
    Matrix,
    /// Any tensor of `n` elements as an `n x 1` column (the flat vectors of `AdamW`, `Sgd`,
    /// `Sophia`).
    Column,
}

/// The grng device that works on the buffers of candle `device`.
///
/// # Errors
/// [`Error::DeviceUnavailable`] for a CUDA or Metal device: grng views candle's CPU tensors only.
pub fn grng_device(device: &candle_core::Device) -> Result<Device> {
    match device {
        candle_core::Device::Cpu => Ok(Device::Cpu),
        other => Err(Error::DeviceUnavailable(format!(
            "grng::candle views CPU tensors only, got a tensor on {:?}",
            other.location()
        ))),
    }
}

/// The candle device named `name` that grng can work with (the examples' `--device`):
/// `cpu`.
///
/// # Errors
/// [`Error::DeviceUnavailable`] for `cuda` (candle's CUDA tensors are not viewed yet) and any
/// other name.
pub fn candle_device(name: &str) -> Result<candle_core::Device> {
    match name {
        "cpu" => Ok(candle_core::Device::Cpu),
        other => Err(Error::DeviceUnavailable(format!(
            "device {other:?}: grng::candle works on candle's CPU tensors only"
        ))),
    }
}

/// The candle error of a grng one, for the `candle_nn::Optimizer` interface.
pub(crate) fn to_candle(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// The grng error of a candle one.
pub(crate) fn from_candle(e: candle_core::Error) -> Error {
    Error::Candle(e.to_string())
}

/// So that `?` carries candle's errors in code returning [`crate::Result`].
impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        from_candle(e)
    }
}

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
    // The storage must be exactly the tensor: the whole `Vec` is lent out.
    let (storage, _) = t.storage_and_layout();
    let len = match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => v.len(),
        _ => return Err(bad("an f32 CPU storage", "another storage".into())),
    };
    if len != t.elem_count() {
        return Err(bad(
            "the whole of its storage",
            format!("{} of {len} stored elements", t.elem_count()),
        ));
    }
    Ok(shape)
}

/// `t` itself when it can be viewed in place, else a copy that can (a strided or offset
/// gradient, a view into a larger storage): for statistics and gradients, which grng only reads.
pub(crate) fn owned(t: &Tensor) -> Result<Tensor> {
    if check_tensor("grng::candle::owned", "t", t, ViewAs::Column).is_ok() {
        return Ok(t.clone());
    }
    (|| Tensor::from_vec(t.flatten_all()?.to_vec1::<f32>()?, t.shape(), t.device()))()
        .map_err(from_candle)
}

/// Address of the buffer of a checked CPU f32 tensor (to refuse lending one storage twice,
/// which would deadlock on its lock).
fn buffer_addr(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => v.as_ptr() as usize,
        _ => 0,
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
/// or when `f` replaced a matrix by one of another shape (the tensor is zero-filled then);
/// [`Error::DeviceUnavailable`] for a non-CPU tensor; whatever `f` returns. Nothing is lent
/// when a check fails.
pub fn with_matrices<R>(
    tensors: &[&Tensor],
    how: ViewAs,
    f: impl FnOnce(&mut [Matrix]) -> Result<R>,
) -> Result<R> {
    const OP: &str = "grng::candle::with_matrices";
    let mut shapes = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        shapes.push(check_tensor(OP, &format!("tensors[{i}]"), t, how)?);
    }
    let mut addrs: Vec<usize> = tensors.iter().map(|t| buffer_addr(t)).collect();
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

/// The [`InplaceOp1`] that moves the storage's `Vec` into a matrix, runs `body` and moves the
/// (possibly replaced) buffer back.
struct Lend<B, R> {
    rows: usize,
    cols: usize,
    body: RefCell<Option<B>>,
    out: RefCell<Option<Result<R>>>,
}

impl<B: FnOnce(Matrix) -> (Matrix, Result<R>), R> InplaceOp1 for Lend<B, R> {
    fn name(&self) -> &'static str {
        "grng-lend"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _layout: &Layout) -> candle_core::Result<()> {
        const OP: &str = "grng::candle::with_matrices";
        let CpuStorage::F32(v) = storage else {
            // Checked before locking; a dtype change in between is candle's bug, not ours.
            return Err(candle_core::Error::Msg(format!("{OP}: storage is not f32")));
        };
        let Some(body) = self.body.borrow_mut().take() else {
            return Ok(());
        };
        let len = v.len();
        let m =
            Matrix::from_host_vec(self.rows, self.cols, std::mem::take(v)).map_err(to_candle)?;
        let (m, mut r) = body(m);
        let shape = m.shape();
        let mut back = match m.into_host_vec() {
            Ok(back) => back,
            Err(e) => {
                r = Err(e);
                Vec::new()
            }
        };
        if back.len() != len {
            // The body broke the contract: keep the tensor valid and say so.
            back = vec![0.0; len];
            if let (Ok(_), Err(e)) = (&r, check_len(OP, "lent matrix", shape.0 * shape.1, len)) {
                r = Err(e);
            }
        }
        *v = back;
        *self.out.borrow_mut() = Some(r);
        Ok(())
    }
}
