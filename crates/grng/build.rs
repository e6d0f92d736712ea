//! Builds the CUDA kernels of `kernels/` twice (kernels/README.md):
//!
//! 1. always, as C++17 for the CPU emulator (`-DGRNG_EMU`, the `cc` crate): a static library
//!    with one `grng_emu_<kernel>` entry per kernel, so tests run the kernels on any machine;
//! 2. when a CUDA compiler is found, to PTX for compute_80 (JIT-compiled by the driver for
//!    sm_80 and newer, sm_90 included), embedded through the generated `OUT_DIR/ptx.rs`;
//!    files that include `gemm/wgmma_sm90.cuh` (the sm_90a GEMM mainloop) a second time, to
//!    PTX for compute_90a (`<FILE>_SM90A`), which only a compute capability 9.0 device runs.
//!
//! CUDA compilers, first found wins: `GRNG_CUDA_TOOLS` (the folder made by
//! `scripts/install-cuda-tools.sh`, or a CUDA toolkit root), `./.cuda-tools`, `CUDA_HOME` /
//! `CUDA_PATH` (nvcc, else NVRTC + headers), `nvcc` on `PATH`, `/usr/local/cuda`. NVRTC is
//! loaded from its full path, so no `LD_LIBRARY_PATH` is needed. Without any, the build
//! succeeds with one warning and `CudaDevice::new` reports that the kernels were not built.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::{env, fs};

/// Virtual architecture of the PTX: the driver JIT-compiles it for sm_80, sm_90 and later.
const ARCH: &str = "compute_80";
/// Architecture of the second PTX of the files using wgmma: the `a` features (wgmma,
/// setmaxnreg) exist on sm_90 only, not on later architectures.
const ARCH_SM90A: &str = "compute_90a";
/// The header whose inclusion asks for the compute_90a build.
const SM90A_HEADER: &str = "gemm/wgmma_sm90.cuh";

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets it"));
    let kernels = manifest.join("kernels");
    println!("cargo:rerun-if-changed=kernels");
    for var in ["GRNG_CUDA_TOOLS", "CUDA_HOME", "CUDA_PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let sources = kernel_sources(&kernels);
    build_emulator(&kernels, &sources);

    // (source, architecture, constant name): every file for compute_80, the wgmma users
    // once more for compute_90a.
    let mut builds: Vec<(&PathBuf, &str, String)> =
        sources.iter().map(|s| (s, ARCH, const_name(s))).collect();
    for src in &sources {
        let text = fs::read_to_string(src)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", src.display()));
        if text.contains(SM90A_HEADER) {
            builds.push((src, ARCH_SM90A, format!("{}_SM90A", const_name(src))));
        }
    }
    let consts: Vec<Ptx> = match find_cuda(&manifest) {
        Ok(compiler) => builds
            .into_iter()
            .map(|(src, arch, name)| {
                let suffix = if arch == ARCH { "" } else { ".sm90a" };
                let ptx = out.join(format!("{}{suffix}.ptx", stem(src)));
                let path = match compiler.compile(src, arch, &kernels, &ptx) {
                    Ok(()) => Some(ptx),
                    // A toolkit older than CUDA 12 has no compute_90a: the sm_80 kernels still
                    // serve sm_90 (src/cuda/sm90.rs). CI's audit requires the sm_90a PTX, so a
                    // kernel that stops compiling is caught there.
                    Err(why) if arch == ARCH_SM90A => {
                        // No stale PTX of an earlier build for the audit to find.
                        let _ = fs::remove_file(&ptx);
                        let first = why.lines().take(4).collect::<Vec<_>>().join(" | ");
                        println!(
                            "cargo:warning=grng: sm_90a GEMM kernels not built, H100s will use \
                             the sm_80 ones: {first}"
                        );
                        None
                    }
                    // Every other kernel must compile: the log fails the build.
                    Err(why) => panic!("{why}"),
                };
                Ptx { name, arch, path }
            })
            .collect(),
        Err(why) => {
            println!(
                "cargo:warning=grng: GPU kernels not built ({why}); the CPU and emulated \
                 backends work. For CUDA: run scripts/install-cuda-tools.sh, export the \
                 GRNG_CUDA_TOOLS it prints, and rebuild."
            );
            builds
                .into_iter()
                .map(|(_, arch, name)| Ptx {
                    name,
                    arch,
                    path: None,
                })
                .collect()
        }
    };
    write_ptx_rs(&out.join("ptx.rs"), &consts);
}

