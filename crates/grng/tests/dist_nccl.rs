//! The NCCL communicator (feature `nccl`) with a world of one GPU: every collective is the
//! identity there, and the data-parallel checks of `grng_testkit::dist` hold on it (a world
//! of one against one process: same bits, since nothing is added). Skipped without a GPU
//! (`common::cuda`); multi-rank NCCL needs a machine with several GPUs (docs/distributed.md).
//!
//! `cargo test --release -p grng --features nccl --test dist_nccl`
#![cfg(feature = "nccl")]

use std::sync::Arc;

use grng::dist::{Communicator, Nccl};
use grng::Device;
use grng_testkit as common;

#[test]
fn world_of_one() {
    let Some(Device::Cuda(cuda)) = common::cuda() else {
        return;
    };
    let nccl = Nccl::world_of_one(&cuda).expect("NCCL loads and initializes");
    assert_eq!((nccl.rank(), nccl.size()), (0, 1));
    let mut rng = common::seeded_rng();
    let x = common::vals(&mut rng, 1000);
    let mut y = x.clone();
    nccl.all_reduce_sum(&mut y).unwrap();
    assert_eq!(y, x, "a sum over one rank is the identity");
    let mut z: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    nccl.all_reduce_sum_f64(&mut z).unwrap();
    assert!(z.iter().zip(&x).all(|(&a, &b)| a == b as f64));
    nccl.broadcast(&mut y, 0).unwrap();
    assert_eq!(y, x);
    assert!(
        nccl.broadcast(&mut y, 1).is_err(),
        "root 1 of a world of one"
    );
    nccl.barrier().unwrap();
    let comm: Arc<dyn Communicator> = Arc::new(nccl);
    grng_testkit::dist::all_single(comm, common::seed());
}
