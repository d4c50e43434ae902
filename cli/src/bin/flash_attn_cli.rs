//! `flash-attn-cli`: forward attention on tensors stored in files.
//!
//! Reads Q, K and V (`[B, N, H, d]`, F16, BF16 or F32) from one `.safetensors` file or from
//! three `.npy` files, runs the forward pass on GPU 0 when there is one (the CPU backend
//! otherwise, or with `--cpu`), and writes `o` (Q's shape, the input dtype) and `lse`
//! (`[B, Hq, Nq]`, f32, natural log) to a `.safetensors` file. With `--backward` it also reads
//! dO (`do`) and writes the gradients `dq`, `dk`, `dv`, computed on the CPU backend (forward
//! and backward both, so that the five outputs agree). See `--help`.
//!
//! The file handling (bounded readers, output checks, writes through temporary files) is in
//! the `flash_attn_cli` library; this file is the command line and the forward pass.

use clap::{ArgAction, Parser};
use flash_attn::shape::check_shapes;
use flash_attn::{cpu, AttnParams, BwdMode, DType, Device, DeviceTensor, Element, FlashError};
use flash_attn_cli::input::{read_npy, read_safetensors, FileElement, RawTensor};
use flash_attn_cli::output::{check_aliases, PendingOutput};
use flash_attn_cli::CliError;
use flash_attn_kernels::registry::{self, MaskKind};
use half::{bf16, f16};
use ndarray::{Array3, Array4};
use safetensors::{tensor::TensorView, Dtype};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

const AFTER_HELP: &str = "\
INPUT:
    Q is [B, Nq, Hq, d]; K and V are [B, Nk, Hkv, d] with Hq a multiple of Hkv (GQA/MQA).
    All three have the same dtype: F16, BF16 or F32 (safetensors); f16 '<f2' or f32 '<f4',
    C order, format 1.0 to 3.0 (.npy; NumPy has no bf16).

OUTPUT:
    -o FILE (default out.safetensors) holds `o` [B, Nq, Hq, d] (input dtype) and `lse`
    [B, Hq, Nq] (f32, natural log), with metadata `backend`, `causal` and `softmax_scale`.
    An output may not be the same file as an input or as another output. Outputs are
    checked before the forward pass and written through a temporary file in the same
    directory, renamed into place, so a failed run leaves existing files as they were.

BACKWARD (--backward):
    Also reads dO (`do`, or --do NAME) [B, Nq, Hq, d], Q's shape and dtype, from the
    safetensors input (.npy input and --npy-out are not supported with --backward), and
    writes `o`, `lse`, `dq` [B, Nq, Hq, d] and `dk`, `dv` [B, Nk, Hkv, d] (input dtype; dK and
    dV of a shared KV head sum over its query heads) to -o. Both passes run on GPU 0 like the
    forward (f16/bf16, head dims up to 256), else on the CPU backend.
    The GPU backward adds dQ with f32 atomics, so its low bits can vary run to run;
    --deterministic selects its deterministic mode (bit-identical results, slower). The CPU
    backward is always deterministic.

The forward pass runs on GPU 0 when a CUDA driver and an sm_80+ GPU are present, on the CPU
backend otherwise; f32 inputs always run on the CPU (the GPU kernels take f16 and bf16). The
backend used is reported on stderr. Every option may be given once. Exit status: 0 on
success, 1 on any error.";

