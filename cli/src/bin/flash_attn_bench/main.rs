//! Attention benchmark: FlashAttention's configuration (B·N = 16K tokens, total width 2048,
//! d ∈ {64, 128}, N from 512 to 16K, causal or not, f16 and bf16), for the forward pass
//! (`fwd`), the backward pass alone (`bwd`) and forward + backward (`fwd_bwd`). Prints a table
//! and writes JSON rows; `xtask/scripts/bench_torch.py` adds PyTorch SDPA's numbers measured in
//! the same run on the same device.
//!
//! `--op decode` times the decode path instead (`attn_with_kvcache`: one new token, Hq = 32,
//! Hkv ∈ {1, 8}, d = 128, bf16, B ∈ {1, 8, 64}, contexts 1K to 128K where K and V fit in
//! 24 GB; contiguous caches token-major (`[B, N, Hkv, d]`, layout `contiguous`) and, where
//! Hkv > 1, head-major (the same shape with `[B, Hkv, N, d]` strides, layout `heads`), and
//! paged caches with pages of 16 and 256 keys): rows with `op` =
//! `decode`, latency and the effective bandwidth (bytes of K and V read ÷ time), the splits,
//! the kernel launches per call and the host's time inside a call (`host_us`). `meta`: the
//! lengths and block table validated from host copies (`host`), read back from the device
//! (`device`, contiguous caches), or (`checked`, paged caches) from host copies whose block
//! table was checked once before the timed calls (`HostBlockTable::checked`).
//!
//! `--op masks` times the mask family and varlen instead (see `masks.rs`): rows with a `mask`
//! key, N = 16K and 64K (`--quick`: 16K; `--n` picks one), d = 128 (`--d` picks another for
//! the mask family's rows; `--dropout P` runs them with attention dropout).
//!
//! `--op dropout` times attention dropout (see `dropout.rs`): rows with a `dropout` key,
//! p = 0.1 beside p = 0.
//!
//! Usage: `flash-attn-bench [--out rows.json] [--op fwd|bwd|fwd_bwd|all|decode|masks|dropout]
//! [--mode fast|deterministic|both] [--quick] [--reps N] [--d D] [--n N] [--dtype f16|bf16]
//! [--causal true|false] [--dropout P]` (`--mode`: the backward mode of the `bwd` and `fwd_bwd` rows, their
//! `mode` key; the last four restrict the sweep, e.g. for a profiler; `--d` also takes head
//! dims outside the sweep, such as 96 or 256, with `2048 / d` heads rounded down). With
//! `FLASH_ATTN_FWD=wgmma` on Hopper, every forward row times the `wgmma` path beside `mma_ms`. Exit status: 0 on success, 1 on an error, 2 when there is no GPU.
//!
//! Forward rows also carry `host_us`, the host's time inside one call (checks, launch data,
//! launches; measured apart from the timed calls, on an idle stream).
//!
//! FLOPs as FlashAttention's benchmarks count them: forward 4·B·H·N²·d, backward 2.5× that,
//! forward + backward 3.5× that, each halved for causal.

use clap::{ArgAction, Parser};
use flash_attn::timing::{median, time_ms};
use flash_attn::{
    attn_with_kvcache_into, auto_decode_splits, backward_kernel_name, flash_attn_backward_into,
    flash_attn_into, forward_kernel_name, AttnParams, BackwardPath, BwdMode, DecodeOptions, Device,
    DeviceTensor, Element, ForwardPath, HostBlockTable, HostCacheMeta, KvCache, Result,
};
use half::{bf16, f16};

mod dropout;
mod masks;

const TOKENS: usize = 16 * 1024;
const WIDTH: usize = 2048;

/// What one row times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    /// `flash_attn_into` alone.
    Fwd,
    /// `flash_attn_backward_into` alone (O and LSE from one forward call beforehand).
    Bwd,
    /// Forward then backward, per timed iteration.
    FwdBwd,
}

