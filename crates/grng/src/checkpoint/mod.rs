//! Checkpoints: a versioned, checksummed binary file of named records, written atomically, and
//! the [`Checkpoint`] trait every optimizer, the reference MLP and the trainer's RNG implement
//! (impls in [`impls`]).
//!
//! # Format (version 1, all integers and floats little-endian)
//! ```text
//! magic    8 bytes   b"GRNGCKPT"
//! version  u32       FORMAT_VERSION
//! count    u64       number of records
//! record × count:
//!   name_len u32, name (UTF-8, 1..=MAX_NAME bytes, unique in the file)
//!   kind     u8      1 = f32 tensor, 2 = u64, 3 = f64, 4 = bytes, 5 = u64 list
//!   payload  kind 1: ndim u32 (≤ MAX_NDIM), dims u64 × ndim, f32 × Π dims (ndim 0: 1 value)
//!            kind 2: u64;  kind 3: f64;  kind 4: len u64, bytes;  kind 5: len u64, u64 × len
//! crc32    u32       CRC-32 (IEEE, crc32fast) of every byte before it
//! ```
//! Reading checks the magic, the version and the checksum before parsing, then parses with
//! every length bounded by the bytes actually left, so a truncated or corrupted file is an
//! [`Error::Checkpoint`] — never a panic, never a huge allocation, never a silently wrong state
//! (CRC-32 detects every error burst of up to 32 bits, so every single flipped byte).
//!
//! # Names
//! Objects write flat names (`momentum`, `layer0.lambda.factor`); [`Writer::scope`] and
//! [`Reader::scope`] prefix them (`optim.momentum`) so several objects share one file.

pub mod impls;

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};

/// The 8 bytes every checkpoint starts with.
pub const MAGIC: [u8; 8] = *b"GRNGCKPT";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Longest record name, in bytes.
pub const MAX_NAME: usize = 4096;
/// Most dimensions of a tensor record.
pub const MAX_NDIM: usize = 8;

const HEADER: usize = 8 + 4 + 8;
const TRAILER: usize = 4;
/// Smallest encoded record: name length, a 1-byte name, kind, and the smallest payload (8).
const MIN_RECORD: usize = 4 + 1 + 1 + 8;

/// A value stored under a name.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Row-major `f32` tensor; `shape = []` is a scalar (one value).
    F32 { shape: Vec<usize>, data: Vec<f32> },
    /// Unsigned scalar (step counters, sizes).
    U64(u64),
    /// Float scalar.
    F64(f64),
    /// Opaque bytes (strings, RNG seeds).
    Bytes(Vec<u8>),
    /// List of unsigned integers (layer shapes).
    U64s(Vec<u64>),
}

impl Value {
    fn kind(&self) -> u8 {
        match self {
            Value::F32 { .. } => 1,
            Value::U64(_) => 2,
            Value::F64(_) => 3,
            Value::Bytes(_) => 4,
            Value::U64s(_) => 5,
        }
    }

    fn kind_name(&self) -> &'static str {
        match self {
            Value::F32 { .. } => "an f32 tensor",
            Value::U64(_) => "a u64",
            Value::F64(_) => "an f64",
            Value::Bytes(_) => "a byte blob",
            Value::U64s(_) => "a u64 list",
        }
    }
}

fn ck(msg: impl Into<String>) -> Error {
    Error::Checkpoint(msg.into())
}

/// Product of `shape`, `None` on overflow.
fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Collects named records; [`Writer::to_bytes`] encodes them, [`Writer::write_atomic`] writes
/// them to a file.
#[derive(Debug, Default)]
pub struct Writer {
    prefix: String,
    records: Vec<(String, Value)>,
    names: BTreeMap<String, usize>,
}

impl Writer {
    /// An empty writer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of records so far.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True when no record was written.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Runs `f` with every name it writes prefixed by `name.`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for an empty name or one containing `.`; whatever `f` returns.
    pub fn scope<R>(&mut self, name: &str, f: impl FnOnce(&mut Writer) -> Result<R>) -> Result<R> {
        check_scope_name(name)?;
        let old = self.prefix.len();
        self.prefix.push_str(name);
        self.prefix.push('.');
        let out = f(self);
        self.prefix.truncate(old);
        out
    }

