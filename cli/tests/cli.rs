//! End-to-end tests of the `flash-attn-cli` binary: write inputs to a temporary directory, run
//! the binary, read its safetensors (or .npy) output back and compare O and LSE with the
//! float64 reference.
//!
//! The binary is the one cargo built (`CARGO_BIN_EXE_flash-attn-cli`); in the GPU bundle,
//! where that path does not exist, it is `bin/flash-attn-cli` next to the `tests/` directory,
//! and `FLASH_ATTN_CLI` overrides both.

use flash_attn::cpu::{attention_cpu, attention_reference, gather_sequence};
use flash_attn::AttnParams;
use half::{bf16, f16};
use ndarray::{s, Array2, Array3, Array4, ArrayD, IxDyn};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

mod common;
use common::cli;

/// A fresh, empty directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "flash-attn-cli-{tag}-{}-{nanos}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic values in [-2, 2).
fn random(n: usize, seed: u64) -> Vec<f32> {
    flash_attn_cli::sample::uniform(n, seed, -2.0, 2.0)
}

/// Element types the tests write: safetensors dtype and little-endian bytes.
trait Elem: Copy {
    const DTYPE: Dtype;
    fn from_f32(x: f32) -> Self;
    fn to_f64(self) -> f64;
    fn le(self) -> Vec<u8>;
    fn from_le(b: &[u8]) -> Self;
}

