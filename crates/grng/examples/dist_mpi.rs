//! The data-parallel checks of `grng_testkit::dist` under MPI, one rank per process:
//!
//! ```text
//! cargo build --release -p grng --features mpi --example dist_mpi
//! mpirun -np 2 target/release/examples/dist_mpi
//! mpirun -np 3 --oversubscribe target/release/examples/dist_mpi
//! ```
//!
//! Inputs are drawn from `GRNG_TEST_SEED` when set, else from a seed rank 0 draws and
//! broadcasts; it is printed for replay. A failed check panics on its rank, whose non-zero
//! exit makes `mpirun` end the job (no rank waits forever). `.ci/run` runs it.

use std::sync::Arc;

use grng::dist::{Communicator, Mpi};
use grng_testkit as common;

fn main() {
    let comm: Arc<dyn Communicator> = Arc::new(Mpi::init().expect("MPI"));
    // The seed in four 16-bit pieces: exact in f32.
    let mut pieces = [0.0f32; 4];
    if comm.rank() == 0 {
        let seed = common::master_seed();
        for (i, p) in pieces.iter_mut().enumerate() {
            *p = ((seed >> (16 * i)) & 0xffff) as f32;
        }
    }
    comm.broadcast(&mut pieces, 0).expect("broadcast");
    let seed = pieces
        .iter()
        .enumerate()
        .fold(0u64, |s, (i, &p)| s | ((p as u64) << (16 * i)));
    if comm.rank() == 0 {
        eprintln!(
            "dist_mpi: {} ranks, replay with GRNG_TEST_SEED={seed}",
            comm.size()
        );
    }
    let started = std::time::Instant::now();
    grng_testkit::dist::all(comm.clone(), seed);
    comm.barrier().expect("barrier");
    if comm.rank() == 0 {
        eprintln!(
            "dist_mpi: every check passed on {} ranks ({:.2?})",
            comm.size(),
            started.elapsed()
        );
    }
}