    /// Adds a record.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a duplicate or invalid name, a tensor whose data length is
    /// not the product of its shape, or more than [`MAX_NDIM`] dimensions.
    pub fn put(&mut self, name: &str, value: Value) -> Result<()> {
        let full = format!("{}{name}", self.prefix);
        if name.is_empty() || full.len() > MAX_NAME {
            return Err(ck(format!(
                "record name {full:?} must be 1..={MAX_NAME} bytes"
            )));
        }
        if let Value::F32 { shape, data } = &value {
            if shape.len() > MAX_NDIM || numel(shape) != Some(data.len()) {
                return Err(ck(format!(
                    "record `{full}`: shape {shape:?} does not hold {} values (at most {MAX_NDIM} dims)",
                    data.len()
                )));
            }
        }
        if self.names.contains_key(&full) {
            return Err(ck(format!("record `{full}` written twice")));
        }
        self.names.insert(full.clone(), self.records.len());
        self.records.push((full, value));
        Ok(())
    }

    /// An `f32` tensor of `shape` (row-major `data`).
    ///
    /// # Errors
    /// As [`Writer::put`].
    pub fn tensor(&mut self, name: &str, shape: &[usize], data: &[f32]) -> Result<()> {
        self.put(
            name,
            Value::F32 {
                shape: shape.to_vec(),
                data: crate::error::try_to_vec(data)?,
            },
        )
    }

    /// An `f32` scalar (a 0-dimensional tensor: stored bit for bit).
    ///
    /// # Errors
    /// As [`Writer::put`].
    pub fn f32(&mut self, name: &str, v: f32) -> Result<()> {
        self.tensor(name, &[], &[v])
    }

    /// An optional `f32` (a tensor of shape `[0]` or `[1]`).
    ///
    /// # Errors
    /// As [`Writer::put`].
    pub fn opt_f32(&mut self, name: &str, v: Option<f32>) -> Result<()> {
        match v {
            Some(v) => self.tensor(name, &[1], &[v]),
            None => self.tensor(name, &[0], &[]),
        }
    }

    /// A `u64` scalar.
    ///
    /// # Errors
    /// As [`Writer::put`].
    pub fn u64(&mut self, name: &str, v: u64) -> Result<()> {
        self.put(name, Value::U64(v))
    }

    /// An `f64` scalar.
    ///
    /// # Errors
    /// As [`Writer::put`].
    pub fn f64(&mut self, name: &str, v: f64) -> Result<()> {
        self.put(name, Value::F64(v))
    }

    /// A byte blob.
    ///
    /// # Errors
    /// As [`Writer::put`].
    pub fn bytes(&mut self, name: &str, v: &[u8]) -> Result<()> {
        self.put(name, Value::Bytes(v.to_vec()))
    }

    /// A UTF-8 string (a byte blob).
    ///
    /// # Errors
    /// As [`Writer::put`].
    pub fn str(&mut self, name: &str, v: &str) -> Result<()> {
        self.bytes(name, v.as_bytes())
    }

    /// A scope `name` of one `u64` record per `(name, value)` pair: a set of counters.
    ///
    /// # Errors
    /// As [`Writer::put`].
    pub fn u64_scope(&mut self, name: &str, values: &[(&str, u64)]) -> Result<()> {
        self.scope(name, |w| values.iter().try_for_each(|&(k, v)| w.u64(k, v)))
    }

    /// A list of `u64`.
    ///
    /// # Errors
    /// As [`Writer::put`].
    pub fn u64s(&mut self, name: &str, v: &[u64]) -> Result<()> {
        self.put(name, Value::U64s(v.to_vec()))
    }