/// One PTX constant of the generated `ptx.rs`: its name, architecture and file (`None`:
/// not built).
struct Ptx {
    name: String,
    arch: &'static str,
    path: Option<PathBuf>,
}

/// `kernels/*.cu` (the hot paths) plus the emulator self-test kernels, sorted.
fn kernel_sources(kernels: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(kernels)
        .expect("kernels/ exists")
        .map(|e| e.expect("readable kernels/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    files.push(kernels.join("emu").join("selftest.cu"));
    files
}

fn stem(src: &Path) -> String {
    src.file_stem()
        .expect("a .cu file name")
        .to_string_lossy()
        .into_owned()
}

/// `kron.cu` → `SYRK`.
fn const_name(src: &Path) -> String {
    stem(src)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// The CPU build of every kernel file plus the emulator runtime, always optimized: the
/// emulated tests are slow enough without a debug build of the kernels.
fn build_emulator(kernels: &Path, sources: &[PathBuf]) {
    let mut b = cc::Build::new();
    b.cpp(true)
        .opt_level(2)
        .debug(false)
        .define("GRNG_EMU", None)
        .include(kernels)
        .flag("-x")
        .flag("c++")
        .flag("-std=c++17")
        // nvcc contracts a*b+c into FMAs by default; the host compiler must not add its
        // own contractions on top (the __f*_rn intrinsics rely on it).
        .flag("-ffp-contract=off")
        .warnings(true)
        .extra_warnings(true)
        .flag_if_supported("-Wno-unused-parameter")
        .file(kernels.join("emu").join("cuda_emu.cpp"));
    for src in sources {
        b.file(src);
    }
    b.compile("grng_kernels_emu");
}

/// A CUDA C++ → PTX compiler.
enum Compiler {
    Nvrtc {
        lib: PathBuf,
        includes: Vec<PathBuf>,
    },
    Nvcc {
        exe: PathBuf,
    },
}

fn find_cuda(manifest: &Path) -> Result<Compiler, String> {
    if let Some(dir) = env::var_os("GRNG_CUDA_TOOLS").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        return pip_tools(&dir).or_else(|| toolkit(&dir)).ok_or_else(|| {
            format!(
                "GRNG_CUDA_TOOLS={} holds neither the wheels of scripts/install-cuda-tools.sh \
                     nor a CUDA toolkit",
                dir.display()
            )
        });
    }
    // ./.cuda-tools at the workspace root (crates/grng/../..), where the script puts it.
    if let Some(c) = pip_tools(&manifest.join("../../.cuda-tools")) {
        return Ok(c);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(c) = env::var_os(var)
            .filter(|v| !v.is_empty())
            .and_then(|d| toolkit(Path::new(&d)))
        {
            return Ok(c);
        }
    }
    if let Some(exe) = env::var_os("PATH").and_then(|paths| {
        env::split_paths(&paths)
            .map(|d| d.join("nvcc"))
            .find(|p| p.is_file())
    }) {
        return Ok(Compiler::Nvcc { exe });
    }
    toolkit(Path::new("/usr/local/cuda")).ok_or_else(|| {
        "no CUDA compiler found: GRNG_CUDA_TOOLS, .cuda-tools, CUDA_HOME, nvcc".into()
    })
}

/// The layout `pip install --target DIR nvidia-cuda-*-cu12` produces (GPU.md §1).
fn pip_tools(dir: &Path) -> Option<Compiler> {
    let nv = dir.join("nvidia");
    let lib = find_nvrtc(&nv.join("cuda_nvrtc").join("lib"))?;
    let runtime = nv.join("cuda_runtime").join("include");
    let crt = nv.join("cuda_nvcc").join("include"); // crt/*.h, needed by mma.h
    (runtime.join("cuda_bf16.h").is_file() && crt.join("crt").is_dir()).then(|| Compiler::Nvrtc {
        lib,
        includes: vec![runtime, crt],
    })
}

/// A CUDA toolkit root: nvcc if present, else NVRTC with the toolkit's headers.
fn toolkit(root: &Path) -> Option<Compiler> {
    let exe = root.join("bin").join("nvcc");
    if exe.is_file() {
        return Some(Compiler::Nvcc { exe });
    }
    let include = root.join("include");
    let lib = find_nvrtc(&root.join("lib64")).or_else(|| find_nvrtc(&root.join("lib")))?;
    include
        .join("cuda_bf16.h")
        .is_file()
        .then(|| Compiler::Nvrtc {
            lib,
            includes: vec![include],
        })
}

fn find_nvrtc(dir: &Path) -> Option<PathBuf> {
    let mut libs: Vec<PathBuf> = fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc.so"))
        })
        .collect();
    libs.sort();
    libs.into_iter().next()
}

