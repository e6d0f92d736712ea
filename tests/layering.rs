//! The crate's layers call downwards only (the argument is in `src/params/mod.rs`):
//! `ops` dispatches to the backends `cpu` and `cuda`, and all three share the plain data of
//! `params` and the iteration control of `iteration`. A backend naming `ops` (or a layer above
//! it), or `params`/`iteration` naming anything but `error`/`params`, is an import circle;
//! this test fails naming the file and the line.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The top-level modules the code of `file` names through `crate::…` paths (including
/// `crate::{a, b}` groups), comments and string literals left out, with their line numbers.
fn crate_modules(file: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
    let mut found = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = strip_comment_and_strings(line);
        let mut rest = code.as_str();
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let name: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        found.push((i + 1, name));
                    }
                }
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                found.push((i + 1, name));
            }
        }
    }
    found
}

/// `line` without its `//` comment and with the contents of `"…"` literals removed.
fn strip_comment_and_strings(line: &str) -> String {
    let mut out = String::new();
    let mut in_str = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (in_str, c) {
            (false, '/') if chars.peek() == Some(&'/') => break,
            (false, '"') => in_str = true,
            (true, '\\') => {
                chars.next();
            }
            (true, '"') => in_str = false,
            (false, c) => out.push(c),
            (true, _) => {}
        }
    }
    out
}

/// Every `.rs` file under `path` (or `path` itself).
fn rust_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_path_buf()];
    }
    let mut files = Vec::new();
    let entries = std::fs::read_dir(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    for entry in entries {
        let p = entry.expect("directory entry").path();
        if p.is_dir() {
            files.extend(rust_files(&p));
        } else if p.extension().is_some_and(|e| e == "rs") {
            files.push(p);
        }
    }
    files.sort();
    files
}

/// `(line, module)` uses in the files of `layers` that `allowed` rejects, as messages.
fn violations(layers: &[&str], allowed: impl Fn(&str) -> bool) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut bad = Vec::new();
    for layer in layers {
        let files = rust_files(&src.join(layer));
        assert!(!files.is_empty(), "src/{layer} has no Rust files");
        for file in files {
            for (line, module) in crate_modules(&file) {
                if !allowed(&module) {
                    let rel = file.strip_prefix(&src).unwrap_or(&file).display();
                    bad.push(format!("src/{rel}:{line} names crate::{module}"));
                }
            }
        }
    }
    bad
}

#[test]
fn backends_do_not_call_up() {
    // The layers above the backends: they dispatch to them, so the backends must not name them.
    let above: BTreeSet<&str> = [
        "ops",
        "optim",
        "train",
        "mlp",
        "candle",
        "checkpoint",
        "report",
        "data",
    ]
    .into();
    let bad = violations(&["cpu", "cuda"], |m| !above.contains(m));
    assert!(bad.is_empty(), "upward imports:\n{}", bad.join("\n"));
}

#[test]
fn cpu_backend_does_not_name_cuda() {
    let bad = violations(&["cpu"], |m| m != "cuda");
    assert!(bad.is_empty(), "cpu names cuda:\n{}", bad.join("\n"));
}

#[test]
fn shared_data_names_only_errors() {
    let below: BTreeSet<&str> = ["error", "params", "iteration"].into();
    let bad = violations(&["params", "iteration.rs"], |m| below.contains(m));
    assert!(bad.is_empty(), "params/iteration name:\n{}", bad.join("\n"));
}

#[test]
fn scanner_sees_paths_and_groups_and_skips_comments() {
    let dir = std::env::temp_dir().join(format!("grng-layering-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("probe.rs");
    std::fs::write(
        &file,
        "use crate::ops::x; // crate::optim\nuse crate::{error::E, mlp};\nlet s = \"crate::train\";\n",
    )
    .expect("write probe");
    let found = crate_modules(&file);
    std::fs::remove_dir_all(&dir).ok();
    let want = [(1, "ops"), (2, "error"), (2, "mlp")];
    assert_eq!(
        found,
        want.map(|(l, m)| (l, m.to_string())).to_vec(),
        "the scanner must see plain paths and groups, and skip comments and strings"
    );
}
