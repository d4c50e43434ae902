//! A table of bad inputs for `flash-attn-cli`: files, arguments, shapes, values and paths.
//!
//! Every row runs the binary (CPU backend) in a fresh directory that holds good inputs
//! (`in.safetensors`, `q.npy`, `k.npy`, `v.npy`, f16) and earlier outputs (`out.safetensors`,
//! `o.npy`, `lse.npy` holding `previous`), and asserts the exit status, a substring of the
//! message, and, for failures, that the directory is byte for byte as it was: nothing written,
//! nothing overwritten, no temporary file left behind. Rows that succeed document the result.

use half::f16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

mod common;
use common::cli;

/// A fresh directory, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "flash-attn-cli-bad-{tag}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    fn write(&self, name: &str, bytes: &[u8]) {
        std::fs::write(self.path(name), bytes).unwrap();
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every entry under `dir`: relative path -> file bytes, link target or `<dir>`.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(dir).unwrap().to_path_buf();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            let content = if meta.file_type().is_symlink() {
                std::fs::read_link(&p)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes()
            } else if meta.is_dir() {
                stack.push(p);
                b"<dir>".to_vec()
            } else {
                std::fs::read(&p).unwrap()
            };
            out.insert(rel, content);
        }
    }
    out
}

fn f16_bytes(n: usize, seed: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            let x = ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32;
            f16::from_f32(x / 500.0 - 1.0).to_le_bytes()
        })
        .collect()
}

