//! The independent work of a Kronecker step (per layer, and per factor within a layer) as
//! parallel tasks on the CPU.
//!
//! Each product splits over both threads, but its threads idle at its end and in the gaps
//! between products, where rayon's workers go to sleep and take tens of µs to wake: on the
//! 2-core bench machine one core idled 11% of a RING step, most of it inside or between the
//! rows' products. With two chains of products in flight, an idle thread takes work from the
//! other chain. The tasks run in parallel only on the CPU and only from a pool worker, where
//! the step has gone because its products are large (`cpu::on_pool`): small steps keep their
//! single thread, and the kernel devices' deferred scope (`cuda::deferred`) is per thread.
//!
//! A task's values do not depend on the thread that runs it (a product splits by the pool's
//! size, not by who calls it), so the bits are those of the tasks run one after another, and
//! the error returned is the first in task order, as it would be then.

use rayon::prelude::*;

use crate::device::Device;
use crate::error::Result;

/// Whether tasks on `d` run in parallel.
fn parallel(d: &Device) -> bool {
    matches!(d, Device::Cpu) && rayon::current_thread_index().is_some()
}

/// `f` of each item, in item order; the first error in that order.
pub(super) fn map<I: Send, T: Send>(
    d: &Device,
    items: Vec<I>,
    f: impl Fn(I) -> Result<T> + Sync + Send,
) -> Result<Vec<T>> {
    if parallel(d) {
        let all: Vec<Result<T>> = items.into_par_iter().map(f).collect();
        all.into_iter().collect()
    } else {
        items.into_iter().map(f).collect()
    }
}

/// `(a(), b())`; `a`'s error first.
pub(super) fn join<A: Send, B: Send>(
    d: &Device,
    a: impl FnOnce() -> Result<A> + Send,
    b: impl FnOnce() -> Result<B> + Send,
) -> Result<(A, B)> {
    if parallel(d) {
        let (a, b) = rayon::join(a, b);
        Ok((a?, b?))
    } else {
        let a = a()?;
        Ok((a, b()?))
    }
}
