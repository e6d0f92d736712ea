//! The sentiment task's loader, splits and MCC, on small files written here (no download).

use grng::Error;
use grng_lora::sentiment::{self, mcc, Splits, MARGIN};

fn write(name: &str, body: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("grng-sentiment-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    path
}

/// CRLF rows parse; near-neutral ratings are dropped; the sign gives the label.
#[test]
fn rows_parse_and_neutral_ones_are_dropped() {
    let path = write(
        "ok.txt",
        "1\t2.26\tThe Rock is destined to be great.\r\n2\t-0.6\tEffective but too tepid\r\n3\t0.2\tMeh.\r\n4\t-3.1\tAwful, awful film\r\n",
    );
    let ex = sentiment::load(&path).unwrap();
    assert_eq!(ex.len(), 3);
    assert_eq!(
        ex.iter().map(|e| e.label).collect::<Vec<_>>(),
        vec![1, 0, 0]
    );
    assert_eq!(ex[1].text, "Effective but too tepid");
    assert!(ex.iter().all(|e| e.rating.abs() >= MARGIN));
}

/// Malformed rows name their line; a missing file names the path and the fetch script.
#[test]
fn bad_files_are_typed_errors() {
    for (body, line) in [
        ("1\t1.0\tfine\n2\tnot-a-number\ttext\n", 2.0),
        ("1\t1.0\tfine\n2\t9.5\ttoo high\n", 2.0),
        ("1\t1.0\n", 1.0),
        ("1\t1.0\t   \n", 1.0),
    ] {
        let r = sentiment::load(&write("bad.txt", body));
        assert!(
            matches!(r, Err(Error::Value { value, .. }) if value == line),
            "{body:?}: {r:?}"
        );
    }
    let missing = std::path::Path::new("/nonexistent/grng/snippets.txt");
    let e = sentiment::load(missing).unwrap_err().to_string();
    assert!(
        e.contains("/nonexistent/grng/snippets.txt") && e.contains("fetch-minilm.sh"),
        "{e}"
    );
}

/// Splits are a fixed-seed shuffle: the same seed the same split, disjoint parts covering
/// everything, nested training sets.
#[test]
fn splits_are_fixed_disjoint_and_nested() {
    let body: String = (0..50)
        .map(|i| {
            format!(
                "{i}\t{}\tsnippet {i}\n",
                if i % 2 == 0 { 1.5 } else { -1.5 }
            )
        })
        .collect();
    let ex = sentiment::load(&write("split.txt", &body)).unwrap();
    let a = Splits::new(ex.clone(), 7, 10, 15).unwrap();
    let b = Splits::new(ex.clone(), 7, 10, 15).unwrap();
    assert_eq!(a.pool, b.pool);
    assert_eq!((a.val.len(), a.test.len(), a.pool.len()), (10, 15, 25));
    let mut all: Vec<&str> = a
        .pool
        .iter()
        .chain(&a.val)
        .chain(&a.test)
        .map(|e| e.text.as_str())
        .collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 50);
    assert_eq!(a.train(5).unwrap(), &a.train(20).unwrap()[..5]);
    assert!(matches!(a.train(26), Err(Error::Value { .. })));
    assert!(matches!(a.train(0), Err(Error::Value { .. })));
    assert!(matches!(
        Splits::new(ex, 7, 25, 25),
        Err(Error::Value { .. })
    ));
    let other = Splits::new(
        sentiment::load(&write("split.txt", &body)).unwrap(),
        8,
        10,
        15,
    );
    assert_ne!(other.unwrap().pool, a.pool);
}

/// MCC against hand-computed cases.
#[test]
fn mcc_matches_hand_computed_values() {
    assert_eq!(mcc(&[1, 0, 1, 0], &[1, 0, 1, 0]), 1.0);
    assert_eq!(mcc(&[0, 1, 0, 1], &[1, 0, 1, 0]), -1.0);
    assert_eq!(mcc(&[1, 1, 1, 1], &[1, 0, 1, 0]), 0.0);
    // tp 2, tn 1, fp 1, fn 0: (2 − 0)/√(3·2·2·1)
    let want = 2.0 / 12f64.sqrt();
    assert!((mcc(&[1, 1, 1, 0], &[1, 1, 0, 0]) - want).abs() < 1e-15);
}