impl Op {
    /// The `op` key of the JSON rows.
    fn name(self) -> &'static str {
        match self {
            Op::Fwd => "fwd",
            Op::Bwd => "bwd",
            Op::FwdBwd => "fwd_bwd",
        }
    }

    /// FLOPs relative to the forward's (FlashAttention's convention: the backward does 5
    /// matrix products to the forward's 2).
    fn flop_factor(self) -> f64 {
        match self {
            Op::Fwd => 1.0,
            Op::Bwd => 2.5,
            Op::FwdBwd => 3.5,
        }
    }

    /// The ops selected by `--op`.
    fn parse_list(arg: &str) -> Vec<Op> {
        match arg {
            "bwd" => vec![Op::Bwd],
            "fwd_bwd" => vec![Op::FwdBwd],
            "all" => vec![Op::Fwd, Op::Bwd, Op::FwdBwd],
            _ => vec![Op::Fwd],
        }
    }
}

struct Row {
    op: Op,
    mode: BwdMode,
    dtype: &'static str,
    d: usize,
    b: usize,
    h: usize,
    n: usize,
    causal: bool,
    ms: f32,
    /// The path of the kernel the row times (the forward's for `fwd`, the backward's for
    /// `bwd` and `fwd_bwd`): `wgmma` (Hopper) or `mma` (`mma.sync`).
    path: &'static str,
    /// On Hopper, `fwd` and `bwd` rows on `wgmma` also time the `mma.sync` path (`mma_ms`).
    mma_ms: Option<f32>,
    /// `fwd` rows: the host's time inside one call ([`host_time_us`]).
    host_us: Option<f64>,
}

impl Row {
    fn tflops(&self) -> f64 {
        let flops =
            4.0 * (self.b * self.h * self.n * self.n * self.d) as f64 * self.op.flop_factor();
        let flops = if self.causal { flops / 2.0 } else { flops };
        flops / (self.ms as f64 * 1e-3) / 1e12
    }
}

/// Deterministic pseudo-random values in [-1, 1), so runs are comparable.
fn random<T: Element>(n: usize, seed: u64) -> Vec<T> {
    flash_attn_cli::sample::uniform(n, seed, -1.0, 1.0)
        .into_iter()
        .map(T::from_f32)
        .collect()
}

/// Which rows of the sweep to run.
struct Filter {
    d: Option<usize>,
    n: Option<usize>,
    dtype: Option<String>,
    causal: Option<bool>,
}