impl Compiler {
    /// Compiles `src` to PTX for `arch` at `ptx`; `Err` holds the compiler's complaint.
    fn compile(&self, src: &Path, arch: &str, kernels: &Path, ptx: &Path) -> Result<(), String> {
        match self {
            Compiler::Nvcc { exe } => {
                let status = Command::new(exe)
                    .args(["-ptx", &format!("-arch={arch}"), "-std=c++17", "-lineinfo"])
                    .arg("-I")
                    .arg(kernels)
                    .arg("-o")
                    .arg(ptx)
                    .arg(src)
                    .status()
                    .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
                if !status.success() {
                    return Err(format!("nvcc -arch={arch} failed on {}", src.display()));
                }
                Ok(())
            }
            Compiler::Nvrtc { lib, includes } => {
                let source = fs::read_to_string(src)
                    .unwrap_or_else(|e| panic!("cannot read {}: {e}", src.display()));
                let mut opts = vec![
                    format!("--gpu-architecture={arch}"),
                    "-std=c++17".to_string(),
                    "-lineinfo".to_string(),
                    format!("-I{}", kernels.display()),
                ];
                opts.extend(includes.iter().map(|i| format!("-I{}", i.display())));
                let (code, log) = nvrtc_compile(lib, &source, &src.display().to_string(), &opts);
                let log = log.trim();
                match code {
                    Ok(text) => {
                        for line in log.lines().filter(|l| !l.trim().is_empty()) {
                            println!("cargo:warning=NVRTC: {line}");
                        }
                        fs::write(ptx, text)
                            .unwrap_or_else(|e| panic!("cannot write {}: {e}", ptx.display()));
                        Ok(())
                    }
                    Err(e) => Err(format!(
                        "NVRTC --gpu-architecture={arch} failed on {} ({e}):\n{log}",
                        src.display()
                    )),
                }
            }
        }
    }
}

