//! `flash-attn-cli`: forward attention on tensors stored in files.
//!
//! Reads Q, K and V (`[B, N, H, d]`, F16, BF16 or F32) from one `.safetensors` file or from
//! three `.npy` files, runs the forward pass on GPU 0 when there is one (the CPU backend
//! otherwise, or with `--cpu`), and writes `o` (Q's shape, the input dtype) and `lse`
//! (`[B, Hq, Nq]`, f32, natural log) to a `.safetensors` file. With `--backward` it also reads
//! dO (`do`) and writes the gradients `dq`, `dk`, `dv`, computed on the CPU backend (forward
//! and backward both, so that the five outputs agree). With `--decode` it reads a KV cache
//! (contiguous or paged), appends the new keys and values when given, runs
//! `attn_with_kvcache` (or its CPU twin) and writes `o`, `lse` and the updated cache.
//! `--dropout P` (forward and backward) applies attention dropout, its mask drawn from
//! `--seed` and `--offset`, and writes the RNG state `rng_state` (and, with
//! `--return-dropout-mask`, the mask itself). See `--help`.
//!
//! The file handling (bounded readers, output checks, writes through temporary files) is in
//! the `flash_attn_cli` library; this file is the command line and the passes.

use clap::{ArgAction, Parser};
use flash_attn::shape::{check_shapes, AttnShape};
use flash_attn::{
    cpu, AttnParams, BlockMask, BwdMode, DType, DecodeOptions, Device, DeviceTensor, Dropout,
    Element, FlashError, HostVarlen, TreeMask, Varlen,
};
use flash_attn_cli::input::{
    read_npy, read_safetensors, FileElement, RawTensor, SafetensorsFile, FLOAT_DTYPES,
    FLOAT_SUPPORTED,
};
use flash_attn_cli::output::{check_aliases, PendingOutput};
use flash_attn_cli::CliError;
use flash_attn_kernels::config::MAX_DECODE_SPLITS;
use flash_attn_kernels::registry;
use half::{bf16, f16};
use ndarray::{Array1, Array2, Array3, Array4, ArrayView3, Axis, Ix1, Ix2};
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
    [B, Hq, Nq] (f32, natural log), with metadata `backend`, `causal`, `softmax_scale`,
    `window`, `softcap`, `alibi` and `dropout` (P, or none; with P > 0 also `seed` and
    `offset`).
    An output may not be the same file as an input or as another output. Outputs are
    checked before the forward pass and written through a temporary file in the same
    directory, renamed into place, so a failed run leaves existing files as they were.

MASKS:
    --causal, --window L,R (query i sees keys i + Nk - Nq - L ..= i + Nk - Nq + R; -1: that
    side unbounded), --softcap C (logits C·tanh(scale·q·k / C)) and ALiBi: the safetensors
    input's `alibi_slopes` (F32, [Hq] or [B, Hq]; bias -slope·|i + Nk - Nq - j|) when present.
    They combine, and apply to the forward, --backward and --decode alike.

SEQUENCES OF DIFFERENT LENGTHS (forward and --backward, safetensors input):
    cu_seqlens_q, cu_seqlens_k (I32, [B + 1] prefix sums from 0 to the totals): a packed
    varlen batch; q, k, v (and do) are [total, H, d], sequence b is rows cu[b] .. cu[b + 1];
    the outputs o, dq are [total_q, Hq, d], dk, dv [total_k, Hkv, d], lse [Hq, total_q].
    seqlens_k (I32, [B]): key padding; entry b of a padded batch sees its first seqlens_k[b]
    keys. Masks align to each sequence's own lengths; alibi_slopes [B, Hq] are per sequence.

BLOCK-SPARSE (forward and --backward, safetensors input):
    block_mask (I32, [B or 1, Hq or 1, ceil(Nq/128), ceil(Nk/128)]): nonzero where query block
    i (queries 128·i ..) may see key block j; zero blocks are skipped. Combines with --causal
    and GQA; not with --window, --softcap, alibi_slopes, seqlens_k or a varlen batch.

TREE MASKS (speculative decoding: forward, --decode and --backward):
    tree_mask (I32, [B or 1, T, T]: nonzero where draft i sees draft t) or tree_parents (I32,
    [B or 1, T]: each draft's parent, an earlier draft or -1 for one that continues the
    prefix; a draft sees itself and its ancestors). The T queries are the drafts, the last T
    keys the same drafts (appended with k_new/v_new in --decode), and every key before them
    stays visible. Combines with --causal and GQA.

BACKWARD (--backward):
    Also reads dO (`do`, or --do NAME) [B, Nq, Hq, d], Q's shape and dtype, from the
    safetensors input (.npy input and --npy-out are not supported with --backward), and
    writes `o`, `lse`, `dq` [B, Nq, Hq, d] and `dk`, `dv` [B, Nk, Hkv, d] (input dtype; dK and
    dV of a shared KV head sum over its query heads) to -o. Both passes run on GPU 0 like the
    forward (f16/bf16, head dims up to 256), else on the CPU backend.
    The GPU backward adds dQ with f32 atomics, so its low bits can vary run to run;
    --deterministic selects its deterministic mode (bit-identical results, slower). The CPU
    backward is always deterministic.

