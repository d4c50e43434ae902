//! End-to-end tests of the `flash-attn-cli` binary: write inputs to a temporary directory, run
//! the binary, read its safetensors (or .npy) output back and compare O and LSE with the
//! float64 reference.
//!
//! The binary is the one cargo built (`CARGO_BIN_EXE_flash-attn-cli`); in the GPU bundle,
//! where that path does not exist, it is `bin/flash-attn-cli` next to the `tests/` directory,
//! and `FLASH_ATTN_CLI` overrides both.

use flash_attn::cpu::attention_reference;
use flash_attn::AttnParams;
use half::{bf16, f16};
use ndarray::{Array3, Array4, ArrayD, IxDyn};
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
