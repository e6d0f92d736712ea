//! The unit tests' property-test seeding, as the integration tests' `tests/common` does it:
//! `GRNG_TEST_SEED` (decimal `u64`) replays a run, and without it every run draws a fresh seed,
//! printed so that a failure can be replayed (`scripts/flake-hunt.sh` sets it).

use proptest::test_runner::{Config, RngSeed};

/// A proptest config of `cases` cases seeded by `GRNG_TEST_SEED`, or by a fresh random seed.
pub(crate) fn proptest_config(cases: u32) -> Config {
    let seed = match std::env::var("GRNG_TEST_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("GRNG_TEST_SEED={s:?} is not a decimal u64")),
        Err(_) => rand::random(),
    };
    eprintln!("replay with GRNG_TEST_SEED={seed}");
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        ..Config::default()
    }
}
