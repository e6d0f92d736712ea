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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use crate::device::Device;
use crate::error::Result;

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
