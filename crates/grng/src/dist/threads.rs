//! [`Threads`]: `P` ranks as threads of one process, on a mutex and a condition variable.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::{check_root, Communicator};
use crate::error::{Error, Result};

/// One rank of a world of threads ([`Threads::world`]): each collective waits for all `P`
/// ranks, then hands every rank the result, summed in rank order (so the same bits on every
/// rank and from run to run). For tests of the data-parallel steps and for running them on
/// one machine without MPI; every rank must be driven by its own thread. A rank that is
/// dropped (its thread ended, or panicked) makes the other ranks' waiting collectives fail
/// with [`Error::Communicator`] instead of waiting forever.
#[derive(Debug)]
pub struct Threads {
    rank: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    round: Mutex<Round>,
    turn: Condvar,
}

/// One collective in flight: the ranks' contributions, then (once all arrived) the result
/// the ranks take before the next collective may start.
#[derive(Debug, Default)]
struct Round {
    slots: Vec<Option<Data>>,
    arrived: usize,
    result: Option<std::result::Result<Arc<Data>, String>>,
    taken: usize,
    /// Ranks dropped: a collective they have not joined can never complete.
    left: usize,
}

#[derive(Clone, Debug)]
enum Data {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Broadcast(Vec<f32>, usize),
    Barrier,
}

impl Threads {
    /// The `size` ranks of a new world, rank `p` at index `p`.
    ///
    /// # Errors
    /// [`Error::Value`] for `size = 0`.
    pub fn world(size: usize) -> Result<Vec<Threads>> {
        crate::error::check_value(
            "Threads::world",
            "size",
            size as f64,
            size >= 1,
            "size >= 1",
        )?;
        let shared = Arc::new(Shared {
            size,
            round: Mutex::new(Round {
                slots: vec![None; size],
                ..Round::default()
            }),
            turn: Condvar::new(),
        });
        Ok((0..size)
            .map(|rank| Threads {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }

    fn lock(&self) -> Result<MutexGuard<'_, Round>> {
        self.shared
            .round
            .lock()
            .map_err(|_| Error::Communicator("a rank's thread panicked".into()))
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Round>) -> Result<MutexGuard<'a, Round>> {
        self.shared
            .turn
            .wait(g)
            .map_err(|_| Error::Communicator("a rank's thread panicked".into()))
    }

    /// Deposits `mine`, waits for every rank's, and returns the combined result.
    fn exchange(&self, mine: Data) -> Result<Arc<Data>> {
        let size = self.shared.size;
        let mut g = self.lock()?;
        // The last collective's result is still being taken: wait for its end.
        while g.result.is_some() {
            g = self.wait(g)?;
        }
        g.slots[self.rank] = Some(mine);
        g.arrived += 1;
        if g.arrived == size {
            let slots: Vec<Data> = g.slots.iter_mut().filter_map(Option::take).collect();
            g.result = Some(combine(slots).map(Arc::new));
            self.shared.turn.notify_all();
        }
        while g.result.is_none() {
            if g.left > 0 {
                // Withdraw, so a later collective does not count this contribution.
                g.slots[self.rank] = None;
                g.arrived -= 1;
                return Err(Error::Communicator(
                    "a rank left the world before joining this collective".into(),
                ));
            }
            g = self.wait(g)?;
        }
        let result = g.result.clone().expect("set above");
        g.taken += 1;
        if g.taken == size {
            g.result = None;
            g.arrived = 0;
            g.taken = 0;
            self.shared.turn.notify_all();
        }
        result.map_err(Error::Communicator)
    }
}

/// The ranks' contributions (in rank order) combined: sums added in rank order, the root's
/// broadcast buffer; an error when the ranks called different collectives or lengths.
fn combine(slots: Vec<Data>) -> std::result::Result<Data, String> {
    let mismatch = || "the ranks called different collectives or lengths".to_string();
    let mut it = slots.into_iter();
    let first = it.next().expect("size >= 1");
    match first {
        Data::F32(acc) => {
            let rest = it.map(|d| match d {
                Data::F32(x) => Some(x),
                _ => None,
            });
            added(acc, rest).map(Data::F32).ok_or_else(mismatch)
        }
        Data::F64(acc) => {
            let rest = it.map(|d| match d {
                Data::F64(x) => Some(x),
                _ => None,
            });
            added(acc, rest).map(Data::F64).ok_or_else(mismatch)
        }
        Data::Broadcast(x, root) => {
            let mut all = vec![x];
            for d in it {
                match d {
                    Data::Broadcast(y, r) if r == root && y.len() == all[0].len() => all.push(y),
                    _ => return Err(mismatch()),
                }
            }
            Ok(Data::F32(all.swap_remove(root)))
        }
        Data::Barrier => {
            if it.all(|d| matches!(d, Data::Barrier)) {
                Ok(Data::Barrier)
            } else {
                Err(mismatch())
            }
        }
    }
}

/// `acc` plus every vector of `rest`, in order; `None` when one is missing or of another
/// length.
fn added<T: Copy + std::ops::AddAssign>(
    mut acc: Vec<T>,
    rest: impl Iterator<Item = Option<Vec<T>>>,
) -> Option<Vec<T>> {
    for x in rest {
        let x = x.filter(|x| x.len() == acc.len())?;
        acc.iter_mut().zip(&x).for_each(|(a, &b)| *a += b);
    }
    Some(acc)
}

impl Drop for Threads {
    fn drop(&mut self) {
        // A poisoned lock: the other ranks already fail on it.
        if let Ok(mut g) = self.shared.round.lock() {
            g.left += 1;
            self.shared.turn.notify_all();
        }
    }
}

impl Communicator for Threads {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        if let Data::F32(x) = &*self.exchange(Data::F32(buf.to_vec()))? {
            buf.copy_from_slice(x);
        }
        Ok(())
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        if let Data::F64(x) = &*self.exchange(Data::F64(buf.to_vec()))? {
            buf.copy_from_slice(x);
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        check_root("Threads::broadcast", root, self.size())?;
        if let Data::F32(x) = &*self.exchange(Data::Broadcast(buf.to_vec(), root))? {
            buf.copy_from_slice(x);
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange(Data::Barrier).map(|_| ())
    }
}
