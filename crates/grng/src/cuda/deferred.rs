//! Deferred checks: the finiteness checks and scalar reductions of a run of ops on a kernel
//! device written into one device buffer and read back once (issue 10: one status read per
//! optimizer step instead of one synchronization per op).
//!
//! [`crate::Device::deferred`] installs a [`Ledger`] for the calling thread and runs a body.
//! While it is installed, [`crate::Device::check_finite`] (and so every op's input and result
//! check, `Device::commit_finite` included) queues its check kernel into slots of the ledger
//! and returns `Ok` without reading anything back, and [`crate::Device::dots_deferred`] queues
//! its reduction there and returns a [`Scalar`] slot. An op inside the body can therefore
//! return `Ok` for inputs or results that are not finite: the body must commit nothing (the
//! one caller, `KronOptimizer`, builds new buffers from state it only borrows, and installs
//! them after the scope). At the end the ledger is read back — one read per [`CHUNK`] floats,
//! one for a step of up to ~25 layers — and if any check flagged, any reduction was not
//! finite, or the body itself failed, the body runs again without a ledger. So an error is
//! exactly the eager path's (same op, argument, index and value) and costs the step twice;
//! a clean step costs one read-back.
//!
//! The ledger is per thread, which is where ops are issued from: a check issued from another
//! thread, or on another device, runs eagerly. A nested scope takes the outer ledger off for
//! its duration.

use std::cell::RefCell;
use std::sync::Arc;

use super::launch::{kernel, launch, stream_config, to_i32, KernelArgs};
use crate::device::{Device, Matrix};
use crate::error::Result;

/// Floats per ledger buffer: 5 per check launch, [`SCALAR_SLOT`] per reduction. A lazy
/// Kronecker step queues about 15 checks and 3 reductions per layer (~85 floats).
pub(crate) const CHUNK: usize = 2048;

/// Floats of a reduction's slot: `(value, finite flag, block count)`. `elementwise_dot`'s
/// blocks count themselves in the third (up from its preset bits) and the last one to finish
/// writes the first two, so the reduction needs no preset launch of its own.
pub(crate) const SCALAR_SLOT: usize = 3;

/// "No bad index" in a check slot, as the kernels write it (`EW_NONE`), as `f32` bits.
const NONE_BITS: u32 = NONE as u32;

/// Where a queued check or reduction writes: buffer `chunk`, floats `offset..offset + len`.
#[derive(Clone, Copy, Debug)]
struct Slot {
    chunk: usize,
    offset: usize,
    len: usize,
}

/// A reduction's result: known now (CPU, or no ledger), or in a ledger slot until
/// [`crate::Device::deferred`] returns.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Scalar {
    Value(f32),
    Deferred { chunk: usize, offset: usize },
}

/// `0`, known: what an output slot holds before a reduction sets it.
impl Default for Scalar {
    fn default() -> Self {
        Scalar::Value(0.0)
    }
}

/// The ledger's buffers as read back, to resolve [`Scalar`]s.
#[derive(Debug, Default)]
pub(crate) struct Readout {
    chunks: Vec<Vec<f32>>,
}

impl Readout {
    /// The value of `s`: its own, or, deferred, as read back by the scope this readout came
    /// from (`None` from another readout, e.g. an empty one while the scope still runs).
    pub(crate) fn get(&self, s: Scalar) -> Option<f32> {
        match s {
            Scalar::Value(v) => Some(v),
            Scalar::Deferred { chunk, offset } => {
                self.chunks.get(chunk).and_then(|c| c.get(offset)).copied()
            }
        }
    }
}

/// The checks and reductions queued by one scope.
pub(crate) struct Ledger {
    device: Device,
    chunks: Vec<Matrix>,
    /// Floats handed out from the last chunk.
    used: usize,
    checks: Vec<Slot>,
    scalars: Vec<Slot>,
}

thread_local! {
    static LEDGER: RefCell<Option<Ledger>> = const { RefCell::new(None) };
}