    /// The encoded file (format in the module docs).
    pub fn to_bytes(&self) -> Vec<u8> {
        let payload: usize = self
            .records
            .iter()
            .map(|(n, v)| {
                4 + n.len()
                    + 1
                    + match v {
                        Value::F32 { shape, data } => 4 + 8 * shape.len() + 4 * data.len(),
                        Value::U64(_) | Value::F64(_) => 8,
                        Value::Bytes(b) => 8 + b.len(),
                        Value::U64s(u) => 8 + 8 * u.len(),
                    }
            })
            .sum();
        let mut out = Vec::with_capacity(HEADER + payload + TRAILER);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.records.len() as u64).to_le_bytes());
        for (name, value) in &self.records {
            out.extend_from_slice(&(name.len() as u32).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.push(value.kind());
            match value {
                Value::F32 { shape, data } => {
                    out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
                    for &d in shape {
                        out.extend_from_slice(&(d as u64).to_le_bytes());
                    }
                    for &x in data {
                        out.extend_from_slice(&x.to_le_bytes());
                    }
                }
                Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
                Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
                Value::Bytes(b) => {
                    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
                    out.extend_from_slice(b);
                }
                Value::U64s(u) => {
                    out.extend_from_slice(&(u.len() as u64).to_le_bytes());
                    for &x in u {
                        out.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Writes the file atomically: a temporary file in the same directory is written and
    /// fsynced, renamed over `path`, and the directory is fsynced, so after a crash `path`
    /// holds either the old checkpoint or the new one, never a mix.
    ///
    /// # Errors
    /// [`Error::Io`] from the file system (the temporary file is removed then).
    pub fn write_atomic(&self, path: impl AsRef<Path>) -> Result<()> {
        write_atomic(path.as_ref(), &self.to_bytes())
    }

    /// Decodes what was written so far (an in-memory round trip, e.g. for snapshots).
    ///
    /// # Errors
    /// Never in practice: the encoding is always valid.
    pub fn to_reader(&self) -> Result<Reader> {
        Reader::from_bytes(&self.to_bytes())
    }
}

fn check_scope_name(name: &str) -> Result<()> {
    if name.is_empty() || name.contains('.') {
        return Err(ck(format!(
            "scope name {name:?} must be non-empty and contain no '.'"
        )));
    }
    Ok(())
}

/// Source of unique temporary-file names within this process.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// `bytes` to `path` through a temporary file in the same directory, fsync, rename, fsync of
/// the directory.
///
/// # Errors
/// [`Error::Io`]; [`Error::Checkpoint`] for a path without a file name.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let file_name = path
        .file_name()
        .ok_or_else(|| ck(format!("{}: not a file path", path.display())))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(
        ".{}.tmp.{}.{}",
        file_name.to_string_lossy(),
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| -> Result<()> {
        let io = |e| Error::io(&tmp, e);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io)?;
        f.write_all(bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
        drop(f);
        fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    })();
    if let Err(e) = written {
        // Best effort: the temporary file is garbage either way.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(&dir)
}

/// fsync of a directory, so the rename itself is durable (POSIX; a no-op elsewhere).
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let io = |e| Error::io(dir, e);
        File::open(dir).map_err(io)?.sync_all().map_err(io)?;
    }
    #[cfg(not(unix))]
    {
        let _ = (dir, File::open);
    }
    Ok(())
}

/// The records of a decoded checkpoint, looked up by name (within an optional scope).
#[derive(Clone, Debug)]
pub struct Reader {
    records: Arc<BTreeMap<String, Value>>,
    prefix: String,
}

/// Bounded little-endian cursor over the record section.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(ck(format!(
                "truncated: {} needs {n} bytes at offset {}, only {} left",
                what(),
                HEADER + self.pos,
                self.left()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A length field that must fit in what is left when each unit takes `unit` bytes.
    fn len(&mut self, unit: usize, what: &dyn Fn() -> String) -> Result<usize> {
        let n = self.u64(what)?;
        let max = (self.left() / unit.max(1)) as u64;
        if n > max {
            return Err(ck(format!(
                "{}: length {n} exceeds the {} bytes left",
                what(),
                self.left()
            )));
        }
        Ok(n as usize)
    }
}

impl Reader {
    /// Decodes and validates a whole checkpoint file image.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a file that is too short, has the wrong magic or version, a
    /// checksum mismatch, or any malformed record (truncated, unknown kind, bad name, duplicate
    /// name, lengths beyond the file, trailing bytes).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() < HEADER + TRAILER {
            return Err(ck(format!(
                "truncated: {} bytes, a checkpoint has at least {}",
                bytes.len(),
                HEADER + TRAILER
            )));
        }
        if bytes[..8] != MAGIC {
            return Err(ck(format!(
                "not a grng checkpoint: magic {:?}, expected {:?}",
                String::from_utf8_lossy(&bytes[..8]),
                String::from_utf8_lossy(&MAGIC)
            )));
        }
        let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        if version != FORMAT_VERSION {
            return Err(ck(format!(
                "unsupported format version {version}: this build reads version {FORMAT_VERSION}"
            )));
        }
        let (body, tail) = bytes.split_at(bytes.len() - TRAILER);
        let stored = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
        let computed = crc32fast::hash(body);
        if stored != computed {
            return Err(ck(format!(
                "checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the file is corrupted or truncated"
            )));
        }
        let mut c8 = [0u8; 8];
        c8.copy_from_slice(&body[12..HEADER]);
        let count = u64::from_le_bytes(c8);
        let mut cur = Cursor {
            buf: &body[HEADER..],
            pos: 0,
        };
        if count > (cur.left() / MIN_RECORD) as u64 {
            return Err(ck(format!(
                "record count {count} cannot fit in {} bytes",
                cur.left()
            )));
        }
        let mut records = BTreeMap::new();
        for i in 0..count {
            let (name, value) = read_record(&mut cur, i)?;
            if records.contains_key(&name) {
                return Err(ck(format!("record `{name}` appears twice")));
            }
            records.insert(name, value);
        }
        if cur.left() != 0 {
            return Err(ck(format!(
                "{} unexpected bytes after the last of {count} records",
                cur.left()
            )));
        }
        Ok(Self {
            records: Arc::new(records),
            prefix: String::new(),
        })
    }

    /// Reads and decodes the file at `path`.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read; otherwise as [`Reader::from_bytes`] (the
    /// message names the path).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::from_bytes(&bytes).map_err(|e| match e {
            Error::Checkpoint(m) => ck(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// The records under `name.` (nested scopes stack).
    pub fn scope(&self, name: &str) -> Reader {
        Reader {
            records: Arc::clone(&self.records),
            prefix: format!("{}{name}.", self.prefix),
        }
    }

    /// Total number of records in the file (all scopes).
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True when the file holds no record.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Every full record name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.records.keys().map(String::as_str)
    }

    /// Whether `name` exists in this scope.
    pub fn contains(&self, name: &str) -> bool {
        self.records.contains_key(&self.full(name))
    }

    fn full(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The value stored under `name` in this scope.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a missing record.
    pub fn get(&self, name: &str) -> Result<&Value> {
        let full = self.full(name);
        self.records
            .get(&full)
            .ok_or_else(|| ck(format!("missing record `{full}`")))
    }

    fn wrong_kind(&self, name: &str, v: &Value, expected: &str) -> Error {
        ck(format!(
            "record `{}` is {}, expected {expected}",
            self.full(name),
            v.kind_name()
        ))
    }

    /// The `f32` tensor `name` together with its shape.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a missing record or another kind.
    pub fn tensor_any(&self, name: &str) -> Result<(&[usize], &[f32])> {
        match self.get(name)? {
            Value::F32 { shape, data } => Ok((shape, data)),
            v => Err(self.wrong_kind(name, v, "an f32 tensor")),
        }
    }

    /// The `f32` tensor `name`, which must have exactly `shape`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a missing record, another kind or another shape.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<&[f32]> {
        let (got, data) = self.tensor_any(name)?;
        if got != shape {
            return Err(ck(format!(
                "record `{}` has shape {got:?}, expected {shape:?}",
                self.full(name)
            )));
        }
        Ok(data)
    }

    /// The `f32` scalar `name` (a 0-dimensional tensor).
    ///
    /// # Errors
    /// As [`Reader::tensor`].
    pub fn f32(&self, name: &str) -> Result<f32> {
        Ok(self.tensor(name, &[])?[0])
    }

    /// The optional `f32` `name` (a tensor of shape `[0]` or `[1]`).
    ///
    /// # Errors
    /// As [`Reader::tensor`].
    pub fn opt_f32(&self, name: &str) -> Result<Option<f32>> {
        let (shape, data) = self.tensor_any(name)?;
        match shape {
            [0] => Ok(None),
            [1] => Ok(Some(data[0])),
            _ => Err(ck(format!(
                "record `{}` has shape {shape:?}, expected [0] or [1]",
                self.full(name)
            ))),
        }
    }

    /// The `u64` scalar `name`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a missing record or another kind.
    pub fn u64(&self, name: &str) -> Result<u64> {
        match self.get(name)? {
            Value::U64(v) => Ok(*v),
            v => Err(self.wrong_kind(name, v, "a u64")),
        }
    }

    /// The `u64` records `names` of scope `name`, in that order: a set of counters as
    /// [`Writer::u64_scope`] writes it. A name in `absent_as_zero` that the scope lacks reads
    /// as 0 (a counter added after older checkpoints were written).
    ///
    /// # Errors
    /// As [`Reader::u64`], for each record read.
    pub fn u64_scope<const N: usize>(
        &self,
        name: &str,
        names: [&str; N],
        absent_as_zero: &[&str],
    ) -> Result<[u64; N]> {
        let scope = self.scope(name);
        let mut values = [0; N];
        for (v, name) in values.iter_mut().zip(names) {
            if !absent_as_zero.contains(&name) || scope.contains(name) {
                *v = scope.u64(name)?;
            }
        }
        Ok(values)
    }

    /// The `u64` scalar `name` as a `usize`.
    ///
    /// # Errors
    /// As [`Reader::u64`], and for a value that does not fit.
    pub fn usize(&self, name: &str) -> Result<usize> {
        let v = self.u64(name)?;
        usize::try_from(v).map_err(|_| {
            ck(format!(
                "record `{}` = {v} does not fit in usize",
                self.full(name)
            ))
        })
    }

    /// The `f64` scalar `name`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a missing record or another kind.
    pub fn f64(&self, name: &str) -> Result<f64> {
        match self.get(name)? {
            Value::F64(v) => Ok(*v),
            v => Err(self.wrong_kind(name, v, "an f64")),
        }
    }

    /// The byte blob `name`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a missing record or another kind.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        match self.get(name)? {
            Value::Bytes(v) => Ok(v),
            v => Err(self.wrong_kind(name, v, "a byte blob")),
        }
    }

    /// The UTF-8 string `name`.
    ///
    /// # Errors
    /// As [`Reader::bytes`], and for invalid UTF-8.
    pub fn str(&self, name: &str) -> Result<&str> {
        std::str::from_utf8(self.bytes(name)?)
            .map_err(|_| ck(format!("record `{}` is not UTF-8", self.full(name))))
    }

    /// The `u64` list `name`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a missing record or another kind.
    pub fn u64s(&self, name: &str) -> Result<&[u64]> {
        match self.get(name)? {
            Value::U64s(v) => Ok(v),
            v => Err(self.wrong_kind(name, v, "a u64 list")),
        }
    }

    /// Checks that the string record `kind` (the object type tag) is `expected`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming both kinds.
    pub fn expect_kind(&self, expected: &str) -> Result<()> {
        let got = self.str("kind")?;
        if got != expected {
            return Err(ck(format!(
                "`{}kind`: the checkpoint holds a {got:?} state, expected {expected:?}",
                self.prefix
            )));
        }
        Ok(())
    }

    /// An object's own validation error from its `restore`, as an [`Error::Checkpoint`]
    /// naming this reader's scope (a checkpoint error is returned as it is).
    pub fn wrap_restore(&self, e: Error) -> Error {
        match e {
            Error::Checkpoint(_) => e,
            other => ck(format!(
                "`{}` cannot be restored: {other}",
                self.prefix.trim_end_matches('.')
            )),
        }
    }
}