#[allow(clippy::too_many_arguments)]
fn bench_dtype<T: Element>(
    dev: &Device,
    name: &'static str,
    ops: &[(Op, BwdMode)],
    filter: &Filter,
    ns: &[usize],
    reps: usize,
    rows: &mut Vec<Row>,
) -> Result<()> {
    if filter.dtype.as_deref().is_some_and(|f| f != name) {
        return Ok(());
    }
    // `--d` may name any head dim (e.g. 96 or 256), with `WIDTH / d` heads (rounded down).
    let dims = filter.d.map_or(vec![64usize, 128], |d| vec![d]);
    for d in dims {
        let h = WIDTH / d;
        let total = TOKENS * h * d;
        let q = DeviceTensor::from_host(dev, &[total], &random::<T>(total, 1))?;
        let k = DeviceTensor::from_host(dev, &[total], &random::<T>(total, 2))?;
        let v = DeviceTensor::from_host(dev, &[total], &random::<T>(total, 3))?;
        let o = DeviceTensor::<T>::from_host(dev, &[total], &vec![T::default(); total])?;
        let (mut q, mut k, mut v, mut o) = (q, k, v, o);
        // Backward buffers, only when a backward op is asked for (64 MiB each at 16K × 2048).
        let backward = ops.iter().any(|&(op, _)| op != Op::Fwd);
        let mut grads = if backward {
            let zeros = vec![T::default(); total];
            Some([
                DeviceTensor::from_host(dev, &[total], &random::<T>(total, 4))?,
                DeviceTensor::from_host(dev, &[total], &zeros)?,
                DeviceTensor::from_host(dev, &[total], &zeros)?,
                DeviceTensor::from_host(dev, &[total], &zeros)?,
            ])
        } else {
            None
        };
        for &n in ns {
            if filter.n.is_some_and(|f| f != n) {
                continue;
            }
            let b = TOKENS / n;
            let shape = [b, n, h, d];
            let strides = [n * h * d, h * d, d, 1];
            q = q.with_layout(&shape, &strides, 0)?;
            k = k.with_layout(&shape, &strides, 0)?;
            v = v.with_layout(&shape, &strides, 0)?;
            o = o.with_layout(&shape, &strides, 0)?;
            if let Some([d_o, dq, dk, dv]) = grads.take() {
                grads = Some([
                    d_o.with_layout(&shape, &strides, 0)?,
                    dq.with_layout(&shape, &strides, 0)?,
                    dk.with_layout(&shape, &strides, 0)?,
                    dv.with_layout(&shape, &strides, 0)?,
                ]);
            }
            let mut lse = DeviceTensor::<f32>::from_host(dev, &[b, h, n], &vec![0.0; b * h * n])?;
            for causal in [false, true] {
                if filter.causal.is_some_and(|f| f != causal) {
                    continue;
                }
                let params = AttnParams {
                    causal,
                    softmax_scale: None,
                    ..AttnParams::default()
                };
                let kernel = forward_kernel_name(dev, T::DTYPE, d, n, &params)?;
                let path = if kernel.contains("wgmma") {
                    "wgmma"
                } else {
                    "mma"
                };
                let bwd_kernel = backward_kernel_name(dev, T::DTYPE, d, &params)?;
                let bwd_path = if bwd_kernel.contains("wgmma") {
                    "wgmma"
                } else {
                    "mma"
                };
                for &(op, mode) in ops {
                    let mut mma_ms = None;
                    if op == Op::Bwd && bwd_path == "wgmma" {
                        // The same backward on `mma.sync`, for the ratio between the paths.
                        flash_attn_into(dev, &q, &k, &v, &params, &mut o, &mut lse)?;
                        let Some([d_o, dq, dk, dv]) = grads.as_mut() else {
                            unreachable!("backward buffers exist for backward ops")
                        };
                        dev.set_backward_path(BackwardPath::Mma);
                        let times = time_ms(dev, 3, reps, || {
                            flash_attn_backward_into(
                                dev, &q, &k, &v, &o, d_o, &lse, &params, mode, dq, dk, dv,
                            )
                        });
                        dev.set_backward_path(BackwardPath::Auto);
                        mma_ms = Some(median(&times?));
                    }
                    let path = match op {
                        Op::Fwd => path,
                        Op::Bwd | Op::FwdBwd => bwd_path,
                    };
                    if op == Op::Fwd && path == "wgmma" {
                        let chosen = dev.forward_path(); // Auto, or FLASH_ATTN_FWD's
                        dev.set_forward_path(ForwardPath::Mma);
                        let times = time_ms(dev, 3, reps, || {
                            flash_attn_into(dev, &q, &k, &v, &params, &mut o, &mut lse)
                        });
                        dev.set_forward_path(chosen);
                        mma_ms = Some(median(&times?));
                    }
                    let mut host_us = None;
                    let times = match (op, grads.as_mut()) {
                        (Op::Fwd, _) => {
                            let mut call =
                                || flash_attn_into(dev, &q, &k, &v, &params, &mut o, &mut lse);
                            let times = time_ms(dev, 3, reps, &mut call)?;
                            host_us = Some(host_time_us(dev, reps, &mut call)?);
                            times
                        }
                        (Op::Bwd, Some([d_o, dq, dk, dv])) => {
                            // O and LSE of this masking, once, outside the timing.
                            flash_attn_into(dev, &q, &k, &v, &params, &mut o, &mut lse)?;
                            time_ms(dev, 3, reps, || {
                                flash_attn_backward_into(
                                    dev, &q, &k, &v, &o, d_o, &lse, &params, mode, dq, dk, dv,
                                )
                            })?
                        }
                        (Op::FwdBwd, Some([d_o, dq, dk, dv])) => time_ms(dev, 3, reps, || {
                            flash_attn_into(dev, &q, &k, &v, &params, &mut o, &mut lse)?;
                            flash_attn_backward_into(
                                dev, &q, &k, &v, &o, d_o, &lse, &params, mode, dq, dk, dv,
                            )
                        })?,
                        (_, None) => unreachable!("backward buffers exist for backward ops"),
                    };
                    let row = Row {
                        op,
                        mode,
                        dtype: name,
                        d,
                        b,
                        h,
                        n,
                        causal,
                        ms: median(&times),
                        path,
                        mma_ms,
                        host_us,
                    };
                    eprintln!(
                        "{:<7} {:<5} {:<5} d={:<4} b={:<3} h={:<3} n={:<6} causal={:<5} {:>9.3} ms {:>7.1} TFLOP/s {} (mma.sync {})",
                        op.name(),
                        mode_name(mode),
                        name,
                        d,
                        b,
                        h,
                        n,
                        causal,
                        row.ms,
                        row.tflops(),
                        path,
                        mma_ms.map_or("-".into(), |t| format!("{t:.3} ms")),
                    );
                    rows.push(row);
                }
            }
        }
    }
    Ok(())
}