/// FlashAttention forward pass on tensors stored in files.
#[derive(Debug, Parser)]
#[command(
    name = "flash-attn-cli",
    override_usage = "flash-attn-cli INPUT.safetensors [OPTIONS]\n       flash-attn-cli --npy Q.npy K.npy V.npy [OPTIONS]",
    after_help = AFTER_HELP
)]
struct Args {
    /// Safetensors file holding Q, K and V
    #[arg(
        value_name = "INPUT.safetensors",
        required_unless_present = "npy",
        conflicts_with = "npy"
    )]
    input: Option<PathBuf>,
    /// Name of Q in the safetensors file [default: q]
    #[arg(long = "q", value_name = "NAME", allow_hyphen_values = true)]
    q_name: Option<String>,
    /// Name of K in the safetensors file [default: k]
    #[arg(long = "k", value_name = "NAME", allow_hyphen_values = true)]
    k_name: Option<String>,
    /// Name of V in the safetensors file [default: v]
    #[arg(long = "v", value_name = "NAME", allow_hyphen_values = true)]
    v_name: Option<String>,
    /// Name of dO in the safetensors file, with --backward [default: do]
    #[arg(
        long = "do",
        value_name = "NAME",
        allow_hyphen_values = true,
        requires = "backward"
    )]
    do_name: Option<String>,
    /// Read Q, K and V from three .npy files instead
    #[arg(long, num_args = 3, value_names = ["Q", "K", "V"], allow_hyphen_values = true,
          action = ArgAction::Set, conflicts_with_all = ["q_name", "k_name", "v_name"])]
    npy: Option<Vec<PathBuf>>,
    /// Causal mask (bottom-right aligned when Nq != Nk)
    #[arg(long)]
    causal: bool,
    /// Softmax scale [default: 1/sqrt(d)]
    #[arg(long, value_name = "X", allow_negative_numbers = true, value_parser = parse_scale)]
    scale: Option<f32>,
    /// Run on the CPU even when a GPU is present
    #[arg(long)]
    cpu: bool,
    /// Also run the backward pass on dO and write dq, dk, dv
    #[arg(long)]
    backward: bool,
    /// Deterministic GPU backward (bit-identical run to run; the CPU backward always is)
    #[arg(long)]
    deterministic: bool,
    /// Output safetensors file holding `o` and `lse` (and `dq`, `dk`, `dv`)
    #[arg(
        short = 'o',
        long = "out",
        value_name = "FILE",
        default_value = "out.safetensors",
        allow_hyphen_values = true
    )]
    out: PathBuf,
    /// Also write o and lse as .npy files (f16/f32 inputs only)
    #[arg(long = "npy-out", num_args = 2, value_names = ["O", "LSE"],
          allow_hyphen_values = true, action = ArgAction::Set)]
    npy_out: Option<Vec<PathBuf>>,
}

fn parse_scale(s: &str) -> Result<f32, String> {
    let x: f32 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if x.is_finite() {
        Ok(x)
    } else {
        Err(format!("must be finite, got {s}"))
    }
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) => {
            use clap::error::ErrorKind;
            // Help goes to stdout and succeeds; every other command-line error exits 1, as
            // the errors found later do.
            let _ = e.print();
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => ExitCode::SUCCESS,
                _ => ExitCode::FAILURE,
            };
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flash-attn-cli: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The outputs, checked and with their temporary files created.
struct Outputs {
    safetensors: PendingOutput,
    npy: Option<(PendingOutput, PendingOutput)>,
}

