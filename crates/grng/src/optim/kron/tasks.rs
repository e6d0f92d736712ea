//! The independent work of a Kronecker step (per layer, and per factor within a layer) as
//! parallel tasks on the CPU ([`crate::cpu::map_tasks`]: on a pool worker, where the step has
//! gone because its products are large; small steps keep one thread). On the 2-core bench
//! machine one core idled 11% of a RING step, most of it at the end of and between the rows'
//! products of one chain; with two chains in flight an idle thread takes the other's work.
//! The kernel devices run the tasks one after another: their deferred scope
//! (`cuda::deferred`) is per thread.
//!
//! Either way the error returned is the first in task order, as one after another.

use crate::device::Device;
use crate::error::Result;

/// `f` of each item, in item order; the first error in that order.
pub(super) fn map<I: Send, T: Send>(
    d: &Device,
    items: Vec<I>,
    f: impl Fn(I) -> Result<T> + Sync + Send,
) -> Result<Vec<T>> {
    if matches!(d, Device::Cpu) {
        crate::cpu::map_tasks(items, f).into_iter().collect()
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
    if matches!(d, Device::Cpu) {
        let (a, b) = crate::cpu::join_tasks(a, b);
        Ok((a?, b?))
    } else {
        let a = a()?;
        Ok((a, b()?))
    }
}