/// Forward / backward benchmark of flash-attn (FlashAttention's configuration); JSON rows on
/// stdout or in `--out`, a table on stderr.
#[derive(Debug, Parser)]
#[command(name = "flash-attn-bench")]
struct Args {
    /// Write the JSON rows to this file instead of stdout
    #[arg(long, value_name = "FILE")]
    out: Option<std::path::PathBuf>,
    /// What to time: the forward (`fwd`), the backward alone (`bwd`), forward + backward
    /// (`fwd_bwd`) or all three (`all`); or the decode path (`decode`), the mask family
    /// (`masks`) or attention dropout (`dropout`)
    #[arg(long, value_name = "OP", default_value = "fwd",
          value_parser = ["fwd", "bwd", "fwd_bwd", "all", "decode", "masks", "dropout"])]
    op: String,
    /// Backward mode(s) of the `bwd` and `fwd_bwd` rows: `fast`, `deterministic` or `both`
    #[arg(long, value_name = "MODE", default_value = "fast",
          value_parser = ["fast", "deterministic", "both"])]
    mode: String,
    /// N in {1K, 4K} only
    #[arg(long)]
    quick: bool,
    /// Timed repetitions per row (the median is reported)
    #[arg(long, value_name = "N", default_value_t = 20)]
    reps: usize,
    /// Only this head dim (64 or 128)
    #[arg(long, value_name = "D")]
    d: Option<usize>,
    /// Only this batch size (decode rows)
    #[arg(long, value_name = "B")]
    batch: Option<usize>,
    /// Decode rows: this many key splits instead of the automatic choice
    #[arg(long, value_name = "S")]
    splits: Option<usize>,
    /// Only this sequence length (the context, for decode rows)
    #[arg(long, value_name = "N")]
    n: Option<usize>,
    /// Only this dtype
    #[arg(long, value_parser = ["f16", "bf16"])]
    dtype: Option<String>,
    /// Only causal (true) or non-causal (false) rows
    #[arg(long, value_name = "BOOL", action = ArgAction::Set)]
    causal: Option<bool>,
    /// `masks`: the mask family's rows with attention dropout of this probability (seed 1234;
    /// rows gain a `dropout` key, and the PyTorch script skips them: FlexAttention has none)
    #[arg(long, value_name = "P")]
    dropout: Option<f32>,
}