fn run(args: &Args) -> Result<(), CliError> {
    if args.backward && args.npy.is_some() {
        return Err(CliError::Usage(
            "--backward reads Q, K, V and dO from a safetensors file; .npy input is not \
             supported for the backward pass"
                .into(),
        ));
    }
    if args.backward && args.npy_out.is_some() {
        return Err(CliError::Usage(
            "--backward writes its outputs to the safetensors file (-o); --npy-out is not \
             supported for the backward pass"
                .into(),
        ));
    }
    let mut inputs: Vec<(&'static str, &std::path::Path)> = Vec::new();
    if let Some(path) = &args.input {
        inputs.push(("input", path));
    }
    for (what, path) in ["--npy Q", "--npy K", "--npy V"]
        .into_iter()
        .zip(args.npy.iter().flatten())
    {
        inputs.push((what, path));
    }
    let mut outputs: Vec<(&'static str, &std::path::Path)> = vec![("-o", &args.out)];
    for (what, path) in ["--npy-out O", "--npy-out LSE"]
        .into_iter()
        .zip(args.npy_out.iter().flatten())
    {
        outputs.push((what, path));
    }
    check_aliases(&inputs, &outputs)?;
    let mut pending = outputs
        .iter()
        .map(|(what, path)| PendingOutput::prepare(what, path))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter();
    let safetensors = pending.next().expect("-o is always there");
    let npy = pending.next().zip(pending.next());
    let outputs = Outputs { safetensors, npy };

    let name = |n: &Option<String>, default: &str| n.clone().unwrap_or_else(|| default.to_string());
    if args.backward {
        let path = args
            .input
            .as_ref()
            .expect("--backward takes a safetensors input");
        let names = [
            name(&args.q_name, "q"),
            name(&args.k_name, "k"),
            name(&args.v_name, "v"),
            name(&args.do_name, "do"),
        ];
        let [q, k, v, d_o] = read_safetensors(path, &names)?;
        check_dtypes(&q, [&k, &v, &d_o])?;
        let params = AttnParams {
            causal: args.causal,
            softmax_scale: args.scale,
        };
        let raw = [&q, &k, &v, &d_o];
        let out = outputs.safetensors;
        return match q.dtype {
            DType::F16 => run_backward::<f16>(args, &params, raw, out),
            DType::BF16 => run_backward::<bf16>(args, &params, raw, out),
            DType::F32 => run_backward::<f32>(args, &params, raw, out),
        };
    }
    let [q, k, v] = match (&args.input, &args.npy) {
        (Some(path), _) => {
            let names = [
                name(&args.q_name, "q"),
                name(&args.k_name, "k"),
                name(&args.v_name, "v"),
            ];
            read_safetensors(path, &names)?
        }
        (None, Some(paths)) => [
            read_npy(&paths[0])?,
            read_npy(&paths[1])?,
            read_npy(&paths[2])?,
        ],
        (None, None) => {
            return Err(CliError::Usage(
                "no input: give a safetensors file or --npy Q K V".into(),
            ))
        }
    };
    check_dtypes(&q, [&k, &v])?;
    let params = AttnParams {
        causal: args.causal,
        softmax_scale: args.scale,
    };
    match q.dtype {
        DType::F16 => run_typed::<f16>(args, &params, [&q, &k, &v], outputs),
        DType::BF16 => run_typed::<bf16>(args, &params, [&q, &k, &v], outputs),
        DType::F32 => run_typed::<f32>(args, &params, [&q, &k, &v], outputs),
    }
}

/// Fails unless every tensor of `others` has Q's dtype.
fn check_dtypes<const N: usize>(q: &RawTensor, others: [&RawTensor; N]) -> Result<(), CliError> {
    for t in others {
        if t.dtype != q.dtype {
            return Err(CliError::MixedDtypes {
                q: q.name.clone(),
                q_dtype: format!("{:?}", q.dtype),
                other: t.name.clone(),
                other_dtype: format!("{:?}", t.dtype),
            });
        }
    }
    Ok(())
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

fn run_typed<T: FileElement>(
    args: &Args,
    params: &AttnParams,
    raw: [&RawTensor; 3],
    outputs: Outputs,
) -> Result<(), CliError> {
    if outputs.npy.is_some() && !T::HAS_NPY {
        return Err(CliError::Usage(format!(
            "--npy-out: {:?} has no .npy dtype; use the safetensors output",
            T::DTYPE
        )));
    }
    let [q, k, v] = raw.map(RawTensor::to_array::<T>);
    let (q, k, v) = (q?, k?, v?);
    let attention = |e: FlashError| CliError::Attention(e.to_string());
    // Shape errors are the same on both backends: report them before opening a GPU.
    let dims = |a: &Array4<T>| -> [usize; 4] { a.dim().into() };
    let shape = check_shapes(&dims(&q), &dims(&k), &dims(&v)).map_err(attention)?;
    let scale = params.scale(shape.head_dim).map_err(attention)?;
    let backend = pick_backend(T::DTYPE, args.cpu);
    let start = Instant::now();
    let (o, lse) = match &backend {
        Backend::Gpu(dev) => gpu_forward(dev, &q, &k, &v, params),
        Backend::Cpu => cpu::attention_cpu(q.view(), k.view(), v.view(), params),
    }
    .map_err(|e| match e {
        FlashError::HeadDim(_) if matches!(backend, Backend::Gpu(_)) => CliError::Attention(
            format!("{e} on the GPU; --cpu runs the CPU backend, which takes any head dim"),
        ),
        e => attention(e),
    })?;
    eprintln!(
        "flash-attn-cli: Q {:?} K {:?} {:?}{} in {:.1} ms",
        q.shape(),
        k.shape(),
        T::DTYPE,
        if params.causal { " causal" } else { "" },
        start.elapsed().as_secs_f64() * 1e3
    );

    let backend_name = match &backend {
        Backend::Gpu(dev) => format!("cuda:0 {}", dev.ptx_arch()),
        Backend::Cpu => "cpu".into(),
    };
    let metadata = HashMap::from([
        ("backend".to_string(), backend_name),
        ("causal".to_string(), params.causal.to_string()),
        ("softmax_scale".to_string(), scale.to_string()),
    ]);
    let Outputs {
        safetensors: mut st_out,
        npy,
    } = outputs;
    let tensors = [named("o", T::ST_DTYPE, &o), named("lse", Dtype::F32, &lse)];
    let st_bytes = safetensors_bytes(&tensors, metadata).map_err(|e| CliError::Format {
        path: st_out.path().to_path_buf(),
        message: e.to_string(),
    })?;
    st_out.fill(|w| w.write_all(&st_bytes))?;
    let o_values: Vec<T> = o.iter().copied().collect();
    let lse_values: Vec<f32> = lse.iter().copied().collect();
    let npy = match npy {
        Some((mut o_out, mut lse_out)) => {
            let unsupported = || std::io::Error::other("no .npy dtype");
            o_out.fill(|w| {
                T::write_npy(w, o.shape(), &o_values).unwrap_or_else(|| Err(unsupported()))
            })?;
            lse_out.fill(|w| {
                f32::write_npy(w, lse.shape(), &lse_values).unwrap_or_else(|| Err(unsupported()))
            })?;
            Some((o_out, lse_out))
        }
        None => None,
    };
    // Everything is on disk: only now are existing files replaced.
    let st_path = st_out.path().to_path_buf();
    st_out.commit()?;
    eprintln!(
        "flash-attn-cli: wrote {} (o {:?} {:?}, lse {:?} F32)",
        st_path.display(),
        o.shape(),
        T::DTYPE,
        lse.shape()
    );
    if let Some((o_out, lse_out)) = npy {
        let (o_path, lse_path) = (o_out.path().to_path_buf(), lse_out.path().to_path_buf());
        o_out.commit()?;
        lse_out.commit()?;
        eprintln!(
            "flash-attn-cli: wrote {} and {}",
            o_path.display(),
            lse_path.display()
        );
    }
    Ok(())
}

/// Forward and backward outputs: O, LSE, dQ, dK, dV.
type FwdBwd<T> = (Array4<T>, Array3<f32>, Array4<T>, Array4<T>, Array4<T>);

/// The forward and backward passes on the CPU backend.
fn cpu_forward_backward<T: Element>(
    [q, k, v, d_o]: [&Array4<T>; 4],
    params: &AttnParams,
) -> flash_attn::Result<FwdBwd<T>> {
    let (o, lse) = cpu::attention_cpu(q.view(), k.view(), v.view(), params)?;
    let (dq, dk, dv) = cpu::attention_backward_cpu(
        q.view(),
        k.view(),
        v.view(),
        o.view(),
        d_o.view(),
        lse.view(),
        params,
    )?;
    Ok((o, lse, dq, dk, dv))
}

/// The forward and backward passes on the GPU: upload, run, download.
fn gpu_forward_backward<T: Element>(
    dev: &Device,
    [q, k, v, d_o]: [&Array4<T>; 4],
    params: &AttnParams,
    deterministic: bool,
) -> flash_attn::Result<FwdBwd<T>> {
    let mode = if deterministic {
        BwdMode::Deterministic
    } else {
        BwdMode::Fast
    };
    let upload = |a: &Array4<T>| DeviceTensor::from_ndarray(dev, a.view());
    let (qd, kd, vd, dod) = (upload(q)?, upload(k)?, upload(v)?, upload(d_o)?);
    let (o, lse) = flash_attn::flash_attn(dev, &qd, &kd, &vd, params)?;
    let (dq, dk, dv) =
        flash_attn::flash_attn_backward(dev, &qd, &kd, &vd, &o, &dod, &lse, params, mode)?;
    let down4 = |t: &DeviceTensor<T>, name: &str| -> flash_attn::Result<Array4<T>> {
        t.to_ndarray(dev)?
            .into_dimensionality()
            .map_err(|e| FlashError::Shape(format!("{name}: {e}")))
    };
    let lse = lse
        .to_ndarray(dev)?
        .into_dimensionality()
        .map_err(|e| FlashError::Shape(format!("LSE: {e}")))?;
    Ok((
        down4(&o, "O")?,
        lse,
        down4(&dq, "dQ")?,
        down4(&dk, "dK")?,
        down4(&dv, "dV")?,
    ))
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

/// A tensor to write: name, dtype, shape and little-endian bytes.
type Named = (&'static str, Dtype, Vec<usize>, Vec<u8>);

/// An array as a [`Named`] tensor.
fn named<T: FileElement, D: ndarray::Dimension>(
    name: &'static str,
    dtype: Dtype,
    a: &ndarray::Array<T, D>,
) -> Named {
    (name, dtype, a.shape().to_vec(), le_bytes(a))
}

/// The safetensors file holding `tensors` (`o` and `lse`, and the gradients).
fn safetensors_bytes(
    tensors: &[Named],
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            Ok((*name, TensorView::new(*dtype, shape.clone(), bytes)?))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize(views, Some(metadata))
}

/// `--backward`: the forward and backward passes (on the GPU when one is usable for these
/// inputs, else on the CPU backend), and one safetensors output holding `o`, `lse`, `dq`,
/// `dk` and `dv`.
fn run_backward<T: FileElement>(
    args: &Args,
    params: &AttnParams,
    raw: [&RawTensor; 4],
    mut out: PendingOutput,
) -> Result<(), CliError> {
    let [q, k, v, d_o] = raw.map(RawTensor::to_array::<T>);
    let (q, k, v, d_o) = (q?, k?, v?, d_o?);
    let attention = |e: FlashError| CliError::Attention(e.to_string());
    let dims = |a: &Array4<T>| -> [usize; 4] { a.dim().into() };
    let shape = check_shapes(&dims(&q), &dims(&k), &dims(&v)).map_err(attention)?;
    shape
        .check_backward_inputs(&shape.q_dims(), &dims(&d_o), &shape.lse_dims())
        .map_err(|e| CliError::Attention(format!("{e} (tensor `{}`)", raw[3].name)))?;
    let scale = params.scale(shape.head_dim).map_err(attention)?;
    let gpu_backward = registry::bwd_kernel(shape.head_dim, MaskKind::Causal).is_some();
    let backend = if !gpu_backward {
        eprintln!(
            "flash-attn-cli: backward: CPU backend (no GPU backward kernel for head dim {})",
            shape.head_dim
        );
        Backend::Cpu
    } else {
        pick_backend(T::DTYPE, args.cpu)
    };
    let start = Instant::now();
    let (o, lse, dq, dk, dv) = match &backend {
        Backend::Gpu(dev) => {
            gpu_forward_backward(dev, [&q, &k, &v, &d_o], params, args.deterministic)
        }
        Backend::Cpu => cpu_forward_backward([&q, &k, &v, &d_o], params),
    }
    .map_err(attention)?;
    eprintln!(
        "flash-attn-cli: forward + backward: Q {:?} K {:?} {:?}{} in {:.1} ms",
        q.shape(),
        k.shape(),
        T::DTYPE,
        if params.causal { " causal" } else { "" },
        start.elapsed().as_secs_f64() * 1e3
    );
    let deterministic = args.deterministic || matches!(backend, Backend::Cpu);
    let backend_name = match &backend {
        Backend::Gpu(dev) => format!("cuda:0 {}", dev.ptx_arch()),
        Backend::Cpu => "cpu".to_string(),
    };
    let metadata = HashMap::from([
        ("backend".to_string(), backend_name),
        ("causal".to_string(), params.causal.to_string()),
        ("softmax_scale".to_string(), scale.to_string()),
        ("deterministic".to_string(), deterministic.to_string()),
    ]);
    let tensors = [
        named("o", T::ST_DTYPE, &o),
        named("lse", Dtype::F32, &lse),
        named("dq", T::ST_DTYPE, &dq),
        named("dk", T::ST_DTYPE, &dk),
        named("dv", T::ST_DTYPE, &dv),
    ];
    let bytes = safetensors_bytes(&tensors, metadata).map_err(|e| CliError::Format {
        path: out.path().to_path_buf(),
        message: e.to_string(),
    })?;
    out.fill(|w| w.write_all(&bytes))?;
    let path = out.path().to_path_buf();
    out.commit()?;
    eprintln!(
        "flash-attn-cli: wrote {} (o, dq {:?}, dk, dv {:?} {:?}; lse {:?} F32)",
        path.display(),
        o.shape(),
        dk.shape(),
        T::DTYPE,
        lse.shape()
    );
    Ok(())
}

/// Little-endian bytes of an array's elements in logical (C) order.
fn le_bytes<T: FileElement, D: ndarray::Dimension>(a: &ndarray::Array<T, D>) -> Vec<u8> {
    let mut out = Vec::with_capacity(a.len() * std::mem::size_of::<T>());
    for x in a.iter() {
        x.put_le(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn parses_options() {
        let a = Args::try_parse_from([
            "flash-attn-cli",
            "in.safetensors",
            "--k",
            "key",
            "--causal",
            "--scale",
            "-0.5",
            "--cpu",
            "-o",
            "x.safetensors",
        ])
        .unwrap();
        assert!(a.causal && a.cpu);
        assert_eq!(a.scale, Some(-0.5));
        assert_eq!(a.out, PathBuf::from("x.safetensors"));
        assert_eq!(a.input, Some(PathBuf::from("in.safetensors")));
        assert_eq!((a.q_name, a.k_name), (None, Some("key".into())));
        let a = Args::try_parse_from(["flash-attn-cli", "--npy", "a", "b", "c"]).unwrap();
        assert_eq!(a.npy.map(|v| v.len()), Some(3));
        assert_eq!(a.out, PathBuf::from("out.safetensors"));
        assert!(!a.backward && !a.deterministic);
        let a = Args::try_parse_from([
            "flash-attn-cli",
            "in.safetensors",
            "--backward",
            "--do",
            "grad",
            "--deterministic",
        ])
        .unwrap();
        assert!(a.backward && a.deterministic);
        assert_eq!(a.do_name, Some("grad".into()));
        assert!(Args::try_parse_from(["flash-attn-cli", "in.safetensors", "--do", "g"]).is_err());
    }
}