/// A safetensors file of named tensors (dtype, shape, data).
fn safetensors(tensors: &[(&str, Dtype, &[usize], Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                *name,
                TensorView::new(*dtype, shape.to_vec(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// Q, K, V in f16 with the given shapes.
fn qkv_file(q: &[usize], k: &[usize], v: &[usize]) -> Vec<u8> {
    let n = |s: &[usize]| s.iter().product::<usize>();
    safetensors(&[
        ("q", Dtype::F16, q, f16_bytes(n(q), 1)),
        ("k", Dtype::F16, k, f16_bytes(n(k), 2)),
        ("v", Dtype::F16, v, f16_bytes(n(v), 3)),
    ])
}

/// Q, K, V in f16 of the good shapes and `do` of `do_shape` and `do_dtype` (2-byte values).
fn qkvdo_file(do_shape: &[usize], do_dtype: Dtype) -> Vec<u8> {
    let n = do_shape.iter().product::<usize>();
    safetensors(&[
        ("q", Dtype::F16, &SHAPE, f16_bytes(N_Q, 1)),
        ("k", Dtype::F16, &KV_SHAPE, f16_bytes(N_KV, 2)),
        ("v", Dtype::F16, &KV_SHAPE, f16_bytes(N_KV, 3)),
        ("do", do_dtype, do_shape, f16_bytes(n, 4)),
    ])
}

/// A packed varlen batch in f16: q and do `[12, 2, 16]`, k and v `[10, 1, 16]` and the I32
/// `cu_seqlens_q` = [0, 5, 12], `cu_seqlens_k` = [0, 4, 10].
fn varlen_file() -> Vec<u8> {
    let ints = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    safetensors(&[
        ("q", Dtype::F16, &[12, 2, 16], f16_bytes(12 * 32, 1)),
        ("k", Dtype::F16, &[10, 1, 16], f16_bytes(10 * 16, 2)),
        ("v", Dtype::F16, &[10, 1, 16], f16_bytes(10 * 16, 3)),
        ("do", Dtype::F16, &[12, 2, 16], f16_bytes(12 * 32, 4)),
        ("cu_seqlens_q", Dtype::I32, &[3], ints(&[0, 5, 12])),
        ("cu_seqlens_k", Dtype::I32, &[3], ints(&[0, 4, 10])),
    ])
}

/// A .npy file: format `version`, header dict `dict` (padded to 64 bytes), then `data`.
fn npy(version: u8, dict: &str, data: &[u8]) -> Vec<u8> {
    let prefix = if version == 1 { 10 } else { 12 };
    let mut header = dict.to_string();
    while (prefix + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY".to_vec();
    out.extend_from_slice(&[version, 0]);
    if version == 1 {
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn npy_dict(descr: &str, fortran: bool, shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!(
        "{{'descr': '{descr}', 'fortran_order': {}, 'shape': ({},), }}",
        if fortran { "True" } else { "False" },
        dims.join(", ")
    )
}

const SHAPE: [usize; 4] = [1, 8, 2, 16];
const KV_SHAPE: [usize; 4] = [1, 8, 1, 16];
const N_Q: usize = 256;
const N_KV: usize = 128;

/// The good inputs and earlier outputs every row starts from.
fn populate(dir: &Dir) {
    dir.write("in.safetensors", &qkv_file(&SHAPE, &KV_SHAPE, &KV_SHAPE));
    let d = npy_dict("<f2", false, &SHAPE);
    dir.write("q.npy", &npy(1, &d, &f16_bytes(N_Q, 1)));
    let d = npy_dict("<f2", false, &KV_SHAPE);
    dir.write("k.npy", &npy(1, &d, &f16_bytes(N_KV, 2)));
    dir.write("v.npy", &npy(1, &d, &f16_bytes(N_KV, 3)));
    for name in ["out.safetensors", "o.npy", "lse.npy"] {
        dir.write(name, b"previous");
    }
}

/// What a row expects.
enum Expect {
    /// Exit status 1, this substring on stderr, the directory unchanged.
    Fails(&'static str),
    /// Exit status 0, this substring on stderr.
    Succeeds(&'static str),
}

type Setup = fn(&Dir);

struct Row {
    name: &'static str,
    setup: Setup,
    args: Vec<OsString>,
    expect: Expect,
}

fn row(name: &'static str, setup: Setup, args: &[&str], expect: Expect) -> Row {
    Row {
        name,
        setup,
        args: args.iter().map(OsString::from).collect(),
        expect,
    }
}

fn none(_: &Dir) {}

#[cfg(unix)]
fn non_utf8(prefix: &[u8]) -> OsString {
    use std::os::unix::ffi::OsStringExt;
    let mut b = prefix.to_vec();
    b.extend_from_slice(b"\xff\xfe");
    OsString::from_vec(b)
}

fn rows() -> Vec<Row> {
    use Expect::{Fails, Succeeds};
    let st = "in.safetensors";
    let bad = |name, setup: Setup, args: &[&str], msg| row(name, setup, args, Fails(msg));
    let bad_st =
        |name, setup: Setup, msg| row(name, setup, &["bad.safetensors", "--cpu"], Fails(msg));
    let bad_npy = |name, setup: Setup, msg| {
        row(
            name,
            setup,
            &["--npy", "bad.npy", "k.npy", "v.npy", "--cpu"],
            Fails(msg),
        )
    };
    let mut rows = vec![
        // --- arguments ---
        bad("no arguments", none, &[], "required arguments"),
        bad(
            "--scale without value",
            none,
            &[st, "--scale"],
            "a value is required",
        ),
        bad(
            "--scale not a number",
            none,
            &[st, "--scale", "abc"],
            "is not a number",
        ),
        bad(
            "--scale nan",
            none,
            &[st, "--scale", "nan"],
            "must be finite",
        ),
        bad(
            "--scale inf",
            none,
            &[st, "--scale", "inf"],
            "must be finite",
        ),
        bad(
            "unknown option",
            none,
            &[st, "--frobnicate"],
            "unexpected argument",
        ),
        bad("two input files", none, &[st, st], "unexpected argument"),
        bad(
            "input and --npy",
            none,
            &[st, "--npy", "q.npy", "k.npy", "v.npy"],
            "cannot be used with",
        ),
        bad(
            "--q with --npy",
            none,
            &["--npy", "q.npy", "k.npy", "v.npy", "--q", "x"],
            "cannot be used with",
        ),
        bad(
            "--npy with two files",
            none,
            &["--npy", "q.npy", "k.npy"],
            "3 values required",
        ),
        bad(
            "--npy-out with one file",
            none,
            &[st, "--npy-out", "x.npy"],
            "2 values required",
        ),
        bad("-o without value", none, &[st, "-o"], "a value is required"),
        bad(
            "-o twice",
            none,
            &[st, "-o", "a.safetensors", "-o", "b.safetensors"],
            "cannot be used multiple times",
        ),
        bad(
            "--out and -o",
            none,
            &[st, "--out", "a.safetensors", "-o", "b.safetensors"],
            "cannot be used multiple times",
        ),
        bad(
            "--scale twice",
            none,
            &[st, "--scale", "1", "--scale", "2"],
            "cannot be used multiple times",
        ),
        bad(
            "--npy-out twice",
            none,
            &[
                st,
                "--npy-out",
                "a.npy",
                "b.npy",
                "--npy-out",
                "c.npy",
                "d.npy",
            ],
            "cannot be used multiple times",
        ),
        bad(
            "--causal twice",
            none,
            &[st, "--causal", "--causal"],
            "cannot be used multiple times",
        ),
        bad(
            "--q twice",
            none,
            &[st, "--q", "q", "--q", "q"],
            "cannot be used multiple times",
        ),
        bad(
            "--npy twice",
            none,
            &[
                "--npy", "q.npy", "k.npy", "v.npy", "--npy", "q.npy", "k.npy", "v.npy",
            ],
            "cannot be used multiple times",
        ),
        // --- paths ---
        bad(
            "-o is the input",
            none,
            &[st, "--cpu", "-o", st],
            "same file as input",
        ),
        bad(
            "-o is the input, spelled differently",
            none,
            &[st, "--cpu", "-o", "./sub/../in.safetensors"],
            "same file as input",
        ),
        bad(
            "-o is a symlink to the input",
            |d| symlink(d, "in.safetensors", "link.safetensors"),
            &[st, "--cpu", "-o", "link.safetensors"],
            "same file as input",
        ),
        bad(
            "-o is a hard link to the input",
            |d| std::fs::hard_link(d.path("in.safetensors"), d.path("hard.safetensors")).unwrap(),
            &[st, "--cpu", "-o", "hard.safetensors"],
            "same file as input",
        ),
        bad(
            "--npy-out O is an input",
            none,
            &[
                "--npy",
                "q.npy",
                "k.npy",
                "v.npy",
                "--cpu",
                "--npy-out",
                "k.npy",
                "lse.npy",
            ],
            "same file as --npy K",
        ),
        bad(
            "--npy-out LSE is -o",
            none,
            &[st, "--cpu", "--npy-out", "o.npy", "out.safetensors"],
            "same file as -o",
        ),
        bad(
            "--npy-out names one file twice",
            none,
            &[st, "--cpu", "--npy-out", "o.npy", "o.npy"],
            "same file as --npy-out O",
        ),
        bad(
            "--npy-out names one new file twice",
            none,
            &[st, "--cpu", "--npy-out", "new.npy", "./new.npy"],
            "same file as --npy-out O",
        ),
        bad(
            "-o in a missing directory",
            none,
            &[st, "--cpu", "-o", "missing/out.safetensors"],
            "does not exist",
        ),
        bad(
            "-o is a directory",
            |d| std::fs::create_dir(d.path("adir")).unwrap(),
            &[st, "--cpu", "-o", "adir"],
            "is a directory",
        ),
        bad(
            "-o is read-only",
            |d| set_readonly(&d.path("out.safetensors")),
            &[st, "--cpu"],
            "read-only",
        ),
        bad(
            "input missing",
            none,
            &["missing.safetensors", "--cpu"],
            "No such file",
        ),
        bad(
            "input is a directory",
            |d| std::fs::create_dir(d.path("adir")).unwrap(),
            &["adir", "--cpu"],
            "is a directory",
        ),
        // --- safetensors files ---
        bad_st(
            "safetensors: empty file",
            |d| d.write("bad.safetensors", b""),
            "truncated",
        ),
        bad_st(
            "safetensors: 4 bytes",
            |d| d.write("bad.safetensors", b"\x10\0\0\0"),
            "truncated",
        ),
        bad_st(
            "safetensors: huge header length",
            |d| d.write("bad.safetensors", &u64::MAX.to_le_bytes()),
            "exceeds the limit",
        ),
        bad_st(
            "safetensors: header cut short",
            |d| {
                let mut b = 1000u64.to_le_bytes().to_vec();
                b.extend_from_slice(b"{\"q\"");
                d.write("bad.safetensors", &b)
            },
            "truncated",
        ),
        bad_st(
            "safetensors: data cut short",
            |d| {
                let b = std::fs::read(d.path("in.safetensors")).unwrap();
                d.write("bad.safetensors", &b[..b.len() - 3])
            },
            "truncated",
        ),
        bad_st(
            "safetensors: trailing bytes",
            |d| {
                let mut b = std::fs::read(d.path("in.safetensors")).unwrap();
                b.extend_from_slice(b"junk");
                d.write("bad.safetensors", &b)
            },
            "unexpected bytes",
        ),
        bad_st(
            "safetensors: text file",
            |d| d.write("bad.safetensors", b"definitely not safetensors"),
            "exceeds the limit",
        ),
        bad_st(
            "safetensors: header not JSON",
            |d| {
                let mut b = 4u64.to_le_bytes().to_vec();
                b.extend_from_slice(b"}}}}");
                d.write("bad.safetensors", &b)
            },
            "not a safetensors file",
        ),
        bad_st(
            "safetensors: missing tensor",
            |d| {
                d.write(
                    "bad.safetensors",
                    &safetensors(&[
                        ("q", Dtype::F16, &SHAPE, f16_bytes(N_Q, 1)),
                        ("k", Dtype::F16, &KV_SHAPE, f16_bytes(N_KV, 2)),
                    ]),
                )
            },
            "no tensor `v`",
        ),
        bad_st(
            "safetensors: F64 tensors",
            |d| {
                d.write(
                    "bad.safetensors",
                    &safetensors(&[
                        ("q", Dtype::F64, &SHAPE, vec![0; N_Q * 8]),
                        ("k", Dtype::F64, &KV_SHAPE, vec![0; N_KV * 8]),
                        ("v", Dtype::F64, &KV_SHAPE, vec![0; N_KV * 8]),
                    ]),
                )
            },
            "unsupported dtype F64",
        ),
        bad_st(
            "safetensors: mixed dtypes",
            |d| {
                d.write(
                    "bad.safetensors",
                    &safetensors(&[
                        ("q", Dtype::F16, &SHAPE, f16_bytes(N_Q, 1)),
                        ("k", Dtype::F32, &KV_SHAPE, vec![0; N_KV * 4]),
                        ("v", Dtype::F16, &KV_SHAPE, f16_bytes(N_KV, 3)),
                    ]),
                )
            },
            "must have one dtype",
        ),
        bad_st(
            "safetensors: rank 3",
            |d| {
                d.write(
                    "bad.safetensors",
                    &qkv_file(&[8, 2, 16], &[8, 1, 16], &[8, 1, 16]),
                )
            },
            "rank 4",
        ),
        bad(
            "/dev/zero as safetensors input",
            none,
            &["/dev/zero", "--cpu"],
            "not a safetensors file",
        ),
        // --- .npy files ---
        bad_npy(
            "npy: bad magic",
            |d| d.write("bad.npy", b"PK\x03\x04 this is a zip"),
            "bad magic",
        ),
        bad_npy("npy: empty file", |d| d.write("bad.npy", b""), "bad magic"),
        bad_npy(
            "npy: magic cut short",
            |d| d.write("bad.npy", b"\x93NUM"),
            "truncated",
        ),
        bad_npy(
            "npy: version 2 cut short",
            |d| d.write("bad.npy", b"\x93NUMPY\x02\x00\x10\x00"),
            "truncated",
        ),
        bad_npy(
            "npy: version 4",
            |d| {
                d.write(
                    "bad.npy",
                    &npy(1, &npy_dict("<f2", false, &SHAPE), &f16_bytes(N_Q, 1))
                        .iter()
                        .enumerate()
                        .map(|(i, &b)| if i == 6 { 4 } else { b })
                        .collect::<Vec<_>>(),
                )
            },
            "unsupported .npy format version 4.0",
        ),
        bad_npy(
            "npy: uint16",
            |d| {
                d.write(
                    "bad.npy",
                    &npy(1, &npy_dict("<u2", false, &SHAPE), &f16_bytes(N_Q, 1)),
                )
            },
            "unsupported dtype '<u2'",
        ),
        bad_npy(
            "npy: float64",
            |d| {
                d.write(
                    "bad.npy",
                    &npy(1, &npy_dict("<f8", false, &SHAPE), &vec![0; N_Q * 8]),
                )
            },
            "unsupported dtype '<f8'",
        ),
        bad_npy(
            "npy: big-endian",
            |d| {
                d.write(
                    "bad.npy",
                    &npy(1, &npy_dict(">f2", false, &SHAPE), &f16_bytes(N_Q, 1)),
                )
            },
            "big-endian",
        ),
        bad_npy(
            "npy: Fortran order",
            |d| {
                d.write(
                    "bad.npy",
                    &npy(1, &npy_dict("<f2", true, &SHAPE), &f16_bytes(N_Q, 1)),
                )
            },
            "Fortran-order",
        ),
        bad_npy(
            "npy: huge header length",
            |d| {
                let mut b = b"\x93NUMPY\x02\x00".to_vec();
                b.extend_from_slice(&u32::MAX.to_le_bytes());
                d.write("bad.npy", &b)
            },
            "exceeds the limit",
        ),
        bad_npy(
            "npy: header not a dict",
            |d| d.write("bad.npy", &npy(1, "{'descr': <f2, oops", &[])),
            "bad .npy header",
        ),
        bad_npy(
            "npy: data cut short",
            |d| {
                d.write(
                    "bad.npy",
                    &npy(1, &npy_dict("<f2", false, &SHAPE), &f16_bytes(N_Q - 1, 1)),
                )
            },
            "truncated",
        ),
        bad_npy(
            "npy: trailing data",
            |d| {
                d.write(
                    "bad.npy",
                    &npy(1, &npy_dict("<f2", false, &SHAPE), &f16_bytes(N_Q + 1, 1)),
                )
            },
            "unexpected bytes",
        ),
        bad_npy(
            "npy: 2^40 elements declared, none present",
            |d| {
                d.write(
                    "bad.npy",
                    &npy(
                        1,
                        &npy_dict("<f2", false, &[1 << 10, 1 << 10, 1 << 10, 1 << 10]),
                        &[],
                    ),
                )
            },
            "truncated",
        ),
        bad_npy(
            "npy: shape overflows",
            |d| {
                d.write(
                    "bad.npy",
                    &npy(1, &npy_dict("<f2", false, &[usize::MAX, 2, 1, 1]), &[]),
                )
            },
            "overflows",
        ),
        bad(
            "/dev/zero as .npy input",
            none,
            &["--npy", "/dev/zero", "k.npy", "v.npy", "--cpu"],
            "bad magic",
        ),
        // --- shapes and values (CPU backend) ---
        bad_st(
            "K and V shapes differ",
            |d| {
                d.write(
                    "bad.safetensors",
                    &qkv_file(&SHAPE, &KV_SHAPE, &[1, 9, 1, 16]),
                )
            },
            "must have the same shape",
        ),
        bad_st(
            "batch differs",
            |d| {
                d.write(
                    "bad.safetensors",
                    &qkv_file(&SHAPE, &[2, 8, 1, 16], &[2, 8, 1, 16]),
                )
            },
            "batch",
        ),
        bad_st(
            "head dim differs",
            |d| {
                d.write(
                    "bad.safetensors",
                    &qkv_file(&SHAPE, &[1, 8, 1, 8], &[1, 8, 1, 8]),
                )
            },
            "head dim",
        ),
        bad_st(
            "GQA ratio",
            |d| {
                d.write(
                    "bad.safetensors",
                    &qkv_file(&[1, 8, 3, 16], &[1, 8, 2, 16], &[1, 8, 2, 16]),
                )
            },
            "GQA",
        ),
        bad_st(
            "zero heads of K",
            |d| {
                d.write(
                    "bad.safetensors",
                    &qkv_file(&SHAPE, &[1, 8, 0, 16], &[1, 8, 0, 16]),
                )
            },
            "heads_kv is 0",
        ),
        bad_st(
            "empty batch",
            |d| {
                d.write(
                    "bad.safetensors",
                    &qkv_file(&[0, 8, 2, 16], &[0, 8, 1, 16], &[0, 8, 1, 16]),
                )
            },
            "batch is 0",
        ),
        bad_st(
            "head dim 0",
            |d| {
                d.write(
                    "bad.safetensors",
                    &qkv_file(&[1, 8, 2, 0], &[1, 8, 1, 0], &[1, 8, 1, 0]),
                )
            },
            "head dim is 0",
        ),
        bad(
            "bf16 with --npy-out",
            |d| {
                d.write(
                    "bf.safetensors",
                    &safetensors(&[
                        ("q", Dtype::BF16, &SHAPE, f16_bytes(N_Q, 1)),
                        ("k", Dtype::BF16, &KV_SHAPE, f16_bytes(N_KV, 2)),
                        ("v", Dtype::BF16, &KV_SHAPE, f16_bytes(N_KV, 3)),
                    ]),
                )
            },
            &["bf.safetensors", "--cpu", "--npy-out", "o.npy", "lse.npy"],
            "no .npy dtype",
        ),
        bad(
            "-o /dev/full: the write fails",
            none,
            &[st, "--cpu", "-o", "/dev/full"],
            "No space left",
        ),
        // --- backward ---
        bad(
            "--backward without `do`",
            none,
            &[st, "--backward"],
            "no tensor `do`",
        ),
        bad(
            "--backward with a missing --do name",
            |d| d.write("bwd.safetensors", &qkvdo_file(&SHAPE, Dtype::F16)),
            &["bwd.safetensors", "--backward", "--do", "grad"],
            "no tensor `grad`",
        ),
        bad(
            "--backward, `do` of the wrong shape",
            |d| d.write("bwd.safetensors", &qkvdo_file(&[1, 8, 2, 8], Dtype::F16)),
            &["bwd.safetensors", "--backward"],
            "dO is [1, 8, 2, 8], expected [1, 8, 2, 16]",
        ),
        bad(
            "--backward, `do` of rank 3",
            |d| d.write("bwd.safetensors", &qkvdo_file(&[1, 8, 32], Dtype::F16)),
            &["bwd.safetensors", "--backward"],
            "tensor `do` must have rank 4",
        ),
        bad(
            "--backward, `do` of another dtype",
            |d| d.write("bwd.safetensors", &qkvdo_file(&SHAPE, Dtype::BF16)),
            &["bwd.safetensors", "--backward"],
            "`do` is BF16",
        ),
        bad(
            "--backward with --npy",
            none,
            &["--npy", "q.npy", "k.npy", "v.npy", "--backward"],
            ".npy input is not supported for the backward pass",
        ),
        bad(
            "--backward with --npy-out",
            |d| d.write("bwd.safetensors", &qkvdo_file(&SHAPE, Dtype::F16)),
            &[
                "bwd.safetensors",
                "--backward",
                "--npy-out",
                "a.npy",
                "b.npy",
            ],
            "--npy-out is not supported for the backward pass",
        ),
        bad(
            "--do without --backward",
            none,
            &[st, "--do", "x"],
            "--backward",
        ),
        bad(
            "--backward, -o is the input",
            |d| d.write("bwd.safetensors", &qkvdo_file(&SHAPE, Dtype::F16)),
            &["bwd.safetensors", "--backward", "-o", "bwd.safetensors"],
            "same file as input",
        ),
        row(
            "--backward --deterministic writes the gradients",
            |d| d.write("bwd.safetensors", &qkvdo_file(&SHAPE, Dtype::F16)),
            &["bwd.safetensors", "--backward", "--deterministic", "--cpu"],
            Succeeds("backend: CPU (--cpu)"),
        ),
        // --- dropout ---
        bad(
            "--dropout 1",
            none,
            &[st, "--cpu", "--dropout", "1"],
            "`1` is not a dropout probability in [0, 1)",
        ),
        bad(
            "--dropout -0.1",
            none,
            &[st, "--cpu", "--dropout", "-0.1"],
            "`-0.1` is not a dropout probability in [0, 1)",
        ),
        bad(
            "--dropout nan",
            none,
            &[st, "--cpu", "--dropout", "nan"],
            "`nan` is not a dropout probability in [0, 1)",
        ),
        bad(
            "--dropout inf",
            none,
            &[st, "--cpu", "--dropout", "inf"],
            "`inf` is not a dropout probability in [0, 1)",
        ),
        bad(
            "--dropout not a number",
            none,
            &[st, "--cpu", "--dropout", "half"],
            "`half` is not a dropout probability",
        ),
        bad(
            "--dropout without value",
            none,
            &[st, "--cpu", "--dropout"],
            "a value is required",
        ),
        bad(
            "--seed without --dropout",
            none,
            &[st, "--cpu", "--seed", "1"],
            "--dropout <P>",
        ),
        bad(
            "--offset without --dropout",
            none,
            &[st, "--cpu", "--offset", "1"],
            "--dropout <P>",
        ),
        bad(
            "--return-dropout-mask without --dropout",
            none,
            &[st, "--cpu", "--return-dropout-mask"],
            "--dropout <P>",
        ),
        bad(
            "--seed not a u64",
            none,
            &[st, "--cpu", "--dropout", "0.1", "--seed", "1.5"],
            "invalid value '1.5' for '--seed <S>'",
        ),
        bad(
            "--seed negative",
            none,
            &[st, "--cpu", "--dropout", "0.1", "--seed", "-1"],
            "unexpected argument '-1'",
        ),
        bad(
            "--decode --dropout",
            none,
            &[st, "--decode", "--cpu", "--dropout", "0.1"],
            "'--decode' cannot be used with '--dropout <P>'",
        ),
        bad(
            "--decode --return-dropout-mask",
            none,
            &[st, "--decode", "--dropout", "0.1", "--return-dropout-mask"],
            "cannot be used with",
        ),
        bad(
            "--return-dropout-mask with a varlen batch",
            |d| d.write("varlen.safetensors", &varlen_file()),
            &[
                "varlen.safetensors",
                "--cpu",
                "--dropout",
                "0.1",
                "--return-dropout-mask",
            ],
            "--return-dropout-mask writes the mask of a padded batch, [B, Hq, Nq, Nk]; it is not supported with a varlen batch",
        ),
        bad(
            "--backward --return-dropout-mask with a varlen batch",
            |d| d.write("varlen.safetensors", &varlen_file()),
            &[
                "varlen.safetensors",
                "--backward",
                "--dropout",
                "0.1",
                "--return-dropout-mask",
            ],
            "not supported with a varlen batch",
        ),
        row(
            "a varlen batch takes dropout",
            |d| d.write("varlen.safetensors", &varlen_file()),
            &["varlen.safetensors", "--cpu", "--dropout", "0.1"],
            Succeeds("dropout 0.1 (seed 0, offset 0)"),
        ),
        row(
            "dropout with its mask",
            none,
            &[
                st,
                "--cpu",
                "--dropout",
                "0.5",
                "--seed",
                "3",
                "--offset",
                "18446744073709551615",
                "--return-dropout-mask",
            ],
            Succeeds("dropout 0.5 (seed 3, offset 18446744073709551615)"),
        ),
        row(
            "--backward with dropout and its mask",
            |d| d.write("bwd.safetensors", &qkvdo_file(&SHAPE, Dtype::F16)),
            &[
                "bwd.safetensors",
                "--backward",
                "--cpu",
                "--dropout",
                "0.1",
                "--return-dropout-mask",
            ],
            Succeeds("F16 dropout 0.1 (seed 0, offset 0)"),
        ),
        row(
            "--dropout 0 is no dropout",
            none,
            &[st, "--cpu", "--dropout", "0"],
            Succeeds("wrote out.safetensors"),
        ),
        // --- documented results ---
        row(
            "negative --scale is a scale",
            none,
            &[st, "--cpu", "--scale", "-0.5"],
            Succeeds("wrote out.safetensors"),
        ),
        row(
            "NaN in Q propagates to O and LSE",
            |d| {
                let mut b = f16_bytes(N_Q, 1);
                b[0..2].copy_from_slice(&f16::NAN.to_le_bytes());
                let n = |s: &[usize]| s.iter().product::<usize>();
                d.write(
                    "in.safetensors",
                    &safetensors(&[
                        ("q", Dtype::F16, &SHAPE, b),
                        ("k", Dtype::F16, &KV_SHAPE, f16_bytes(n(&KV_SHAPE), 2)),
                        ("v", Dtype::F16, &KV_SHAPE, f16_bytes(n(&KV_SHAPE), 3)),
                    ]),
                )
            },
            &[st, "--cpu"],
            Succeeds("wrote out.safetensors"),
        ),
        row(
            "Q, K and V from one .npy file",
            none,
            &[
                "--npy",
                "k.npy",
                "k.npy",
                "k.npy",
                "--cpu",
                "--npy-out",
                "o.npy",
                "lse.npy",
            ],
            Succeeds("wrote o.npy and lse.npy"),
        ),
        row(
            "-o /dev/null writes through",
            none,
            &[st, "--cpu", "-o", "/dev/null"],
            Succeeds("wrote /dev/null"),
        ),
    ];
    #[cfg(unix)]
    {
        rows.push(Row {
            name: "non-UTF-8 input path",
            setup: none,
            args: vec![non_utf8(b"in"), "--cpu".into()],
            expect: Fails("No such file"),
        });
        rows.push(Row {
            name: "non-UTF-8 tensor name",
            setup: none,
            args: vec![st.into(), "--q".into(), non_utf8(b"q")],
            expect: Fails("invalid UTF-8"),
        });
        rows.push(Row {
            name: "non-UTF-8 option",
            setup: none,
            args: vec![st.into(), non_utf8(b"--")],
            expect: Fails("unexpected argument"),
        });
    }
    rows
}

#[cfg(unix)]
fn symlink(d: &Dir, target: &str, link: &str) {
    std::os::unix::fs::symlink(d.path(target), d.path(link)).unwrap();
}

#[cfg(not(unix))]
fn symlink(d: &Dir, target: &str, link: &str) {
    std::fs::copy(d.path(target), d.path(link)).unwrap();
}

fn set_readonly(path: &Path) {
    let mut perms = std::fs::metadata(path).unwrap().permissions();
    perms.set_readonly(true);
    std::fs::set_permissions(path, perms).unwrap();
}

#[test]
fn bad_inputs_table() {
    let rows = rows();
    assert!(rows.len() >= 40, "the table has {} rows", rows.len());
    let mut failures = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let dir = Dir::new(&i.to_string());
        std::fs::create_dir(dir.path("sub")).unwrap();
        populate(&dir);
        (row.setup)(&dir);
        let before = snapshot(&dir.0);
        let out = Command::new(cli())
            .args(&row.args)
            .current_dir(&dir.0)
            .output()
            .expect("run flash-attn-cli");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let after = snapshot(&dir.0);
        let mut problems = Vec::new();
        if stderr.contains("panicked") {
            problems.push("panicked".to_string());
        }
        match row.expect {
            Expect::Fails(msg) => {
                if out.status.code() != Some(1) {
                    problems.push(format!("exit status {:?}, expected 1", out.status.code()));
                }
                if !stderr.contains(msg) {
                    problems.push(format!("stderr lacks {msg:?}"));
                }
                if before != after {
                    let changed: Vec<_> = before
                        .keys()
                        .chain(after.keys())
                        .filter(|k| before.get(*k) != after.get(*k))
                        .collect();
                    problems.push(format!("the directory changed: {changed:?}"));
                }
            }
            Expect::Succeeds(msg) => {
                if !out.status.success() {
                    problems.push(format!("exit status {:?}, expected 0", out.status.code()));
                }
                if !stderr.contains(msg) {
                    problems.push(format!("stderr lacks {msg:?}"));
                }
                let stray: Vec<_> = after
                    .keys()
                    .filter(|k| k.to_string_lossy().ends_with(".tmp"))
                    .collect();
                if !stray.is_empty() {
                    problems.push(format!("temporary files left: {stray:?}"));
                }
            }
        }
        if !problems.is_empty() {
            failures.push(format!(
                "row {i} `{}` {:?}: {}\n  stderr: {}",
                row.name,
                row.args,
                problems.join("; "),
                stderr.trim()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
}

/// A successful run replaces an earlier output (through its temporary file) and keeps the
/// file's mode; a symlinked output has its target replaced, not the link.
#[test]
fn success_replaces_outputs_in_place() {
    let dir = Dir::new("ok");
    populate(&dir);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            dir.path("out.safetensors"),
            std::fs::Permissions::from_mode(0o640),
        )
        .unwrap();
        symlink(&dir, "o.npy", "o-link.npy");
    }
    let out = Command::new(cli())
        .args([
            "in.safetensors",
            "--cpu",
            "--npy-out",
            "o-link.npy",
            "lse.npy",
        ])
        .current_dir(&dir.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st = std::fs::read(dir.path("out.safetensors")).unwrap();
    assert!(safetensors::SafeTensors::deserialize(&st).is_ok());
    assert!(std::fs::read(dir.path("o.npy"))
        .unwrap()
        .starts_with(b"\x93NUMPY"));
    assert!(std::fs::read(dir.path("lse.npy"))
        .unwrap()
        .starts_with(b"\x93NUMPY"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path("out.safetensors"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o640, "the earlier file's mode is kept");
        assert!(std::fs::symlink_metadata(dir.path("o-link.npy"))
            .unwrap()
            .file_type()
            .is_symlink());
    }
    let names: Vec<_> = snapshot(&dir.0).into_keys().collect();
    assert!(
        !names.iter().any(|n| n.to_string_lossy().ends_with(".tmp")),
        "{names:?}"
    );
}