DROPOUT (forward and --backward):
    --dropout P (0 <= P < 1) drops each softmax probability with probability P and scales
    the kept ones by 1/(1 - P); the LSE is that of the softmax before dropout. The mask is
    drawn from Philox keyed by --seed S and --offset O (u64, default 0; both need --dropout)
    and counted by (sequence, query head, query, key): the same flags draw the same mask on
    every backend, and --backward regenerates the forward's. With P > 0 the output also
    holds `rng_state` (I64 [2]: the seed and offset, their u64 bits; the forward's RNG state,
    which a backward needs) and metadata `seed` and `offset`; --dropout 0 is no dropout.
    --return-dropout-mask also writes `dropout_mask` (U8 [B, Hq, Nq, Nk], 1 = kept; with
    seqlens_k the padded batch's; not with a varlen batch). It costs O(B·Hq·Nq·Nk) time and
    memory: for tests at small sizes. Not with --decode.

DECODE (--decode):
    Attention of new query tokens over a KV cache, as flash_attn::attn_with_kvcache. Reads
    from the safetensors input `q` [B, Nq, Hq, d], `k_cache` and `v_cache`, `cache_seqlens`
    (I32 [B]: the keys cached per sequence), and optionally `block_table` (I32
    [B, max_pages]) and `k_new`, `v_new` [B, N_new, Hkv, d] (both or neither). Without
    `block_table` the cache is contiguous, [B, capacity, Hkv, d]; with it, paged:
    [num_pages, page_size, Hkv, d], page_size a multiple of 16, key j of sequence b in row
    j % page_size of page block_table[b, j / page_size]. The new keys and values are written
    into the cache at keys cache_seqlens[b] .. cache_seqlens[b] + N_new, and sequence b
    attends to its first cache_seqlens[b] + N_new keys (--causal: aligned bottom-right).
    Writes `o`, `lse` and the updated `k_cache`, `v_cache` (the inputs' shapes and dtype; the
    lengths are not advanced) to -o, with metadata `mode` = decode. Runs on GPU 0 (f16/bf16,
    head dims up to 256) like the forward, else on the CPU backend. --num-splits N (1 to
    128, GPU only) forces the number of key splits. Not with --backward, --npy or --npy-out.

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
    /// Name of Q in the safetensors file (also with --decode) [default: q]
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
    /// Sliding window: query i sees keys i + Nk - Nq - LEFT ..= i + Nk - Nq + RIGHT (-1: no
    /// bound on that side)
    #[arg(long, value_name = "LEFT,RIGHT", allow_hyphen_values = true, value_parser = parse_window)]
    window: Option<(usize, usize)>,
    /// Logit softcap C > 0: the logits are C·tanh(scale·q·k / C)
    #[arg(long, value_name = "C", value_parser = parse_softcap)]
    softcap: Option<f32>,
    /// Run on the CPU even when a GPU is present
    #[arg(long)]
    cpu: bool,
    /// Also run the backward pass on dO and write dq, dk, dv
    #[arg(long)]
    backward: bool,
    /// Deterministic GPU backward (bit-identical run to run; the CPU backward always is)
    #[arg(long)]
    deterministic: bool,
    /// Attention over a KV cache (q, k_cache, v_cache, cache_seqlens; optional block_table,
    /// k_new, v_new), writing o, lse and the updated cache
    #[arg(long, conflicts_with_all = [
        "backward", "npy", "npy_out", "k_name", "v_name", "do_name", "deterministic",
        "dropout", "seed", "offset", "return_dropout_mask",
    ])]
    decode: bool,
    /// Attention dropout: drop each softmax probability with probability P (0 <= P < 1) and
    /// scale the kept ones by 1/(1 - P) (forward and --backward)
    #[arg(long, value_name = "P", allow_negative_numbers = true, value_parser = parse_dropout)]
    dropout: Option<f32>,
    /// Philox seed of the dropout mask, with --dropout [default: 0]
    #[arg(long, value_name = "S", requires = "dropout")]
    seed: Option<u64>,
    /// Philox offset of the dropout mask, with --dropout [default: 0]
    #[arg(long, value_name = "O", requires = "dropout")]
    offset: Option<u64>,
    /// Also write the dropout mask `dropout_mask` (U8 [B, Hq, Nq, Nk], 1 = kept), with
    /// --dropout: O(B·Hq·Nq·Nk), for tests at small sizes
    #[arg(long, requires = "dropout")]
    return_dropout_mask: bool,
    /// Number of key splits of the GPU decode (1 to 128) [default: automatic]
    #[arg(long, value_name = "N", requires = "decode", value_parser = parse_num_splits)]
    num_splits: Option<usize>,
    /// Output safetensors file holding `o` and `lse` (and `dq`, `dk`, `dv`, or the updated
    /// `k_cache`, `v_cache`)
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

/// `LEFT,RIGHT` with each side a count of keys or -1 (unbounded).
fn parse_window(s: &str) -> Result<(usize, usize), String> {
    let side = |x: &str| match x.trim() {
        "-1" => Ok(usize::MAX),
        x => x
            .parse::<usize>()
            .map_err(|_| format!("`{x}` is not a window side (a number of keys ≥ 0, or -1)")),
    };
    match s.split_once(',') {
        Some((l, r)) => Ok((side(l)?, side(r)?)),
        None => Err(format!("`{s}` is not LEFT,RIGHT")),
    }
}

fn parse_softcap(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("`{s}` is not a finite softcap > 0")),
    }
}

/// A dropout probability: a number in [0, 1) (NaN is not).
fn parse_dropout(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        // -0 is 0.
        Ok(p) if (0.0..1.0).contains(&p) => Ok(p + 0.0),
        _ => Err(format!("`{s}` is not a dropout probability in [0, 1)")),
    }
}

fn parse_num_splits(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_DECODE_SPLITS).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a number of splits from 1 to {MAX_DECODE_SPLITS}"
        )),
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
    if args.decode {
        let path = args
            .input
            .as_ref()
            .expect("--decode takes a safetensors input");
        let file = SafetensorsFile::read(path)?;
        return run_decode(args, &file, &name(&args.q_name, "q"), outputs.safetensors);
    }
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
        let [mut q, mut k, mut v, mut d_o] = read_safetensors(path, &names)?;
        check_dtypes(&q, [&k, &v, &d_o])?;
        let seqs = read_seqs(args, [&mut q, &mut k, &mut v, &mut d_o])?;
        check_mask_request(args, &seqs)?;
        let masks = MaskInputs::read(args, seqs.batch(&q.shape), dim(&q.shape, 2))?;
        let params = masks.params(args, seqs.seqlens_k.as_deref());
        let raw = [&q, &k, &v, &d_o];
        let out = outputs.safetensors;
        return match q.dtype {
            DType::F16 => run_backward::<f16>(args, &params, &seqs, raw, out),
            DType::BF16 => run_backward::<bf16>(args, &params, &seqs, raw, out),
            DType::F32 => run_backward::<f32>(args, &params, &seqs, raw, out),
            DType::I32 => unreachable!("read_safetensors reads float tensors only"),
        };
    }
    let [mut q, mut k, mut v] = match (&args.input, &args.npy) {
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
    let seqs = read_seqs(args, [&mut q, &mut k, &mut v])?;
    check_mask_request(args, &seqs)?;
    let masks = MaskInputs::read(args, seqs.batch(&q.shape), dim(&q.shape, 2))?;
    let params = masks.params(args, seqs.seqlens_k.as_deref());
    match q.dtype {
        DType::F16 => run_typed::<f16>(args, &params, &seqs, [&q, &k, &v], outputs),
        DType::BF16 => run_typed::<bf16>(args, &params, &seqs, [&q, &k, &v], outputs),
        DType::F32 => run_typed::<f32>(args, &params, &seqs, [&q, &k, &v], outputs),
        DType::I32 => unreachable!("the readers read float tensors only"),
    }
}

