//! The main job: every optimizer side by side on the UCI handwritten digits
//! (`cargo run --release -- --help` for the flags; the logic is in `grng_train::cli`).

use std::process::ExitCode;

use clap::Parser;
use grng_train::cli::{run, Cli};

fn main() -> ExitCode {
    match run(&Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
