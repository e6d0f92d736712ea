//! The reference trainer data-parallel (`RunConfig::dist`, what `grng --dist` runs) on
//! `P = 2` and `P = 3` thread ranks, every method: the ranks' runs are the same bits (the
//! replicas stay equal), the Kalman methods (not sharded) are the single process's bit for
//! bit, and the gradient methods' curves are the single process's at the same batch.
//!
//! Tolerance of the last: each sharded step equals the single process's to its summation-order
//! rounding (`grng_testkit::dist` bounds it per step: relative `~1e-6` here); over this run's
//! 6 steps that moves the training loss by far less than `1e-3` relative, while what sharding
//! could get wrong — a row counted twice or dropped, a shard weighed as a whole batch, other
//! sampled labels — changes one step's gradient by `O(1/B)` of its rows, about `6%` at `B = 16`,
//! and the loss at the `1e-2` level. The largest gap seen is printed.

use grng::dist::DataParallel;
use grng::Device;
use grng_testkit as common;
use grng_testkit::dist::ranks;
use grng_train::data::synthetic_classification;
use grng_train::train::{
    train_method, Dist, Method, MethodConfig, MethodResult, RunConfig, Splits,
};

fn run(splits: &Splits, method: Method, dist: Option<Dist>) -> MethodResult {
    let run = RunConfig {
        epochs: 1,
        batch_size: Some(16),
        hidden: vec![8],
        eval_points: 1000,
        max_steps: Some(6),
        dist,
        ..RunConfig::default()
    };
    let r = train_method(
        &Device::Cpu,
        splits,
        &run,
        MethodConfig::tuned(method),
        &mut |_, _| {},
    )
    .expect("train");
    assert!(r.failure.is_none(), "{method:?}: {:?}", r.failure);
    r
}

/// The curve's numbers (times left out), bit patterns.
fn numbers(r: &MethodResult) -> Vec<u32> {
    r.curve
        .iter()
        .flat_map(|p| [p.val_acc, p.train_loss, p.grad_norm].map(f32::to_bits))
        .chain([r.test_acc.to_bits()])
        .collect()
}

#[test]
fn sharded_runs_are_the_single_process_run() {
    let seed = common::seed();
    let data = synthetic_classification(150, 6, 3, seed).expect("data");
    let (train, val, test) = data.split(seed, (0.6, 0.2)).expect("split");
    let splits = Splits { train, val, test };
    let mut worst = 0.0f64;
    for method in Method::ALL {
        let single = run(&splits, method, None);
        for p in [2, 3] {
            let results = ranks(p, |comm| {
                run(&splits, method, Some(Dist(DataParallel::new(comm))))
            });
            for r in &results[1..] {
                assert_eq!(
                    numbers(r),
                    numbers(&results[0]),
                    "{method:?} P={p}: replicas"
                );
            }
            let r = &results[0];
            assert_eq!(r.steps, single.steps);
            if method.is_kalman() {
                assert_eq!(numbers(r), numbers(&single), "{method:?}: not sharded");
                continue;
            }
            for (a, b) in r.curve.iter().zip(&single.curve) {
                let rel = ((a.train_loss - b.train_loss) / b.train_loss).abs() as f64;
                worst = worst.max(rel);
                assert!(
                    rel < 1e-3,
                    "{method:?} P={p} step {}: train loss {} vs {}",
                    a.step,
                    a.train_loss,
                    b.train_loss
                );
            }
        }
    }
    eprintln!("largest relative train-loss gap to one process: {worst:e}");
}