/// The masks the safetensors input may hold beside the flags: ALiBi slopes, a block mask and
/// a tree mask (each `None` when absent, or with .npy input).
struct MaskInputs {
    alibi: Option<Vec<f32>>,
    blocks: Option<BlockMask>,
    tree: Option<TreeMask>,
}

impl MaskInputs {
    /// Reads them for a call of `batch` sequences and `heads_q` query heads.
    fn read(args: &Args, batch: usize, heads_q: usize) -> Result<Self, CliError> {
        Ok(Self {
            alibi: read_alibi(args, batch, heads_q)?,
            blocks: read_block_mask(args)?,
            tree: read_tree(args)?,
        })
    }

    /// The options of the call: the flags (dropout included), these masks and `seqlens_k`
    /// (from [`read_seqs`]).
    fn params<'a>(&'a self, args: &Args, seqlens_k: Option<&'a [i32]>) -> AttnParams<'a> {
        AttnParams {
            causal: args.causal,
            softmax_scale: args.scale,
            window: args.window,
            softcap: args.softcap,
            alibi_slopes: self.alibi.as_deref(),
            seqlens_k,
            block_mask: self.blocks.as_ref(),
            tree_mask: self.tree.as_ref().map(TreeMask::as_ref),
            dropout: args
                .dropout
                .map(|p| Dropout::new(p, args.seed.unwrap_or(0), args.offset.unwrap_or(0))),
        }
    }
}

/// The tree mask of the safetensors input: `tree_mask` (I32 `[B or 1, T, T]`, nonzero where
/// draft `i` sees draft `t`) or `tree_parents` (I32 `[B or 1, T]`: each draft's parent, −1
/// for one that continues the prefix), or `None`.
fn read_tree(args: &Args) -> Result<Option<TreeMask>, CliError> {
    let Some(path) = &args.input else {
        return Ok(None);
    };
    let file = SafetensorsFile::read(path)?;
    let int = |name| {
        file.tensor(
            name,
            &[DType::I32],
            "tree_mask and tree_parents must be I32",
        )
    };
    let attention = |e: FlashError| CliError::Attention(e.to_string());
    match (int("tree_mask")?, int("tree_parents")?) {
        (Some(_), Some(_)) => Err(CliError::Attention(
            "give tree_mask or tree_parents, not both".into(),
        )),
        (Some(t), None) => {
            let dense = t.to_array_nd::<i32, ndarray::Ix3>("[B or 1, T, T]")?;
            let (b, n, m) = dense.dim();
            if n != m {
                return Err(CliError::Attention(format!(
                    "tree_mask is {:?}, expected [B or 1, T, T]",
                    dense.shape()
                )));
            }
            let values: Vec<i32> = dense.iter().copied().collect();
            TreeMask::from_dense(b, n, &values)
                .map(Some)
                .map_err(attention)
        }
        (None, Some(t)) => {
            let parents = t.to_array_nd::<i32, Ix2>("[B or 1, T]")?;
            let (b, n) = parents.dim();
            let values: Vec<i32> = parents.iter().copied().collect();
            TreeMask::from_parents(b, n, &values)
                .map(Some)
                .map_err(attention)
        }
        (None, None) => Ok(None),
    }
}

/// The block-sparse mask `block_mask` of the safetensors input (I32 `[B or 1, H or 1,
/// ⌈Nq/128⌉, ⌈Nk/128⌉]`, nonzero where a 128 × 128 block is visible), or `None`.
fn read_block_mask(args: &Args) -> Result<Option<BlockMask>, CliError> {
    let Some(path) = &args.input else {
        return Ok(None);
    };
    let file = SafetensorsFile::read(path)?;
    let Some(t) = file.tensor("block_mask", &[DType::I32], "block_mask must be I32")? else {
        return Ok(None);
    };
    let dense = t.to_array_nd::<i32, ndarray::Ix4>("[B or 1, H or 1, query blocks, key blocks]")?;
    let dims: [usize; 4] = dense.dim().into();
    let values: Vec<i32> = dense.iter().copied().collect();
    BlockMask::from_dense(dims, &values)
        .map(Some)
        .map_err(|e| CliError::Attention(e.to_string()))
}

/// Per-sequence lengths from the safetensors input: a packed varlen batch (`cu_seqlens_q`,
/// `cu_seqlens_k`) or key padding (`seqlens_k`).
#[derive(Default)]
struct Seqs {
    /// The prefix sums of a varlen batch, `[B + 1]` each.
    varlen: Option<(Vec<i32>, Vec<i32>)>,
    /// Keys per batch entry of a padded batch, `[B]`.
    seqlens_k: Option<Vec<i32>>,
}

impl Seqs {
    /// The batch size: the number of sequences of a varlen batch, else Q's first dim.
    fn batch(&self, q_shape: &[usize]) -> usize {
        match &self.varlen {
            Some((cu_q, _)) => cu_q.len().saturating_sub(1),
            None => dim(q_shape, 0),
        }
    }
}

/// Size `i` of `shape`, 0 past its rank (the rank is checked where the tensor is decoded).
fn dim(shape: &[usize], i: usize) -> usize {
    shape.get(i).copied().unwrap_or(0)
}

/// The names of the lengths tensors.
const SEQ_NAMES: [&str; 3] = ["cu_seqlens_q", "cu_seqlens_k", "seqlens_k"];

