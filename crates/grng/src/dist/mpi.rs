//! [`Mpi`]: the [`Communicator`] on rsmpi (feature `mpi`), over the system's MPI library.

use std::sync::Mutex;

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives, Equivalence, Root};
use mpi::Threading;

use super::{check_root, Communicator};
use crate::error::{Error, Result};

/// `MPI_COMM_WORLD` as a [`Communicator`]: one per process, from [`Mpi::init`], which
/// initializes MPI (dropping the last handle finalizes it). Run the program under `mpirun`.
///
/// A sum all-reduce is an `MPI_Reduce` to rank 0 then an `MPI_Bcast`: `MPI_Allreduce` may
/// add in another order on each rank (its result is not promised bit-equal everywhere), and
/// equal bits are what keep the replicas equal. MPI's default error handler aborts the job
/// on a failed call, so the collectives here return `Ok` or do not return.
pub struct Mpi {
    /// Held for its `Drop` (`MPI_Finalize`).
    _universe: Universe,
    /// MPI is initialized `MPI_THREAD_SERIALIZED`: the lock makes the calls so.
    world: Mutex<SimpleCommunicator>,
    rank: usize,
    size: usize,
}

// SAFETY: the communicator handle is an MPI object that any thread may use while no other
// thread calls MPI (MPI_THREAD_SERIALIZED, checked in `init`); every use goes through the
// mutex.
unsafe impl Send for Mpi {}
// SAFETY: as for `Send`: shared use is serialized by the mutex.
unsafe impl Sync for Mpi {}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl Mpi {
    /// Initializes MPI and returns this process's rank of `MPI_COMM_WORLD`.
    ///
    /// # Errors
    /// [`Error::Communicator`] when MPI was already initialized in this process or does not
    /// support `MPI_THREAD_SERIALIZED`.
    pub fn init() -> Result<Mpi> {
        let (universe, level) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| Error::Communicator("MPI is already initialized".into()))?;
        if level < Threading::Serialized {
            return Err(Error::Communicator(format!(
                "MPI provides thread level {level:?}, MPI_THREAD_SERIALIZED needed"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(Mpi {
            _universe: universe,
            world: Mutex::new(world),
            rank,
            size,
        })
    }

    fn world(&self) -> Result<std::sync::MutexGuard<'_, SimpleCommunicator>> {
        self.world
            .lock()
            .map_err(|_| Error::Communicator("a thread panicked inside MPI".into()))
    }

    /// Reduce to rank 0, then broadcast (see the type's docs).
    fn sum<T: Equivalence + Copy>(&self, buf: &mut [T]) -> Result<()> {
        let world = self.world()?;
        let root = world.process_at_rank(0);
        if self.rank == 0 {
            let send = buf.to_vec();
            root.reduce_into_root(&send[..], buf, SystemOperation::sum());
        } else {
            root.reduce_into(&*buf, SystemOperation::sum());
        }
        root.broadcast_into(buf);
        Ok(())
    }
}

impl Communicator for Mpi {
    rank_size_sums!();

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        check_root("Mpi::broadcast", root, self.size)?;
        self.world()?
            .process_at_rank(root as i32)
            .broadcast_into(buf);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.world()?.barrier();
        Ok(())
    }
}
