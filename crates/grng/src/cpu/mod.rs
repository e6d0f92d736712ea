//! CPU backend (rayon): the fallback and the oracle for the kernels.

pub mod cholesky;
pub mod elementwise;
pub mod gemm;
pub mod kalman;
pub mod math;
pub mod newton;
pub mod norm;
pub mod precondition;
pub mod syrk;
pub mod woodbury;

pub(crate) use cholesky::damped_cholesky_inverse;
pub use cholesky::{cholesky, cholesky_inverse, cholesky_solve};
pub use gemm::{batch_gradient, gemm};
pub use norm::{spectral_norm, trace};
pub use precondition::{add_diagonal, damped_inverse_update, precondition};
pub use syrk::syrk_ema;
pub use woodbury::{low_rank_damped_inverse, low_rank_is_cheaper, LowRankKernel, LowRankTerms};

use crate::element::Element;
use crate::error::{first_non_finite, Error, Result};
use crate::mat::MatRef;

/// `Err(Error::NonFinite)` at the first NaN/Inf of a view (flat index `i * cols + j`): the
/// scan of [`crate::error::first_non_finite`], once over the data when the view is
/// contiguous, else row by row.
pub(crate) fn check_finite_view<T: Element>(
    op: &'static str,
    arg: &'static str,
    a: MatRef<'_, T>,
) -> Result<()> {
    let (rows, cols) = a.shape();
    let found = if a.ld() == cols || rows <= 1 {
        first_non_finite(&a.data()[..rows * cols]).map(|k| (k / cols.max(1), k % cols.max(1)))
    } else {
        (0..rows).find_map(|i| first_non_finite(a.row(i)).map(|j| (i, j)))
    };
    match found {
        None => Ok(()),
        Some((i, j)) => Err(Error::NonFinite {
            op,
            arg,
            index: i * cols + j,
            value: a.at(i, j).to_f32(),
        }),
    }
}

/// Runs `f` on a worker thread of the current rayon pool when its largest product has at
/// least `work` multiply-adds above the `gemm` crate's threading threshold (below it the
/// products run on one thread, and the hop, a wake-up of a worker and of the caller after it,
/// would be all that changes: ~20 µs a step on the main job's 64-64-10 network); inline
/// otherwise, and always inline on a worker already.
///
/// Why: a parallel loop entered from a thread outside the pool is handed to the workers and
/// the caller sleeps until it ends, a cross-thread wake-up per loop, and in faer's recursive
/// factorizations one per `join`. An optimizer step is a sequence of such loops; run from a
/// worker, each is an in-pool `join` instead. Measured on 2 cores (`benches/step.rs`,
/// 784-1024-1024-10, batch 256): AdamW 8.5 → 7.9–8.2 ms, RING S = 8 46 → 37 ms, RING S = 1
/// 118 → 96 ms. The bits are the same: the work and its split are, only the thread that
/// starts it changes.
pub fn on_pool<R: Send>(work: usize, f: impl FnOnce() -> R + Send) -> R {
    if work >= ::gemm::get_threading_threshold() {
        rayon::scope(|_| f())
    } else {
        f()
    }
}

/// Whether the calling thread is a rayon pool worker: where [`on_pool`] sends a step whose
/// products are large, and where a `join` of a step's independent tasks is an in-pool hand-off
/// (from outside the pool it would wake the workers, and the caller after them).
fn on_worker() -> bool {
    rayon::current_thread_index().is_some()
}

/// `f` of each item, in item order: parallel tasks on a pool worker (`on_worker`), one after
/// another elsewhere. A step's independent chains of products (per layer, per Kronecker
/// factor) keep both threads busy this way: within one product the threads idle at its end and
/// between products, where rayon's workers fall asleep and take tens of µs to wake. The bits
/// are the same either way (a product splits by the pool's size, not by its caller).
pub fn map_tasks<I: Send, T: Send>(items: Vec<I>, f: impl Fn(I) -> T + Sync + Send) -> Vec<T> {
    if on_worker() {
        use rayon::prelude::*;
        items.into_par_iter().map(f).collect()
    } else {
        items.into_iter().map(f).collect()
    }
}

/// `(a(), b())`, as [`map_tasks`] runs its tasks.
pub fn join_tasks<A: Send, B: Send>(
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B + Send,
) -> (A, B) {
    if on_worker() {
        rayon::join(a, b)
    } else {
        (a(), b())
    }
}

#[cfg(test)]
mod tests {
    /// Large work runs on a pool worker, small work on the caller; on a worker already,
    /// inline (the same worker).
    #[test]
    fn on_pool_hops_by_size() {
        let big = ::gemm::get_threading_threshold();
        assert_eq!(super::on_pool(big - 1, rayon::current_thread_index), None);
        assert!(super::on_pool(big, rayon::current_thread_index).is_some());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| {
            let here = rayon::current_thread_index();
            assert_eq!(super::on_pool(big, rayon::current_thread_index), here);
        });
    }

    /// The tasks' results come back in task order, from a worker (in parallel) and from
    /// another thread (in order) alike.
    #[test]
    fn tasks_keep_their_order() {
        let check = || {
            let items: Vec<usize> = (0..257).collect();
            let want: Vec<usize> = items.iter().map(|i| i * i).collect();
            assert_eq!(super::map_tasks(items, |i| i * i), want);
            assert_eq!(super::join_tasks(|| 1, || 2), (1, 2));
        };
        check();
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap()
            .install(check);
    }
}
