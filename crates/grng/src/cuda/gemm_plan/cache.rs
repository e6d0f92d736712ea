//! The GEMM plan's optional on-disk cache of decisions (`GRNG_GEMM_CACHE=FILE`, issue 36
//! item 2): a trial's decision is appended to `FILE` as one line, and a later process with the
//! same identity — device name and compute capability, driver version, grng's version and a
//! hash of its embedded PTX — takes the decision from the file instead of running a trial.
//! So the first step of a run pays no trial, and processes that share the file choose alike
//! (their results then agree bit for bit where they did not have to before). Lines of other
//! identities are kept and ignored, so one file serves several machines and builds; a line
//! that does not parse is ignored. Unset, decisions live in the process only.
//!
//! A line: `grng-gemm-plan v1`, the identity, the plan, the shape class and the candidate,
//! tab-separated (`Debug` forms, which the build hash pins).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once, OnceLock, PoisonError};

use super::{Candidate, GemmPlan, ShapeClass};
use crate::driver::CudaDevice;
use crate::error::{Error, Result};

/// The first field of every line: the format's name and version.
const MAGIC: &str = "grng-gemm-plan v1";

/// `GRNG_GEMM_CACHE`, read once per process; `None` when unset or empty.
pub(super) fn path() -> Option<&'static Path> {
    static PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
    PATH.get_or_init(|| {
        std::env::var_os("GRNG_GEMM_CACHE")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    })
    .as_deref()
}

/// What a cached decision holds for: the device, its driver and this build, one string.
///
/// # Errors
/// [`Error::Cuda`] when the driver does not answer.
pub(super) fn identity(dev: &CudaDevice) -> Result<String> {
    let ctx = dev.context();
    let name = ctx
        .name()
        .map_err(|e| Error::Cuda(format!("cuda::gemm_plan: device name: {e}")))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| Error::Cuda(format!("cuda::gemm_plan: compute capability: {e}")))?;
    let mut driver = 0i32;
    // SAFETY: cuDriverGetVersion writes one int through the pointer, which is live.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
        .result()
        .map_err(|e| Error::Cuda(format!("cuda::gemm_plan: driver version: {e}")))?;
    Ok(format!(
        "{name} sm_{major}{minor} driver {driver} grng {} ptx {:016x}",
        env!("CARGO_PKG_VERSION"),
        build_hash()
    ))
}