/// The `mode` key of the JSON rows (`fast` for forward rows).
fn mode_name(mode: BwdMode) -> &'static str {
    match mode {
        BwdMode::Fast => "fast",
        BwdMode::Deterministic => "deterministic",
    }
}

fn main() {
    // Exit status 2 means "no GPU" to `cargo xtask bench`, so a bad command line (clap's
    // default status is 2) exits 1.
    let args = Args::try_parse().unwrap_or_else(|e| {
        let _ = e.print();
        std::process::exit(if e.use_stderr() { 1 } else { 0 });
    });
    let (out, reps, quick) = (args.out, args.reps, args.quick);
    let modes = match args.mode.as_str() {
        "deterministic" => vec![BwdMode::Deterministic],
        "both" => vec![BwdMode::Fast, BwdMode::Deterministic],
        _ => vec![BwdMode::Fast],
    };
    // (op, backward mode) per row; forward rows have no mode (recorded as `fast`).
    let ops: Vec<(Op, BwdMode)> = Op::parse_list(&args.op)
        .into_iter()
        .flat_map(|op| {
            let op_modes = if op == Op::Fwd {
                &modes[..1]
            } else {
                &modes[..]
            };
            op_modes.iter().map(move |&m| (op, m)).collect::<Vec<_>>()
        })
        .collect();
    let filter = Filter {
        d: args.d,
        n: args.n,
        dtype: args.dtype,
        causal: args.causal,
    };
    let ns: Vec<usize> = if quick {
        vec![1024, 4096]
    } else {
        vec![512, 1024, 2048, 4096, 8192, 16384]
    };
    let dev = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("flash-attn-bench: SKIPPED, no GPU: {e}");
            std::process::exit(2);
        }
    };
    let device = dev.name().unwrap_or_default();
    let date = std::env::var("BENCH_DATE").unwrap_or_default();
    if ["decode", "masks", "dropout"].contains(&args.op.as_str()) {
        let rows = if args.op == "dropout" {
            dropout::bench_dropout(&dev, reps, quick, args.d, args.n)
        } else if args.op == "masks" {
            let ns = match (args.n, quick) {
                (Some(n), _) => vec![n],
                (None, true) => vec![16384],
                (None, false) => vec![16384, 65536],
            };
            masks::bench_masks(&dev, reps, &ns, args.d.unwrap_or(128), args.dropout)
        } else {
            bench_decode(&dev, reps, quick, args.n, args.batch, args.splits)
        }
        .unwrap_or_else(|e| {
            eprintln!("flash-attn-bench: error: {e}");
            std::process::exit(1);
        });
        let rows: Vec<serde_json::Value> = rows
            .into_iter()
            .map(|mut r| {
                r["device"] = device.clone().into();
                r["date"] = date.clone().into();
                r["ptx_arch"] = dev.ptx_arch().into();
                r
            })
            .collect();
        write_rows(out, &rows);
        return;
    }
    let mut rows = Vec::new();
    let run = bench_dtype::<f16>(&dev, "f16", &ops, &filter, &ns, reps, &mut rows)
        .and_then(|_| bench_dtype::<bf16>(&dev, "bf16", &ops, &filter, &ns, reps, &mut rows));
    if let Err(e) = run {
        eprintln!("flash-attn-bench: error: {e}");
        std::process::exit(1);
    }
    let json: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "op": r.op.name(), "mode": mode_name(r.mode), "dtype": r.dtype, "d": r.d, "b": r.b, "h": r.h, "n": r.n,
                "causal": r.causal, "ours_ms": r.ms, "ours_tflops": r.tflops(),
                "path": r.path, "mma_ms": r.mma_ms, "host_us": r.host_us,
                "device": device, "date": date, "ptx_arch": dev.ptx_arch(),
            })
        })
        .collect();
    write_rows(out, &json);
}

