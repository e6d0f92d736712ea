//! The house's arrows run down only: no module of any crate of the workspace imports, directly
//! or through others, a module that imports it back. Every `.rs` file under each crate's
//! `src/` is read; the paths its code names (`crate::…`, `super::…`, `self::…` and the
//! workspace crates' `grng::…`, use-groups expanded, comments and string literals left out)
//! are resolved to the deepest module that exists. Among the children of one module
//! (the crate root's top-level modules, `cuda`'s files, …) an edge `a → b` says a file in `a`
//! names `b`; a strongly connected set of two or more is an import cycle, and the test fails
//! naming it with one line per edge that closes it.
//!
//! On top of that, the library's layers (docs/architecture.md): the launchers of the CUDA
//! backend (one per kernel file) name no other launcher, only the shared layer below them,
//! and the lowest layer (`error`, `element`, `mat`, `shape`, `simd`, `hooks`) names nothing
//! above it. There is no exception.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path inside one crate: `["cuda", "gemm"]` for `src/cuda/gemm.rs`.
type ModPath = Vec<String>;

/// The workspace's crates: (crate name as code names it, its `src/` folder).
fn crates() -> Vec<(String, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&root).expect("crates/") {
        let dir = entry.expect("entry").path();
        if dir.join("Cargo.toml").is_file() && dir.join("src").is_dir() {
            let name = dir.file_name().unwrap().to_string_lossy().replace('-', "_");
            out.push((name, dir.join("src")));
        }
    }
    out.sort();
    assert!(
        out.iter().any(|(n, _)| n == "grng") && out.len() >= 3,
        "expected the workspace's crates beside crates/grng, found {out:?}"
    );
    out
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{dir:?}: {e}")) {
        let p = entry.expect("entry").path();
        if p.is_dir() {
            files.extend(rust_files(&p));
        } else if p.extension().is_some_and(|e| e == "rs") {
            files.push(p);
        }
    }
    files.sort();
    files
}

