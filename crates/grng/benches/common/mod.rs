//! Criterion setup shared by the benches (`mod common;` in each bench crate).

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode};
use std::time::Duration;

/// A benchmark group with flat sampling: ten samples of equal iteration counts, 1 s warm-up
/// and 3 s of measurement, so the largest sizes (~0.3 s an iteration) fit the short window
/// on a 2-core machine.
pub fn flat_group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .sampling_mode(SamplingMode::Flat);
    group
}
