//! Launchers of `kernels/elementwise.cu`: element-wise vector operations, the fused optimizer
//! updates and the deterministic one-launch reductions, for [`Device::Emulated`] and
//! [`Device::Cuda`] (called by the GPU arms of [`crate::ops::elementwise`]).
//!
//! Semantics are those of [`crate::cpu::elementwise`], errors included: a failed call
//! changes nothing. Shapes and scalars are validated once, by the ops; the launchers check
//! only buffer lengths against the `n` they pass to a kernel (memory safety). The fused
//! optimizer updates check values while they stream: the kernel reads the old state, writes
//! new buffers and records the first NaN/Inf per input array and the first sign violation
//! (integer `atomicMin`, only where a bad value is seen) into a 5-int status; the host
//! reads it once (the only synchronization) and swaps the new buffers in when it is clean,
//! else reports the error the CPU backend would report. A clean update thus costs one pass
//! and one 20-byte read-back. `axpy` and `scale` still run the read-only
//! `elementwise_check` pass first, into the status their kernel reads before writing.
//!
//! Matrices hold `f32`; integer slots of the status live in an `f32` matrix as bit patterns.

use super::deferred::{self, filled, first_flagged, queued_status, Scalar, NONE, SCALAR_SLOT};
use super::launch::{
    kernel, launch, stream_config, to_i32, KernelArgs, LaunchConfig, STREAM_BLOCK, TABLE_WORDS,
};
use std::any::Any;

use super::engine::SplitCache;
use crate::device::{Device, Element, Matrix};
use crate::error::{check_len, check_value, Error, Result};
use crate::params::elementwise::{
    AdamWCoeffs, MultiLayout, MultiUpdate, SgdCoeffs, SophiaCoeffs, MULTI_SLOTS,
};
use half::bf16;

kernel!(pub(crate) AXPY = ELEMENTWISE::elementwise_axpy;);
kernel!(pub(crate) AXPY_NEW = ELEMENTWISE::elementwise_axpy_new;);
kernel!(pub(crate) MULTI_AXPY_NEW = ELEMENTWISE::elementwise_multi_axpy_new;);
kernel!(pub(crate) SCALE = ELEMENTWISE::elementwise_scale;);
kernel!(pub(crate) COPY = ELEMENTWISE::elementwise_copy;);
kernel!(pub(crate) DOT = ELEMENTWISE::elementwise_dot;);
kernel!(pub(crate) MULTI_DOT = ELEMENTWISE::elementwise_multi_dot;);
kernel!(pub(crate) CHECK = ELEMENTWISE::elementwise_check;);
kernel!(pub(crate) CHECK_BF16 = ELEMENTWISE::elementwise_check_bf16;);
kernel!(pub(crate) SGD = ELEMENTWISE::elementwise_sgd;);
kernel!(pub(crate) ADAMW = ELEMENTWISE::elementwise_adamw;);
kernel!(pub(crate) SOPHIA = ELEMENTWISE::elementwise_sophia;);
kernel!(pub(crate) HESSIAN_EMA = ELEMENTWISE::elementwise_hessian_ema;);
kernel!(pub(crate) MULTI_SGD = ELEMENTWISE::elementwise_multi_sgd;);
kernel!(pub(crate) MULTI_ADAMW = ELEMENTWISE::elementwise_multi_adamw;);
kernel!(pub(crate) MULTI_SOPHIA = ELEMENTWISE::elementwise_multi_sophia;);

/// Grid cap of the reductions: at most this many f64 partials for the last block to sum. The
/// grid is a function of `n` only, so the summation order (and the result) is
/// device-independent.
const REDUCE_BLOCKS: usize = 1024;

/// A fresh 5-slot status (every slot [`NONE`]).
fn new_status(dev: &Device) -> Result<Matrix> {
    filled(dev, 5, NONE as u32)
}

/// The sign condition of one checked array: `(array index, strict)` — `strict` rejects
/// `v ≤ 0`, otherwise `v < 0`.
type SignCheck = Option<(usize, bool)>;