/// FNV-1a of every embedded PTX module: a rebuilt kernel makes older decisions stale.
fn build_hash() -> u64 {
    use crate::driver::ptx;
    let modules = [
        ptx::GEMM,
        ptx::NEWTON,
        ptx::SYRK,
        ptx::ELEMENTWISE,
        ptx::GEMM_SM90A,
        ptx::NEWTON_SM90A,
        ptx::SYRK_SM90A,
    ];
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for byte in modules
        .iter()
        .flat_map(|m| m.unwrap_or("-").bytes().chain([0]))
    {
        h = (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The key of a decision within an identity.
fn key(plan: GemmPlan, class: ShapeClass) -> String {
    format!("{plan:?}\t{},{},{}", class.m, class.n, class.k)
}

/// One decision as a line of the file (with its newline).
pub(super) fn line(identity: &str, plan: GemmPlan, class: ShapeClass, c: Candidate) -> String {
    format!("{MAGIC}\t{identity}\t{}\t{c:?}\n", key(plan, class))
}

/// The decisions of `identity` in a file's text: the last line of a key wins.
pub(super) fn parse(text: &str, identity: &str) -> HashMap<String, Candidate> {
    let mut out = HashMap::new();
    for l in text.lines() {
        let mut f = l.split('\t');
        let (Some(MAGIC), Some(id), Some(plan), Some(class), Some(c), None) =
            (f.next(), f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let Some(c) = Candidate::ALL.into_iter().find(|x| format!("{x:?}") == c) else {
            continue;
        };
        if id == identity {
            out.insert(format!("{plan}\t{class}"), c);
        }
    }
    out
}

/// The file's decisions by identity, read at the first look-up of each identity.
fn loaded() -> std::sync::MutexGuard<'static, HashMap<String, HashMap<String, Candidate>>> {
    static LOADED: OnceLock<Mutex<HashMap<String, HashMap<String, Candidate>>>> = OnceLock::new();
    LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// The cached decision for `(plan, class)` on a device of `identity`, from the file at `path`
/// (missing or unreadable: none, said once).
pub(super) fn lookup(
    path: &Path,
    identity: &str,
    plan: GemmPlan,
    class: ShapeClass,
) -> Option<Candidate> {
    let mut all = loaded();
    let mine =
        all.entry(identity.to_owned())
            .or_insert_with(|| match std::fs::read_to_string(path) {
                Ok(text) => parse(&text, identity),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => HashMap::new(),
                Err(e) => {
                    say_once(path, &e);
                    HashMap::new()
                }
            });
    mine.get(&key(plan, class)).copied()
}

/// Appends a trial's decision to the file (one `write` of one line, so processes sharing the
/// file interleave whole lines). A failure is said once and otherwise ignored: the decision
/// still holds in this process.
pub(super) fn store(path: &Path, identity: &str, plan: GemmPlan, class: ShapeClass, c: Candidate) {
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(line(identity, plan, class, c).as_bytes()));
    if let Err(e) = written {
        say_once(path, &e);
    }
    loaded()
        .entry(identity.to_owned())
        .or_default()
        .insert(key(plan, class), c);
}

fn say_once(path: &Path, e: &std::io::Error) {
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        eprintln!(
            "grng: GRNG_GEMM_CACHE={}: {e}; GEMM plan decisions are kept in this process only",
            path.display()
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gemm_plan::{Format, Product};
    use crate::mat::Trans;

    fn plan(format: Format) -> GemmPlan {
        GemmPlan {
            product: Product::Gemm,
            format,
            ta: Trans::No,
            tb: Trans::Yes,
            reads_c: false,
        }
    }

    #[test]
    fn lines_parse_back_by_identity_and_the_last_line_of_a_key_wins() {
        let class = ShapeClass::of(1000, 64, 4096);
        let (f32a, bf) = (plan(Format::F32Accurate), plan(Format::Bf16));
        let text = [
            line("H200 a", f32a, class, Candidate::Vendor),
            line("H200 a", bf, class, Candidate::Engine),
            line("H100 b", f32a, class, Candidate::Engine),
            "grng-gemm-plan v0\tH200 a\tx\t1,2,3\tEngine\n".into(),
            "garbage line\n".into(),
            line("H200 a", f32a, class, Candidate::Bf16x3),
        ]
        .concat();
        let got = parse(&text, "H200 a");
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[&key(f32a, class)], Candidate::Bf16x3);
        assert_eq!(got[&key(bf, class)], Candidate::Engine);
        assert_eq!(parse(&text, "H100 b")[&key(f32a, class)], Candidate::Engine);
        assert!(parse(&text, "A100 c").is_empty());
        // Another shape class is another key.
        assert!(!got.contains_key(&key(f32a, ShapeClass::of(1000, 64, 8193))));
    }

    #[test]
    fn a_stored_decision_is_found_and_a_missing_file_is_empty() {
        let dir = std::env::temp_dir().join(format!("grng-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("plan.tsv");
        let _ = std::fs::remove_file(&path);
        let (p, class) = (plan(Format::F32Checked), ShapeClass::of(7, 9, 11));
        assert_eq!(lookup(&path, "test id 1", p, class), None);
        store(&path, "test id 1", p, class, Candidate::Bf16x3);
        assert_eq!(
            lookup(&path, "test id 1", p, class),
            Some(Candidate::Bf16x3)
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(parse(&text, "test id 1")[&key(p, class)], Candidate::Bf16x3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
