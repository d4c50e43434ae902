//! `flash-attn-cli`: forward attention on tensors stored in files.
//!
//! Reads Q, K and V (`[B, N, H, d]`, F16, BF16 or F32) from one `.safetensors` file or from
//! three `.npy` files, runs the forward pass on GPU 0 when there is one (the CPU backend
//! otherwise, or with `--cpu`), and writes `o` (Q's shape, the input dtype) and `lse`
//! (`[B, Hq, Nq]`, f32, natural log) to a `.safetensors` file. See `--help`.
//!
//! `.npy` support is deliberately small: little-endian `<f2` (f16) and `<f4` (f32) arrays in C
//! order, format versions 1.0 to 3.0. NumPy has no bf16 dtype; store bf16 in safetensors.

use flash_attn::shape::check_shapes;
use flash_attn::{cpu, AttnParams, DType, Device, DeviceTensor, Element, FlashError};
use half::{bf16, f16};
use ndarray::{Array3, Array4};
use safetensors::{tensor::TensorView, Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

const USAGE: &str = "\
flash-attn-cli: FlashAttention forward pass on tensors stored in files.

USAGE:
    flash-attn-cli INPUT.safetensors [OPTIONS]
    flash-attn-cli --npy Q.npy K.npy V.npy [OPTIONS]

INPUT:
    Q is [B, Nq, Hq, d]; K and V are [B, Nk, Hkv, d] with Hq a multiple of Hkv (GQA/MQA).
    All three have the same dtype: F16, BF16 or F32 (safetensors); f16 '<f2' or f32 '<f4',
    C order (.npy; NumPy has no bf16).

OPTIONS:
    --q NAME, --k NAME, --v NAME
                      tensor names in the safetensors file (default: q, k, v)
    --npy Q K V       read Q, K and V from three .npy files instead
    --causal          causal mask (bottom-right aligned when Nq != Nk)
    --scale X         softmax scale (default: 1/sqrt(d))
    --cpu             run on the CPU even when a GPU is present
    -o, --out FILE    output safetensors file (default: out.safetensors) holding
                      `o` [B, Nq, Hq, d] (input dtype) and `lse` [B, Hq, Nq] (f32)
    --npy-out O LSE   also write o and lse as .npy files (f16/f32 inputs only)
    -h, --help        this text

The forward pass runs on GPU 0 when a CUDA driver and an sm_80+ GPU are present, on the CPU
backend otherwise; f32 inputs always run on the CPU (the GPU kernels take f16 and bf16). The
backend used is reported on stderr. Exit status: 0 on success, 1 on any error.";

/// Parsed command line.
#[derive(Debug)]
struct Args {
    input: Input,
    params: AttnParams,
    force_cpu: bool,
    out: PathBuf,
    npy_out: Option<(PathBuf, PathBuf)>,
}

#[derive(Debug)]
enum Input {
    SafeTensors { path: PathBuf, names: [String; 3] },
    Npy([PathBuf; 3]),
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let result = parse_args(&argv)
        .map_err(|e| format!("{e}\n(run `flash-attn-cli --help` for usage)"))
        .and_then(|args| run(&args));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flash-attn-cli: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse_args(argv: &[String]) -> Result<Args, String> {
    let mut it = argv.iter();
    let mut input_path = None;
    let mut names: [Option<String>; 3] = [None, None, None];
    let mut npy = None;
    let mut params = AttnParams::default();
    let mut force_cpu = false;
    let mut out = None;
    let mut npy_out = None;
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| -> Result<String, String> {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match arg.as_str() {
            "--q" | "--k" | "--v" => {
                let i = ["--q", "--k", "--v"]
                    .iter()
                    .position(|f| *f == arg)
                    .unwrap_or(0);
                if names[i].is_some() {
                    return Err(format!("{arg} given twice"));
                }
                names[i] = Some(value(arg)?);
            }
            "--npy" => {
                if npy.is_some() {
                    return Err("--npy given twice".into());
                }
                let q = value("--npy")?;
                let k = value("--npy (K)")?;
                let v = value("--npy (V)")?;
                npy = Some([q, k, v].map(PathBuf::from));
            }
            "--causal" => params.causal = true,
            "--scale" => {
                let s = value("--scale")?;
                let x: f32 = s
                    .parse()
                    .map_err(|_| format!("--scale: `{s}` is not a number"))?;
                if !x.is_finite() {
                    return Err(format!("--scale must be finite, got {s}"));
                }
                params.softmax_scale = Some(x);
            }
            "--cpu" => force_cpu = true,
            "-o" | "--out" => {
                if out.is_some() {
                    return Err(format!("{arg} given twice"));
                }
                out = Some(PathBuf::from(value(arg)?));
            }
            "--npy-out" => {
                let o = value("--npy-out")?;
                let lse = value("--npy-out (LSE)")?;
                npy_out = Some((PathBuf::from(o), PathBuf::from(lse)));
            }
            s if s.starts_with('-') && s.len() > 1 => {
                return Err(format!("unknown option `{s}`"));
            }
            _ => {
                if input_path.is_some() {
                    return Err(format!("unexpected argument `{arg}` (one input file only)"));
                }
                input_path = Some(PathBuf::from(arg));
            }
        }
    }
    let input = match (input_path, npy) {
        (Some(_), Some(_)) => {
            return Err("give either a safetensors file or --npy Q K V, not both".into())
        }
        (None, None) => return Err("no input: give a safetensors file or --npy Q K V".into()),
        (None, Some(paths)) => {
            if names.iter().any(Option::is_some) {
                return Err(
                    "--q/--k/--v name tensors of a safetensors file; not with --npy".into(),
                );
            }
            Input::Npy(paths)
        }
        (Some(path), None) => {
            let [q, k, v] = names;
            Input::SafeTensors {
                path,
                names: [
                    q.unwrap_or_else(|| "q".into()),
                    k.unwrap_or_else(|| "k".into()),
                    v.unwrap_or_else(|| "v".into()),
                ],
            }
        }
    };
    Ok(Args {
        input,
        params,
        force_cpu,
        out: out.unwrap_or_else(|| PathBuf::from("out.safetensors")),
        npy_out,
    })
}

/// An element type the CLI reads and writes: its safetensors dtype, its `.npy` descriptor (if
/// NumPy has one) and its little-endian encoding.
trait FileElement: Element {
    const ST_DTYPE: Dtype;
    const NPY_DESCR: Option<&'static str>;
    const SIZE: usize;
    fn from_le(b: &[u8]) -> Self;
    fn put_le(self, out: &mut Vec<u8>);
}

impl FileElement for f16 {
    const ST_DTYPE: Dtype = Dtype::F16;
    const NPY_DESCR: Option<&'static str> = Some("<f2");
    const SIZE: usize = 2;
    fn from_le(b: &[u8]) -> Self {
        f16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes());
    }
}

impl FileElement for bf16 {
    const ST_DTYPE: Dtype = Dtype::BF16;
    const NPY_DESCR: Option<&'static str> = None;
    const SIZE: usize = 2;
    fn from_le(b: &[u8]) -> Self {
        bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes());
    }
}