/// Queues `elementwise_check` over `arrays` (1..=4, of any lengths) into the 5 status slots
/// of `status` from float `at` on.
fn queue_check(
    dev: &Device,
    op: &'static str,
    arrays: &[(&'static str, &Matrix)],
    sign: SignCheck,
    (status, at): (&mut Matrix, usize),
    planes: &mut [Option<Matrix<bf16>>],
) -> Result<()> {
    // Memory safety: at most 4 arrays, at most one planes buffer per array, each 3·len bf16.
    check_len(op, "arrays", arrays.len().min(4), arrays.len())?;
    check_len(op, "planes", planes.len().min(arrays.len()), planes.len())?;
    for (p, (_, m)) in planes.iter().zip(arrays) {
        if let Some(p) = p {
            check_len(op, "planes", p.len(), 3 * m.len())?;
        }
    }
    let ptr = |a: usize| arrays[a.min(arrays.len() - 1)].1;
    let (sign_arr, strict) = sign.map_or((-1, 0), |(a, s)| (a as i32, i32::from(s)));
    let mut args = KernelArgs::new(dev);
    args.input(op, ptr(0))?
        .input(op, ptr(1))?
        .input(op, ptr(2))?
        .input(op, ptr(3))?
        .scalar(arrays.len() as i32)
        .scalar(sign_arr)
        .scalar(strict);
    for a in 0..4 {
        let n = arrays
            .get(a)
            .map_or(Ok(0), |&(arg, m)| to_i32(op, arg, m.len()))?;
        args.scalar(n);
    }
    args.output_at(op, status, at, 5)?;
    let n = arrays.iter().map(|(_, m)| m.len()).max().unwrap_or(0);
    let mut planes = planes.iter_mut();
    for _ in 0..4 {
        match planes.next().and_then(Option::as_mut) {
            Some(p) => args.output(op, p)?,
            None => args.scalar(0u64),
        };
    }
    // SAFETY: elementwise_check(const float* a0, const float* a1, const float* a2,
    // const float* a3, int narr, int sign_arr, int strict, int n0, int n1, int n2, int n3,
    // int* status, bf16* s0, bf16* s1, bf16* s2, bf16* s3): array a < narr = arrays.len() <= 4
    // (checked) holds n_a = its length floats and is read at i < n_a only; unused slots repeat
    // the last array with n_a = 0 and are not read; status points at 5 ints inside its buffer
    // (`output_at`); s_a is null (the 8-byte 0) or 3·n_a bf16 (checked) of which element
    // p·n_a + i is written for i < n_a, only for a < narr (at most one per array, checked).
    unsafe { launch(&CHECK, stream_config(n)?, args) }
}

/// Reads `status` back (the synchronization point) and turns it into the error the CPU
/// backend reports for the same inputs: the first array (in `arrays` order) holding a
/// NaN/Inf, at its first such index; else the first sign violation.
fn status_result(
    op: &'static str,
    arrays: &[(&'static str, &Matrix)],
    sign: SignCheck,
    status: &Matrix,
) -> Result<()> {
    status_error(op, arrays, sign, &status_slots(status)?)
}

/// A status read back as its `int` slots.
fn status_slots(status: &Matrix) -> Result<Vec<i32>> {
    Ok(status
        .to_vec()?
        .iter()
        .map(|v| v.to_bits() as i32)
        .collect())
}

/// [`status_result`] of the 5 slots `s` read back.
fn status_error(
    op: &'static str,
    arrays: &[(&'static str, &Matrix)],
    sign: SignCheck,
    s: &[i32],
) -> Result<()> {
    for (a, &(arg, m)) in arrays.iter().enumerate() {
        if s[a] != NONE {
            let index = s[a] as usize;
            return Err(Error::NonFinite {
                op,
                arg,
                index,
                value: m.to_vec()?[index],
            });
        }
    }
    match sign {
        Some((a, strict)) if s[4] != NONE => {
            let (arg, m) = arrays[a];
            let value = m.to_vec()?[s[4] as usize] as f64;
            let expected = if strict {
                "every entry > 0"
            } else {
                "every entry >= 0"
            };
            check_value(op, arg, value, false, expected)
        }
        _ => Ok(()),
    }
}

/// Validates `arrays` on the device the way the CPU backend does (first NaN/Inf per array,
/// then the sign condition); reads back a status (one synchronization).
pub(crate) fn validate(
    dev: &Device,
    op: &'static str,
    arrays: &[(&'static str, &Matrix)],
    sign: SignCheck,
) -> Result<()> {
    if arrays[0].1.is_empty() {
        return Ok(());
    }
    let mut status = new_status(dev)?;
    queue_check(dev, op, arrays, sign, (&mut status, 0), &mut [])?;
    status_result(op, arrays, sign, &status)
}

/// [`crate::Device::check_finite`] on a kernel device: `Err(Error::NonFinite)` at the first
/// NaN/Inf of each matrix, in `arrays` order. Consecutive `f32` matrices (up to 4, of any
/// lengths) are checked by one `elementwise_check` launch, a `bf16` matrix by
/// `elementwise_check_bf16`; each launch costs one 20-byte status read-back (a stream
/// synchronization on a GPU) — or, inside [`crate::Device::deferred`], none: the launch
/// writes into the scope's ledger and the scope reads it once (`cuda::deferred`). Read-only.
pub(crate) fn check_finite<T: Element>(
    dev: &Device,
    op: &'static str,
    arrays: &[(&'static str, &Matrix<T>)],
) -> Result<()> {
    let mut rest = arrays;
    while let Some(&(arg, first)) = rest.first() {
        let any: &dyn Any = first;
        if let Some(m) = any.downcast_ref::<Matrix<f32>>() {
            let mut group = vec![(arg, m)];
            for &(arg, next) in rest[1..].iter().take(3) {
                let any: &dyn Any = next;
                match any.downcast_ref::<Matrix<f32>>() {
                    Some(next) => group.push((arg, next)),
                    None => break,
                }
            }
            rest = &rest[group.len()..];
            check_group(dev, op, &group, &mut [])?;
        } else if let Some(m) = any.downcast_ref::<Matrix<bf16>>() {
            rest = &rest[1..];
            check_bf16(dev, op, arg, m)?;
        } else {
            return Err(Error::DeviceUnavailable(format!(
                "{op}: no finiteness check for elements of type {}",
                std::any::type_name::<T>()
            )));
        }
    }
    Ok(())
}

/// One `elementwise_check` of `group` (up to 4 `f32` matrices, any lengths) writing the
/// `planes` given (one per matrix, or none), into the ledger or a status read here.
fn check_group(
    dev: &Device,
    op: &'static str,
    group: &[(&'static str, &Matrix)],
    planes: &mut [Option<Matrix<bf16>>],
) -> Result<()> {
    let queue = |status: &mut Matrix, at| queue_check(dev, op, group, None, (status, at), planes);
    match queued_status(dev, 5, queue)? {
        Some(status) => status_result(op, group, None, &status),
        None => Ok(()),
    }
}

/// [`check_finite`] of `f32` matrices, each with a cache (empty, or holding its planes) where
/// the caller wants its split3 planes: the check launch writes them as it reads the matrix
/// (kept in the cache once the check is queued or has passed), so that the f32-accurate
/// products that read it next split nothing. Matrices above
/// [`KEEP_MAX_ELEMENTS`](super::engine::KEEP_MAX_ELEMENTS) get none (there a split is a few per cent of a
/// product, and the planes 6 bytes per element). Groups as [`check_finite`]: up to 4
/// consecutive matrices per launch.
///
/// # Errors
/// As [`check_finite`]; the caches of a group that failed stay as they were.
pub(crate) fn check_finite_split(
    dev: &Device,
    op: &'static str,
    arrays: &[(&'static str, &Matrix, Option<&SplitCache>)],
) -> Result<()> {
    for group in arrays.chunks(4) {
        let mut planes = group
            .iter()
            .map(|&(_, m, c)| SplitCache::planes_to_write(dev, c, m))
            .collect::<Result<Vec<_>>>()?;
        let named: Vec<_> = group.iter().map(|&(arg, m, _)| (arg, m)).collect();
        check_group(dev, op, &named, &mut planes)?;
        for (&(_, _, c), p) in group.iter().zip(planes) {
            SplitCache::keep_written(c, p);
        }
    }
    Ok(())
}

/// `elementwise_check_bf16` over `m` and one status read-back.
fn check_bf16(dev: &Device, op: &'static str, arg: &'static str, m: &Matrix<bf16>) -> Result<()> {
    let n = to_i32(op, arg, m.len())?;
    if n == 0 {
        return Ok(());
    }
    let queue = |status: &mut Matrix, at: usize| {
        let mut args = KernelArgs::new(dev);
        args.input(op, m)?.scalar(n).output_at(op, status, at, 1)?;
        // SAFETY: elementwise_check_bf16(const __nv_bfloat16* a, int n, int* status): a holds
        // n bf16 values, status points at an int inside its buffer (`output_at`), the only
        // one written; threads read index i < n only.
        unsafe { launch(&CHECK_BF16, stream_config(m.len())?, args) }
    };
    match first_flagged(dev, queue)? {
        None => Ok(()),
        Some(index) => Err(Error::NonFinite {
            op,
            arg,
            index,
            value: m.to_vec()?[index].to_f32(),
        }),
    }
}

/// `y ← α x + y` (same length); `y` unchanged on error (non-finite `x` or `y`). `α` is
/// checked by [`Device::axpy`].
pub(crate) fn axpy(dev: &Device, alpha: f32, x: &Matrix, y: &mut Matrix) -> Result<()> {
    const OP: &str = "cuda::axpy";
    // Memory safety: the kernel reads and writes n = len(y) elements of both.
    check_len(OP, "x", x.len(), y.len())?;
    let n = to_i32(OP, "y", y.len())?;
    if n == 0 {
        return Ok(());
    }
    let cfg = stream_config(y.len())?;
    let mut status = new_status(dev)?;
    queue_check(
        dev,
        OP,
        &[("x", x), ("y", &*y)],
        None,
        (&mut status, 0),
        &mut [],
    )?;
    let mut args = KernelArgs::new(dev);
    args.output(OP, y)?
        .input(OP, x)?
        .scalar(alpha)
        .scalar(n)
        .input(OP, &status)?;
    // SAFETY: elementwise_axpy(float* y, const float* x, float alpha, int n, const int*
    // status): x and y hold n floats (checked above), status 5 ints; indices stay below n.
    unsafe { launch(&AXPY, cfg, args)? };
    status_result(OP, &[("x", x), ("y", &*y)], None, &status)
}

/// `y + α x` (same length) into a new matrix of `y`'s shape, checked while it streams
/// (`elementwise_axpy_new`): `Err(Error::NonFinite)` at the first NaN/Inf of `x`, else of
/// `y`, else of the result (`"result (overflow)"`), as the CPU's `axpy_new` reports them. One
/// pass and one status read-back, or none inside [`crate::Device::deferred`] (the scope
/// reads the status). `α` is checked by [`Device::axpy_new`]. With `planes` (a cache without
/// planes, of a result up to [`KEEP_MAX_ELEMENTS`](super::engine::KEEP_MAX_ELEMENTS)), the same pass writes the result's split3
/// planes, kept there once the launch is queued or has passed: a product reading the result
/// then splits nothing.
pub(crate) fn axpy_new(
    dev: &Device,
    alpha: f32,
    x: &Matrix,
    y: &Matrix,
    planes: Option<&SplitCache>,
) -> Result<Matrix> {
    const OP: &str = "cuda::axpy_new";
    // Memory safety: the kernel reads x and y and writes out, n = len(y) elements each.
    check_len(OP, "x", x.len(), y.len())?;
    let n = to_i32(OP, "y", y.len())?;
    let mut out = dev.scratch(y.rows(), y.cols())?;
    if n == 0 {
        return Ok(out);
    }
    // The planes of `out` (`y`'s shape) where the caller keeps them and they fit.
    let mut written = SplitCache::planes_to_write(dev, planes, y)?;
    let cfg = stream_config(y.len())?;
    let mut queue = |out: &mut Matrix, status: &mut Matrix, at: usize| {
        let mut args = KernelArgs::new(dev);
        args.output(OP, out)?
            .input(OP, x)?
            .input(OP, y)?
            .scalar(alpha)
            .scalar(n)
            .output_at(OP, status, at, 5)?;
        match written.as_mut() {
            Some(p) => args.output(OP, p)?,
            None => args.scalar(0u64),
        };
        // SAFETY: elementwise_axpy_new(float* out, const float* x, const float* y, float
        // alpha, int n, int* status, bf16* planes): out, x and y hold n floats (out is y's
        // shape, x checked above); status points at 5 ints inside its buffer (`output_at`),
        // slots 0..2 written; planes is null (the 8-byte 0) or 3n bf16 (allocated above),
        // element p·n + i written for p < 3; indices stay below n.
        unsafe { launch(&AXPY_NEW, cfg, args) }
    };
    if let Some(status) = queued_status(dev, 5, |status, at| queue(&mut out, status, at))? {
        let arrays = [("x", x), ("y", y), (crate::error::OVERFLOW, &out)];
        status_result(OP, &arrays, None, &status)?;
    }
    SplitCache::keep_written(planes, written);
    Ok(out)
}

/// Device addresses into the first words of a multi-tensor kernel's table entry `e`: two
/// words each, low first (`ew_entry_ptr` in the kernels).
fn put_addresses(e: &mut [u32], addrs: &[u64]) {
    for (w, a) in e.chunks_exact_mut(2).zip(addrs) {
        w[0] = *a as u32;
        w[1] = (*a >> 32) as u32;
    }
}

/// 32-bit words per tensor in `elementwise_multi_axpy_new`'s table (`EW_AXPY_ENTRY`): the
/// addresses of out, x, y and planes (two words each, low first; planes 0 for none), then the
/// length, the first float4 item and the bits of `α`.
const AXPY_ENTRY: usize = 11;

/// One `y + α x` of [`multi_axpy_new`], with the cache its result's planes go to (as
/// [`axpy_new`]'s `planes`).
pub(crate) type AxpyJob<'a> = (f32, &'a Matrix, &'a Matrix, Option<&'a SplitCache>);

/// [`axpy_new`] of every job in ONE launch per 90 jobs (`elementwise_multi_axpy_new`, the
/// jobs a table parameter holds): each result and
/// its planes the bits [`axpy_new`] of that job alone gives, one status of 5 slots per job
/// (read by [`crate::Device::deferred`]'s scope, or here), and on error the one the first
/// failing job's own [`axpy_new`] reports. A lazy Kronecker step forms all its first-order
/// inverses so: one launch, not one per factor.
pub(crate) fn multi_axpy_new(dev: &Device, jobs: &[AxpyJob<'_>]) -> Result<Vec<Matrix>> {
    const OP: &str = "cuda::axpy_new";
    let mut outs = Vec::with_capacity(jobs.len());
    let mut written = Vec::with_capacity(jobs.len());
    for &(_, x, y, planes) in jobs {
        // Memory safety: the kernel reads x and y and writes out (y's shape), n = len(y)
        // elements each, and 3n planes where it has some.
        check_len(OP, "x", x.len(), y.len())?;
        to_i32(OP, "y", y.len())?;
        outs.push(dev.scratch(y.rows(), y.cols())?);
        written.push(SplitCache::planes_to_write(dev, planes, y)?);
    }
    let items: usize = jobs.iter().map(|j| j.2.len().div_ceil(4)).sum();
    to_i32(OP, "y", items)?;
    if items == 0 {
        return Ok(outs);
    }
    let slots = 5 * jobs.len();
    let per_launch = TABLE_WORDS / AXPY_ENTRY;
    let queue = |status: &mut Matrix, at: usize| {
        let launches = jobs
            .chunks(per_launch)
            .zip(outs.chunks_mut(per_launch))
            .zip(written.chunks_mut(per_launch));
        for (c, ((jobs, outs), written)) in launches.enumerate() {
            let mut args = KernelArgs::new(dev);
            let mut words = vec![0u32; AXPY_ENTRY * jobs.len()];
            let mut item = 0usize;
            let entries = words.chunks_exact_mut(AXPY_ENTRY).zip(jobs);
            let buffers = outs.iter_mut().zip(written.iter_mut());
            for ((e, &(alpha, x, y, _)), (out, planes)) in entries.zip(buffers) {
                let addrs = [
                    args.address_mut(OP, out)?,
                    args.address(OP, x)?,
                    args.address(OP, y)?,
                    match planes {
                        Some(p) => args.address_mut(OP, p)?,
                        None => 0,
                    },
                ];
                put_addresses(e, &addrs);
                // Each below 2^31: len(y) and item <= items (checked above).
                e[8] = y.len() as u32;
                e[9] = item as u32;
                e[10] = alpha.to_bits();
                item += y.len().div_ceil(4);
            }
            if item == 0 {
                continue;
            }
            // Below 2^31: at most items, and per_launch jobs.
            args.table(OP, &words)?
                .scalar(jobs.len() as i32)
                .scalar(item as i32)
                .output_at(OP, status, at + 5 * per_launch * c, 5 * jobs.len())?;
            // SAFETY: elementwise_multi_axpy_new(EwTable table, int ntensors, int nitems, int*
            // status): the table holds AXPY_ENTRY words per job of this launch with the
            // addresses of out, x and y (len(y) floats each, checked above) and of its planes
            // (null, or 3·len(y) bf16 from `planes_to_write`), all borrowed by `args`; the
            // items add up to nitems; status points at 5 ints per job of the launch inside its
            // buffer (`output_at`), the kernel writes slots 5t..5t + 2 only; indices stay
            // below each job's len(y).
            unsafe { launch(&MULTI_AXPY_NEW, stream_config(4 * item)?, args)? };
        }
        Ok(())
    };
    if let Some(status) = queued_status(dev, slots, queue)? {
        let s = status_slots(&status)?;
        for (t, (&(_, x, y, _), out)) in jobs.iter().zip(&outs).enumerate() {
            let arrays = [("x", x), ("y", y), (crate::error::OVERFLOW, out)];
            status_error(OP, &arrays, None, &s[5 * t..5 * t + 5])?;
        }
    }
    for (&(_, _, _, planes), w) in jobs.iter().zip(written) {
        SplitCache::keep_written(planes, w);
    }
    Ok(outs)
}

/// `x ← α x`; `x` unchanged on error (non-finite `x`). `α` is checked by [`Device::scale`].
pub(crate) fn scale(dev: &Device, alpha: f32, x: &mut Matrix) -> Result<()> {
    const OP: &str = "cuda::scale";
    let n = to_i32(OP, "x", x.len())?;
    if n == 0 {
        return Ok(());
    }
    let cfg = stream_config(x.len())?;
    let mut status = new_status(dev)?;
    queue_check(dev, OP, &[("x", &*x)], None, (&mut status, 0), &mut [])?;
    let mut args = KernelArgs::new(dev);
    args.output(OP, x)?
        .scalar(alpha)
        .scalar(n)
        .input(OP, &status)?;
    // SAFETY: elementwise_scale(float* x, float alpha, int n, const int* status): x holds n
    // floats, status 5 ints; indices stay below n.
    unsafe { launch(&SCALE, cfg, args)? };
    status_result(OP, &[("x", &*x)], None, &status)
}

/// `dst ← src` (same length; non-finite values copied as they are). Asynchronous on CUDA.
pub(crate) fn copy(dev: &Device, src: &Matrix, dst: &mut Matrix) -> Result<()> {
    const OP: &str = "cuda::copy";
    // Memory safety: the kernel reads and writes n = len(dst) elements of both.
    check_len(OP, "src", src.len(), dst.len())?;
    let n = to_i32(OP, "dst", dst.len())?;
    if n == 0 {
        return Ok(());
    }
    let cfg = stream_config(src.len())?;
    let mut args = KernelArgs::new(dev);
    args.output(OP, dst)?.input(OP, src)?.scalar(n);
    // SAFETY: elementwise_copy(float* dst, const float* src, int n): both hold n floats
    // (checked above); indices stay below n.
    unsafe { launch(&COPY, cfg, args) }
}

/// One pair of a reduction, `Σ xᵢ yᵢ`, with its arguments' names (for errors).
type Pair<'a> = [(&'static str, &'a Matrix); 2];

/// Most pairs one `elementwise_dot` launch sums (a Kronecker layer's three model terms).
pub(crate) const MAX_PAIRS: usize = 3;

/// `Σ xᵢ yᵢ` in f64 (deterministic, one launch), rounded to f32 — see
/// [`crate::cpu::elementwise::dot`] for the error bound, which holds here too (only the f64
/// summation order differs).
pub(crate) fn dot(dev: &Device, x: &Matrix, y: &Matrix) -> Result<f32> {
    const OP: &str = "cuda::dot";
    // Memory safety: the kernel reads n = len(x) elements of both.
    check_len(OP, "y", y.len(), x.len())?;
    if x.is_empty() {
        return Ok(0.0);
    }
    one(reduce(dev, OP, &[vec![[("x", x), ("y", y)]]], false, &Ok)?)
}

/// `√(Σ xᵢ²)` accumulated in f64 like [`dot`], the square root taken in f64.
pub(crate) fn norm2(dev: &Device, x: &Matrix) -> Result<f32> {
    if x.is_empty() {
        return Ok(0.0);
    }
    one(reduce(
        dev,
        "cuda::norm2",
        &[vec![[("x", x), ("x", x)]]],
        true,
        &Ok,
    )?)
}

/// The one value of a one-pair [`reduce`].
fn one(v: Vec<f32>) -> Result<f32> {
    v.first()
        .copied()
        .ok_or_else(|| crate::Error::Cuda("a reduction without its value".into()))
}

/// [`dot`] of each `(x, y)` pair of every group (a group's pairs of one length, checked) into
/// `out` (one slot per pair, in order, checked), queued into the ledger of an enclosing
/// [`crate::Device::deferred`] (no read-back here), or computed now when there is none — then
/// each value, in order, through `finish` (the op's overflow check), as one dot after the
/// other would. Either way ONE launch: `elementwise_dot` when the pairs make one chunk (at
/// most [`MAX_PAIRS`] of one length), else `elementwise_multi_dot` over every chunk (a
/// Kronecker step's model terms, every layer's; one launch per 55 chunks, what a table
/// parameter holds); each pair's value the bits of [`dot`]'s.
pub(crate) fn dots_deferred(
    dev: &Device,
    groups: &[&[(&Matrix, &Matrix)]],
    out: &mut [Scalar],
    finish: &dyn Fn(f32) -> Result<f32>,
) -> Result<()> {
    const OP: &str = "cuda::dot";
    let total = groups.iter().map(|g| g.len()).sum();
    check_len(OP, "out", out.len(), total)?;
    // The launch's chunks (each pair named, for errors) and each chunk's first slot in `out`.
    let (mut chunks, mut firsts): (Vec<Vec<Pair<'_>>>, Vec<usize>) = (Vec::new(), Vec::new());
    let mut at = 0;
    for g in groups {
        if let Some(&(first, _)) = g.first() {
            // Memory safety: the kernel reads n = len(first) elements of every array.
            for &(x, y) in *g {
                check_len(OP, "x", x.len(), first.len())?;
                check_len(OP, "y", y.len(), first.len())?;
            }
            if to_i32(OP, "x", first.len())? == 0 {
                out[at..at + g.len()].fill(Scalar::Value(0.0));
            } else {
                for (c, chunk) in g.chunks(MAX_PAIRS).enumerate() {
                    chunks.push(chunk.iter().map(|&(x, y)| [("x", x), ("y", y)]).collect());
                    firsts.push(at + c * MAX_PAIRS);
                }
            }
        }
        at += g.len();
    }
    if chunks.is_empty() {
        return Ok(());
    }
    let mut slots = vec![Scalar::default(); chunks.iter().map(Vec::len).sum()];
    let queued = deferred::queue_scalars(dev, &mut slots, |buf, at, preset| {
        queue_reduce(dev, OP, &chunks, false, (buf, at, preset))
    });
    match queued {
        Some(r) => r?,
        None => {
            let values = reduce(dev, OP, &chunks, false, finish)?;
            slots = values.into_iter().map(Scalar::Value).collect();
        }
    }
    let mut slots = slots.into_iter();
    for (chunk, first) in chunks.iter().zip(&firsts) {
        for (o, s) in out[*first..*first + chunk.len()]
            .iter_mut()
            .zip(slots.by_ref())
        {
            *o = s;
        }
    }
    Ok(())
}

/// The f64 reductions of the `chunks` (each 1..=[`MAX_PAIRS`] pairs of one length `n ≥ 1`,
/// checked by the caller) in one launch (per 55 chunks) and one read-back; each value, in
/// pair order, checked (a non-finite sum names its pair's first NaN/Inf as the CPU does) and
/// passed through `finish`, so the first failure is the one a reduction per pair would have
/// met.
fn reduce(
    dev: &Device,
    op: &'static str,
    chunks: &[Vec<Pair<'_>>],
    take_sqrt: bool,
    finish: &dyn Fn(f32) -> Result<f32>,
) -> Result<Vec<f32>> {
    let pairs: Vec<&Pair<'_>> = chunks.iter().flatten().collect();
    // Zeros: each chunk's block count starts at 0 (a memset on CUDA, not a launch).
    let mut out = dev.zeros(SCALAR_SLOT * pairs.len(), 1)?;
    queue_reduce(dev, op, chunks, take_sqrt, (&mut out, 0, 0))?;
    let o = out.to_vec()?;
    let mut values = Vec::with_capacity(pairs.len());
    for (pair, slot) in pairs.into_iter().zip(o.chunks_exact(SCALAR_SLOT)) {
        let v = if slot[1] == 1.0 {
            slot[0]
        } else {
            // A non-finite f64 sum needs a NaN/Inf input (finite f32 products cannot
            // overflow f64): report it as the CPU does, first array first (once for norm2).
            let arrays: &[(&str, &Matrix)] = if std::ptr::eq(pair[0].1, pair[1].1) {
                &pair[..1]
            } else {
                pair
            };
            validate(dev, op, arrays, None)?;
            // Finite inputs and no flag: no block finished the sum. NaN, which the op
            // reports, rather than the zeros' silent 0.
            f32::NAN
        };
        values.push(finish(v)?);
    }
    Ok(values)
}

/// The blocks of one chunk's reduction over `n` elements: a function of `n` only, so the
/// summation order (and the result) is device-independent.
fn reduce_blocks(n: usize) -> usize {
    n.div_ceil(4 * STREAM_BLOCK as usize)
        .clamp(1, REDUCE_BLOCKS)
}

/// Queues [`reduce`]'s launch over the `chunks` (each 1..=[`MAX_PAIRS`] pairs of one length
/// `n ≥ 1`): pair `j` (counted over all chunks) gets its `(sum, finite flag)` in the
/// [`SCALAR_SLOT`] floats of `out` from float `at + j·SCALAR_SLOT` on; each chunk's first
/// slot's third float counts its finished blocks up from the bits `preset` (the slots'
/// preset). One chunk: `elementwise_dot`; several: `elementwise_multi_dot` (one launch per 55
/// chunks), each chunk on the blocks a launch of its own would have.
fn queue_reduce(
    dev: &Device,
    op: &'static str,
    chunks: &[Vec<Pair<'_>>],
    take_sqrt: bool,
    (out, at, preset): (&mut Matrix, usize, u32),
) -> Result<()> {
    for c in chunks {
        let k = c.len();
        if !(1..=MAX_PAIRS).contains(&k) {
            return Err(crate::Error::Cuda(format!(
                "{op}: {k} pairs in one reduction (1 to {MAX_PAIRS})"
            )));
        }
    }
    let [pairs0] = chunks else {
        // One launch per table's worth of chunks, each from its first pair's slots on.
        let mut at = at;
        for batch in chunks.chunks(TABLE_WORDS / DOT_ENTRY) {
            queue_multi_reduce(dev, op, batch, take_sqrt, (out, at, preset))?;
            at += SCALAR_SLOT * batch.iter().map(Vec::len).sum::<usize>();
        }
        return Ok(());
    };
    let x = pairs0[0][0].1;
    let k = pairs0.len();
    let n = to_i32(op, pairs0[0][0].0, x.len())?;
    let blocks = reduce_blocks(x.len());
    // f64 partials in an f32 buffer, one spare float for the kernel's 8-byte alignment; every
    // block writes its own before it counts itself, so no preset.
    let mut partial: Matrix = dev.scratch(2 * k * blocks + 1, 1)?;
    let mut args = KernelArgs::new(dev);
    // Unused pairs repeat the last one (never read: the kernel stops at k).
    for j in 0..MAX_PAIRS {
        let [(_, x), (_, y)] = pairs0[j.min(k - 1)];
        args.input(op, x)?.input(op, y)?;
    }
    args.scalar(k as i32)
        .scalar(n)
        .output(op, &mut partial)?
        .scalar(i32::from(take_sqrt))
        .scalar(preset)
        .output_at(op, out, at, SCALAR_SLOT * k)?;
    let cfg = LaunchConfig::linear(blocks as u32, STREAM_BLOCK);
    // SAFETY: elementwise_dot(const float* x0, const float* y0, const float* x1, const
    // float* y1, const float* x2, const float* y2, int k, int n, float* partial, int
    // take_sqrt, unsigned int counted_from, float* out): the k <= 3 pairs' arrays hold n
    // floats each (checked by the callers; the unused pointers repeat a used pair and are not
    // read), read below n only; block b < blocks writes the f64 at the 8-byte aligned start
    // of partial + j*blocks + b, j < k, inside its 2*k*blocks+1 floats, and the last block
    // reads those k*blocks f64; out points at SCALAR_SLOT*k floats inside its buffer
    // (`output_at`): every block adds to out[2], the last writes out[3j..3j+2], j < k.
    unsafe { launch(&DOT, cfg, args) }
}

/// 32-bit words per chunk in `elementwise_multi_dot`'s table (`EW_DOT_ENTRY`): the addresses
/// of x0, y0, x1, y1, x2, y2 (two words each, low first), then k, n, the first block, the
/// block count, the partials' offset in f64s and the outputs' offset in floats.
const DOT_ENTRY: usize = 18;

/// [`queue_reduce`] of several chunks, at most a table's worth (`TABLE_WORDS / DOT_ENTRY`,
/// 55): one launch of `elementwise_multi_dot`.
fn queue_multi_reduce(
    dev: &Device,
    op: &'static str,
    chunks: &[Vec<Pair<'_>>],
    take_sqrt: bool,
    (out, at, preset): (&mut Matrix, usize, u32),
) -> Result<()> {
    let pairs = chunks.iter().map(Vec::len).sum::<usize>();
    let ngroups = to_i32(op, "pairs", chunks.len())?;
    let blocks: Vec<usize> = chunks
        .iter()
        .map(|c| reduce_blocks(c[0][0].1.len()))
        .collect();
    let parts: usize = chunks.iter().zip(&blocks).map(|(c, b)| c.len() * b).sum();
    let total_blocks = u32::try_from(blocks.iter().sum::<usize>()).ok();
    let total_blocks = total_blocks.filter(|&b| b <= i32::MAX as u32 && parts <= u32::MAX as usize);
    let total_blocks = total_blocks.ok_or(crate::Error::Value {
        op,
        arg: "pairs",
        value: pairs as f64,
        expected: "fewer than 2^31 reduction blocks in one launch",
    })?;
    let mut partial: Matrix = dev.scratch(2 * parts + 1, 1)?;
    let mut args = KernelArgs::new(dev);
    let mut words = vec![0u32; DOT_ENTRY * chunks.len()];
    let (mut block, mut part, mut slot) = (0usize, 0usize, 0usize);
    for ((e, c), &nb) in words.chunks_exact_mut(DOT_ENTRY).zip(chunks).zip(&blocks) {
        let k = c.len();
        let n = to_i32(op, c[0][0].0, c[0][0].1.len())?;
        // Unused pairs repeat the last one (never read: the kernel stops at k).
        let mut addrs = [0u64; 2 * MAX_PAIRS];
        for j in 0..MAX_PAIRS {
            let [(_, x), (_, y)] = c[j.min(k - 1)];
            addrs[2 * j] = args.address(op, x)?;
            addrs[2 * j + 1] = args.address(op, y)?;
        }
        put_addresses(e, &addrs);
        // Each below 2^31 or 2^32: k <= 3, n an int, blocks and parts checked above, slot
        // below SCALAR_SLOT * pairs (the launch's own output range).
        e[12] = k as u32;
        e[13] = n as u32;
        e[14] = block as u32;
        e[15] = nb as u32;
        e[16] = part as u32;
        e[17] = (SCALAR_SLOT * slot) as u32;
        block += nb;
        part += k * nb;
        slot += k;
    }
    args.table(op, &words)?
        .scalar(ngroups)
        .output(op, &mut partial)?
        .scalar(i32::from(take_sqrt))
        .scalar(preset)
        .output_at(op, out, at, SCALAR_SLOT * pairs)?;
    let cfg = LaunchConfig::linear(total_blocks, STREAM_BLOCK);
    // SAFETY: elementwise_multi_dot(EwTable table, int ngroups, float* partial, int
    // take_sqrt, unsigned int counted_from, float* out): the table holds DOT_ENTRY words per
    // chunk, whose k <= 3 pairs' arrays (borrowed by `args`) hold n floats each (checked by
    // the callers), read below n only; chunk g's nb blocks, consecutive from its first block,
    // write the f64s at the 8-byte aligned start of partial + 2·(its offset) + j·nb + b,
    // inside the 2·parts + 1 floats, and its last block reads those k·nb; out points at
    // SCALAR_SLOT·pairs floats inside its buffer (`output_at`), chunk g's slots from its
    // offset: every block adds to the first slot's third float, the last writes its k slots.
    unsafe { launch(&MULTI_DOT, cfg, args) }
}

/// The prologue and epilogue the four fused optimizer updates share: in order, the length
/// checks (every array against the first: memory safety, the kernel indexes all of them up
/// to `n`; shapes and coefficients are the op's to check, [`crate::ops::elementwise`]), the
/// kernels' `int` conversion of `n`, the `n == 0` early return; then fresh output buffers
/// shaped like the written arrays (`written` indexes into `arrays(bufs)`) and a fresh
/// status, and `queue_update(bufs, outs, n, status)` queues the update kernel, which reads
/// the old state, writes `outs` and flags NaN/Inf and sign violations of its inputs into
/// the status while it streams (no separate check pass); last, the status read-back (the
/// only synchronization) and either the error the CPU backend would report — the old state
/// untouched, the outputs dropped — or `commit(bufs, outs)`, which swaps the outputs in (no
/// copy pass).
///
/// `bufs` holds the launcher's matrices (the written ones by `&mut`); `arrays(bufs)` names
/// all of them in the CPU backend's check order, which is the kernel's status-slot order.
/// `sign` indexes into that list.
#[allow(clippy::too_many_arguments)]
fn fused_update<B, const K: usize, const W: usize>(
    dev: &Device,
    op: &'static str,
    mut bufs: B,
    arrays: impl for<'b> Fn(&'b B) -> [(&'static str, &'b Matrix); K],
    written: [usize; W],
    sign: SignCheck,
    queue_update: impl FnOnce(&B, &mut [Matrix; W], i32, &mut Matrix) -> Result<()>,
    commit: impl FnOnce(&mut B, &mut [Matrix; W]),
) -> Result<()> {
    let list = arrays(&bufs);
    let (first, n) = (list[0].0, list[0].1.len());
    for &(arg, m) in &list[1..] {
        check_len(op, arg, m.len(), n)?;
    }
    let ni = to_i32(op, first, n)?;
    if n == 0 {
        return Ok(());
    }
    let outs = written
        .iter()
        .map(|&a| dev.scratch(list[a].1.rows(), list[a].1.cols()))
        .collect::<Result<Vec<Matrix>>>()?;
    let Ok(mut outs) = <[Matrix; W]>::try_from(outs) else {
        unreachable!("one output per entry of `written`")
    };
    let mut status = new_status(dev)?;
    queue_update(&bufs, &mut outs, ni, &mut status)?;
    status_result(op, &arrays(&bufs), sign, &status)?;
    commit(&mut bufs, &mut outs);
    Ok(())
}

/// Pushes SGD's coefficient parameters `float lr, float mu, float lrwd`, shared by the
/// one-tensor and multi-tensor kernels.
fn sgd_scalars<'b, 'a>(args: &'b mut KernelArgs<'a>, c: &SgdCoeffs) -> &'b mut KernelArgs<'a> {
    args.scalar(c.lr)
        .scalar(c.momentum)
        .scalar(c.lr * c.weight_decay)
}

/// Pushes AdamW's coefficient parameters `float lr, float b1, float omb1, float b2, float
/// omb2, float eps, float lrwd, float bc1, float bc2`, shared by the one-tensor and
/// multi-tensor kernels.
fn adamw_scalars<'b, 'a>(args: &'b mut KernelArgs<'a>, c: &AdamWCoeffs) -> &'b mut KernelArgs<'a> {
    let (bc1, bc2) = c.bias_corrections();
    args.scalar(c.lr)
        .scalar(c.beta1)
        .scalar(1.0 - c.beta1)
        .scalar(c.beta2)
        .scalar(1.0 - c.beta2)
        .scalar(c.eps)
        .scalar(c.lr * c.weight_decay)
        .scalar(bc1)
        .scalar(bc2)
}

/// Pushes Sophia's coefficient parameters `float lr, float b1, float omb1, float gamma, float
/// eps, float lrwd`, shared by the one-tensor and multi-tensor kernels.
fn sophia_scalars<'b, 'a>(
    args: &'b mut KernelArgs<'a>,
    c: &SophiaCoeffs,
) -> &'b mut KernelArgs<'a> {
    args.scalar(c.lr)
        .scalar(c.beta1)
        .scalar(1.0 - c.beta1)
        .scalar(c.gamma)
        .scalar(c.eps)
        .scalar(c.lr * c.weight_decay)
}

/// Fused SGD step (see [`crate::cpu::elementwise::sgd_update`]) on `(params, grad,
/// momentum_buf)`; nothing written on error.
pub(crate) fn sgd_update(
    dev: &Device,
    operands: (&mut Matrix, &Matrix, &mut Matrix),
    c: &SgdCoeffs,
) -> Result<()> {
    const OP: &str = "cuda::sgd_update";
    fused_update(
        dev,
        OP,
        operands,
        |(p, g, b)| [("params", &**p), ("grad", *g), ("momentum_buf", &**b)],
        [0, 2],
        None,
        |(p, g, b), outs, n, status| {
            let [po, bo] = outs;
            let mut args = KernelArgs::new(dev);
            args.input(OP, p)?
                .input(OP, g)?
                .input(OP, b)?
                .output(OP, po)?
                .output(OP, bo)?;
            sgd_scalars(&mut args, c).scalar(n).output(OP, status)?;
            // SAFETY: elementwise_sgd(const float* p, const float* g, const float* b, float*
            // po, float* bo, float lr, float mu, float lrwd, int n, int* status): p, g, b, po,
            // bo hold n floats (lengths checked and outputs shaped by `fused_update`), status
            // 5 ints; indices stay below n.
            unsafe { launch(&SGD, stream_config(n as usize)?, args) }
        },
        |(p, _, b), [po, bo]| {
            std::mem::swap(*p, po);
            std::mem::swap(*b, bo);
        },
    )
}

/// Fused AdamW step (see [`crate::cpu::elementwise::adamw_update`]) on `(params, grad, m,
/// v)`; nothing written on error.
pub(crate) fn adamw_update(
    dev: &Device,
    operands: (&mut Matrix, &Matrix, &mut Matrix, &mut Matrix),
    c: &AdamWCoeffs,
) -> Result<()> {
    const OP: &str = "cuda::adamw_update";
    fused_update(
        dev,
        OP,
        operands,
        |(p, g, m, v)| [("params", &**p), ("grad", *g), ("m", &**m), ("v", &**v)],
        [0, 2, 3],
        Some((3, false)),
        |(p, g, m, v), outs, n, status| {
            let [po, mo, vo] = outs;
            let mut args = KernelArgs::new(dev);
            args.input(OP, p)?
                .input(OP, g)?
                .input(OP, m)?
                .input(OP, v)?
                .output(OP, po)?
                .output(OP, mo)?
                .output(OP, vo)?;
            adamw_scalars(&mut args, c).scalar(n).output(OP, status)?;
            // SAFETY: elementwise_adamw(const float* p, const float* g, const float* m, const
            // float* v, float* po, float* mo, float* vo, float lr, float b1, float omb1, float
            // b2, float omb2, float eps, float lrwd, float bc1, float bc2, int n, int* status):
            // the seven arrays hold n floats (lengths checked and outputs shaped by
            // `fused_update`), status 5 ints; indices stay below n.
            unsafe { launch(&ADAMW, stream_config(n as usize)?, args) }
        },
        |(p, _, m, v), [po, mo, vo]| {
            std::mem::swap(*p, po);
            std::mem::swap(*m, mo);
            std::mem::swap(*v, vo);
        },
    )
}

/// Fused Sophia step (see [`crate::cpu::elementwise::sophia_update`]) on `(params, grad, m,
/// h)`; nothing written on error.
pub(crate) fn sophia_update(
    dev: &Device,
    operands: (&mut Matrix, &Matrix, &mut Matrix, &Matrix),
    c: &SophiaCoeffs,
) -> Result<()> {
    const OP: &str = "cuda::sophia_update";
    fused_update(
        dev,
        OP,
        operands,
        |(p, g, m, h)| [("params", &**p), ("grad", *g), ("m", &**m), ("h", *h)],
        [0, 2],
        Some((3, false)),
        |(p, g, m, h), outs, n, status| {
            let [po, mo] = outs;
            let mut args = KernelArgs::new(dev);
            args.input(OP, p)?
                .input(OP, g)?
                .input(OP, m)?
                .input(OP, h)?
                .output(OP, po)?
                .output(OP, mo)?;
            sophia_scalars(&mut args, c).scalar(n).output(OP, status)?;
            // SAFETY: elementwise_sophia(const float* p, const float* g, const float* m, const
            // float* h, float* po, float* mo, float lr, float b1, float omb1, float gamma,
            // float eps, float lrwd, int n, int* status): the six arrays hold n floats
            // (lengths checked and outputs shaped by `fused_update`), status 5 ints; indices
            // stay below n.
            unsafe { launch(&SOPHIA, stream_config(n as usize)?, args) }
        },
        |(p, _, m, _), [po, mo]| {
            std::mem::swap(*p, po);
            std::mem::swap(*m, mo);
        },
    )
}

/// Sophia-G's Hessian EMA (see [`crate::cpu::elementwise::sophia_hessian_ema`]); `h`
/// unchanged on error.
pub(crate) fn sophia_hessian_ema(
    dev: &Device,
    h: &mut Matrix,
    sampled_grad: &Matrix,
    beta2: f32,
    batch: usize,
) -> Result<()> {
    const OP: &str = "cuda::sophia_hessian_ema";
    fused_update(
        dev,
        OP,
        (h, sampled_grad),
        |(h, g)| [("h", &**h), ("sampled_grad", *g)],
        [0],
        Some((0, false)),
        |(h, g), outs, n, status| {
            let mut args = KernelArgs::new(dev);
            args.input(OP, h)?
                .input(OP, g)?
                .output(OP, &mut outs[0])?
                .scalar(beta2)
                .scalar(1.0 - beta2)
                .scalar(batch as f32)
                .scalar(n)
                .output(OP, status)?;
            // SAFETY: elementwise_hessian_ema(const float* h, const float* g, float* ho, float
            // b2, float omb2, float bs, int n, int* status): h, g, ho hold n floats (lengths
            // checked and the output shaped by `fused_update`), status 5 ints; indices stay
            // below n.
            unsafe { launch(&HESSIAN_EMA, stream_config(n as usize)?, args) }
        },
        |(h, _), [ho]| std::mem::swap(*h, ho),
    )
}

/// 32-bit words per tensor in a multi-tensor kernel's table (`EW_ENTRY`): the addresses of
/// params, gradient, output params and Hessian sample (two words each, low first), then the
/// length, the state segment's start, the first float4 item and the first flat position.
const ENTRY: usize = 12;

/// The buffers of one multi-tensor update on a kernel device (see
/// [`crate::cpu::elementwise::MultiHost`] for their roles): `state` and `next` hold the flat
/// state arrays and their ping-pong partners (one or two each), `spare` the output params.
pub(crate) struct MultiDevice<'a> {
    pub params: &'a [&'a Matrix],
    pub grads: &'a [&'a Matrix],
    pub sampled: Option<&'a [&'a Matrix]>,
    pub state: &'a [Matrix],
    pub next: &'a mut [Matrix],
    pub spare: &'a mut [Matrix],
}

/// One multi-tensor update in ONE launch of `elementwise_multi_{sgd,adamw,sophia}` over every
/// tensor (per 83 tensors, what a table parameter holds; the launches share the status), then
/// one 36-byte status read-back (the only synchronization); on a clean status the
/// outputs (`spare`, `next`) hold the step and the caller swaps them in, else the error the CPU
/// backend reports ([`MultiUpdate::error`]). Nothing is written but the outputs.
pub(crate) fn multi_update(
    dev: &Device,
    op: &'static str,
    layout: &MultiLayout,
    upd: &MultiUpdate,
    bufs: MultiDevice<'_>,
) -> Result<()> {
    let MultiDevice {
        params,
        grads,
        sampled,
        state,
        next,
        spare,
    } = bufs;
    // Memory safety: the kernel reads and writes lens[t] elements of every per-tensor buffer
    // and the whole state segments, and needs one entry per tensor.
    let lens = layout.lens();
    let count = |arg: &'static str, got: usize| check_len(op, arg, got, lens.len());
    count("grads", grads.len())?;
    count("params", params.len())?;
    count("spare", spare.len())?;
    let per_tensor = |arg: &'static str, ms: &[&Matrix]| -> Result<()> {
        ms.iter()
            .zip(lens)
            .try_for_each(|(m, &n)| check_len(op, arg, m.len(), n))
    };
    per_tensor("params", params)?;
    per_tensor("grads", grads)?;
    if let Some(gh) = sampled {
        count("sampled", gh.len())?;
        per_tensor("sampled", gh)?;
    }
    for (m, &n) in spare.iter().zip(lens) {
        check_len(op, "spare", m.len(), n)?;
    }
    let arrays = upd.arrays();
    check_len(op, "state", state.len(), arrays)?;
    check_len(op, "next", next.len(), arrays)?;
    for m in state.iter().chain(next.iter()) {
        check_len(op, "state", m.len(), layout.state_len())?;
    }
    to_i32(op, "params", layout.state_len())?;
    let items: usize = lens.iter().map(|n| n.div_ceil(4)).sum();
    to_i32(op, "params", items)?;
    if items == 0 {
        return Ok(());
    }

    let mut status = filled(dev, MULTI_SLOTS, NONE as u32)?;
    let (next0, next1) = next.split_at_mut(1);
    // One launch per table's worth of tensors; they share the status (positions are global),
    // the state arrays (segments are global) and the outputs.
    let per_launch = TABLE_WORDS / ENTRY;
    for (c, spare) in spare.chunks_mut(per_launch).enumerate() {
        let (first, ntensors) = (c * per_launch, spare.len());
        let mut args = KernelArgs::new(dev);
        let mut words = vec![0u32; ENTRY * ntensors];
        let mut item = 0usize;
        for (e, (t, po)) in words
            .chunks_exact_mut(ENTRY)
            .zip(spare.iter_mut().enumerate())
        {
            let t = first + t;
            let gh = match sampled {
                Some(gh) => args.address(op, gh[t])?,
                None => 0,
            };
            let addrs = [
                args.address(op, params[t])?,
                args.address(op, grads[t])?,
                args.address_mut(op, po)?,
                gh,
            ];
            put_addresses(e, &addrs);
            // Each below 2^31: lens[t] <= state_len and item, first(t) <= items, total.
            e[8] = lens[t] as u32;
            e[9] = layout.segment(t).start as u32;
            e[10] = item as u32;
            e[11] = layout.first(t) as u32;
            item += lens[t].div_ceil(4);
        }
        if item == 0 {
            continue;
        }
        // Below 2^31: at most per_launch tensors and all tensors' items.
        args.table(op, &words)?
            .scalar(ntensors as i32)
            .scalar(item as i32);
        let cfg = stream_config(4 * item)?;
        match upd {
            MultiUpdate::Sgd(c) => {
                args.input(op, &state[0])?.output(op, &mut next0[0])?;
                sgd_scalars(&mut args, c).output(op, &mut status)?;
                // SAFETY: elementwise_multi_sgd(EwTable table, int ntensors, int nitems, const
                // float* b, float* bo, float lr, float mu, float lrwd, int* status): the table
                // holds ENTRY words per tensor of this launch with the addresses of params,
                // grads and spare, which hold lens[t] floats (checked above) and stay borrowed
                // by `args`; b, bo hold state_len floats and each tensor's segment lies inside;
                // items and positions are computed from `layout` as the kernel expects; status
                // holds MULTI_SLOTS ints.
                unsafe { launch(&MULTI_SGD, cfg, args)? };
            }
            MultiUpdate::AdamW(c) => {
                args.input(op, &state[0])?
                    .input(op, &state[1])?
                    .output(op, &mut next0[0])?
                    .output(op, &mut next1[0])?;
                adamw_scalars(&mut args, c).output(op, &mut status)?;
                // SAFETY: elementwise_multi_adamw(EwTable table, int ntensors, int nitems,
                // const float* m, const float* v, float* mo, float* vo, float lr, float b1,
                // float omb1, float b2, float omb2, float eps, float lrwd, float bc1, float
                // bc2, int* status): as for SGD, with the four state buffers of state_len
                // floats.
                unsafe { launch(&MULTI_ADAMW, cfg, args)? };
            }
            MultiUpdate::Sophia(c, refresh) => {
                let (beta2, batch) = refresh.unwrap_or((0.0, 1));
                args.input(op, &state[0])?
                    .input(op, &state[1])?
                    .output(op, &mut next0[0])?
                    .output(op, &mut next1[0])?;
                sophia_scalars(&mut args, c)
                    .scalar(i32::from(refresh.is_some()))
                    .scalar(beta2)
                    .scalar(1.0 - beta2)
                    .scalar(batch as f32)
                    .output(op, &mut status)?;
                // SAFETY: elementwise_multi_sophia(EwTable table, int ntensors, int nitems,
                // const float* m, const float* h, float* mo, float* ho, float lr, float b1,
                // float omb1, float gamma, float eps, float lrwd, int refresh, float b2, float
                // omb2, float bs, int* status): as for AdamW; the sample addresses are read
                // only when refresh != 0, and then every tensor has one of lens[t] floats
                // (checked).
                unsafe { launch(&MULTI_SOPHIA, cfg, args)? };
            }
        }
    }
    let s: Vec<i32> = status
        .to_vec()?
        .iter()
        .map(|v| v.to_bits() as i32)
        .collect();
    let Some(slot) = s.iter().position(|&v| v != NONE) else {
        return Ok(());
    };
    let pos = s[slot] as usize;
    let (t, i) = layout.locate(pos);
    let at_state = |m: &Matrix| -> Result<f32> { Ok(m.to_vec()?[layout.segment(t).start + i]) };
    let value = match slot {
        0 => params[t].to_vec()?[i],
        1 => grads[t].to_vec()?[i],
        2 => at_state(&state[0])?,
        3 | 5 => at_state(&state[1])?,
        4 => match sampled {
            Some(gh) => gh[t].to_vec()?[i],
            None => f32::NAN,
        },
        6 => spare[t].to_vec()?[i],
        7 => at_state(&next0[0])?,
        _ => at_state(&next1[0])?,
    };
    Err(upd.error(op, layout, slot, pos, value))
}

#[cfg(test)]
mod tests {
    use super::{axpy_new, check_finite_split, SplitCache};
    use crate::cuda::engine::split3;
    use crate::{Device, Error, Matrix};
    use rand::{Rng, SeedableRng};

    fn bits(m: &Matrix<half::bf16>) -> Vec<u16> {
        m.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    proptest::proptest! {
        #![proptest_config(crate::testing::proptest_config(16))]

        /// [`check_finite_split`] on the emulator: five matrices of ragged lengths (`n`, `n`,
        /// `n2`, `n`, `n`: two launches, the first of four matrices of two lengths), caches
        /// wanted or not, one that holds planes already (kept as they are). The planes
        /// written are `gemm_split3`'s of the same matrix, bit for bit; without a cache none
        /// are made. A NaN planted in the third matrix is its typed error, and its group's
        /// caches stay empty. Mutation check: the kernel storing the planes
        /// of `v + v·2⁻¹⁰` fails it.
        #[test]
        fn the_check_writes_the_planes_of_what_it_reads(
            n in 1usize..300,
            n2 in 1usize..300,
            plant in proptest::prelude::any::<bool>(),
            seed in proptest::prelude::any::<u64>(),
        ) {
            let dev = Device::Emulated;
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let lens = [n, n, n2, n, n];
            let mut vals: Vec<Vec<f32>> = lens
                .iter()
                .map(|&l| (0..l).map(|_| rng.random_range(-3.0f32..3.0)).collect())
                .collect();
            if plant {
                vals[2][rng.random_range(0..n2)] = f32::NAN;
            }
            let ms: Vec<Matrix> = vals.iter().map(|v| dev.upload(v.len(), 1, v).unwrap()).collect();
            let caches: Vec<SplitCache> = lens.iter().map(|_| SplitCache::default()).collect();
            // Matrix 4 has planes already (of itself), matrix 1 wants none.
            let own = split3(&dev, &ms[4]).unwrap();
            caches[4].keep(split3(&dev, &ms[4]).unwrap());
            let want = [true, false, true, true, true];
            let named: Vec<_> = ms
                .iter()
                .zip(&caches)
                .zip(want)
                .map(|((m, c), w)| ("x", m, w.then_some(c)))
                .collect();
            let r = check_finite_split(&dev, "test", &named);
            let failed = plant;
            proptest::prop_assert_eq!(r.is_err(), failed);
            if let Err(e) = r {
                proptest::prop_assert!(matches!(e, Error::NonFinite { arg: "x", .. }), "{}", e);
            }
            for (k, (m, c)) in ms.iter().zip(&caches).enumerate() {
                let written = k == 4 || (want[k] && !failed);
                proptest::prop_assert_eq!(c.has_planes(), written, "matrix {}", k);
                if let Some(p) = c.planes() {
                    let expected = if k == 4 { bits(&own) } else { bits(&split3(&dev, m).unwrap()) };
                    proptest::prop_assert_eq!(bits(p), expected, "matrix {}", k);
                }
            }
        }

        /// [`axpy_new`] with a cache on the emulator: the result is the one without (bit for
        /// bit), and the planes it writes are `gemm_split3`'s of the result, bit for bit, at
        /// ragged lengths (the float4 body and its tail, unaligned views excluded: matrices
        /// are fresh). A cache that holds planes keeps its own; a non-finite result fails
        /// and leaves the cache empty. Mutation check: the kernel storing the planes of
        /// `v + v·2⁻¹⁰` fails it.
        #[test]
        fn axpy_new_writes_the_planes_of_its_result(
            n in 1usize..600,
            alpha in -4.0f32..4.0,
            overflow in proptest::prelude::any::<bool>(),
            seed in proptest::prelude::any::<u64>(),
        ) {
            let dev = Device::Emulated;
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut draw = || -> Vec<f32> { (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect() };
            let (xv, mut yv) = (draw(), draw());
            if overflow {
                // y + αx overflows at one element: x finite, y finite, the sum not.
                let i = n / 2;
                yv[i] = f32::MAX;
                let mut xv = xv.clone();
                xv[i] = f32::MAX;
                let (x, y) = (dev.upload(n, 1, &xv).unwrap(), dev.upload(n, 1, &yv).unwrap());
                let c = SplitCache::default();
                proptest::prop_assert!(axpy_new(&dev, 1.0, &x, &y, Some(&c)).is_err());
                proptest::prop_assert!(!c.has_planes());
                return Ok(());
            }
            let (x, y) = (dev.upload(n, 1, &xv).unwrap(), dev.upload(n, 1, &yv).unwrap());
            let plain = axpy_new(&dev, alpha, &x, &y, None).unwrap();
            let c = SplitCache::default();
            let out = axpy_new(&dev, alpha, &x, &y, Some(&c)).unwrap();
            proptest::prop_assert_eq!(out.to_vec().unwrap(), plain.to_vec().unwrap());
            let planes = c.planes().expect("planes written");
            proptest::prop_assert_eq!(bits(planes), bits(&split3(&dev, &out).unwrap()));
            // A cache with planes keeps them.
            let kept = bits(planes);
            axpy_new(&dev, -alpha, &x, &y, Some(&c)).unwrap();
            proptest::prop_assert_eq!(bits(c.planes().unwrap()), kept);
        }
    }
}