type NvrtcCreate = unsafe extern "C" fn(
    *mut *mut c_void,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type NvrtcCompile = unsafe extern "C" fn(*mut c_void, c_int, *const *const c_char) -> c_int;
type NvrtcSize = unsafe extern "C" fn(*mut c_void, *mut usize) -> c_int;
type NvrtcGet = unsafe extern "C" fn(*mut c_void, *mut c_char) -> c_int;
type NvrtcDestroy = unsafe extern "C" fn(*mut *mut c_void) -> c_int;

/// One NVRTC compilation through the library at `lib`: (PTX or error, log).
fn nvrtc_compile(
    lib: &Path,
    source: &str,
    name: &str,
    opts: &[String],
) -> (Result<String, String>, String) {
    // SAFETY: loading libnvrtc runs only its initializers; every symbol is used with the
    // signature of NVRTC's C API (nvrtc.h, stable since CUDA 7), and the program handle is
    // created, used and destroyed within this function. All strings passed are
    // NUL-terminated and outlive the calls; output buffers are sized by NVRTC's size calls.
    unsafe {
        let l = match libloading::Library::new(lib) {
            Ok(l) => l,
            Err(e) => {
                return (
                    Err(format!("cannot load {}: {e}", lib.display())),
                    String::new(),
                )
            }
        };
        let sym = |n: &[u8]| -> *const () {
            *l.get::<*const ()>(n)
                .unwrap_or_else(|e| panic!("{} lacks a symbol: {e}", lib.display()))
        };
        let create: NvrtcCreate = std::mem::transmute(sym(b"nvrtcCreateProgram\0"));
        let compile: NvrtcCompile = std::mem::transmute(sym(b"nvrtcCompileProgram\0"));
        let log_size: NvrtcSize = std::mem::transmute(sym(b"nvrtcGetProgramLogSize\0"));
        let get_log: NvrtcGet = std::mem::transmute(sym(b"nvrtcGetProgramLog\0"));
        let ptx_size: NvrtcSize = std::mem::transmute(sym(b"nvrtcGetPTXSize\0"));
        let get_ptx: NvrtcGet = std::mem::transmute(sym(b"nvrtcGetPTX\0"));
        let destroy: NvrtcDestroy = std::mem::transmute(sym(b"nvrtcDestroyProgram\0"));

        let src = CString::new(source).expect("no NUL in kernel source");
        let cname = CString::new(name).expect("no NUL in path");
        let copts: Vec<CString> = opts
            .iter()
            .map(|o| CString::new(o.as_str()).expect("no NUL in option"))
            .collect();
        let popts: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: *mut c_void = std::ptr::null_mut();
        let rc = create(
            &mut prog,
            src.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        );
        if rc != 0 {
            return (
                Err(format!("nvrtcCreateProgram returned {rc}")),
                String::new(),
            );
        }
        let rc = compile(prog, popts.len() as c_int, popts.as_ptr());
        let read = |size: NvrtcSize, get: NvrtcGet| -> String {
            let mut n = 0usize;
            if size(prog, &mut n) != 0 || n == 0 {
                return String::new();
            }
            let mut buf = vec![0u8; n];
            if get(prog, buf.as_mut_ptr().cast()) != 0 {
                return String::new();
            }
            CStr::from_bytes_until_nul(&buf)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let log = read(log_size, get_log);
        let result = if rc == 0 {
            Ok(read(ptx_size, get_ptx))
        } else {
            Err(format!("nvrtcCompileProgram returned {rc}"))
        };
        destroy(&mut prog);
        (result, log)
    }
}

fn write_ptx_rs(path: &Path, consts: &[Ptx]) {
    let mut s = String::from("// Generated by build.rs: the PTX of each kernel file.\n");
    for Ptx { name, arch, path } in consts {
        let file = name.trim_end_matches("_SM90A").to_lowercase();
        match path {
            Some(p) => s.push_str(&format!(
                "/// PTX ({arch}) of the `{file}` kernel file.\npub const {name}: Option<&str> = \
                 Some(include_str!({:?}));\n",
                p.display().to_string()
            )),
            None => s.push_str(&format!(
                "/// PTX ({arch}) of the `{file}` kernel file: not built (no CUDA compiler at \
                 build time).\npub const {name}: Option<&str> = None;\n"
            )),
        }
    }
    // The compute_90a PTX is optional (see main).
    let built = !consts.is_empty()
        && consts
            .iter()
            .all(|p| p.path.is_some() || p.arch == ARCH_SM90A);
    s.push_str(&format!(
        "/// True when every kernel file was compiled to PTX (compute_80; the compute_90a builds are \
         optional).\npub const BUILT: bool = {built};\n"
    ));
    fs::write(path, s).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}
