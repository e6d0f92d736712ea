//! Soak (issue 5, "long runs"): 10,000 steps of every optimizer through [`Trainer::step`] on a
//! small problem (a 4-8-3 tanh network on 3-class blobs, batch 8; the Kalman methods take
//! batch 1) with no error, no skipped step, no NaN/Inf in any loss or parameter, and no
//! memory growth.
//!
//! Memory is measured two ways after a warm-up (buffers, rayon's pool and the allocator's
//! arenas reach their steady state in the first steps):
//! - live heap bytes, exactly, through a counting global allocator: a leak of even one small
//!   buffer per step (the smallest here, a 3-float vector, is 12 bytes: 120 kB over 10,000
//!   steps) exceeds the 64 KiB bound, which only allows for the few long-lived allocations a
//!   run may still make after the warm-up (a `Vec` of step records growing, lazily created
//!   thread-local state);
//! - the process's resident set (`VmRSS` in `/proc/self/status`, in kB, so no page-size
//!   assumption), bounded by 8 MiB: the allocator may keep freed pages mapped and rayon's
//!   threads touch new stack pages, but a leak large enough to matter for a days-long run
//!   shows up here — and this is what the operating system would see.
//!
//! `GRNG_SOAK_STEPS` overrides the step count (e.g. `GRNG_SOAK_STEPS=100000` for a longer
//! soak) and `GRNG_SOAK_ONLY` the methods (`ring,sgd`); see `docs/main-job.md`. CI runs the
//! default: 10,000 steps of all eight. One test, so no other test of
//! this binary allocates concurrently while memory is measured.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use grng::Device;
use grng_train::data::synthetic_classification;
use grng_train::mlp::{Activation, Loss, Mlp, MlpConfig, Targets};
use grng_train::train::{Batch, Method, MethodConfig, Trainer};

/// The system allocator, counting live bytes.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call forwards to `System` with the caller's arguments unchanged; the counter
// is only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const DEFAULT_STEPS: u64 = 10_000;
const WARMUP: u64 = 200;
const MAX_HEAP_GROWTH: isize = 64 << 10;
const MAX_RSS_GROWTH_KB: i64 = 8 << 10;

fn rss_kb() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line")
}

/// The methods to soak: `GRNG_SOAK_ONLY` (a list as `--optimizers` takes it), else all.
fn methods() -> Vec<Method> {
    match std::env::var("GRNG_SOAK_ONLY") {
        Ok(v) => Method::parse_list(&v).unwrap_or_else(|e| panic!("GRNG_SOAK_ONLY: {e}")),
        Err(_) => Method::ALL.to_vec(),
    }
}

fn steps() -> u64 {
    match std::env::var("GRNG_SOAK_STEPS") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("GRNG_SOAK_STEPS={v:?} is not a step count")),
        Err(_) => DEFAULT_STEPS,
    }
}

#[test]
fn every_optimizer_survives_a_long_run_without_nan_or_memory_growth() {
    let total = steps();
    let data = synthetic_classification(96, 4, 3, 17).expect("data");
    for method in methods() {
        let mut config = MethodConfig::tuned(method);
        if !method.is_kalman() {
            config.batch_size = 8;
        }
        let mlp = Mlp::new(
            MlpConfig {
                sizes: vec![4, 8, 3],
                activation: Activation::Tanh,
                loss: Loss::SoftmaxCrossEntropy,
            },
            17,
        )
        .expect("network");
        let mut trainer = Trainer::new(&Device::Cpu, mlp, config, 17).expect("trainer");
        let mut epoch = 0u64;
        let mut done = 0u64;
        let mut mem = None;
        let start = Instant::now();
        let mut last_loss = f32::NAN;
        while done < WARMUP + total {
            for idx in data.batches(17, epoch, config.batch_size).expect("batches") {
                if done == WARMUP {
                    mem = Some((LIVE.load(Ordering::Relaxed), rss_kb(), Instant::now()));
                }
                if done == WARMUP + total {
                    break;
                }
                if idx.len() != config.batch_size {
                    continue;
                }
                let (x, labels) = data.gather(&idx).expect("gather");
                let r = trainer
                    .step(Batch {
                        x: x.as_ref(),
                        targets: Targets::Classes(&labels),
                    })
                    .unwrap_or_else(|e| panic!("{method}: step {done} failed: {e}"));
                assert!(
                    !r.skipped && r.loss.is_finite() && r.grad_norm.is_finite(),
                    "{method}: step {done}: {r:?}"
                );
                assert!(r.loss_after.is_none_or(f32::is_finite), "{method}: {r:?}");
                assert!(r.rho.is_none_or(|p| p.is_finite() && p > 0.0), "{r:?}");
                if let Some(i) = trainer.mlp().params().iter().position(|p| !p.is_finite()) {
                    panic!("{method}: step {done}: parameter {i} is not finite");
                }
                last_loss = r.loss;
                done += 1;
            }
            epoch += 1;
        }
        let (heap0, rss0, t0) = mem.expect("warm-up finished");
        let heap = LIVE.load(Ordering::Relaxed) - heap0;
        let rss = rss_kb() - rss0;
        let secs = t0.elapsed().as_secs_f64();
        let c = trainer.counters();
        assert_eq!(trainer.steps(), WARMUP + total, "{method}");
        assert_eq!(c.skipped_nonfinite, 0, "{method}: {c:?}");
        // Shown with --nocapture: the numbers docs/main-job.md quotes.
        println!(
            "{:<9} {total} steps in {secs:6.2} s ({:5.1} µs/step, {:.2} s with warm-up); \
             heap {heap:+} B, RSS {rss:+} kB; last loss {last_loss:.3e}; {c:?}",
            method.label(),
            secs * 1e6 / total as f64,
            start.elapsed().as_secs_f64()
        );
        assert!(
            heap.abs() <= MAX_HEAP_GROWTH,
            "{method}: live heap grew by {heap} bytes over {total} steps"
        );
        assert!(
            rss <= MAX_RSS_GROWTH_KB,
            "{method}: resident set grew by {rss} kB over {total} steps"
        );
    }
}