/// Whether two devices queue work on the same stream (the emulator has one).
fn same_device(a: &Device, b: &Device) -> bool {
    match (a, b) {
        (Device::Emulated, Device::Emulated) => true,
        (Device::Cuda(x), Device::Cuda(y)) => Arc::ptr_eq(x.stream(), y.stream()),
        _ => false,
    }
}

impl Ledger {
    fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            chunks: Vec::new(),
            used: CHUNK,
            checks: Vec::new(),
            scalars: Vec::new(),
        }
    }

    /// `len` fresh floats (preset to [`NONE_BITS`]), in a new chunk when the last is full.
    fn reserve(&mut self, len: usize) -> Result<Slot> {
        if self.used + len > CHUNK {
            self.chunks.push(filled(&self.device, CHUNK, NONE_BITS)?);
            self.used = 0;
        }
        let slot = Slot {
            chunk: self.chunks.len() - 1,
            offset: self.used,
            len,
        };
        self.used += len;
        Ok(slot)
    }

    /// Reads every chunk back (the scope's synchronization) and says whether every check
    /// stayed clean and every reduction was finite: `elementwise_dot`'s flag (1.0 for a finite
    /// f64 sum; a slot no block finished keeps the preset's NaN) and its f32 value (the eager
    /// `Device::dot` rejects an overflow).
    fn read(&self) -> Result<(Readout, bool)> {
        let mut chunks = Vec::with_capacity(self.chunks.len());
        for c in &self.chunks {
            chunks.push(c.to_vec()?);
        }
        let at = |s: &Slot| &chunks[s.chunk][s.offset..s.offset + s.len];
        let clean = self
            .checks
            .iter()
            .all(|s| at(s).iter().all(|v| v.to_bits() == NONE_BITS))
            && self
                .scalars
                .iter()
                .all(|s| at(s)[1] == 1.0 && at(s)[0].is_finite());
        Ok((Readout { chunks }, clean))
    }
}

/// Runs `queue` on a fresh `len`-float slot of this thread's ledger (the buffer and the
/// slot's offset) when one is installed for `device`; `None` when not (run eagerly). The
/// slot is a check's status (`scalars = 0`), or `scalars` consecutive [`SCALAR_SLOT`]s.
fn queue_into(
    device: &Device,
    len: usize,
    scalars: usize,
    queue: impl FnOnce(&mut Matrix, usize) -> Result<()>,
) -> Option<Result<Slot>> {
    LEDGER.with(|l| {
        let mut l = l.borrow_mut();
        let ledger = l.as_mut().filter(|g| same_device(&g.device, device))?;
        Some((|| {
            let slot = ledger.reserve(len)?;
            queue(&mut ledger.chunks[slot.chunk], slot.offset)?;
            if scalars == 0 {
                ledger.checks.push(slot);
            }
            ledger.scalars.extend((0..scalars).map(|j| Slot {
                offset: slot.offset + j * SCALAR_SLOT,
                len: SCALAR_SLOT,
                ..slot
            }));
            Ok(slot)
        })())
    })
}

/// A check kernel writing a `len`-int status into the ledger, or `None` without one.
pub(crate) fn queue_check(
    device: &Device,
    len: usize,
    queue: impl FnOnce(&mut Matrix, usize) -> Result<()>,
) -> Option<Result<()>> {
    queue_into(device, len, 0, queue).map(|r| r.map(|_| ()))
}

/// A reduction of `out.len() ≥ 1` sums writing `(value, finite flag)` into as many
/// consecutive [`SCALAR_SLOT`]s of the ledger (the buffer, the first slot's offset and the
/// floats' preset bits), `out` set to them; `None` without a ledger (`out` untouched).
pub(crate) fn queue_scalars(
    device: &Device,
    out: &mut [Scalar],
    queue: impl FnOnce(&mut Matrix, usize, u32) -> Result<()>,
) -> Option<Result<()>> {
    let k = out.len();
    queue_into(device, k * SCALAR_SLOT, k, |m, at| queue(m, at, NONE_BITS)).map(|r| {
        r.map(|s| {
            for (j, o) in out.iter_mut().enumerate() {
                *o = Scalar::Deferred {
                    chunk: s.chunk,
                    offset: s.offset + j * SCALAR_SLOT,
                };
            }
        })
    })
}

