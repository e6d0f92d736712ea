//! Data-parallel steps (`grng::dist`) on the thread communicator, `P = 2` and `P = 3` ranks
//! with ragged shards: the checks of `grng_testkit::dist` (bounds derived there), each rank a
//! thread. The same checks run under `mpirun` in `examples/dist_mpi.rs`.

use grng::optim::adamw::AdamW;
use grng::optim::kalman::RKalmanConfig;
use grng::optim::sgd::Sgd;
use grng::optim::sophia::Sophia;
use grng_testkit as common;
use grng_testkit::dist::{self, ranks};

/// Runs `check` on `P = 2` and `P = 3` thread ranks with this test's seed.
fn on_worlds(check: impl Fn(std::sync::Arc<dyn grng::dist::Communicator>, u64) + Sync) {
    let seed = common::seed();
    for p in [2, 3] {
        ranks(p, |comm| check(comm, seed ^ p as u64));
    }
}

#[test]
fn sgd_equivalence() {
    on_worlds(dist::elementwise::<Sgd>);
}

#[test]
fn adamw_equivalence() {
    on_worlds(dist::elementwise::<AdamW>);
}

#[test]
fn sophia_equivalence() {
    on_worlds(dist::elementwise::<Sophia>);
}

#[test]
fn kron_equivalence_every_variant() {
    for config in dist::kron_configs() {
        for factored in [false, true] {
            on_worlds(|comm, seed| dist::kron(comm, seed, config, factored));
        }
    }
}

#[test]
fn kron_few_rows_take_the_single_process_step() {
    for config in dist::kron_configs().into_iter().take(3) {
        on_worlds(|comm, seed| dist::kron_rows(comm, seed, config));
    }
}

#[test]
fn kalman_gathers_the_whole_observation() {
    on_worlds(|comm, seed| dist::kalman(comm, seed, RKalmanConfig::default()));
    on_worlds(|comm, seed| dist::kalman(comm, seed, RKalmanConfig::plain()));
}

#[test]
fn disagreeing_ranks_fail_everywhere_unchanged() {
    on_worlds(dist::failures);
}