impl Elem for f16 {
    const DTYPE: Dtype = Dtype::F16;
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn le(self) -> Vec<u8> {
        self.to_bits().to_le_bytes().to_vec()
    }
    fn from_le(b: &[u8]) -> Self {
        f16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl Elem for bf16 {
    const DTYPE: Dtype = Dtype::BF16;
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn le(self) -> Vec<u8> {
        self.to_bits().to_le_bytes().to_vec()
    }
    fn from_le(b: &[u8]) -> Self {
        bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl Elem for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn le(self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }
    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

/// Random Q `[b, nq, hq, d]`, K and V `[b, nk, hkv, d]` in `T`.
struct Qkv<T> {
    q: Array4<T>,
    k: Array4<T>,
    v: Array4<T>,
}

fn random_qkv<T: Elem>(b: usize, nq: usize, nk: usize, hq: usize, hkv: usize, d: usize) -> Qkv<T> {
    let make = |dims: [usize; 4], seed| {
        let n = dims.iter().product();
        Array4::from_shape_vec(dims, random(n, seed).into_iter().map(T::from_f32).collect())
            .unwrap()
    };
    Qkv {
        q: make([b, nq, hq, d], 1),
        k: make([b, nk, hkv, d], 2),
        v: make([b, nk, hkv, d], 3),
    }
}

fn bytes_of<T: Elem>(a: &Array4<T>) -> Vec<u8> {
    a.iter().flat_map(|x| x.le()).collect()
}

/// Writes tensors (name, array) to a safetensors file.
fn write_safetensors<T: Elem>(path: &Path, tensors: &[(&str, &Array4<T>)]) {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, a)| bytes_of(a)).collect();
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, a), b)| {
            (
                *name,
                TensorView::new(T::DTYPE, a.shape().to_vec(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// Writes a C-order .npy file (format 1.0).
fn write_npy<T: Elem>(path: &Path, descr: &str, a: &Array4<T>) {
    let s = a.shape();
    let mut header = format!(
        "{{'descr': '{descr}', 'fortran_order': False, 'shape': ({}, {}, {}, {}), }}",
        s[0], s[1], s[2], s[3]
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&bytes_of(a));
    std::fs::write(path, out).unwrap();
}

/// Reads a .npy file written by the CLI: (descr, shape, data bytes).
fn read_npy(path: &Path) -> (String, Vec<usize>, Vec<u8>) {
    let b = std::fs::read(path).unwrap();
    assert!(b.starts_with(b"\x93NUMPY\x01\x00"), "not a v1 .npy file");
    let end = 10 + u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!(end % 64, 0, "data must start on a 64-byte boundary");
    let header = std::str::from_utf8(&b[10..end]).unwrap();
    let descr = header.split('\'').nth(3).unwrap().to_string();
    assert!(header.contains("'fortran_order': False"));
    let shape_text = header.split('(').nth(1).unwrap().split(')').next().unwrap();
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    (descr, shape, b[end..].to_vec())
}

/// Runs the CLI with `args`.
fn run(args: &[&str]) -> Output {
    let out = Command::new(cli())
        .args(args)
        .output()
        .expect("run flash-attn-cli");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "the CLI panicked:\n{stderr}");
    out
}

fn run_ok(args: &[&str]) -> String {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "flash-attn-cli {args:?} failed:\n{stderr}"
    );
    stderr
}

fn run_err(args: &[&str]) -> String {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected exit 1 from {args:?}, stderr:\n{stderr}"
    );
    assert!(stderr.contains("error"), "no error message:\n{stderr}");
    stderr
}

/// Reads `o` (as `T`) and `lse` (f32) from the CLI's output file, checking dtypes and shapes.
fn read_output<T: Elem>(path: &Path) -> (ArrayD<f64>, ArrayD<f64>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let o = st.tensor("o").unwrap();
    let lse = st.tensor("lse").unwrap();
    assert_eq!(o.dtype(), T::DTYPE, "o must have the input dtype");
    assert_eq!(lse.dtype(), Dtype::F32, "lse must be f32");
    let decode = |v: &TensorView, size: usize, f: &dyn Fn(&[u8]) -> f64| {
        let data: Vec<f64> = v.data().chunks_exact(size).map(f).collect();
        ArrayD::from_shape_vec(IxDyn(v.shape()), data).unwrap()
    };
    let size = T::le(T::from_f32(0.0)).len();
    (
        decode(&o, size, &|b| T::from_le(b).to_f64()),
        decode(&lse, 4, &|b| f64::from(<f32 as Elem>::from_le(b))),
    )
}

/// Checks O and LSE against the float64 reference on the same (rounded) inputs.
fn check_against_reference<T: Elem>(
    qkv: &Qkv<T>,
    params: &AttnParams,
    o: &ArrayD<f64>,
    lse: &ArrayD<f64>,
    tol: f64,
) {
    let up = |a: &Array4<T>| a.mapv(Elem::to_f64);
    let (q, k, v) = (up(&qkv.q), up(&qkv.k), up(&qkv.v));
    let (o_ref, lse_ref): (Array4<f64>, Array3<f64>) =
        attention_reference(q.view(), k.view(), v.view(), params).unwrap();
    assert_eq!(o.shape(), o_ref.shape(), "o shape");
    assert_eq!(lse.shape(), lse_ref.shape(), "lse shape");
    let max_err = |a: &ArrayD<f64>, b: &[f64]| {
        a.iter().zip(b).fold(0.0f64, |m, (&x, &y)| {
            if y.is_infinite() || x.is_infinite() {
                assert_eq!(x, y, "infinite LSE must match exactly");
                m
            } else {
                assert!(x.is_finite(), "non-finite output {x}");
                m.max((x - y).abs())
            }
        })
    };
    let o_err = max_err(o, o_ref.as_slice().unwrap());
    let lse_err = max_err(lse, lse_ref.as_slice().unwrap());
    assert!(o_err <= tol, "max |O - ref| = {o_err} > {tol}");
    assert!(lse_err <= tol, "max |LSE - ref| = {lse_err} > {tol}");
}

#[test]
fn f16_safetensors_cpu_matches_reference() {
    let dir = TempDir::new("f16");
    let qkv = random_qkv::<f16>(2, 37, 53, 4, 2, 40);
    let input = dir.path("in.safetensors");
    let output = dir.path("out.safetensors");
    write_safetensors(&input, &[("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v)]);
    let stderr = run_ok(&[
        input.to_str().unwrap(),
        "--cpu",
        "--causal",
        "--scale",
        "0.3",
        "-o",
        output.to_str().unwrap(),
    ]);
    assert!(
        stderr.contains("backend: CPU"),
        "backend not reported:\n{stderr}"
    );
    let (o, lse) = read_output::<f16>(&output);
    let params = AttnParams {
        causal: true,
        softmax_scale: Some(0.3),
        ..AttnParams::default()
    };
    check_against_reference(&qkv, &params, &o, &lse, 2e-2);
}

#[test]
fn bf16_custom_names() {
    let dir = TempDir::new("bf16");
    let qkv = random_qkv::<bf16>(1, 19, 19, 2, 1, 64);
    let input = dir.path("in.safetensors");
    let output = dir.path("out.safetensors");
    write_safetensors(
        &input,
        &[("query", &qkv.q), ("key", &qkv.k), ("value", &qkv.v)],
    );
    run_ok(&[
        input.to_str().unwrap(),
        "--cpu",
        "--q",
        "query",
        "--k",
        "key",
        "--v",
        "value",
        "-o",
        output.to_str().unwrap(),
    ]);
    let (o, lse) = read_output::<bf16>(&output);
    check_against_reference(&qkv, &AttnParams::default(), &o, &lse, 5e-2);
}

/// f32 inputs run on the CPU even without `--cpu`, and the CLI says so. Causal with more
/// queries than keys: the first rows see no key (O = 0, LSE = −∞).
#[test]
fn f32_uses_cpu_automatically() {
    let dir = TempDir::new("f32");
    let qkv = random_qkv::<f32>(1, 20, 9, 3, 3, 16);
    let input = dir.path("in.safetensors");
    let output = dir.path("out.safetensors");
    write_safetensors(&input, &[("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v)]);
    let stderr = run_ok(&[
        input.to_str().unwrap(),
        "--causal",
        "-o",
        output.to_str().unwrap(),
    ]);
    assert!(stderr.contains("backend: CPU (f32"), "stderr:\n{stderr}");
    let (o, lse) = read_output::<f32>(&output);
    let params = AttnParams {
        causal: true,
        softmax_scale: None,
        ..AttnParams::default()
    };
    check_against_reference(&qkv, &params, &o, &lse, 1e-4);
    assert!(lse.iter().any(|x| *x == f64::NEG_INFINITY));
}

/// Without `--cpu`, f16 runs on the GPU when there is one (and must, under
/// `FLASH_ATTN_REQUIRE_GPU=1`), on the CPU otherwise; both agree with the reference.
#[test]
fn f16_default_backend_matches_reference() {
    let dir = TempDir::new("auto");
    let qkv = random_qkv::<f16>(2, 130, 77, 8, 2, 64);
    let input = dir.path("in.safetensors");
    let output = dir.path("out.safetensors");
    write_safetensors(&input, &[("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v)]);
    let stderr = run_ok(&[input.to_str().unwrap(), "-o", output.to_str().unwrap()]);
    let on_gpu = stderr.contains("backend: GPU");
    assert!(
        on_gpu || stderr.contains("backend: CPU"),
        "stderr:\n{stderr}"
    );
    if std::env::var("FLASH_ATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        assert!(
            on_gpu,
            "FLASH_ATTN_REQUIRE_GPU=1 but the CLI ran on the CPU:\n{stderr}"
        );
    }
    let (o, lse) = read_output::<f16>(&output);
    check_against_reference(&qkv, &AttnParams::default(), &o, &lse, 2e-2);
}

#[test]
fn npy_inputs_and_outputs() {
    let dir = TempDir::new("npy");
    let qkv = random_qkv::<f16>(1, 33, 33, 2, 2, 32);
    let [q, k, v] = ["q.npy", "k.npy", "v.npy"].map(|n| dir.path(n));
    write_npy(&q, "<f2", &qkv.q);
    write_npy(&k, "<f2", &qkv.k);
    write_npy(&v, "<f2", &qkv.v);
    let output = dir.path("out.safetensors");
    let (o_npy, lse_npy) = (dir.path("o.npy"), dir.path("lse.npy"));
    let p = |p: &PathBuf| p.to_str().unwrap().to_owned();
    run_ok(&[
        "--npy",
        &p(&q),
        &p(&k),
        &p(&v),
        "--cpu",
        "--causal",
        "-o",
        &p(&output),
        "--npy-out",
        &p(&o_npy),
        &p(&lse_npy),
    ]);
    let (o, lse) = read_output::<f16>(&output);
    let params = AttnParams {
        causal: true,
        softmax_scale: None,
        ..AttnParams::default()
    };
    check_against_reference(&qkv, &params, &o, &lse, 2e-2);

    let (descr, shape, data) = read_npy(&o_npy);
    assert_eq!((descr.as_str(), shape.as_slice()), ("<f2", o.shape()));
    let o2: Vec<f64> = data
        .chunks_exact(2)
        .map(|b| <f16 as Elem>::from_le(b).to_f64())
        .collect();
    assert_eq!(o2, o.iter().copied().collect::<Vec<_>>());
    let (descr, shape, data) = read_npy(&lse_npy);
    assert_eq!((descr.as_str(), shape.as_slice()), ("<f4", lse.shape()));
    let lse2: Vec<f64> = data
        .chunks_exact(4)
        .map(|b| f64::from(<f32 as Elem>::from_le(b)))
        .collect();
    assert_eq!(lse2, lse.iter().copied().collect::<Vec<_>>());
}

#[test]
fn missing_tensor_is_an_error() {
    let dir = TempDir::new("missing");
    let qkv = random_qkv::<f16>(1, 8, 8, 1, 1, 16);
    let input = dir.path("in.safetensors");
    write_safetensors(&input, &[("q", &qkv.q), ("k", &qkv.k)]);
    let output = dir.path("out.safetensors");
    let stderr = run_err(&[
        input.to_str().unwrap(),
        "--cpu",
        "-o",
        output.to_str().unwrap(),
    ]);
    assert!(stderr.contains("`v`"), "stderr:\n{stderr}");
    assert!(!output.exists(), "no output may be written on error");
    let stderr = run_err(&[input.to_str().unwrap(), "--cpu", "--v", "values"]);
    assert!(stderr.contains("values"), "stderr:\n{stderr}");
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let dir = TempDir::new("bad");
    let qkv = random_qkv::<f16>(1, 8, 8, 2, 1, 16);
    let good = dir.path("good.safetensors");
    write_safetensors(&good, &[("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v)]);
    let good = good.to_str().unwrap();

    // Not a safetensors file; a file that does not exist.
    let junk = dir.path("junk.safetensors");
    std::fs::write(&junk, b"definitely not safetensors").unwrap();
    run_err(&[junk.to_str().unwrap(), "--cpu"]);
    run_err(&[dir.path("nope.safetensors").to_str().unwrap(), "--cpu"]);

    // Mixed dtypes; K and V of different shapes; GQA ratio; rank 3.
    let mixed = dir.path("mixed.safetensors");
    let k32 = qkv.k.mapv(|x| x.to_f32());
    let q32 = qkv.q.mapv(|x| x.to_f32());
    let v32 = qkv.v.mapv(|x| x.to_f32());
    {
        // An f32 K alongside f16 Q and V.
        let bytes_q = bytes_of(&qkv.q);
        let bytes_k = bytes_of(&k32);
        let bytes_v = bytes_of(&qkv.v);
        let views = vec![
            (
                "q",
                TensorView::new(Dtype::F16, qkv.q.shape().to_vec(), &bytes_q).unwrap(),
            ),
            (
                "k",
                TensorView::new(Dtype::F32, k32.shape().to_vec(), &bytes_k).unwrap(),
            ),
            (
                "v",
                TensorView::new(Dtype::F16, qkv.v.shape().to_vec(), &bytes_v).unwrap(),
            ),
        ];
        std::fs::write(&mixed, safetensors::serialize(views, None).unwrap()).unwrap();
    }
    assert!(run_err(&[mixed.to_str().unwrap(), "--cpu"]).contains("dtype"));

    let other = random_qkv::<f16>(1, 8, 9, 2, 1, 16);
    let kv_mismatch = dir.path("kv.safetensors");
    write_safetensors(
        &kv_mismatch,
        &[("q", &qkv.q), ("k", &qkv.k), ("v", &other.v)],
    );
    run_err(&[kv_mismatch.to_str().unwrap()]);

    let gqa = random_qkv::<f16>(1, 8, 8, 3, 2, 16);
    let gqa_path = dir.path("gqa.safetensors");
    write_safetensors(&gqa_path, &[("q", &gqa.q), ("k", &gqa.k), ("v", &gqa.v)]);
    assert!(run_err(&[gqa_path.to_str().unwrap()]).contains("GQA"));

    let rank3 = dir.path("rank3.safetensors");
    let b = bytes_of(&qkv.q);
    let view = TensorView::new(Dtype::F16, vec![8, 2, 16], &b).unwrap();
    std::fs::write(
        &rank3,
        safetensors::serialize(
            vec![("q", view.clone()), ("k", view.clone()), ("v", view)],
            None,
        )
        .unwrap(),
    )
    .unwrap();
    assert!(run_err(&[rank3.to_str().unwrap(), "--cpu"]).contains("rank 4"));

    // Unsupported .npy dtype and layout.
    let npy = dir.path("q.npy");
    write_npy(&npy, "<f4", &q32);
    let npy_k = dir.path("k.npy");
    write_npy(&npy_k, "<f4", &k32);
    let npy_v = dir.path("v.npy");
    write_npy(&npy_v, "<f8", &v32); // wrong descr for the data
    let p = |p: &PathBuf| p.to_str().unwrap().to_owned();
    assert!(run_err(&["--npy", &p(&npy), &p(&npy_k), &p(&npy_v)]).contains("'<f8'"));

    // Bad arguments.
    run_err(&[]);
    run_err(&[good, "--scale", "x"]);
    run_err(&[good, "--scale", "nan"]);
    run_err(&[good, "--frobnicate"]);
    run_err(&[good, "-o"]);
    // bf16 has no .npy dtype.
    let bf = random_qkv::<bf16>(1, 4, 4, 1, 1, 8);
    let bf_path = dir.path("bf.safetensors");
    write_safetensors(&bf_path, &[("q", &bf.q), ("k", &bf.k), ("v", &bf.v)]);
    let o_npy = dir.path("o.npy");
    let l_npy = dir.path("l.npy");
    run_err(&[
        bf_path.to_str().unwrap(),
        "--cpu",
        "--npy-out",
        &p(&o_npy),
        &p(&l_npy),
    ]);

    // --help succeeds.
    let out = run(&["--help"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("--npy"));
}

/// Reads tensor `name` of the CLI's output, checking its dtype, as f64.
fn read_tensor<T: Elem>(path: &Path, name: &str, dtype: Dtype) -> ArrayD<f64> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), dtype, "{name}: dtype");
    let size = if dtype == Dtype::F32 { 4 } else { 2 };
    let data: Vec<f64> = t
        .data()
        .chunks_exact(size)
        .map(|b| {
            if dtype == Dtype::F32 {
                f64::from(<f32 as Elem>::from_le(b))
            } else {
                T::from_le(b).to_f64()
            }
        })
        .collect();
    ArrayD::from_shape_vec(IxDyn(t.shape()), data).unwrap()
}

/// `--backward` writes o, lse, dq, dk, dv equal (bit for bit) to the library's CPU forward and
/// backward on the same inputs, with the input dtype and layouts.
fn backward_matches_library<T: Elem + flash_attn::Element>(causal: bool) {
    let dir = TempDir::new("bwd");
    let qkv = random_qkv::<T>(1, 13, 9, 4, 2, 12);
    let d_o = Array4::from_shape_vec(
        [1, 13, 4, 12],
        random(13 * 4 * 12, 4)
            .into_iter()
            .map(<T as Elem>::from_f32)
            .collect(),
    )
    .unwrap();
    let (input, output) = (dir.path("in.safetensors"), dir.path("grads.safetensors"));
    write_safetensors(
        &input,
        &[("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v), ("grad", &d_o)],
    );
    let mut args = vec![
        input.to_str().unwrap(),
        "--backward",
        "--cpu",
        "--do",
        "grad",
        "--scale",
        "-0.4",
        "-o",
        output.to_str().unwrap(),
    ];
    if causal {
        args.push("--causal");
    }
    let stderr = run_ok(&args);
    assert!(stderr.contains("backend: CPU (--cpu)"), "{stderr}");
    let params = AttnParams {
        causal,
        softmax_scale: Some(-0.4),
        ..AttnParams::default()
    };
    let (o, lse) =
        flash_attn::cpu::attention_cpu(qkv.q.view(), qkv.k.view(), qkv.v.view(), &params).unwrap();
    let (dq, dk, dv) = flash_attn::cpu::attention_backward_cpu(
        qkv.q.view(),
        qkv.k.view(),
        qkv.v.view(),
        o.view(),
        d_o.view(),
        lse.view(),
        &params,
    )
    .unwrap();
    let wide = |a: &Array4<T>| a.mapv(Elem::to_f64).into_dyn();
    let expected = [
        ("o", <T as Elem>::DTYPE, wide(&o)),
        ("lse", Dtype::F32, lse.mapv(f64::from).into_dyn()),
        ("dq", <T as Elem>::DTYPE, wide(&dq)),
        ("dk", <T as Elem>::DTYPE, wide(&dk)),
        ("dv", <T as Elem>::DTYPE, wide(&dv)),
    ];
    for (name, dtype, want) in expected {
        let got = read_tensor::<T>(&output, name, dtype);
        assert_eq!(got.shape(), want.shape(), "{name}: shape");
        let same = got.iter().zip(&want).all(|(a, b)| a == b);
        assert!(same, "{name}: the CLI's output differs from the library's");
    }
    assert!(wide(&dq).iter().any(|&x| x != 0.0), "dq is all zero");
}

#[test]
fn backward_writes_the_library_gradients() {
    backward_matches_library::<f32>(false);
    backward_matches_library::<bf16>(true);
    backward_matches_library::<f16>(true);
}

/// A tensor to write: name, dtype, shape and little-endian bytes.
type RawEntry = (String, Dtype, Vec<usize>, Vec<u8>);

/// Writes raw tensors to a safetensors file.
fn write_raw(path: &Path, tensors: &[RawEntry]) {
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                name.as_str(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// The inputs of one `--decode` call.
#[derive(Clone)]
struct DecodeCase<T> {
    q: Array4<T>,
    k_cache: Array4<T>,
    v_cache: Array4<T>,
    seqlens: Vec<i32>,
    block_table: Option<Array2<i32>>,
    new_kv: Option<(Array4<T>, Array4<T>)>,
}

/// An array of `dims` with deterministic values in [-2, 2).
fn random4<T: Elem>(dims: [usize; 4], seed: u64) -> Array4<T> {
    let n = dims.iter().product();
    Array4::from_shape_vec(dims, random(n, seed).into_iter().map(T::from_f32).collect()).unwrap()
}

/// B = 3 sequences holding 20, 0 and 30 keys, Nq = 2, Hq = 4, Hkv = 2, d = 16, and
/// `appended` new keys (0: none). Contiguous: capacity 40. Paged: 8 pages of 16, three table
/// slots per sequence, used slots scattered over the pages and unused ones −1.
fn decode_case<T: Elem>(paged: bool, appended: usize) -> DecodeCase<T> {
    let (batch, hkv, d) = (3, 2, 16);
    let cache_dims = if paged {
        [8, 16, hkv, d]
    } else {
        [batch, 40, hkv, d]
    };
    DecodeCase {
        q: random4([batch, 2, 4, d], 11),
        k_cache: random4(cache_dims, 12),
        v_cache: random4(cache_dims, 13),
        seqlens: vec![20, 0, 30],
        block_table: paged
            .then(|| Array2::from_shape_vec((3, 3), vec![5, 2, -1, 1, -1, -1, 0, 6, 3]).unwrap()),
        new_kv: (appended > 0).then(|| {
            (
                random4([batch, appended, hkv, d], 14),
                random4([batch, appended, hkv, d], 15),
            )
        }),
    }
}

/// The tensors of a decode input file.
fn decode_tensors<T: Elem>(case: &DecodeCase<T>) -> Vec<RawEntry> {
    let float =
        |name: &str, a: &Array4<T>| (name.to_string(), T::DTYPE, a.shape().to_vec(), bytes_of(a));
    let ints = |name: &str, shape: Vec<usize>, values: &mut dyn Iterator<Item = &i32>| {
        let bytes = values.flat_map(|x| x.to_le_bytes()).collect();
        (name.to_string(), Dtype::I32, shape, bytes)
    };
    let mut tensors = vec![
        float("q", &case.q),
        float("k_cache", &case.k_cache),
        float("v_cache", &case.v_cache),
        ints(
            "cache_seqlens",
            vec![case.seqlens.len()],
            &mut case.seqlens.iter(),
        ),
    ];
    if let Some(t) = &case.block_table {
        tensors.push(ints("block_table", t.shape().to_vec(), &mut t.iter()));
    }
    if let Some((k, v)) = &case.new_kv {
        tensors.push(float("k_new", k));
        tensors.push(float("v_new", v));
    }
    tensors
}

/// What `--decode` must write on the CPU: the caches with the new keys appended (by hand
/// here), and per sequence `attention_cpu` over the keys `gather_sequence` reads from them.
fn expected_decode<T: Elem + flash_attn::Element>(
    case: &DecodeCase<T>,
    params: &AttnParams,
) -> (Array4<T>, Array3<f32>, Array4<T>, Array4<T>) {
    let (mut k, mut v) = (case.k_cache.clone(), case.v_cache.clone());
    let appended = case.new_kv.as_ref().map_or(0, |(k, _)| k.dim().1);
    if let Some((k_new, v_new)) = &case.new_kv {
        for (b, &cached) in case.seqlens.iter().enumerate() {
            for t in 0..appended {
                let j = cached as usize + t;
                let (entry, row) = match &case.block_table {
                    None => (b, j),
                    Some(table) => (table[[b, j / 16]] as usize, j % 16),
                };
                k.slice_mut(s![entry, row, .., ..])
                    .assign(&k_new.slice(s![b, t, .., ..]));
                v.slice_mut(s![entry, row, .., ..])
                    .assign(&v_new.slice(s![b, t, .., ..]));
            }
        }
    }
    let (batch, nq, hq, d) = case.q.dim();
    let mut o = Array4::from_elem((batch, nq, hq, d), <T as Elem>::from_f32(0.0));
    let mut lse = Array3::from_elem((batch, hq, nq), f32::NEG_INFINITY);
    for (b, &cached) in case.seqlens.iter().enumerate() {
        let len = cached as usize + appended;
        if len == 0 {
            continue;
        }
        let table = case.block_table.as_ref().map(|t| t.view());
        let (kg, vg) = gather_sequence(k.view(), v.view(), table, b, len);
        let q_b = case.q.slice(s![b..b + 1, .., .., ..]);
        let (o_b, lse_b) = attention_cpu(q_b, kg.view(), vg.view(), params).unwrap();
        o.slice_mut(s![b..b + 1, .., .., ..]).assign(&o_b);
        lse.slice_mut(s![b..b + 1, .., ..]).assign(&lse_b);
    }
    (o, lse, k, v)
}

/// The output file's metadata.
fn output_metadata(path: &Path) -> std::collections::HashMap<String, String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone().unwrap_or_default()
}

/// Runs `--decode --cpu` on `case` and checks that the four outputs equal (bit for bit)
/// [`expected_decode`], and the metadata.
fn decode_matches_library<T: Elem + flash_attn::Element>(case: &DecodeCase<T>, causal: bool) {
    let dir = TempDir::new("decode");
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_raw(&input, &decode_tensors(case));
    let mut args = vec![
        input.to_str().unwrap(),
        "--decode",
        "--cpu",
        "--scale",
        "0.3",
        "-o",
        output.to_str().unwrap(),
    ];
    if causal {
        args.push("--causal");
    }
    let stderr = run_ok(&args);
    assert!(stderr.contains("backend: CPU (--cpu)"), "{stderr}");
    let params = AttnParams {
        causal,
        softmax_scale: Some(0.3),
        ..AttnParams::default()
    };
    let (o, lse, k, v) = expected_decode(case, &params);
    let wide = |a: &Array4<T>| a.mapv(Elem::to_f64).into_dyn();
    let expected = [
        ("o", <T as Elem>::DTYPE, wide(&o)),
        ("lse", Dtype::F32, lse.mapv(f64::from).into_dyn()),
        ("k_cache", <T as Elem>::DTYPE, wide(&k)),
        ("v_cache", <T as Elem>::DTYPE, wide(&v)),
    ];
    for (name, dtype, want) in expected {
        let got = read_tensor::<T>(&output, name, dtype);
        assert_eq!(got.shape(), want.shape(), "{name}: shape");
        let same = got.iter().zip(&want).all(|(a, b)| a == b);
        assert!(same, "{name}: the CLI's output differs from the library's");
    }
    // The caches changed exactly where keys were appended.
    let changed = wide(&k)
        .iter()
        .zip(&wide(&case.k_cache))
        .filter(|(a, b)| a != b)
        .count();
    let appended = case.new_kv.as_ref().map_or(0, |(k, _)| k.dim().1);
    assert_eq!(
        changed,
        3 * appended * 2 * 16,
        "rows written into the K cache"
    );
    // Sequence 1 without new keys sees nothing: O = 0, LSE = −∞.
    if appended == 0 {
        assert!(lse
            .slice(s![1, .., ..])
            .iter()
            .all(|&x| x == f32::NEG_INFINITY));
        assert!(wide(&o).slice(s![1, .., .., ..]).iter().all(|&x| x == 0.0));
    }
    let meta = output_metadata(&output);
    assert_eq!(meta.get("mode").map(String::as_str), Some("decode"));
    assert_eq!(meta.get("backend").map(String::as_str), Some("cpu"));
    assert_eq!(meta.get("causal"), Some(&causal.to_string()));
    assert_eq!(meta.get("softmax_scale").map(String::as_str), Some("0.3"));
}

#[test]
fn decode_contiguous_cache_on_the_cpu() {
    decode_matches_library(&decode_case::<f32>(false, 0), false);
    decode_matches_library(&decode_case::<f32>(false, 3), true);
    decode_matches_library(&decode_case::<bf16>(false, 1), true);
}

#[test]
fn decode_paged_cache_on_the_cpu() {
    decode_matches_library(&decode_case::<f16>(true, 0), true);
    decode_matches_library(&decode_case::<f16>(true, 3), false);
    decode_matches_library(&decode_case::<bf16>(true, 2), true);
    decode_matches_library(&decode_case::<f32>(true, 1), true);
}

/// Without `--cpu`, f16 decode runs on the GPU when there is one (and must, under
/// `FLASH_ATTN_REQUIRE_GPU=1`), with `--num-splits` honoured there; either way the caches are
/// updated exactly and O and LSE agree with the CPU backend's within f16 accuracy.
#[test]
fn decode_default_backend_matches_the_cpu() {
    let dir = TempDir::new("decode-auto");
    let case = decode_case::<f16>(true, 2);
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_raw(&input, &decode_tensors(&case));
    let out = output.to_str().unwrap();
    let stderr = run_ok(&[
        input.to_str().unwrap(),
        "--decode",
        "--causal",
        "--num-splits",
        "2",
        "-o",
        out,
    ]);
    let on_gpu = stderr.contains("backend: GPU");
    if std::env::var("FLASH_ATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        assert!(
            on_gpu,
            "FLASH_ATTN_REQUIRE_GPU=1 but the CLI ran on the CPU:\n{stderr}"
        );
    }
    if !on_gpu {
        assert!(stderr.contains("ignored on the CPU"), "{stderr}");
    }
    let params = AttnParams {
        causal: true,
        softmax_scale: None,
        ..AttnParams::default()
    };
    let (o, lse, k, v) = expected_decode(&case, &params);
    for (name, want) in [("k_cache", &k), ("v_cache", &v)] {
        let got = read_tensor::<f16>(&output, name, Dtype::F16);
        let want = want.mapv(Elem::to_f64).into_dyn();
        assert_eq!(got, want, "{name}");
    }
    let max_err = |got: ArrayD<f64>, want: ArrayD<f64>| {
        got.iter().zip(&want).fold(0.0f64, |m, (&a, &b)| {
            if a.is_infinite() || b.is_infinite() {
                assert_eq!(a, b, "infinite LSE must match exactly");
                m
            } else {
                m.max((a - b).abs())
            }
        })
    };
    let o_err = max_err(
        read_tensor::<f16>(&output, "o", Dtype::F16),
        o.mapv(Elem::to_f64).into_dyn(),
    );
    let lse_err = max_err(
        read_tensor::<f16>(&output, "lse", Dtype::F32),
        lse.mapv(f64::from).into_dyn(),
    );
    assert!(o_err <= 1e-2 && lse_err <= 1e-3, "O {o_err}, LSE {lse_err}");
    assert_eq!(
        output_metadata(&output).get("mode").map(String::as_str),
        Some("decode")
    );
}

/// Runs `--decode --cpu` on `tensors` and expects exit 1, no output file and an error
/// message containing every one of `texts`.
fn decode_fails(tensors: &[RawEntry], extra: &[&str], texts: &[&str]) {
    let dir = TempDir::new("decode-err");
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_raw(&input, tensors);
    let mut args = vec![
        input.to_str().unwrap(),
        "--decode",
        "--cpu",
        "-o",
        output.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let stderr = run_err(&args);
    for text in texts {
        assert!(stderr.contains(text), "expected {text:?} in:\n{stderr}");
    }
    assert!(!output.exists(), "no output may be written on error");
}

#[test]
fn decode_input_errors() {
    let paged = decode_case::<f16>(true, 2);
    let without = |case: &DecodeCase<f16>, name: &str| {
        let mut t = decode_tensors(case);
        t.retain(|(n, ..)| n != name);
        t
    };
    // Missing tensors; one of k_new and v_new alone.
    decode_fails(
        &without(&paged, "cache_seqlens"),
        &[],
        &["no tensor `cache_seqlens`", "--decode reads"],
    );
    decode_fails(&without(&paged, "k_cache"), &[], &["no tensor `k_cache`"]);
    decode_fails(&without(&paged, "v_new"), &[], &["`k_new` without `v_new`"]);
    decode_fails(&without(&paged, "k_new"), &[], &["`v_new` without `k_new`"]);
    // Without the block table, the paged cache is taken for a contiguous one of 8 entries.
    decode_fails(
        &without(&paged, "block_table"),
        &[],
        &["needs a block table"],
    );

    // A length beyond the capacity: 47 + 2 new keys > 3 pages of 16.
    let mut long = paged.clone();
    long.seqlens[2] = 47;
    decode_fails(
        &decode_tensors(&long),
        &[],
        &["cache_seqlens[2] = 47", "0..=46"],
    );
    let mut negative = decode_case::<f16>(false, 0);
    negative.seqlens[0] = -3;
    decode_fails(&decode_tensors(&negative), &[], &["cache_seqlens[0] = -3"]);
    let mut long = decode_case::<f32>(false, 0);
    long.seqlens[1] = 41;
    decode_fails(
        &decode_tensors(&long),
        &[],
        &["cache_seqlens[1] = 41", "0..=40"],
    );

    // A page index the lengths reach that is not a page; one they do not reach may be.
    let mut bad_page = paged.clone();
    bad_page.block_table.as_mut().unwrap()[[2, 1]] = 8;
    decode_fails(
        &decode_tensors(&bad_page),
        &[],
        &["block_table[2, 1] = 8 is not a page of the cache (0..8)"],
    );
    // Sequence 2 reaches 32 keys: its third slot is not read, whatever it holds.
    let mut unused = paged.clone();
    unused.block_table.as_mut().unwrap()[[2, 2]] = 1000;
    decode_matches_library(&unused, true);
    let mut bad_page = paged.clone();
    bad_page.block_table.as_mut().unwrap()[[1, 0]] = -2;
    decode_fails(&decode_tensors(&bad_page), &[], &["block_table[1, 0] = -2"]);

    // cache_seqlens (or block_table) of another dtype, rank or length.
    let mut tensors = decode_tensors(&paged);
    for t in tensors.iter_mut().filter(|t| t.0 == "cache_seqlens") {
        t.1 = Dtype::F32;
    }
    decode_fails(
        &tensors,
        &[],
        &["unsupported dtype F32", "cache_seqlens", "must be I32"],
    );
    let mut tensors = decode_tensors(&paged);
    for t in tensors.iter_mut().filter(|t| t.0 == "block_table") {
        t.1 = Dtype::I64;
        t.3.extend(std::iter::repeat_n(0u8, 36)); // 9 elements of 8 bytes
    }
    decode_fails(&tensors, &[], &["unsupported dtype I64", "block_table"]);
    let mut tensors = decode_tensors(&paged);
    for t in tensors.iter_mut().filter(|t| t.0 == "cache_seqlens") {
        t.2 = vec![1, 3];
    }
    decode_fails(&tensors, &[], &["cache_seqlens", "rank 1"]);
    let mut short = paged.clone();
    short.seqlens.pop();
    decode_fails(
        &decode_tensors(&short),
        &[],
        &["cache_seqlens is [2], expected [3]"],
    );

    // The cache in another dtype than Q; a k_new of the wrong shape.
    let mut tensors = decode_tensors(&paged);
    let k32 = paged.k_cache.mapv(|x| x.to_f32());
    for t in tensors.iter_mut().filter(|t| t.0 == "k_cache") {
        t.1 = Dtype::F32;
        t.3 = bytes_of(&k32);
    }
    decode_fails(&tensors, &[], &["`k_cache` is F32", "one dtype"]);
    let mut wrong = paged.clone();
    wrong.new_kv = Some((random4([3, 2, 1, 16], 1), random4([3, 2, 1, 16], 2)));
    decode_fails(&decode_tensors(&wrong), &[], &["k_new", "N_new ≥ 1"]);

    // GQA ratio and command-line conflicts.
    let mut gqa = decode_case::<f32>(false, 0);
    gqa.q = random4([3, 2, 3, 16], 3);
    decode_fails(&decode_tensors(&gqa), &[], &["GQA"]);
    let good = decode_tensors(&paged);
    decode_fails(&good, &["--backward"], &["--backward"]);
    decode_fails(&good, &["--num-splits", "0"], &["--num-splits"]);
    decode_fails(&good, &["--num-splits", "200"], &["--num-splits"]);
    decode_fails(&good, &["--scale", "inf"], &["--scale"]);
}

// --- attention dropout ---

/// Tensor `name` of the CLI's output as written: dtype, shape and little-endian bytes; `None`
/// when the file has no such tensor.
fn raw_tensor(path: &Path, name: &str) -> Option<(Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).ok()?;
    Some((t.dtype(), t.shape().to_vec(), t.data().to_vec()))
}

/// The output's `rng_state` (I64 `[2]`), or `None` when it has none.
fn rng_state(path: &Path) -> Option<[i64; 2]> {
    let (dtype, shape, data) = raw_tensor(path, "rng_state")?;
    assert_eq!(
        (dtype, shape.as_slice()),
        (Dtype::I64, &[2][..]),
        "rng_state"
    );
    let word = |i: usize| i64::from_le_bytes(data[8 * i..8 * i + 8].try_into().unwrap());
    Some([word(0), word(1)])
}

/// The output's `dropout_mask`, checked to be U8 `dims` of zeros and ones.
fn dropout_mask_of(path: &Path, dims: [usize; 4]) -> Array4<u8> {
    let (dtype, shape, data) = raw_tensor(path, "dropout_mask").expect("no dropout_mask");
    assert_eq!(dtype, Dtype::U8, "dropout_mask dtype");
    assert_eq!(shape, dims, "dropout_mask shape");
    assert!(
        data.iter().all(|&z| z <= 1),
        "dropout_mask holds 0 and 1 only"
    );
    Array4::from_shape_vec(dims, data).unwrap()
}

/// Writes `qkv` (and `do`, and `seqlens_k` when given) to `path`.
fn write_dropout_input<T: Elem>(
    path: &Path,
    qkv: &Qkv<T>,
    d_o: Option<&Array4<T>>,
    seqlens_k: Option<&[i32]>,
) {
    let float =
        |name: &str, a: &Array4<T>| (name.to_string(), T::DTYPE, a.shape().to_vec(), bytes_of(a));
    let mut tensors = vec![float("q", &qkv.q), float("k", &qkv.k), float("v", &qkv.v)];
    if let Some(d_o) = d_o {
        tensors.push(float("do", d_o));
    }
    if let Some(lens) = seqlens_k {
        let bytes = lens.iter().flat_map(|x| x.to_le_bytes()).collect();
        tensors.push(("seqlens_k".into(), Dtype::I32, vec![lens.len()], bytes));
    }
    write_raw(path, &tensors);
}

/// Attention with a given dropout mask, in f64: forward and (with dO) backward.
struct DropoutRef {
    o: Array4<f64>,
    lse: Array3<f64>,
    /// dQ, dK, dV, with dO.
    grads: Option<[Array4<f64>; 3]>,
}

/// The float64 reference of attention with dropout, written here from the definition: per
/// (batch entry b, query head h), query i sees keys j < Nk_b (`lens[b]`, else Nk) and, when
/// causal, j ≤ i + Nk_b − Nq; P = softmax(scale·q·kᵀ) over them (LSE before dropout);
/// O = (P ∘ Z)·V/(1 − p) with Z = `z[b, h]`. The backward differentiates exactly that:
/// dV = (P ∘ Z)ᵀ·dO/(1 − p), G = (dO·Vᵀ) ∘ Z/(1 − p), dS = P ∘ (G − rowsum(dO ∘ O)),
/// dQ = scale·dS·K, dK = scale·dSᵀ·Q (dK and dV summed over the query heads of a KV head).
#[allow(clippy::too_many_arguments)]
fn dropout_reference(
    [q, k, v]: [&Array4<f64>; 3],
    d_o: Option<&Array4<f64>>,
    z: &Array4<u8>,
    p: f64,
    scale: f64,
    causal: bool,
    lens: Option<&[i32]>,
) -> DropoutRef {
    let (batch, nq, hq, d) = q.dim();
    let (_, nk, hkv, _) = k.dim();
    let keep = 1.0 / (1.0 - p);
    let mut o = Array4::<f64>::zeros((batch, nq, hq, d));
    let mut lse = Array3::<f64>::from_elem((batch, hq, nq), f64::NEG_INFINITY);
    let mut dq = Array4::<f64>::zeros(q.dim());
    let mut dk = Array4::<f64>::zeros(k.dim());
    let mut dv = Array4::<f64>::zeros(v.dim());
    let dot = |a: ndarray::ArrayView1<f64>, b: ndarray::ArrayView1<f64>| a.dot(&b);
    for b in 0..batch {
        let nk_b = lens.map_or(nk, |l| l[b] as usize);
        for h in 0..hq {
            let kv = h / (hq / hkv);
            for i in 0..nq {
                let seen: Vec<usize> = (0..nk_b)
                    .filter(|&j| !causal || j as isize <= i as isize + nk_b as isize - nq as isize)
                    .collect();
                if seen.is_empty() {
                    continue;
                }
                let qi = q.slice(s![b, i, h, ..]);
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&j| scale * dot(qi, k.slice(s![b, j, kv, ..])))
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                let row_lse = max + sum.ln();
                lse[[b, h, i]] = row_lse;
                let probs: Vec<f64> = scores.iter().map(|s| (s - row_lse).exp()).collect();
                let dropped: Vec<f64> = seen
                    .iter()
                    .zip(&probs)
                    .map(|(&j, &pr)| pr * f64::from(z[[b, h, i, j]]) * keep)
                    .collect();
                for (&j, &pd) in seen.iter().zip(&dropped) {
                    let mut oi = o.slice_mut(s![b, i, h, ..]);
                    oi.scaled_add(pd, &v.slice(s![b, j, kv, ..]));
                }
                let Some(d_o) = d_o else { continue };
                let doi = d_o.slice(s![b, i, h, ..]);
                let row_d = dot(doi, o.slice(s![b, i, h, ..]));
                for ((&j, &pr), &pd) in seen.iter().zip(&probs).zip(&dropped) {
                    dv.slice_mut(s![b, j, kv, ..]).scaled_add(pd, &doi);
                    let g = dot(doi, v.slice(s![b, j, kv, ..])) * f64::from(z[[b, h, i, j]]) * keep;
                    let ds = pr * (g - row_d);
                    dq.slice_mut(s![b, i, h, ..])
                        .scaled_add(scale * ds, &k.slice(s![b, j, kv, ..]));
                    dk.slice_mut(s![b, j, kv, ..]).scaled_add(scale * ds, &qi);
                }
            }
        }
    }
    DropoutRef {
        o,
        lse,
        grads: d_o.map(|_| [dq, dk, dv]),
    }
}

/// max |a − b| over two arrays of one shape (equal infinities count as 0).
fn max_abs_diff(a: &ArrayD<f64>, b: &ArrayD<f64>) -> f64 {
    assert_eq!(a.shape(), b.shape());
    a.iter().zip(b).fold(0.0, |m, (&x, &y)| {
        if x.is_infinite() || y.is_infinite() {
            assert_eq!(x, y, "infinities must match");
            m
        } else {
            m.max((x - y).abs())
        }
    })
}

/// With P > 0 the output holds `rng_state` = (seed, offset) as I64 and the metadata
/// `dropout`, `seed`, `offset`; without dropout it holds neither, and `dropout` = none.
#[test]
fn dropout_writes_rng_state_and_metadata() {
    let dir = TempDir::new("dropout-meta");
    let qkv = random_qkv::<f16>(2, 9, 12, 4, 2, 16);
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_safetensors(&input, &[("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v)]);
    let (inp, out) = (input.to_str().unwrap(), output.to_str().unwrap());
    let stderr = run_ok(&[
        inp,
        "--cpu",
        "--dropout",
        "0.2",
        "--seed",
        "7",
        "--offset",
        "11",
        "-o",
        out,
    ]);
    assert!(
        stderr.contains("dropout 0.2 (seed 7, offset 11)"),
        "{stderr}"
    );
    assert_eq!(rng_state(&output), Some([7, 11]));
    assert!(raw_tensor(&output, "dropout_mask").is_none());
    let meta = output_metadata(&output);
    let get = |k: &str| meta.get(k).map(String::as_str);
    assert_eq!(
        (get("dropout"), get("seed"), get("offset")),
        (Some("0.2"), Some("7"), Some("11"))
    );
    let (o, lse) = read_output::<f16>(&output);
    assert_eq!(
        (o.shape(), lse.shape()),
        (&[2, 9, 4, 16][..], &[2, 4, 9][..])
    );

    // The defaults are seed 0 and offset 0; a u64 beyond i64 keeps its bits in the I64 state.
    run_ok(&[inp, "--cpu", "--dropout", "0.5", "-o", out]);
    assert_eq!(rng_state(&output), Some([0, 0]));
    let meta = output_metadata(&output);
    assert_eq!(meta.get("seed").map(String::as_str), Some("0"));
    let big = u64::MAX.to_string();
    run_ok(&[inp, "--cpu", "--dropout", "0.5", "--seed", &big, "-o", out]);
    assert_eq!(rng_state(&output), Some([-1, 0]));
    assert_eq!(output_metadata(&output).get("seed"), Some(&big));

    // No dropout: no rng_state, `dropout` = none and no seed or offset.
    run_ok(&[inp, "--cpu", "-o", out]);
    assert_eq!(rng_state(&output), None);
    let meta = output_metadata(&output);
    assert_eq!(meta.get("dropout").map(String::as_str), Some("none"));
    assert!(!meta.contains_key("seed") && !meta.contains_key("offset"));
}

/// One seed and offset draw one mask (the same O twice, bit for bit); another offset or
/// seed draws another.
#[test]
fn dropout_is_reproducible_and_keyed_by_seed_and_offset() {
    let dir = TempDir::new("dropout-seed");
    let qkv = random_qkv::<bf16>(1, 33, 40, 2, 1, 32);
    let input = dir.path("in.safetensors");
    write_safetensors(&input, &[("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v)]);
    let o_of = |seed: &str, offset: &str, name: &str| {
        let output = dir.path(name);
        run_ok(&[
            input.to_str().unwrap(),
            "--cpu",
            "--causal",
            "--dropout",
            "0.25",
            "--seed",
            seed,
            "--offset",
            offset,
            "-o",
            output.to_str().unwrap(),
        ]);
        raw_tensor(&output, "o").unwrap().2
    };
    let first = o_of("42", "3", "a.safetensors");
    assert_eq!(
        first,
        o_of("42", "3", "b.safetensors"),
        "same seed and offset"
    );
    assert_ne!(first, o_of("42", "4", "c.safetensors"), "another offset");
    assert_ne!(first, o_of("43", "3", "d.safetensors"), "another seed");
}

/// `--dropout 0` is no dropout: the same O and LSE bit for bit, no `rng_state`, `dropout` =
/// none; its `--return-dropout-mask` keeps everything.
#[test]
fn dropout_zero_is_no_dropout() {
    let dir = TempDir::new("dropout-zero");
    let qkv = random_qkv::<f16>(2, 17, 17, 2, 2, 24);
    let d_o = random4::<f16>([2, 17, 2, 24], 5);
    let input = dir.path("in.safetensors");
    write_dropout_input(&input, &qkv, Some(&d_o), None);
    for backward in [false, true] {
        let run_with = |extra: &[&str], name: &str| {
            let output = dir.path(name);
            let mut args = vec![input.to_str().unwrap(), "--cpu", "-o"];
            args.push(output.to_str().unwrap());
            if backward {
                args.push("--backward");
            }
            args.extend_from_slice(extra);
            run_ok(&args);
            output
        };
        let plain = run_with(&[], "plain.safetensors");
        let zero = run_with(&["--dropout", "0", "--seed", "9"], "zero.safetensors");
        let names: &[&str] = if backward {
            &["o", "lse", "dq", "dk", "dv"]
        } else {
            &["o", "lse"]
        };
        for name in names {
            assert_eq!(
                raw_tensor(&plain, name),
                raw_tensor(&zero, name),
                "{name} (backward: {backward})"
            );
        }
        assert_eq!(rng_state(&zero), None);
        let meta = output_metadata(&zero);
        assert_eq!(meta.get("dropout").map(String::as_str), Some("none"));
        let with_mask = run_with(
            &["--dropout", "-0", "--return-dropout-mask"],
            "mask.safetensors",
        );
        let mask = dropout_mask_of(&with_mask, [2, 2, 17, 17]);
        assert!(mask.iter().all(|&z| z == 1), "P = 0 keeps everything");
        assert_eq!(raw_tensor(&with_mask, "o"), raw_tensor(&plain, "o"));
    }
}

/// `--return-dropout-mask` writes the mask the forward applied: O (f32, CPU backend) equals
/// the float64 reference computed here from Q, K, V and that mask within 1e-5, the LSE is
/// the one before dropout, and the mask is the library's `cpu::dropout_mask` of the seed and
/// offset. GQA, causal or not, Nq ≠ Nk.
#[test]
fn dropout_mask_reproduces_the_forward() {
    let dir = TempDir::new("dropout-mask");
    let (b, nq, nk, hq, hkv, d) = (2, 19, 26, 4, 2, 16);
    let qkv = random_qkv::<f32>(b, nq, nk, hq, hkv, d);
    let input = dir.path("in.safetensors");
    write_safetensors(&input, &[("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v)]);
    let up = |a: &Array4<f32>| a.mapv(f64::from);
    let (q, k, v) = (up(&qkv.q), up(&qkv.k), up(&qkv.v));
    for (causal, p, seed, offset) in [(false, 0.3, "5", "0"), (true, 0.6, "123456789", "77")] {
        let output = dir.path("out.safetensors");
        let p_text = p.to_string();
        let mut args = vec![
            input.to_str().unwrap(),
            "--dropout",
            &p_text,
            "--seed",
            seed,
            "--offset",
            offset,
            "--return-dropout-mask",
            "--scale",
            "0.4",
            "-o",
            output.to_str().unwrap(),
        ];
        if causal {
            args.push("--causal");
        }
        let stderr = run_ok(&args);
        assert!(stderr.contains("backend: CPU (f32"), "{stderr}");
        let z = dropout_mask_of(&output, [b, hq, nq, nk]);
        let dropout =
            flash_attn::Dropout::new(p as f32, seed.parse().unwrap(), offset.parse().unwrap());
        let library = flash_attn::cpu::dropout_mask(b, hq, nq, nk, &dropout).unwrap();
        assert_eq!(z, library, "the mask of the seed and offset");
        let dropped = z.iter().filter(|&&x| x == 0).count() as f64 / z.len() as f64;
        assert!((dropped - p).abs() < 0.08, "dropped {dropped}, p = {p}");
        let want = dropout_reference(
            [&q, &k, &v],
            None,
            &z,
            f64::from(p as f32),
            0.4f32.into(),
            causal,
            None,
        );
        let (o, lse) = read_output::<f32>(&output);
        let o_err = max_abs_diff(&o, &want.o.into_dyn());
        let lse_err = max_abs_diff(&lse, &want.lse.into_dyn());
        assert!(o_err <= 1e-5, "causal {causal}: max |O - ref| = {o_err}");
        assert!(
            lse_err <= 1e-5,
            "causal {causal}: max |LSE - ref| = {lse_err}"
        );
    }
}

/// `--backward` with dropout regenerates the forward's mask: O, dQ, dK and dV (f32, CPU
/// backend) equal the float64 reference computed here from the returned mask.
#[test]
fn dropout_backward_matches_the_mask() {
    let dir = TempDir::new("dropout-bwd");
    let (b, nq, nk, hq, hkv, d) = (1, 21, 15, 4, 1, 8);
    let qkv = random_qkv::<f32>(b, nq, nk, hq, hkv, d);
    let d_o = random4::<f32>([b, nq, hq, d], 6);
    let input = dir.path("in.safetensors");
    write_dropout_input(&input, &qkv, Some(&d_o), None);
    let up = |a: &Array4<f32>| a.mapv(f64::from);
    let (q, k, v, g) = (up(&qkv.q), up(&qkv.k), up(&qkv.v), up(&d_o));
    for causal in [false, true] {
        let output = dir.path("grads.safetensors");
        let mut args = vec![
            input.to_str().unwrap(),
            "--backward",
            "--dropout",
            "0.4",
            "--seed",
            "2024",
            "--offset",
            "1",
            "--return-dropout-mask",
            "-o",
            output.to_str().unwrap(),
        ];
        if causal {
            args.push("--causal");
        }
        run_ok(&args);
        assert_eq!(rng_state(&output), Some([2024, 1]));
        let z = dropout_mask_of(&output, [b, hq, nq, nk]);
        assert!(z.iter().any(|&x| x == 0) && z.iter().any(|&x| x == 1));
        let scale = 1.0 / f64::from((d as f32).sqrt());
        let want = dropout_reference(
            [&q, &k, &v],
            Some(&g),
            &z,
            f64::from(0.4f32),
            scale,
            causal,
            None,
        );
        let o = read_tensor::<f32>(&output, "o", Dtype::F32);
        let o_err = max_abs_diff(&o, &want.o.into_dyn());
        assert!(o_err <= 1e-5, "causal {causal}: max |O - ref| = {o_err}");
        let [dq, dk, dv] = want.grads.unwrap();
        for (name, want) in [("dq", dq), ("dk", dk), ("dv", dv)] {
            let got = read_tensor::<f32>(&output, name, Dtype::F32);
            let err = max_abs_diff(&got, &want.into_dyn());
            assert!(err <= 1e-5, "causal {causal}: max |{name} - ref| = {err}");
        }
    }
}

/// With key padding (`seqlens_k`) the mask is the padded batch's, `[B, Hq, Nq, Nk]`, and O
/// equals the reference in which entry b sees its first seqlens_k[b] keys.
#[test]
fn dropout_mask_with_key_padding() {
    let dir = TempDir::new("dropout-padding");
    let (b, nq, nk, hq, hkv, d) = (3, 10, 20, 2, 2, 16);
    let qkv = random_qkv::<f32>(b, nq, nk, hq, hkv, d);
    let lens = [20, 7, 0];
    let input = dir.path("in.safetensors");
    write_dropout_input(&input, &qkv, None, Some(&lens));
    let output = dir.path("out.safetensors");
    run_ok(&[
        input.to_str().unwrap(),
        "--causal",
        "--dropout",
        "0.5",
        "--seed",
        "1",
        "--return-dropout-mask",
        "-o",
        output.to_str().unwrap(),
    ]);
    let z = dropout_mask_of(&output, [b, hq, nq, nk]);
    let up = |a: &Array4<f32>| a.mapv(f64::from);
    let scale = 1.0 / f64::from((d as f32).sqrt());
    let want = dropout_reference(
        [&up(&qkv.q), &up(&qkv.k), &up(&qkv.v)],
        None,
        &z,
        0.5,
        scale,
        true,
        Some(&lens),
    );
    let (o, lse) = read_output::<f32>(&output);
    assert!(max_abs_diff(&o, &want.o.into_dyn()) <= 1e-5);
    assert!(max_abs_diff(&lse, &want.lse.into_dyn()) <= 1e-5);
    assert_eq!(
        output_metadata(&output)
            .get("seqlens_k")
            .map(String::as_str),
        Some("true")
    );
}

/// A varlen batch takes dropout (not `--return-dropout-mask`): the CLI's O and gradients are
/// the library's varlen CPU passes with the same dropout, bit for bit.
#[test]
fn dropout_with_a_varlen_batch_is_the_librarys() {
    let dir = TempDir::new("dropout-varlen");
    let (cu_q, cu_k) = (vec![0, 5, 5, 17], vec![0, 9, 12, 30]);
    let (hq, hkv, d) = (2, 1, 16);
    let q3 = random4::<f32>([1, 17, hq, d], 21).index_axis_move(ndarray::Axis(0), 0);
    let k3 = random4::<f32>([1, 30, hkv, d], 22).index_axis_move(ndarray::Axis(0), 0);
    let v3 = random4::<f32>([1, 30, hkv, d], 23).index_axis_move(ndarray::Axis(0), 0);
    let do3 = random4::<f32>([1, 17, hq, d], 24).index_axis_move(ndarray::Axis(0), 0);
    let float = |name: &str, a: &Array3<f32>| {
        let bytes = a.iter().flat_map(|x| x.to_le_bytes()).collect();
        (name.to_string(), Dtype::F32, a.shape().to_vec(), bytes)
    };
    let ints = |name: &str, v: &[i32]| {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        (name.to_string(), Dtype::I32, vec![v.len()], bytes)
    };
    let input = dir.path("in.safetensors");
    write_raw(
        &input,
        &[
            float("q", &q3),
            float("k", &k3),
            float("v", &v3),
            float("do", &do3),
            ints("cu_seqlens_q", &cu_q),
            ints("cu_seqlens_k", &cu_k),
        ],
    );
    let output = dir.path("out.safetensors");
    run_ok(&[
        input.to_str().unwrap(),
        "--backward",
        "--causal",
        "--dropout",
        "0.3",
        "--seed",
        "8",
        "--offset",
        "2",
        "-o",
        output.to_str().unwrap(),
    ]);
    assert_eq!(rng_state(&output), Some([8, 2]));
    let params = AttnParams {
        causal: true,
        dropout: Some(flash_attn::Dropout::new(0.3, 8, 2)),
        ..AttnParams::default()
    };
    let (o, lse) = flash_attn::cpu::attention_varlen_cpu(
        q3.view(),
        k3.view(),
        v3.view(),
        (&cu_q, &cu_k),
        &params,
    )
    .unwrap();
    let (dq, dk, dv) = flash_attn::cpu::attention_varlen_backward_cpu(
        q3.view(),
        k3.view(),
        v3.view(),
        o.view(),
        do3.view(),
        lse.view(),
        (&cu_q, &cu_k),
        &params,
    )
    .unwrap();
    let wide = |a: &Array3<f32>| a.mapv(f64::from).into_dyn();
    let expected = [
        ("o", wide(&o)),
        ("lse", lse.mapv(f64::from).into_dyn()),
        ("dq", wide(&dq)),
        ("dk", wide(&dk)),
        ("dv", wide(&dv)),
    ];
    for (name, want) in expected {
        let got = read_tensor::<f32>(&output, name, Dtype::F32);
        assert_eq!(got, want, "{name}");
    }
}