/// Reads the lengths tensors of the safetensors input (I32, rank 1). With a varlen batch the
/// float tensors are packed `[total, H, d]`: they are given a leading batch dim of 1 here (the
/// passes run them as one batch entry; the outputs drop it again).
fn read_seqs<const N: usize>(args: &Args, tensors: [&mut RawTensor; N]) -> Result<Seqs, CliError> {
    let Some(path) = &args.input else {
        return Ok(Seqs::default());
    };
    let file = SafetensorsFile::read(path)?;
    let read = |name: &str| -> Result<Option<Vec<i32>>, CliError> {
        let Some(t) = file.tensor(
            name,
            &[DType::I32],
            "cu_seqlens_q, cu_seqlens_k and seqlens_k must be I32",
        )?
        else {
            return Ok(None);
        };
        Ok(Some(t.to_array_nd::<i32, Ix1>("[N]")?.to_vec()))
    };
    let [cu_q, cu_k, lens] = SEQ_NAMES.map(read);
    let seqs = match (cu_q?, cu_k?, lens?) {
        (Some(q), Some(k), None) => Seqs {
            varlen: Some((q, k)),
            seqlens_k: None,
        },
        (None, None, lens) => Seqs {
            varlen: None,
            seqlens_k: lens,
        },
        (Some(_), Some(_), Some(_)) => {
            return Err(CliError::Attention(
                "seqlens_k (key padding of a padded batch) cannot be combined with cu_seqlens_q/cu_seqlens_k (varlen)".into(),
            ))
        }
        _ => {
            return Err(CliError::Attention(
                "give both cu_seqlens_q and cu_seqlens_k (a varlen batch), or neither".into(),
            ))
        }
    };
    if seqs.varlen.is_some() {
        for t in tensors {
            if t.shape.len() != 3 {
                return Err(CliError::Attention(format!(
                    "`{}` is {:?}: with cu_seqlens_q/cu_seqlens_k the tensors are packed [total, H, d]",
                    t.name, t.shape
                )));
            }
            t.shape.insert(0, 1);
        }
    }
    Ok(seqs)
}

/// Fails when `--return-dropout-mask` is asked of a varlen batch, whose mask has no padded
/// `[B, Hq, Nq, Nk]` form.
fn check_mask_request(args: &Args, seqs: &Seqs) -> Result<(), CliError> {
    if args.return_dropout_mask && seqs.varlen.is_some() {
        return Err(CliError::Usage(
            "--return-dropout-mask writes the mask of a padded batch, [B, Hq, Nq, Nk]; it is \
             not supported with a varlen batch (cu_seqlens_q/cu_seqlens_k); key padding \
             (seqlens_k) is"
                .into(),
        ));
    }
    Ok(())
}

/// The dropout outputs of a call of `shape` run on `backend`: `rng_state` (I64 `[2]`: seed,
/// offset) when dropout is on, and `dropout_mask` (U8 `[B, Hq, Nq, Nk]`, 1 = kept) with
/// `--return-dropout-mask`, drawn by the backend that ran the call (all ones for `P = 0`).
fn dropout_outputs(
    args: &Args,
    backend: &Backend,
    params: &AttnParams,
    shape: &AttnShape,
) -> Result<Vec<Named>, CliError> {
    let attention = |e: FlashError| CliError::Attention(e.to_string());
    let mut out = Vec::new();
    let active = params.active_dropout().map_err(attention)?;
    if let Some(d) = &active {
        // The u64 seed and offset as I64 (their bits; PyTorch keeps its RNG state in int64).
        let state = [d.rng.seed, d.rng.offset].map(|x| x as i64);
        out.push((
            "rng_state",
            Dtype::I64,
            vec![2],
            state.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    }
    if args.return_dropout_mask {
        let dims = [shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k];
        let mask = match (backend, &active) {
            (Backend::Gpu(dev), Some(d)) => {
                flash_attn::flash_attn_dropout_mask(dev, dims, d).map_err(attention)?
            }
            // On the CPU, and for P = 0 (every element kept) on either backend.
            _ => {
                let d = params.dropout.unwrap_or_default();
                let [b, h, nq, nk] = dims;
                let mask = cpu::dropout_mask(b, h, nq, nk, &d).map_err(attention)?;
                if mask.is_standard_layout() {
                    mask.into_raw_vec_and_offset().0
                } else {
                    mask.iter().copied().collect()
                }
            }
        };
        out.push(("dropout_mask", Dtype::U8, dims.to_vec(), mask));
    }
    Ok(out)
}

/// The ALiBi slopes `alibi_slopes` of the safetensors input (F32, `[Hq]` or `[B, Hq]` for `b`
/// sequences of `hq` query heads), or `None` when it has none (or the input is .npy files).
fn read_alibi(args: &Args, b: usize, hq: usize) -> Result<Option<Vec<f32>>, CliError> {
    let Some(path) = &args.input else {
        return Ok(None);
    };
    let file = SafetensorsFile::read(path)?;
    let Some(t) = file.tensor(ALIBI_NAME, &[DType::F32], "alibi_slopes must be F32")? else {
        return Ok(None);
    };
    if t.shape != [hq] && t.shape != [b, hq] {
        return Err(CliError::Attention(format!(
            "alibi_slopes is {:?}, expected [{hq}] ([Hq]) or [{b}, {hq}] ([B, Hq])",
            t.shape
        )));
    }
    let slopes = t.bytes.chunks_exact(4);
    Ok(Some(
        slopes
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
    ))
}

/// The name of the ALiBi slopes in the safetensors input.
const ALIBI_NAME: &str = "alibi_slopes";

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
    Gpu(Box<Device>),
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
            Backend::Gpu(Box::new(dev))
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
    seqs: &Seqs,
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
        Backend::Gpu(dev) => gpu_forward(dev, [&q, &k, &v], params, seqs),
        Backend::Cpu => cpu_forward([&q, &k, &v], params, seqs),
    }
    .map_err(|e| match e {
        FlashError::HeadDim(_) if matches!(backend, Backend::Gpu(_)) => CliError::Attention(
            format!("{e} on the GPU; --cpu runs the CPU backend, which takes any head dim"),
        ),
        e => attention(e),
    })?;
    eprintln!(
        "flash-attn-cli: Q {:?} K {:?} {:?}{}{} in {:.1} ms",
        q.shape(),
        k.shape(),
        T::DTYPE,
        if params.causal { " causal" } else { "" },
        dropout_summary(params),
        start.elapsed().as_secs_f64() * 1e3
    );

    let Outputs {
        safetensors: mut st_out,
        npy,
    } = outputs;
    let (o, lse) = (unbatch(o, seqs), unbatch(lse, seqs));
    let mut tensors = vec![named("o", T::ST_DTYPE, &o), named("lse", Dtype::F32, &lse)];
    tensors.extend(dropout_outputs(args, &backend, params, &shape)?);
    fill_safetensors(
        &mut st_out,
        &tensors,
        metadata(&backend, params, scale, seqs, []),
    )?;
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

/// A varlen call's outputs as written: without the leading batch dim of 1 that the passes
/// run the packed tensors with ([`read_seqs`]); other calls' outputs unchanged.
fn unbatch<T, D: ndarray::RemoveAxis>(a: ndarray::Array<T, D>, seqs: &Seqs) -> ndarray::ArrayD<T> {
    match seqs.varlen {
        Some(_) => a.index_axis_move(Axis(0), 0).into_dyn(),
        None => a.into_dyn(),
    }
}

/// A packed tensor run as one batch entry, as the varlen API takes it (`[total, H, d]`).
fn packed<T>(a: &Array4<T>) -> ArrayView3<'_, T> {
    a.index_axis(Axis(0), 0)
}