impl FileElement for f32 {
    const ST_DTYPE: Dtype = Dtype::F32;
    const NPY_DESCR: Option<&'static str> = Some("<f4");
    const SIZE: usize = 4;
    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

/// A tensor read from a file, before its dtype is known statically.
struct RawTensor {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl RawTensor {
    /// Decodes into a rank-4 array of `T` (whose dtype the caller has matched).
    fn to_array<T: FileElement>(&self) -> Result<Array4<T>, String> {
        let dims: [usize; 4] = self.shape.as_slice().try_into().map_err(|_| {
            format!(
                "tensor `{}` must have rank 4 [B, N, H, d], got shape {:?}",
                self.name, self.shape
            )
        })?;
        let data: Vec<T> = self.bytes.chunks_exact(T::SIZE).map(T::from_le).collect();
        Array4::from_shape_vec(dims, data).map_err(|e| format!("tensor `{}`: {e}", self.name))
    }
}

fn run(args: &Args) -> Result<(), String> {
    let [q, k, v] = match &args.input {
        Input::SafeTensors { path, names } => read_safetensors(path, names)?,
        Input::Npy(paths) => {
            let [q, k, v] = paths;
            [read_npy(q)?, read_npy(k)?, read_npy(v)?]
        }
    };
    for t in [&k, &v] {
        if t.dtype != q.dtype {
            return Err(format!(
                "Q, K and V must have one dtype: `{}` is {:?}, `{}` is {:?}",
                q.name, q.dtype, t.name, t.dtype
            ));
        }
    }
    match q.dtype {
        DType::F16 => run_typed::<f16>(args, [&q, &k, &v]),
        DType::BF16 => run_typed::<bf16>(args, [&q, &k, &v]),
        DType::F32 => run_typed::<f32>(args, [&q, &k, &v]),
    }
}

/// Where the forward pass runs.
enum Backend {
    Gpu(Device),
    Cpu,
}

/// Picks the backend and says which on stderr.
fn pick_backend(dtype: DType, force_cpu: bool) -> Backend {
    if force_cpu {
        eprintln!("flash-attn-cli: backend: CPU (--cpu)");
        return Backend::Cpu;
    }
    if dtype == DType::F32 {
        eprintln!(
            "flash-attn-cli: backend: CPU (f32 inputs: the GPU kernels take f16 and bf16 only)"
        );
        return Backend::Cpu;
    }
    match Device::new(0) {
        Ok(dev) => {
            let (major, minor) = dev.compute_capability();
            let name = dev.name().unwrap_or_else(|_| "unknown GPU".into());
            eprintln!(
                "flash-attn-cli: backend: GPU 0 ({name}, compute capability {major}.{minor}, {} PTX)",
                dev.ptx_arch()
            );
            Backend::Gpu(dev)
        }
        Err(e) => {
            eprintln!("flash-attn-cli: backend: CPU (no usable GPU: {e})");
            Backend::Cpu
        }
    }
}

fn run_typed<T: FileElement>(args: &Args, raw: [&RawTensor; 3]) -> Result<(), String> {
    if args.npy_out.is_some() && T::NPY_DESCR.is_none() {
        return Err(format!(
            "--npy-out: {:?} has no .npy dtype; use the safetensors output",
            T::DTYPE
        ));
    }
    let [q, k, v] = raw.map(RawTensor::to_array::<T>);
    let (q, k, v) = (q?, k?, v?);
    // Shape errors are the same on both backends: report them before opening a GPU.
    let dims = |a: &Array4<T>| -> [usize; 4] { a.dim().into() };
    let shape = check_shapes(&dims(&q), &dims(&k), &dims(&v)).map_err(|e| e.to_string())?;
    args.params
        .scale(shape.head_dim)
        .map_err(|e| e.to_string())?;
    let backend = pick_backend(T::DTYPE, args.force_cpu);
    let start = Instant::now();
    let (o, lse) = match &backend {
        Backend::Gpu(dev) => gpu_forward(dev, &q, &k, &v, &args.params),
        Backend::Cpu => cpu::attention_cpu(q.view(), k.view(), v.view(), &args.params),
    }
    .map_err(|e| match e {
        FlashError::HeadDim(_) if matches!(backend, Backend::Gpu(_)) => {
            format!("{e} on the GPU; --cpu runs the CPU backend, which takes any head dim")
        }
        e => e.to_string(),
    })?;
    eprintln!(
        "flash-attn-cli: Q {:?} K {:?} {:?}{} in {:.1} ms",
        q.shape(),
        k.shape(),
        T::DTYPE,
        if args.params.causal { " causal" } else { "" },
        start.elapsed().as_secs_f64() * 1e3
    );

    let backend_name = match &backend {
        Backend::Gpu(dev) => format!("cuda:0 {}", dev.ptx_arch()),
        Backend::Cpu => "cpu".into(),
    };
    let scale = args
        .params
        .scale(shape.head_dim)
        .map_err(|e| e.to_string())?;
    let metadata = HashMap::from([
        ("backend".to_string(), backend_name),
        ("causal".to_string(), args.params.causal.to_string()),
        ("softmax_scale".to_string(), scale.to_string()),
    ]);
    write_safetensors(&args.out, &o, &lse, metadata)?;
    eprintln!(
        "flash-attn-cli: wrote {} (o {:?} {:?}, lse {:?} F32)",
        args.out.display(),
        o.shape(),
        T::DTYPE,
        lse.shape()
    );
    if let Some((o_path, lse_path)) = &args.npy_out {
        write_npy(o_path, o.shape(), o.iter().copied())?;
        write_npy(lse_path, lse.shape(), lse.iter().copied())?;
        eprintln!(
            "flash-attn-cli: wrote {} and {}",
            o_path.display(),
            lse_path.display()
        );
    }
    Ok(())
}

/// The forward pass on the GPU: upload, run, download.
fn gpu_forward<T: Element>(
    dev: &Device,
    q: &Array4<T>,
    k: &Array4<T>,
    v: &Array4<T>,
    params: &AttnParams,
) -> flash_attn::Result<(Array4<T>, Array3<f32>)> {
    let upload = |a: &Array4<T>| DeviceTensor::from_ndarray(dev, a.view());
    let (dq, dk, dv) = (upload(q)?, upload(k)?, upload(v)?);
    let (o, lse) = flash_attn::flash_attn(dev, &dq, &dk, &dv, params)?;
    let o = o.to_ndarray(dev)?;
    let lse = lse.to_ndarray(dev)?;
    let o = o
        .into_dimensionality()
        .map_err(|e| FlashError::Shape(format!("O: {e}")))?;
    let lse = lse
        .into_dimensionality()
        .map_err(|e| FlashError::Shape(format!("LSE: {e}")))?;
    Ok((o, lse))
}

// ---------------------------------------------------------------------------------------------
// safetensors

fn read_safetensors(path: &Path, names: &[String; 3]) -> Result<[RawTensor; 3], String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let get = |name: &String| -> Result<RawTensor, String> {
        let view = st.tensor(name).map_err(|e| {
            let mut have = st.names();
            have.sort();
            format!(
                "{}: {e} (the file holds: {}; pick names with --q/--k/--v)",
                path.display(),
                have.join(", ")
            )
        })?;
        let dtype = match view.dtype() {
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::F32 => DType::F32,
            other => {
                return Err(format!(
                    "tensor `{name}` is {other}; F16, BF16 or F32 is supported"
                ))
            }
        };
        Ok(RawTensor {
            name: name.clone(),
            dtype,
            shape: view.shape().to_vec(),
            bytes: view.data().to_vec(),
        })
    };
    let [q, k, v] = names;
    Ok([get(q)?, get(k)?, get(v)?])
}

fn write_safetensors<T: FileElement>(
    path: &Path,
    o: &Array4<T>,
    lse: &Array3<f32>,
    metadata: HashMap<String, String>,
) -> Result<(), String> {
    let o_bytes = le_bytes(o.iter().copied());
    let lse_bytes = le_bytes(lse.iter().copied());
    let err = |e: safetensors::SafeTensorError| format!("{}: {e}", path.display());
    let tensors = [
        (
            "o",
            TensorView::new(T::ST_DTYPE, o.shape().to_vec(), &o_bytes).map_err(err)?,
        ),
        (
            "lse",
            TensorView::new(Dtype::F32, lse.shape().to_vec(), &lse_bytes).map_err(err)?,
        ),
    ];
    let file = safetensors::serialize(tensors, Some(metadata)).map_err(err)?;
    std::fs::write(path, file).map_err(|e| format!("{}: {e}", path.display()))
}

fn le_bytes<T: FileElement>(values: impl Iterator<Item = T>) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.size_hint().0 * T::SIZE);
    for x in values {
        x.put_le(&mut out);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// .npy (format 1.0-3.0; '<f2' and '<f4', C order)

const NPY_MAGIC: &[u8] = b"\x93NUMPY";

fn read_npy(path: &Path) -> Result<RawTensor, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let fail = |what: String| format!("{}: {what}", path.display());
    if bytes.len() < 10 || !bytes.starts_with(NPY_MAGIC) {
        return Err(fail("not a .npy file (bad magic)".into()));
    }
    let (header_len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(fail(format!("unsupported .npy format version {v}"))),
    };
    let end = start
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| fail("truncated header".into()))?;
    let header =
        std::str::from_utf8(&bytes[start..end]).map_err(|_| fail("header is not text".into()))?;
    let descr = npy_field(header, "descr")
        .and_then(|s| {
            let s = s.trim_start();
            let q = s.chars().next().filter(|c| *c == '\'' || *c == '"')?;
            s[1..].split(q).next()
        })
        .ok_or_else(|| fail(format!("no 'descr' in header {header:?}")))?;
    let dtype = match descr {
        "<f2" => DType::F16,
        "<f4" => DType::F32,
        ">f2" | ">f4" => return Err(fail("big-endian arrays are not supported".into())),
        "<u2" | "<V2" => {
            return Err(fail(
                "bf16 cannot be stored in .npy here; use a safetensors file".into(),
            ))
        }
        d => {
            return Err(fail(format!(
                "dtype '{d}' is not supported ('<f2' f16 or '<f4' f32 only)"
            )))
        }
    };
    let fortran = npy_field(header, "fortran_order")
        .map(|s| s.trim_start().starts_with("True"))
        .ok_or_else(|| fail("no 'fortran_order' in header".into()))?;
    if fortran {
        return Err(fail(
            "Fortran-order arrays are not supported (save with np.ascontiguousarray)".into(),
        ));
    }
    let shape_text = npy_field(header, "shape")
        .and_then(|s| {
            let s = s.trim_start().strip_prefix('(')?;
            Some(&s[..s.find(')')?])
        })
        .ok_or_else(|| fail("no 'shape' in header".into()))?;
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('L').parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| fail(format!("bad shape ({shape_text})")))?;
    let n_bytes = shape
        .iter()
        .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
        .ok_or_else(|| fail("shape overflows".into()))?;
    let data = &bytes[end..];
    if data.len() != n_bytes {
        return Err(fail(format!(
            "shape {shape:?} of {descr} needs {n_bytes} data bytes, the file has {}",
            data.len()
        )));
    }
    Ok(RawTensor {
        name: path.display().to_string(),
        dtype,
        shape,
        bytes: data.to_vec(),
    })
}