/// Writes the JSON rows to `out`, or to stdout.
fn write_rows(out: Option<std::path::PathBuf>, json: &[serde_json::Value]) {
    let text = serde_json::to_string_pretty(json).expect("rows serialise");
    match out {
        Some(path) => std::fs::write(&path, text).unwrap_or_else(|e| {
            eprintln!("flash-attn-bench: cannot write {}: {e}", path.display());
            std::process::exit(1);
        }),
        None => println!("{text}"),
    }
}

/// The median time the host spends inside one call of `f` (its checks and launches; the GPU
/// work it queues is not waited for), in µs: each call starts on an idle stream, as in
/// [`time_ms`], so queueing never blocks it.
fn host_time_us(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        dev.synchronize()?;
        let start = std::time::Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64() * 1e6);
    }
    dev.synchronize()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Bytes of K and V the decode rows may allocate (PyTorch allocates its own copy after us).
const DECODE_MAX_BYTES: usize = 24 << 30;

/// The decode rows (see the module docs): one `attn_with_kvcache_into` call per timed
/// iteration, every sequence full (`cache_seqlens` = context), nothing appended. K and V are
/// zero (random Q): the time of this bandwidth-bound kernel does not depend on the values.
fn bench_decode(
    dev: &Device,
    reps: usize,
    quick: bool,
    only_n: Option<usize>,
    only_b: Option<usize>,
    forced_splits: Option<usize>,
) -> Result<Vec<serde_json::Value>> {
    let (hq, d) = (32usize, 128usize);
    // The split choice reads it (`decode_splits`): said once, for the logs.
    eprintln!(
        "decode: {} SMs, peak memory bandwidth {:.1} GB/s per SM",
        dev.sm_count(),
        dev.memory_gbps_per_sm()
    );
    // `--n` picks one context, also one outside the table's (for sweeps).
    let contexts: &[usize] = match (&only_n, quick) {
        (Some(n), _) => std::slice::from_ref(n),
        (None, true) => &[8192, 32768],
        (None, false) => &[1024, 8192, 32768, 131072],
    };
    let mut rows = Vec::new();
    for b in [1usize, 8, 64] {
        if only_b.is_some_and(|x| x != b) {
            continue;
        }
        for &n in contexts {
            for hkv in [1usize, 8] {
                let bytes = 2 * b * n * hkv * d * 2;
                if bytes > DECODE_MAX_BYTES {
                    continue;
                }
                let mut k = DeviceTensor::<bf16>::zeros(dev, &[b, n, hkv, d])?;
                let mut v = DeviceTensor::<bf16>::zeros(dev, &[b, n, hkv, d])?;
                let q =
                    DeviceTensor::from_host(dev, &[b, 1, hq, d], &random::<bf16>(b * hq * d, 5))?;
                let mut o = DeviceTensor::<bf16>::zeros(dev, &[b, 1, hq, d])?;
                let mut lse = DeviceTensor::<f32>::zeros(dev, &[b, hq, 1])?;
                let lens = DeviceTensor::from_host(dev, &[b], &vec![n as i32; b])?;
                let splits = match forced_splits {
                    Some(s) => s,
                    None => auto_decode_splits::<bf16>(dev, d, [b, hq, hkv, 1], n)?,
                };
                // Layouts: `contiguous` ([B, N, Hkv, d], token-major, as FlashAttention's
                // cache), `heads` (the same shape with head-major strides, [B, Hkv, N, d] in
                // memory; only where Hkv > 1, else it is the same layout), then pages of 16 and
                // 256 keys.
                let layouts: &[(&str, usize)] = if hkv > 1 {
                    &[
                        ("contiguous", 0),
                        ("heads", 0),
                        ("paged16", 16),
                        ("paged256", 256),
                    ]
                } else {
                    &[("contiguous", 0), ("paged16", 16), ("paged256", 256)]
                };
                for &(layout, page) in layouts {
                    if layout == "heads" {
                        let strides = [n * hkv * d, d, n * d, 1];
                        k = k.with_layout(&[b, n, hkv, d], &strides, 0)?;
                        v = v.with_layout(&[b, n, hkv, d], &strides, 0)?;
                    }
                    // Paged: the same bytes as pages in a shuffled order.
                    let pages = b * n / page.max(1);
                    let table = if page > 0 {
                        let mut ids: Vec<i32> = (0..pages as i32).collect();
                        let r = flash_attn_cli::sample::uniform(pages, 9, 0.0, 1.0);
                        for i in (1..pages).rev() {
                            ids.swap(i, (r[i] * (i + 1) as f32) as usize % (i + 1));
                        }
                        k = k.with_layout(
                            &[pages, page, hkv, d],
                            &[page * hkv * d, hkv * d, d, 1],
                            0,
                        )?;
                        v = v.with_layout(
                            &[pages, page, hkv, d],
                            &[page * hkv * d, hkv * d, d, 1],
                            0,
                        )?;
                        Some(DeviceTensor::from_host(dev, &[b, n / page], &ids)?)
                    } else {
                        None
                    };
                    let lens_host = vec![n as i32; b];
                    let table_host = table.as_ref().map(|t| t.to_host(dev)).transpose()?;
                    // Validation from host copies of the lengths and table (no
                    // synchronisation), and for contiguous caches also from the device
                    // tensors read back (the call's default); paged, also with the table
                    // checked once before the timed calls (`checked`, as a decode step does
                    // for all its layers).
                    let metas: &[&str] = match layout {
                        "contiguous" => &["host", "device"],
                        "heads" => &["host"],
                        _ => &["host", "checked"],
                    };
                    for &meta in metas {
                        let block_table = match (meta, table_host.as_deref()) {
                            ("checked", Some(t)) => Some(HostBlockTable::checked(t, pages)?),
                            (_, t) => t.map(HostBlockTable::from),
                        };
                        let host = (meta != "device").then_some(HostCacheMeta {
                            seqlens: &lens_host,
                            block_table,
                        });
                        let mut call = || {
                            attn_with_kvcache_into(
                                dev,
                                &q,
                                KvCache {
                                    k: &mut k,
                                    v: &mut v,
                                    seqlens: &lens,
                                    block_table: table.as_ref(),
                                    host,
                                },
                                None,
                                &AttnParams::default(),
                                &DecodeOptions {
                                    num_splits: forced_splits,
                                },
                                &mut o,
                                &mut lse,
                            )
                        };
                        let times = time_ms(dev, 3, reps, &mut call)?;
                        let host_us = host_time_us(dev, reps, &mut call)?;
                        let ms = median(&times);
                        let gbps = bytes as f64 / (ms as f64 * 1e-3) / 1e9;
                        eprintln!(
                            "decode bf16 d={d} b={b:<3} hq={hq} hkv={hkv} n={n:<6} {layout:<10} {meta:<6} splits={splits:<3} {:>9.1} us {gbps:>7.0} GB/s  host {host_us:>6.1} us",
                            ms * 1e3
                        );
                        rows.push(serde_json::json!({
                            "op": "decode", "dtype": "bf16", "d": d, "b": b, "h": hq, "h_kv": hkv,
                            "n": n, "nq": 1, "causal": false, "layout": layout, "meta": meta,
                            "splits": splits, "launches": if splits > 1 { 2 } else { 1 },
                            "ours_ms": ms, "ours_gbps": gbps, "kv_bytes": bytes,
                            "host_us": host_us,
                        }));
                    }
                    if layout != "contiguous" {
                        k = k.with_layout(&[b, n, hkv, d], &[n * hkv * d, hkv * d, d, 1], 0)?;
                        v = v.with_layout(&[b, n, hkv, d], &[n * hkv * d, hkv * d, d, 1], 0)?;
                    }
                }
            }
        }
    }
    Ok(rows)
}