/// The forward pass on the CPU backend.
fn cpu_forward<T: Element>(
    [q, k, v]: [&Array4<T>; 3],
    params: &AttnParams,
    seqs: &Seqs,
) -> flash_attn::Result<(Array4<T>, Array3<f32>)> {
    match &seqs.varlen {
        None => cpu::attention_cpu(q.view(), k.view(), v.view(), params),
        Some((cu_q, cu_k)) => {
            let (o, lse) =
                cpu::attention_varlen_cpu(packed(q), packed(k), packed(v), (cu_q, cu_k), params)?;
            Ok((o.insert_axis(Axis(0)), lse.insert_axis(Axis(0))))
        }
    }
}

/// The forward and backward passes on the CPU backend.
fn cpu_forward_backward<T: Element>(
    [q, k, v, d_o]: [&Array4<T>; 4],
    params: &AttnParams,
    seqs: &Seqs,
) -> flash_attn::Result<FwdBwd<T>> {
    let (o, lse) = cpu_forward([q, k, v], params, seqs)?;
    let (dq, dk, dv) = match &seqs.varlen {
        None => cpu::attention_backward_cpu(
            q.view(),
            k.view(),
            v.view(),
            o.view(),
            d_o.view(),
            lse.view(),
            params,
        )?,
        Some((cu_q, cu_k)) => {
            let (dq, dk, dv) = cpu::attention_varlen_backward_cpu(
                packed(q),
                packed(k),
                packed(v),
                packed(&o),
                packed(d_o),
                lse.index_axis(Axis(0), 0),
                (cu_q, cu_k),
                params,
            )?;
            let b = |t: Array3<T>| t.insert_axis(Axis(0));
            (b(dq), b(dk), b(dv))
        }
    };
    Ok((o, lse, dq, dk, dv))
}

/// A varlen call's prefix sums on the device, with their host copy.
struct DeviceCu {
    q: DeviceTensor<i32>,
    k: DeviceTensor<i32>,
}

impl DeviceCu {
    fn upload(dev: &Device, (cu_q, cu_k): &(Vec<i32>, Vec<i32>)) -> flash_attn::Result<Self> {
        Ok(Self {
            q: DeviceTensor::from_host(dev, &[cu_q.len()], cu_q)?,
            k: DeviceTensor::from_host(dev, &[cu_k.len()], cu_k)?,
        })
    }

    fn varlen<'a>(&'a self, host: &'a (Vec<i32>, Vec<i32>)) -> Varlen<'a> {
        Varlen {
            cu_seqlens_q: &self.q,
            cu_seqlens_k: &self.k,
            host: Some(HostVarlen {
                cu_seqlens_q: &host.0,
                cu_seqlens_k: &host.1,
            }),
        }
    }
}

/// Uploads a tensor (packed `[total, H, d]` for a varlen call).
fn upload<T: Element>(
    dev: &Device,
    a: &Array4<T>,
    seqs: &Seqs,
) -> flash_attn::Result<DeviceTensor<T>> {
    match seqs.varlen {
        Some(_) => DeviceTensor::from_ndarray(dev, packed(a)),
        None => DeviceTensor::from_ndarray(dev, a.view()),
    }
}

/// Downloads a tensor as `[B, N, H, d]` (a leading 1 for a varlen call's packed tensors).
fn download4<T: Element>(
    dev: &Device,
    t: &DeviceTensor<T>,
    name: &str,
) -> flash_attn::Result<Array4<T>> {
    let a = t.to_ndarray(dev)?;
    let a = if a.ndim() == 3 {
        a.insert_axis(Axis(0))
    } else {
        a
    };
    a.into_dimensionality()
        .map_err(|e| FlashError::Shape(format!("{name}: {e}")))
}

/// Downloads LSE as `[B, Hq, Nq]` (a leading 1 for a varlen call's `[Hq, total_q]`).
fn download_lse(dev: &Device, t: &DeviceTensor<f32>) -> flash_attn::Result<Array3<f32>> {
    let a = t.to_ndarray(dev)?;
    let a = if a.ndim() == 2 {
        a.insert_axis(Axis(0))
    } else {
        a
    };
    a.into_dimensionality()
        .map_err(|e| FlashError::Shape(format!("LSE: {e}")))
}

/// The forward and backward passes on the GPU: upload, run, download.
fn gpu_forward_backward<T: Element>(
    dev: &Device,
    [q, k, v, d_o]: [&Array4<T>; 4],
    params: &AttnParams,
    seqs: &Seqs,
    deterministic: bool,
) -> flash_attn::Result<FwdBwd<T>> {
    let mode = if deterministic {
        BwdMode::Deterministic
    } else {
        BwdMode::Fast
    };
    let up = |a: &Array4<T>| upload(dev, a, seqs);
    let (qd, kd, vd, dod) = (up(q)?, up(k)?, up(v)?, up(d_o)?);
    let ((o, lse), (dq, dk, dv)) = match &seqs.varlen {
        None => {
            let (o, lse) = flash_attn::flash_attn(dev, &qd, &kd, &vd, params)?;
            let grads =
                flash_attn::flash_attn_backward(dev, &qd, &kd, &vd, &o, &dod, &lse, params, mode)?;
            ((o, lse), grads)
        }
        Some(host) => {
            let cu = DeviceCu::upload(dev, host)?;
            let varlen = cu.varlen(host);
            let (o, lse) = flash_attn::flash_attn_varlen(dev, &qd, &kd, &vd, &varlen, params)?;
            let grads = flash_attn::flash_attn_varlen_backward(
                dev, &qd, &kd, &vd, &o, &dod, &lse, &varlen, params, mode,
            )?;
            ((o, lse), grads)
        }
    };
    Ok((
        download4(dev, &o, "O")?,
        download_lse(dev, &lse)?,
        download4(dev, &dq, "dQ")?,
        download4(dev, &dk, "dK")?,
        download4(dev, &dv, "dV")?,
    ))
}