/// The text after `'key':` in a .npy header dict.
fn npy_field<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    ["'", "\""].iter().find_map(|q| {
        let pat = format!("{q}{key}{q}");
        let i = header.find(&pat)? + pat.len();
        header[i..].trim_start().strip_prefix(':')
    })
}

/// Writes a C-order .npy file (format 1.0, or 2.0 when the header is too long for 1.0).
fn write_npy<T: FileElement>(
    path: &Path,
    shape: &[usize],
    values: impl Iterator<Item = T>,
) -> Result<(), String> {
    let descr = T::NPY_DESCR
        .ok_or_else(|| format!("{}: {:?} has no .npy dtype", path.display(), T::DTYPE))?;
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Magic, version and length, then the header padded with spaces and ended by a newline,
    // so that the data starts on a 64-byte boundary.
    let v1 = header.len() + 11 <= u16::MAX as usize;
    let prefix = if v1 { 10 } else { 12 };
    let pad = (64 - (prefix + header.len() + 1) % 64) % 64;
    header.push_str(&" ".repeat(pad));
    header.push('\n');
    let mut out = NPY_MAGIC.to_vec();
    if v1 {
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&[2, 0]);
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&le_bytes(values));
    std::fs::write(path, out).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Result<Args, String> {
        parse_args(&s.split_whitespace().map(String::from).collect::<Vec<_>>())
    }

    #[test]
    fn parses_options() {
        let a = args("in.safetensors --k key --causal --scale 0.5 --cpu -o x.safetensors").unwrap();
        assert!(a.params.causal && a.force_cpu);
        assert_eq!(a.params.softmax_scale, Some(0.5));
        assert_eq!(a.out, PathBuf::from("x.safetensors"));
        match a.input {
            Input::SafeTensors { path, names } => {
                assert_eq!(path, PathBuf::from("in.safetensors"));
                assert_eq!(names, ["q", "key", "v"].map(String::from));
            }
            Input::Npy(_) => panic!("expected safetensors input"),
        }
        assert!(matches!(
            args("--npy a.npy b.npy c.npy").unwrap().input,
            Input::Npy(_)
        ));
    }

    #[test]
    fn rejects_bad_arguments() {
        for bad in [
            "",
            "--scale",
            "in.st --scale abc",
            "in.st --scale inf",
            "in.st --bogus",
            "a.st b.st",
            "in.st --npy a b c",
            "--npy a b c --q x",
            "--npy a b",
            "in.st -o",
        ] {
            assert!(args(bad).is_err(), "accepted `{bad}`");
        }
    }

    #[test]
    fn npy_round_trip() {
        let dir = std::env::temp_dir().join(format!("flash-attn-cli-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.npy");
        let vals: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        write_npy(&path, &[1, 2, 3, 4], vals.iter().copied()).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let header_end = 10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!(header_end % 64, 0);
        let t = read_npy(&path).unwrap();
        assert_eq!(t.dtype, DType::F32);
        assert_eq!(t.shape, vec![1, 2, 3, 4]);
        let a = t.to_array::<f32>().unwrap();
        assert_eq!(a.iter().copied().collect::<Vec<_>>(), vals);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn npy_header_parsing() {
        let h = "{'descr': '<f2', 'fortran_order': False, 'shape': (2, 3), }";
        assert_eq!(
            npy_field(h, "descr").map(str::trim),
            Some("'<f2', 'fortran_order': False, 'shape': (2, 3), }")
        );
        assert!(npy_field(h, "nope").is_none());
    }
}