fn read_record(cur: &mut Cursor<'_>, i: u64) -> Result<(String, Value)> {
    let at = |what: &'static str| move || format!("record {i}'s {what}");
    let name_len = cur.u32(&at("name length"))? as usize;
    if name_len == 0 || name_len > MAX_NAME {
        return Err(ck(format!(
            "record {i}: name length {name_len} outside 1..={MAX_NAME}"
        )));
    }
    let name = std::str::from_utf8(cur.take(name_len, &at("name"))?)
        .map_err(|_| ck(format!("record {i}: name is not UTF-8")))?
        .to_string();
    let ctx = |what: &str| format!("record `{name}`'s {what}");
    let kind = cur.take(1, &|| ctx("kind"))?[0];
    let value = match kind {
        1 => {
            let ndim = cur.u32(&|| ctx("rank"))? as usize;
            if ndim > MAX_NDIM {
                return Err(ck(format!(
                    "record `{name}`: rank {ndim} exceeds {MAX_NDIM}"
                )));
            }
            let mut shape = Vec::with_capacity(ndim);
            for _ in 0..ndim {
                let d = cur.u64(&|| ctx("shape"))?;
                shape.push(
                    usize::try_from(d)
                        .map_err(|_| ck(format!("record `{name}`: dimension {d} does not fit")))?,
                );
            }
            let n = numel(&shape)
                .filter(|&n| n <= cur.left() / 4)
                .ok_or_else(|| {
                    ck(format!(
                        "record `{name}`: shape {shape:?} needs more than the {} bytes left",
                        cur.left()
                    ))
                })?;
            let raw = cur.take(4 * n, &|| ctx("data"))?;
            let data = raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            Value::F32 { shape, data }
        }
        2 => Value::U64(cur.u64(&|| ctx("value"))?),
        3 => Value::F64(f64::from_bits(cur.u64(&|| ctx("value"))?)),
        4 => {
            let n = cur.len(1, &|| ctx("length"))?;
            Value::Bytes(cur.take(n, &|| ctx("bytes"))?.to_vec())
        }
        5 => {
            let n = cur.len(8, &|| ctx("length"))?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(cur.u64(&|| ctx("values"))?);
            }
            Value::U64s(v)
        }
        k => return Err(ck(format!("record `{name}`: unknown kind {k}"))),
    };
    Ok((name, value))
}