/// The forward pass on the GPU: upload, run, download.
fn gpu_forward<T: Element>(
    dev: &Device,
    [q, k, v]: [&Array4<T>; 3],
    params: &AttnParams,
    seqs: &Seqs,
) -> flash_attn::Result<(Array4<T>, Array3<f32>)> {
    let up = |a: &Array4<T>| upload(dev, a, seqs);
    let (qd, kd, vd) = (up(q)?, up(k)?, up(v)?);
    let (o, lse) = match &seqs.varlen {
        None => flash_attn::flash_attn(dev, &qd, &kd, &vd, params)?,
        Some(host) => {
            let cu = DeviceCu::upload(dev, host)?;
            flash_attn::flash_attn_varlen(dev, &qd, &kd, &vd, &cu.varlen(host), params)?
        }
    };
    Ok((download4(dev, &o, "O")?, download_lse(dev, &lse)?))
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

/// The metadata of every output file: `backend`, `causal`, `softmax_scale`, the masks, the
/// lengths and the dropout ([`dropout_metadata`]), then `extra`.
fn metadata<const N: usize>(
    backend: &Backend,
    params: &AttnParams,
    scale: f32,
    seqs: &Seqs,
    extra: [(&str, String); N],
) -> HashMap<String, String> {
    let backend = match backend {
        Backend::Gpu(dev) => format!("cuda:0 {}", dev.ptx_arch()),
        Backend::Cpu => "cpu".to_string(),
    };
    [
        ("backend".to_string(), backend),
        ("causal".to_string(), params.causal.to_string()),
        ("softmax_scale".to_string(), scale.to_string()),
        ("window".to_string(), {
            let (l, r) = params.window_bounds();
            let side = |x: u32| if x == u32::MAX { -1 } else { i64::from(x) };
            format!("{},{}", side(l), side(r))
        }),
        (
            "softcap".to_string(),
            params.softcap.map_or("none".into(), |c| c.to_string()),
        ),
        (
            "alibi".to_string(),
            params.alibi_slopes.is_some().to_string(),
        ),
        ("varlen".to_string(), seqs.varlen.is_some().to_string()),
        (
            "tree".to_string(),
            params
                .tree_mask
                .map_or("none".into(), |t| format!("{:?}", t.dims())),
        ),
        (
            "block_mask".to_string(),
            params.block_mask.map_or("none".into(), |m| {
                format!("{:?} density {:.4}", m.dims(), m.density())
            }),
        ),
        (
            "seqlens_k".to_string(),
            seqs.seqlens_k.is_some().to_string(),
        ),
    ]
    .into_iter()
    .chain(dropout_metadata(params))
    .chain(extra.into_iter().map(|(k, v)| (k.to_string(), v)))
    .collect()
}

/// The dropout's metadata: `dropout` (P, or `none` without dropout or with P = 0), and with
/// dropout `seed` and `offset`.
fn dropout_metadata(params: &AttnParams) -> Vec<(String, String)> {
    // The callers have validated P (the parser, then the call).
    match params.active_dropout().ok().flatten() {
        None => vec![("dropout".to_string(), "none".to_string())],
        Some(d) => vec![
            ("dropout".to_string(), d.p.to_string()),
            ("seed".to_string(), d.rng.seed.to_string()),
            ("offset".to_string(), d.rng.offset.to_string()),
        ],
    }
}

/// ` dropout P` for the summary line on stderr, or nothing without dropout.
fn dropout_summary(params: &AttnParams) -> String {
    match params.active_dropout().ok().flatten() {
        None => String::new(),
        Some(d) => format!(
            " dropout {} (seed {}, offset {})",
            d.p, d.rng.seed, d.rng.offset
        ),
    }
}

/// Writes `tensors` with `metadata` as a safetensors file into `out`'s temporary file (the
/// caller commits it).
fn fill_safetensors(
    out: &mut PendingOutput,
    tensors: &[Named],
    metadata: HashMap<String, String>,
) -> Result<(), CliError> {
    let bytes = safetensors_bytes(tensors, metadata).map_err(|e| CliError::Format {
        path: out.path().to_path_buf(),
        message: e.to_string(),
    })?;
    out.fill(|w| w.write_all(&bytes))
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
    seqs: &Seqs,
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
    let dropout = params.active_dropout().map_err(attention)?.is_some();
    let gpu_backward = registry::bwd_kernel(shape.head_dim, params.mask_kind(), dropout).is_some();
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
            gpu_forward_backward(dev, [&q, &k, &v, &d_o], params, seqs, args.deterministic)
        }
        Backend::Cpu => cpu_forward_backward([&q, &k, &v, &d_o], params, seqs),
    }
    .map_err(attention)?;
    eprintln!(
        "flash-attn-cli: forward + backward: Q {:?} K {:?} {:?}{}{} in {:.1} ms",
        q.shape(),
        k.shape(),
        T::DTYPE,
        if params.causal { " causal" } else { "" },
        dropout_summary(params),
        start.elapsed().as_secs_f64() * 1e3
    );
    let deterministic = args.deterministic || matches!(backend, Backend::Cpu);
    let (o, lse, dq, dk, dv) = (
        unbatch(o, seqs),
        unbatch(lse, seqs),
        unbatch(dq, seqs),
        unbatch(dk, seqs),
        unbatch(dv, seqs),
    );
    let mut tensors = vec![
        named("o", T::ST_DTYPE, &o),
        named("lse", Dtype::F32, &lse),
        named("dq", T::ST_DTYPE, &dq),
        named("dk", T::ST_DTYPE, &dk),
        named("dv", T::ST_DTYPE, &dv),
    ];
    tensors.extend(dropout_outputs(args, &backend, params, &shape)?);
    let extra = [("deterministic", deterministic.to_string())];
    fill_safetensors(
        &mut out,
        &tensors,
        metadata(&backend, params, scale, seqs, extra),
    )?;
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

/// What `--decode` reads, for the error of a missing tensor.
const DECODE_READS: &str = "--decode reads q, k_cache, v_cache, cache_seqlens and optionally \
                            block_table, k_new and v_new";

/// What `--decode` says of an integer tensor of another dtype.
const DECODE_INT_SUPPORTED: &str = "cache_seqlens and block_table must be I32";

/// The tensors of a decode call as read, before their element type is known statically.
struct DecodeRaw {
    q: RawTensor,
    k_cache: RawTensor,
    v_cache: RawTensor,
    seqlens: RawTensor,
    block_table: Option<RawTensor>,
    new_kv: Option<(RawTensor, RawTensor)>,
}