/// The module of `file` under `src`: `lib.rs`/`main.rs` → `[]`, `a/mod.rs` → `[a]`,
/// `a/b.rs` → `[a, b]`.
fn module_of(src: &Path, file: &Path) -> ModPath {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: ModPath = rel
        .iter()
        .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// `text` without comments (`//…`, `/*…*/`), string and char literals (their contents).
fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            '/' if b.get(i + 1) == Some(&'/') => {
                while i < b.len() && b[i] != '\n' {
                    i += 1;
                }
            }
            '/' if b.get(i + 1) == Some(&'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        if b[i] == '\n' {
                            out.push('\n');
                        }
                        i += 1;
                    }
                }
            }
            'r' if b.get(i + 1) == Some(&'"')
                || (b.get(i + 1) == Some(&'#') && !is_ident(b.get(i.wrapping_sub(1)))) =>
            {
                // Raw string r"…" / r#"…"#.
                let mut j = i + 1;
                let mut hashes = 0;
                while b.get(j) == Some(&'#') {
                    hashes += 1;
                    j += 1;
                }
                if b.get(j) != Some(&'"') {
                    out.push(b[i]);
                    i += 1;
                    continue;
                }
                j += 1;
                while j < b.len() {
                    if b[j] == '"' && (0..hashes).all(|h| b.get(j + 1 + h) == Some(&'#')) {
                        j += 1 + hashes;
                        break;
                    }
                    j += 1;
                }
                out.push_str("\"\"");
                i = j;
            }
            '"' => {
                i += 1;
                while i < b.len() && b[i] != '"' {
                    if b[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                out.push_str("\"\"");
            }
            '\'' if b.get(i + 2) == Some(&'\'') || b.get(i + 1) == Some(&'\\') => {
                // A char literal ('x', '\n', '\''); a lifetime has no closing quote.
                i += 1;
                while i < b.len() && b[i] != '\'' {
                    if b[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

fn is_ident(c: Option<&char>) -> bool {
    c.is_some_and(|c| c.is_alphanumeric() || *c == '_')
}

/// The paths `code` names from `roots` (`crate`, `super`, `self`, the crate names), with
/// use-groups `a::{b, c::{d}}` expanded: each as its segments, the root first.
fn named_paths(code: &str, roots: &BTreeSet<String>) -> Vec<Vec<String>> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if is_ident(chars.get(i)) && !is_ident(chars.get(i.wrapping_sub(1))) {
            let start = i;
            while is_ident(chars.get(i)) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let after_colons = start >= 2 && chars[start - 1] == ':' && chars[start - 2] == ':';
            if roots.contains(&word) && !after_colons && chars.get(i) == Some(&':') {
                let (paths, end) = parse_tail(&chars, i, vec![word]);
                out.extend(paths);
                i = end;
            }
        } else {
            i += 1;
        }
    }
    out
}

/// After `prefix` at `i`: `::seg::seg…` or `::{group}`; returns the expanded paths and the
/// position after them.
fn parse_tail(c: &[char], mut i: usize, prefix: Vec<String>) -> (Vec<Vec<String>>, usize) {
    let mut path = prefix;
    loop {
        if !(c.get(i) == Some(&':') && c.get(i + 1) == Some(&':')) {
            return (vec![path], i);
        }
        i += 2;
        while c.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        if c.get(i) == Some(&'{') {
            i += 1;
            let mut all = Vec::new();
            loop {
                while c.get(i).is_some_and(|c| c.is_whitespace() || *c == ',') {
                    i += 1;
                }
                match c.get(i) {
                    None => return (all, i),
                    Some('}') => return (all, i + 1),
                    _ => {}
                }
                let start = i;
                while is_ident(c.get(i)) || c.get(i) == Some(&'*') {
                    i += 1;
                }
                let seg: String = c[start..i].iter().collect();
                if seg.is_empty() {
                    i += 1; // `as`-renames, punctuation: skip
                    continue;
                }
                let mut sub = path.clone();
                if seg != "self" && seg != "*" {
                    sub.push(seg);
                }
                let (paths, end) = parse_tail(c, i, sub);
                all.extend(paths);
                i = end;
                // `x as y`: skip to the next separator.
                while c.get(i).is_some_and(|ch| *ch != ',' && *ch != '}') {
                    i += 1;
                }
            }
        }
        let start = i;
        while is_ident(c.get(i)) {
            i += 1;
        }
        if start == i {
            return (vec![path], i);
        }
        path.push(c[start..i].iter().collect());
    }
}

/// One crate's modules and who names whom: `(from module, to module, file:line)`.
struct CrateGraph {
    name: String,
    modules: BTreeSet<ModPath>,
    edges: Vec<(ModPath, ModPath, String)>,
}

fn crate_graph(name: &str, src: &Path) -> CrateGraph {
    let files = rust_files(src);
    let modules: BTreeSet<ModPath> = files.iter().map(|f| module_of(src, f)).collect();
    let mut roots: BTreeSet<String> = ["crate", "super", "self"].map(String::from).into();
    roots.insert(name.to_string());
    let mut edges = Vec::new();
    for file in &files {
        let here = module_of(src, file);
        let text = std::fs::read_to_string(file).expect("read");
        let code = code_only(&text);
        for (n, line) in code.lines().enumerate() {
            for path in named_paths(line, &roots) {
                let resolved = resolve(&here, &path, name, &modules);
                if let Some(to) = resolved {
                    let at = format!(
                        "{}:{}",
                        file.strip_prefix(src.parent().unwrap()).unwrap().display(),
                        n + 1
                    );
                    edges.push((here.clone(), to, at));
                }
            }
        }
    }
    CrateGraph {
        name: name.to_string(),
        modules,
        edges,
    }
}

/// The deepest existing module `path` (named from module `here`) lies in, or `None` for
/// another crate's paths.
fn resolve(
    here: &ModPath,
    path: &[String],
    krate: &str,
    modules: &BTreeSet<ModPath>,
) -> Option<ModPath> {
    let mut base: ModPath = match path[0].as_str() {
        "crate" => Vec::new(),
        k if k == krate => Vec::new(),
        "self" => here.clone(),
        "super" => here[..here.len().saturating_sub(1)].to_vec(),
        _ => return None,
    };
    let mut rest = &path[1..];
    while rest.first().map(String::as_str) == Some("super") {
        base.pop();
        rest = &rest[1..];
    }
    for seg in rest {
        let mut next = base.clone();
        next.push(seg.clone());
        if modules.contains(&next) {
            base = next;
        } else {
            break;
        }
    }
    Some(base)
}

/// Among the children of each module: the cycles, as messages naming the modules and the
/// lines of their edges.
fn cycles(g: &CrateGraph) -> Vec<String> {
    // Parent → its children's edges: a file in child `a` (or below it) naming child `b`.
    let mut by_parent: BTreeMap<ModPath, BTreeMap<String, BTreeMap<String, String>>> =
        BTreeMap::new();
    for (from, to, at) in &g.edges {
        let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
        if common < from.len() && common < to.len() {
            let parent = from[..common].to_vec();
            by_parent
                .entry(parent)
                .or_default()
                .entry(from[common].clone())
                .or_default()
                .entry(to[common].clone())
                .or_insert_with(|| at.clone());
        }
    }
    let mut found = Vec::new();
    for (parent, adj) in &by_parent {
        for scc in strongly_connected(adj) {
            if scc.len() < 2 {
                continue;
            }
            let under = if parent.is_empty() {
                format!("{} (crate root)", g.name)
            } else {
                format!("{}::{}", g.name, parent.join("::"))
            };
            let mut lines = vec![format!("import cycle among {under}: {}", scc.join(" ↔ "))];
            for a in &scc {
                for (b, at) in &adj[a] {
                    if scc.contains(b) {
                        lines.push(format!("    {a} → {b}  ({at})"));
                    }
                }
            }
            found.push(lines.join("\n"));
        }
    }
    found
}

/// Tarjan's strongly connected components of `adj`.
fn strongly_connected(adj: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        adj: &'a BTreeMap<String, BTreeMap<String, String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on.insert(v);
        if let Some(next) = s.adj.get(v) {
            for w in next.keys() {
                let w = w.as_str();
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let lw = s.low[w];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if s.on.contains(w) {
                    let iw = s.index[w];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            comp.sort();
            s.out.push(comp);
        }
    }
    let mut s = State {
        adj,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    let nodes: BTreeSet<&str> = adj
        .iter()
        .flat_map(|(a, bs)| std::iter::once(a.as_str()).chain(bs.keys().map(String::as_str)))
        .collect();
    for v in nodes {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

fn graphs() -> Vec<CrateGraph> {
    crates()
        .iter()
        .map(|(name, src)| crate_graph(name, src))
        .collect()
}

#[test]
fn no_module_of_any_crate_is_in_an_import_cycle() {
    let mut found = Vec::new();
    let mut modules = 0;
    for g in graphs() {
        modules += g.modules.len();
        found.extend(cycles(&g));
    }
    assert!(modules > 60, "the scan found only {modules} modules");
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The edges of grng from module `from` (a top-level module, or `cuda::x`) to `to`.
fn grng_edges() -> Vec<(ModPath, ModPath, String)> {
    graphs()
        .into_iter()
        .find(|g| g.name == "grng")
        .expect("grng")
        .edges
}

#[test]
fn launchers_name_no_other_launcher() {
    // The CUDA backend's shared layer below the launchers, and the dispatchers above them
    // (the GEMM plan, choosing between `gemm` and `gemm_vendor`): every other file of `cuda/`
    // is a kernel file's launcher, which may use the shared layer and nothing beside; a
    // dispatcher may name launchers, never the reverse. `sm90` (which mainloop runs) is
    // shared: `launch` asks it, and the launchers take its self-check helpers.
    let shared: BTreeSet<&str> = ["launch", "deferred", "engine", "sm90", "timing"].into();
    let dispatchers: BTreeSet<&str> = ["gemm_plan"].into();
    let mut bad = Vec::new();
    for (from, to, at) in grng_edges() {
        let (Some(f), Some(t)) = (cuda_child(&from), cuda_child(&to)) else {
            continue;
        };
        let allowed = shared.contains(f) || shared.contains(t) || dispatchers.contains(f);
        if f != t && (!allowed || dispatchers.contains(t)) {
            bad.push(format!("{at}: cuda::{f} names cuda::{t}"));
        }
    }
    assert!(
        bad.is_empty(),
        "launchers naming launchers:\n{}",
        bad.join("\n")
    );
}

fn cuda_child(m: &ModPath) -> Option<&str> {
    (m.first().map(String::as_str) == Some("cuda"))
        .then(|| m.get(1).map(String::as_str))
        .flatten()
}

#[test]
fn the_lowest_layer_names_only_itself() {
    let low: BTreeSet<&str> = ["error", "element", "mat", "shape", "simd", "hooks"].into();
    let mut bad = Vec::new();
    for (from, to, at) in grng_edges() {
        let (Some(f), Some(t)) = (from.first(), to.first()) else {
            continue;
        };
        if low.contains(f.as_str()) && !low.contains(t.as_str()) {
            bad.push(format!("{at}: {f} names {t}"));
        }
    }
    assert!(
        bad.is_empty(),
        "the lowest layer names upwards:\n{}",
        bad.join("\n")
    );
}

#[test]
fn scanner_sees_paths_groups_and_cycles_and_skips_comments_and_strings() {
    let roots: BTreeSet<String> = ["crate", "super"].map(String::from).into();
    let code = code_only(
        "use crate::ops::x; // crate::optim\nuse crate::{error::E, cpu::{gemm, syrk::t}};\n\
         let s = \"crate::train\"; /* crate::data */ super::launch::go();\n",
    );
    let mut got: Vec<String> = named_paths(&code, &roots)
        .into_iter()
        .map(|p| p.join("::"))
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            "crate::cpu::gemm",
            "crate::cpu::syrk::t",
            "crate::error::E",
            "crate::ops::x",
            "super::launch::go",
        ]
    );
    let modules: BTreeSet<ModPath> = [vec![], vec!["a".into()], vec!["b".into()]].into();
    let edge = |from: &str, to: &str| (vec![from.to_string()], vec![to.to_string()], "f:1".into());
    let g = CrateGraph {
        name: "probe".into(),
        modules,
        edges: vec![edge("a", "b"), edge("b", "a")],
    };
    let found = cycles(&g);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("a ↔ b"), "{}", found[0]);
    let here = vec!["a".to_string()];
    let resolved = resolve(
        &here,
        &["super".into(), "b".into(), "f".into()],
        "probe",
        &g.modules,
    );
    assert_eq!(resolved, Some(vec!["b".to_string()]));
}