/// Puts the outer ledger back when the scope ends, panics included (a ledger left installed
/// would swallow every later check on this thread).
struct Restore(Option<Ledger>);

impl Drop for Restore {
    fn drop(&mut self) {
        let outer = self.0.take();
        LEDGER.with(|l| *l.borrow_mut() = outer);
    }
}

/// [`crate::Device::deferred`] on a kernel device (module docs).
pub(crate) fn scope<R>(
    device: &Device,
    mut body: impl FnMut() -> Result<R>,
) -> Result<(R, Readout)> {
    let restore = Restore(LEDGER.with(|l| l.borrow_mut().replace(Ledger::new(device))));
    let r = body();
    let ledger = LEDGER.with(|l| l.borrow_mut().take());
    let outcome = match (r, ledger) {
        (Ok(v), Some(ledger)) => match ledger.read()? {
            (readout, true) => Some((v, readout)),
            (_, false) => None,
        },
        _ => None,
    };
    // `restore` puts the outer ledger back on return, so the eager run below has none.
    let _restore = restore;
    match outcome {
        Some(done) => Ok(done),
        // Something failed: the eager run names it exactly (or, should it pass, is the result).
        None => body().map(|v| (v, Readout::default())),
    }
}

/// "No bad index" in a status slot (`EW_NONE` in the kernel file).
pub(crate) const NONE: i32 = i32::MAX;

kernel!(pub(crate) FILL = ELEMENTWISE::elementwise_fill;);

/// A new `n x 1` matrix whose every element has the bit pattern `bits`, filled on the device
/// (`elementwise_fill`, queued on the stream: no host upload).
pub(crate) fn filled(dev: &Device, n: usize, bits: u32) -> Result<Matrix> {
    const OP: &str = "cuda::filled";
    let len = to_i32(OP, "n", n)?;
    let mut m = dev.scratch(n, 1)?;
    if n == 0 {
        return Ok(m);
    }
    let mut args = KernelArgs::new(dev);
    args.output(OP, &mut m)?.scalar(bits).scalar(len);
    // SAFETY: elementwise_fill(float* x, unsigned int bits, int n): x holds n floats; threads
    // write index i < n only.
    unsafe { launch(&FILL, stream_config(n)?, args)? };
    Ok(m)
}

/// Runs `queue`, a launch that flags the first bad index into one `int` status slot (the
/// buffer and the slot's float offset): into the ledger inside [`crate::Device::deferred`]
/// (`Ok(None)`: the scope reads it), else into a fresh status read back here — `Some(index)`
/// when it flagged one.
pub(crate) fn first_flagged(
    dev: &Device,
    queue: impl FnMut(&mut Matrix, usize) -> Result<()>,
) -> Result<Option<usize>> {
    let Some(status) = queued_status(dev, 1, queue)? else {
        return Ok(None);
    };
    let first = status.to_vec()?[0].to_bits() as i32;
    Ok((first != NONE).then_some(first as usize))
}

/// Runs `queue`, a launch that writes a `len`-int status (the buffer and the status's float
/// offset): into `len` slots of the ledger inside [`crate::Device::deferred`] (`Ok(None)`: the
/// scope reads them), else into a fresh status preset to [`NONE`], returned for the caller to
/// read (`Ok(Some(status))`) — the one place a check chooses between the two.
pub(crate) fn queued_status(
    dev: &Device,
    len: usize,
    mut queue: impl FnMut(&mut Matrix, usize) -> Result<()>,
) -> Result<Option<Matrix>> {
    if let Some(r) = queue_check(dev, len, &mut queue) {
        return r.map(|()| None);
    }
    let mut status = filled(dev, len, NONE as u32)?;
    queue(&mut status, 0)?;
    Ok(Some(status))
}