/// The tensors of a decode call, decoded.
struct DecodeInputs<T> {
    q: Array4<T>,
    k_cache: Array4<T>,
    v_cache: Array4<T>,
    seqlens: Array1<i32>,
    block_table: Option<Array2<i32>>,
    new_kv: Option<(Array4<T>, Array4<T>)>,
}

/// Decode outputs: O, LSE and the updated K and V caches.
type DecodeOut<T> = (Array4<T>, Array3<f32>, Array4<T>, Array4<T>);

/// `--decode`: reads the cache and the new tokens from `file`, runs attention over the cache
/// (on the GPU when one is usable for these inputs, else on the CPU backend), and writes `o`,
/// `lse`, `k_cache` and `v_cache` to `out`.
fn run_decode(
    args: &Args,
    file: &SafetensorsFile,
    q_name: &str,
    out: PendingOutput,
) -> Result<(), CliError> {
    let format = |message: String| CliError::Format {
        path: file.path().to_path_buf(),
        message,
    };
    let missing = |name: &str| {
        format(format!(
            "no tensor `{name}` ({DECODE_READS}; the file holds: {})",
            file.names().join(", ")
        ))
    };
    let float = |name: &str| file.tensor(name, FLOAT_DTYPES, FLOAT_SUPPORTED);
    let int = |name: &str| file.tensor(name, &[DType::I32], DECODE_INT_SUPPORTED);
    let required = |t: Option<RawTensor>, name: &str| t.ok_or_else(|| missing(name));
    let raw = DecodeRaw {
        q: required(float(q_name)?, q_name)?,
        k_cache: required(float("k_cache")?, "k_cache")?,
        v_cache: required(float("v_cache")?, "v_cache")?,
        seqlens: required(int("cache_seqlens")?, "cache_seqlens")?,
        block_table: int("block_table")?,
        new_kv: match (float("k_new")?, float("v_new")?) {
            (Some(k), Some(v)) => Some((k, v)),
            (None, None) => None,
            (k, _) => {
                let (given, lacking) = if k.is_some() {
                    ("k_new", "v_new")
                } else {
                    ("v_new", "k_new")
                };
                return Err(format(format!(
                    "`{given}` without `{lacking}`: give both the new keys and values, or neither"
                )));
            }
        },
    };
    let mut same_dtype = vec![&raw.k_cache, &raw.v_cache];
    if let Some((k, v)) = &raw.new_kv {
        same_dtype.extend([k, v]);
    }
    if let Some(t) = same_dtype.into_iter().find(|t| t.dtype != raw.q.dtype) {
        return Err(format(format!(
            "`{}` is {:?}, `{}` is {:?}: q, k_cache, v_cache, k_new and v_new must have one dtype",
            t.name, t.dtype, raw.q.name, raw.q.dtype
        )));
    }
    match raw.q.dtype {
        DType::F16 => decode_typed::<f16>(args, &raw, out),
        DType::BF16 => decode_typed::<bf16>(args, &raw, out),
        DType::F32 => decode_typed::<f32>(args, &raw, out),
        DType::I32 => unreachable!("q is read as a float tensor"),
    }
}

