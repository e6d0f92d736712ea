//! One launch taken apart, for benchmarks (feature `test-hooks`): [`launch_anatomy`] times a
//! one-thread kernel queued, waited for, read back, and as a node of a CUDA graph — the parts
//! of the eager launch-and-check op, and what a step replayed as a graph would pay per kernel
//! instead (issue 36 item 4; the GPU bench's `launch-anatomy` rows) — and the other
//! operations a step may queue beside its kernels: a zero-filled allocation, an unset one, a
//! small upload.

use std::time::Instant;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::deferred::FILL;
use super::launch::{launch, KernelArgs, LaunchConfig};
use crate::device::{Device, Matrix};
use crate::error::{Error, Result};

/// One launch taken apart ([`launch_anatomy`]): seconds per launch of a one-thread kernel
/// (`elementwise_fill` of one float), each the best of three runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LaunchAnatomy {
    /// Launches queued back to back, one synchronization after all: what the host and the
    /// GPU's front end take per launch.
    pub queued: f64,
    /// One synchronization after each launch: a launch's round trip.
    pub waited: f64,
    /// A 4-byte read-back (`Matrix::to_vec`) after each launch: an eager op's status read.
    pub read_back: f64,
    /// The same launches captured once into a CUDA graph, replayed: per node. `None` on the
    /// emulator, which has no graphs.
    pub graph: Option<f64>,
    /// A zero-filled one-float allocation (`Device::zeros`: on a GPU the allocation and a
    /// memset) freed again, queued back to back: what each output buffer of a step cost before
    /// the outputs its kernels write whole took `Device::scratch`.
    pub zeroed: f64,
    /// The same allocation unset (`Device::scratch`: the stream-ordered allocation and free
    /// alone).
    pub unset: f64,
    /// An upload of 44 bytes (`Device::upload`, from pageable memory), queued back to back:
    /// what each batched launch cost beside it before its table became a kernel parameter.
    pub upload: f64,
}

/// [`LaunchAnatomy`] over `n ≥ 1` launches on `dev` (the emulator: the host's cost of an
/// emulated launch; no graph). Where the 58 µs of one op with a status read-back went on an
/// H200 (2026-11-27), and what a step replayed as a graph would pay per kernel instead.
///
/// # Errors
/// [`Error::Value`] for `n = 0`; [`Error::DeviceUnavailable`] on the CPU backend; driver
/// errors (a capture that failed is ended before the error returns).
pub fn launch_anatomy(dev: &Device, n: usize) -> Result<LaunchAnatomy> {
    const OP: &str = "cuda::anatomy::launch_anatomy";
    if n == 0 {
        return Err(Error::Value {
            op: OP,
            arg: "n",
            value: 0.0,
            expected: "at least one launch",
        });
    }
    let mut x = dev.zeros(1, 1)?;
    let fill = |x: &mut Matrix| -> Result<()> {
        let mut args = KernelArgs::new(dev);
        args.output(OP, x)?.scalar(0u32).scalar(1i32);
        // SAFETY: elementwise_fill(float* x, unsigned int bits, int n): x holds the n = 1
        // float written; one block of one thread.
        unsafe { launch(&FILL, LaunchConfig::linear(1, 1), args) }
    };
    let sync = || match dev {
        Device::Cuda(d) => d.synchronize(),
        _ => Ok(()),
    };
    // Warm: the module is loaded and the first launch's setup is paid outside the timing.
    fill(&mut x)?;
    sync()?;
    let best = |run: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            run()?;
            best = best.min(t.elapsed().as_secs_f64() / n as f64);
        }
        Ok(best)
    };
    let queued = best(&mut || {
        (0..n).try_for_each(|_| fill(&mut x))?;
        sync()
    })?;
    let waited = best(&mut || (0..n).try_for_each(|_| fill(&mut x).and_then(|()| sync())))?;
    let read_back =
        best(&mut || (0..n).try_for_each(|_| fill(&mut x).and_then(|()| x.to_vec().map(drop))))?;
    let queued_ops = |op: &dyn Fn() -> Result<()>| {
        best(&mut || {
            (0..n).try_for_each(|_| op())?;
            sync()
        })
    };
    let zeroed = queued_ops(&|| dev.zeros::<f32>(1, 1).map(drop))?;
    let unset = queued_ops(&|| dev.scratch::<f32>(1, 1).map(drop))?;
    let table = [0.0f32; 11];
    let upload = queued_ops(&|| dev.upload(table.len(), 1, &table).map(drop))?;
    let graph = match dev {
        Device::Cuda(d) => {
            let stream = d.stream();
            stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let queued = (0..n).try_for_each(|_| fill(&mut x));
            // The capture ends whatever happened, so the stream is usable after an error.
            let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
            queued?;
            let graph = graph.ok_or_else(|| Error::Cuda(format!("{OP}: an empty capture")))?;
            graph.upload()?;
            Some(best(&mut || {
                graph.launch()?;
                sync()
            })?)
        }
        _ => None,
    };
    Ok(LaunchAnatomy {
        queued,
        waited,
        read_back,
        graph,
        zeroed,
        unset,
        upload,
    })
}
