//! Device time by kernel, for benchmarks (feature `test-hooks`): with [`time_kernels`] on, every launch of
//! [`super::launch::launch`] is bracketed by two CUDA events on the device's stream (on the
//! emulator: the host's clock around the emulated launch, which says nothing of a GPU but
//! keeps the bookkeeping tested), and [`take_kernel_times`] sums the spans by kernel. Where
//! Nsight Compute cannot read the counters (a gVisor machine), this still says where a step's
//! time goes, and the sum beside the step's wall time shows what launches and host work cost.
//!
//! The events are two more records per launch, so a step timed with this on is not the
//! step's own time: time it first, then take the breakdown in a run of its own. Process-wide,
//! like the launch record. cuSOLVER's calls are not kernels of ours and are not timed.
//!
//! [`launch_anatomy`] takes one launch apart (queued, waited for, read back, a node of a CUDA
//! graph), for the bench's `launch` section (issue 36 item 4).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaStream};

use super::deferred::FILL;
use super::launch::{launch, KernelArgs, LaunchConfig};
use crate::device::{Device, Matrix};
use crate::error::{Error, Result};

/// Whether launches are timed (off by default: one relaxed load per launch).
static TIMING: AtomicBool = AtomicBool::new(false);
/// The spans since timing was last switched on or drained, in launch order.
static SPANS: Mutex<Vec<(&'static str, Span)>> = Mutex::new(Vec::new());

/// One launch's time: a pair of events on the GPU, seconds on the host clock for the emulator.
enum Span {
    Events(CudaEvent, CudaEvent),
    Host(f64),
}

/// What [`start`] took before a launch.
pub(crate) enum Started {
    Off,
    Event(Arc<CudaStream>, CudaEvent),
    Clock(Instant),
}

/// Before a launch on `device`: its start, when timing is on.
pub(crate) fn start(device: &Device) -> Result<Started> {
    if !TIMING.load(Ordering::Relaxed) {
        return Ok(Started::Off);
    }
    Ok(match device {
        Device::Cuda(d) => {
            let stream = d.stream().clone();
            let event = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            Started::Event(stream, event)
        }
        Device::Cpu | Device::Emulated => Started::Clock(Instant::now()),
    })
}

/// After `kernel`'s launch succeeded: its span, from `started`.
pub(crate) fn finish(started: Started, kernel: &'static str) -> Result<()> {
    let span = match started {
        Started::Off => return Ok(()),
        Started::Event(stream, start) => Span::Events(
            start,
            stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        ),
        Started::Clock(t) => Span::Host(t.elapsed().as_secs_f64()),
    };
    SPANS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push((kernel, span));
    Ok(())
}

/// One kernel's share of the launches timed: how many, and their summed device time.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    /// The kernel that ran (an sm_90a variant under its own name).
    pub name: &'static str,
    /// Its launches.
    pub launches: usize,
    /// Their time in seconds, summed (GPU event time; host time on the emulator).
    pub secs: f64,
}

/// Switches the timing of launches on (clearing what was timed) or off.
pub fn time_kernels(on: bool) {
    SPANS.lock().unwrap_or_else(PoisonError::into_inner).clear();
    TIMING.store(on, Ordering::Relaxed);
}

/// The launches timed since the last call or [`time_kernels`]`(true)`, summed by kernel, the
/// most time first; clears them. Waits for the GPU to reach the last event.
///
/// # Errors
/// [`crate::Error::Cuda`] when the driver cannot give an event's time.
pub fn take_kernel_times() -> Result<Vec<KernelTime>> {
    let spans = std::mem::take(&mut *SPANS.lock().unwrap_or_else(PoisonError::into_inner));
    let mut out: Vec<KernelTime> = Vec::new();
    for (name, span) in spans {
        let secs = match span {
            Span::Events(start, end) => f64::from(start.elapsed_ms(&end)?) * 1e-3,
            Span::Host(secs) => secs,
        };
        match out.iter_mut().find(|k| k.name == name) {
            Some(k) => {
                k.launches += 1;
                k.secs += secs;
            }
            None => out.push(KernelTime {
                name,
                launches: 1,
                secs,
            }),
        }
    }
    out.sort_by(|a, b| b.secs.total_cmp(&a.secs));
    Ok(out)
}

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
}

/// [`LaunchAnatomy`] over `n ≥ 1` launches on `dev` (the emulator: the host's cost of an
/// emulated launch; no graph). Where the 58 µs of one op with a status read-back went on an
/// H200 (2026-11-27), and what a step replayed as a graph would pay per kernel instead.
///
/// # Errors
/// [`Error::Value`] for `n = 0`; [`Error::DeviceUnavailable`] on the CPU backend; driver
/// errors (a capture that failed is ended before the error returns).
pub fn launch_anatomy(dev: &Device, n: usize) -> Result<LaunchAnatomy> {
    const OP: &str = "cuda::timing::launch_anatomy";
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
    })
}
