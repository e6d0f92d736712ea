//! The examples run: each is started as a user would start it (its built binary, small sizes)
//! and must train.

use grng_testkit as common;

use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>/examples/<name>`: `cargo test` builds the examples beside the tests.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // target/<profile>/deps/<test> → target/<profile>/examples/<name>
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>");
    let path = dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.exists(),
        "{} is missing: `cargo test --release` builds the examples (a `--test` filter does not: \
         `cargo build --release -p grng-candle --examples` first)",
        path.display()
    );
    path
}

/// The character GPT example with RING and NGD, on a seed drawn for the run: 40 steps of a
/// one-block model lower the validation loss from its value at step 0 (`≈ ln 62`, the fresh
/// model's uniform guess) by more than 0.5 nats (the smallest drop over seeds 0–15 was 0.95
/// for both methods; at 12 steps and batch 4 both sometimes rose, NGD to 7.3), and the SVG is
/// written.
#[test]
fn gpt_example_trains_with_ring_and_ngd() {
    let out = std::env::temp_dir().join(format!("grng-gpt-example-{}", std::process::id()));
    let run = Command::new(example("candle_gpt"))
        .args([
            "--methods",
            "ring,ngd",
            "--steps",
            "40",
            "--eval-every",
            "20",
        ])
        .args([
            "--layers",
            "1",
            "--width",
            "32",
            "--context",
            "16",
            "--batch",
            "8",
        ])
        .args(["--seed", &common::seed().to_string()])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("the example starts");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    for method in ["RING", "NGD"] {
        let row: Vec<&str> = stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(method))
            .unwrap_or_else(|| panic!("no {method} row in\n{stdout}"))
            .split_whitespace()
            .collect();
        let (first, last): (f32, f32) = (row[1].parse().unwrap(), row[2].parse().unwrap());
        assert!(
            last.is_finite() && last < first - 0.5,
            "{method}: {first} → {last}\n{stdout}"
        );
    }
    assert!(out.join("candle_gpt.svg").exists());
    let _ = std::fs::remove_dir_all(&out);
}