/// State that can be saved to and restored from a checkpoint.
///
/// `load` validates every record (presence, kind, shape, finiteness, ranges) before it changes
/// anything, so a failed load leaves the object exactly as it was. Errors from `load` are
/// [`Error::Checkpoint`] naming the record.
pub trait Checkpoint {
    /// Writes the state as records (under the writer's current scope).
    ///
    /// # Errors
    /// Device errors while copying state to the host; [`Error::Checkpoint`] for name clashes.
    fn save(&self, w: &mut Writer) -> Result<()>;

    /// Restores the state from the records of the reader's scope.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for missing, mistyped, mis-shaped or invalid records; the object
    /// is unchanged then.
    fn load(&mut self, r: &Reader) -> Result<()>;
}

/// Saves several objects, each under its own scope, into one writer.
///
/// # Errors
/// As [`Checkpoint::save`], [`Writer::scope`].
pub fn save_all(w: &mut Writer, parts: &[(&str, &dyn Checkpoint)]) -> Result<()> {
    for (name, part) in parts {
        w.scope(name, |w| part.save(w))?;
    }
    Ok(())
}

/// Loads several objects from their scopes, all or nothing: each object's current state is
/// snapshotted first, and if a later object fails to load, the earlier ones are put back.
///
/// # Errors
/// The first object's load error ([`Error::Checkpoint`]); every object is unchanged then.
pub fn load_all(r: &Reader, parts: &mut [(&str, &mut dyn Checkpoint)]) -> Result<()> {
    let mut snapshots = Vec::with_capacity(parts.len());
    for (name, part) in parts.iter() {
        check_scope_name(name)?;
        let mut w = Writer::new();
        part.save(&mut w)?;
        snapshots.push(w.to_reader()?);
    }
    for k in 0..parts.len() {
        let (name, part) = &mut parts[k];
        if let Err(e) = part.load(&r.scope(name)) {
            for (j, snap) in snapshots.iter().enumerate().take(k) {
                parts[j].1.load(snap).map_err(|re| {
                    ck(format!(
                        "{e}; rolling back `{}` failed too: {re}",
                        parts[j].0
                    ))
                })?;
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Writes `obj` to `path` atomically ([`Writer::write_atomic`]).
///
/// # Errors
/// As [`Checkpoint::save`] and [`Writer::write_atomic`].
pub fn save_file(path: impl AsRef<Path>, obj: &dyn Checkpoint) -> Result<()> {
    let mut w = Writer::new();
    obj.save(&mut w)?;
    w.write_atomic(path)
}

/// Loads `obj` from the checkpoint at `path`; `obj` is unchanged on error.
///
/// # Errors
/// As [`Reader::open`] and [`Checkpoint::load`].
pub fn load_file(path: impl AsRef<Path>, obj: &mut dyn Checkpoint) -> Result<()> {
    obj.load(&Reader::open(path)?)
}