/// `--decode` in the element type `T`.
fn decode_typed<T: FileElement>(
    args: &Args,
    raw: &DecodeRaw,
    mut out: PendingOutput,
) -> Result<(), CliError> {
    let new_kv = match &raw.new_kv {
        Some((k, v)) => Some((k.to_array::<T>()?, v.to_array::<T>()?)),
        None => None,
    };
    let inputs = DecodeInputs {
        q: raw.q.to_array::<T>()?,
        k_cache: raw.k_cache.to_array::<T>()?,
        v_cache: raw.v_cache.to_array::<T>()?,
        seqlens: raw.seqlens.to_array_nd::<i32, Ix1>("[B]")?,
        block_table: match &raw.block_table {
            Some(t) => Some(t.to_array_nd::<i32, Ix2>("[B, max_pages]")?),
            None => None,
        },
        new_kv,
    };
    let (b, hq) = (dim(&raw.q.shape, 0), dim(&raw.q.shape, 2));
    // The decode path reads no block mask (it has no block-sparse kernels).
    let masks = MaskInputs {
        blocks: None,
        ..MaskInputs::read(args, b, hq)?
    };
    let params = masks.params(args, None);
    let options = DecodeOptions {
        num_splits: args.num_splits,
    };
    let head_dim = inputs.q.dim().3;
    let gpu_kernel = registry::decode_kernel(head_dim, params.mask_kind()).is_some();
    let backend = if !gpu_kernel && !args.cpu && T::DTYPE != DType::F32 {
        eprintln!(
            "flash-attn-cli: decode: CPU backend (no GPU decode kernel for head dim {head_dim})"
        );
        Backend::Cpu
    } else {
        pick_backend(T::DTYPE, args.cpu)
    };
    if args.num_splits.is_some() && matches!(backend, Backend::Cpu) {
        eprintln!("flash-attn-cli: --num-splits applies to the GPU only; ignored on the CPU");
    }
    let summary = format!(
        "Q {:?} {} cache {:?}{} {:?}{}",
        inputs.q.shape(),
        if inputs.block_table.is_some() {
            "paged"
        } else {
            "contiguous"
        },
        inputs.k_cache.shape(),
        match &inputs.new_kv {
            Some((k, _)) => format!(" + {} new keys", k.dim().1),
            None => String::new(),
        },
        T::DTYPE,
        if params.causal { " causal" } else { "" },
    );
    let start = Instant::now();
    let (o, lse, k_cache, v_cache) = match &backend {
        Backend::Gpu(dev) => gpu_decode(dev, &inputs, &params, &options),
        Backend::Cpu => cpu_decode(inputs, &params),
    }
    .map_err(|e| CliError::Attention(e.to_string()))?;
    eprintln!(
        "flash-attn-cli: decode: {summary} in {:.1} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    // The call has validated the head dim, so the scale exists.
    let scale = params
        .scale(head_dim)
        .map_err(|e| CliError::Attention(e.to_string()))?;
    let tensors = [
        named("o", T::ST_DTYPE, &o),
        named("lse", Dtype::F32, &lse),
        named("k_cache", T::ST_DTYPE, &k_cache),
        named("v_cache", T::ST_DTYPE, &v_cache),
    ];
    let extra = [("mode", "decode".to_string())];
    fill_safetensors(
        &mut out,
        &tensors,
        metadata(&backend, &params, scale, &Seqs::default(), extra),
    )?;
    let path = out.path().to_path_buf();
    out.commit()?;
    eprintln!(
        "flash-attn-cli: wrote {} (o {:?} {:?}, lse {:?} F32, k_cache and v_cache {:?})",
        path.display(),
        o.shape(),
        T::DTYPE,
        lse.shape(),
        k_cache.shape()
    );
    Ok(())
}

/// The decode pass on the CPU backend (the caches are updated in place).
fn cpu_decode<T: Element>(
    inputs: DecodeInputs<T>,
    params: &AttnParams,
) -> flash_attn::Result<DecodeOut<T>> {
    let DecodeInputs {
        q,
        mut k_cache,
        mut v_cache,
        seqlens,
        block_table,
        new_kv,
    } = inputs;
    let seqlens = seqlens.to_vec();
    let (o, lse) = cpu::attn_with_kvcache_cpu(
        q.view(),
        cpu::CpuKvCache {
            k: k_cache.view_mut(),
            v: v_cache.view_mut(),
            seqlens: &seqlens,
            block_table: block_table.as_ref().map(|t| t.view()),
        },
        new_kv.as_ref().map(|(k, v)| (k.view(), v.view())),
        params,
    )?;
    Ok((o, lse, k_cache, v_cache))
}

/// The decode pass on the GPU: upload, run, download the outputs and the updated caches.
fn gpu_decode<T: Element>(
    dev: &Device,
    inputs: &DecodeInputs<T>,
    params: &AttnParams,
    options: &DecodeOptions,
) -> flash_attn::Result<DecodeOut<T>> {
    let upload = |a: &Array4<T>| DeviceTensor::from_ndarray(dev, a.view());
    let q = upload(&inputs.q)?;
    let mut k = upload(&inputs.k_cache)?;
    let mut v = upload(&inputs.v_cache)?;
    let seqlens = DeviceTensor::from_ndarray(dev, inputs.seqlens.view())?;
    let table = match &inputs.block_table {
        Some(t) => Some(DeviceTensor::from_ndarray(dev, t.view())?),
        None => None,
    };
    let new = match &inputs.new_kv {
        Some((k_new, v_new)) => Some((upload(k_new)?, upload(v_new)?)),
        None => None,
    };
    let (o, lse) = flash_attn::attn_with_kvcache(
        dev,
        &q,
        flash_attn::KvCache {
            k: &mut k,
            v: &mut v,
            seqlens: &seqlens,
            block_table: table.as_ref(),
            host: None, // validated from the device tensors, as most callers would
        },
        new.as_ref().map(|(k, v)| flash_attn::NewKv { k, v }),
        params,
        options,
    )?;
    Ok((
        download(dev, &o, "O")?,
        download(dev, &lse, "LSE")?,
        download(dev, &k, "K cache")?,
        download(dev, &v, "V cache")?,
    ))
}

/// A device tensor copied to the host as an array of rank `D`.
fn download<T: Element, D: ndarray::Dimension>(
    dev: &Device,
    t: &DeviceTensor<T>,
    name: &str,
) -> flash_attn::Result<ndarray::Array<T, D>> {
    t.to_ndarray(dev)?
        .into_dimensionality()
        .map_err(|e| FlashError::Shape(format!("{name}: {e}")))
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
        let a = Args::try_parse_from([
            "flash-attn-cli",
            "in.safetensors",
            "--decode",
            "--num-splits",
            "128",
            "--q",
            "query",
        ])
        .unwrap();
        assert!(a.decode);
        assert_eq!((a.num_splits, a.q_name), (Some(128), Some("query".into())));
        let parse = |extra: &[&str]| {
            let mut argv = vec!["flash-attn-cli", "in.safetensors"];
            argv.extend_from_slice(extra);
            Args::try_parse_from(argv)
        };
        assert!(parse(&["--decode"]).is_ok_and(|a| a.num_splits.is_none()));
        for bad in [
            &["--decode", "--num-splits", "0"][..],
            &["--decode", "--num-splits", "129"],
            &["--decode", "--num-splits", "x"],
            &["--num-splits", "4"],
            &["--decode", "--backward"],
            &["--decode", "--k", "key"],
            &["--decode", "--npy-out", "o.npy", "l.npy"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        let npy = ["flash-attn-cli", "--npy", "a", "b", "c", "--decode"];
        assert!(Args::try_parse_from(npy).is_err());
    }

    #[test]
    fn parses_dropout() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["flash-attn-cli", "in.safetensors"];
            argv.extend_from_slice(extra);
            Args::try_parse_from(argv)
        };
        let a = parse(&[
            "--dropout",
            "0.25",
            "--seed",
            "3",
            "--offset",
            "18446744073709551615",
            "--return-dropout-mask",
            "--backward",
        ])
        .unwrap();
        assert_eq!(
            (a.dropout, a.seed, a.offset, a.return_dropout_mask),
            (Some(0.25), Some(3), Some(u64::MAX), true)
        );
        let masks = MaskInputs {
            alibi: None,
            blocks: None,
            tree: None,
        };
        let params = masks.params(&a, None);
        assert_eq!(params.dropout, Some(Dropout::new(0.25, 3, u64::MAX)));
        // The defaults: seed 0, offset 0; no --dropout, no dropout.
        let a = parse(&["--dropout", "0.5"]).unwrap();
        assert_eq!(
            masks.params(&a, None).dropout,
            Some(Dropout::new(0.5, 0, 0))
        );
        let a = parse(&[]).unwrap();
        assert_eq!(masks.params(&a, None).dropout, None);
        // -0 is 0 (no dropout), not a negative probability.
        let a = parse(&["--dropout", "-0"]).unwrap();
        assert!(a.dropout.is_some_and(|p| p == 0.0 && p.is_sign_positive()));
        assert_eq!(parse_dropout("0.999"), Ok(0.999));
        for bad in [
            &["--dropout", "1"][..],
            &["--dropout", "1.5"],
            &["--dropout", "-0.1"],
            &["--dropout", "NaN"],
            &["--dropout", "inf"],
            &["--dropout", "0.99999999"], // 1 in f32
            &["--dropout", "x"],
            &["--seed", "1"],
            &["--offset", "1"],
            &["--return-dropout-mask"],
            &["--dropout", "0.1", "--seed", "-1"],
            &["--decode", "--dropout", "0.1"],
            &["--decode", "--dropout", "0.1", "--return-dropout-mask"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
