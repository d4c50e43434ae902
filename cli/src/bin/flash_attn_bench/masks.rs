//! `--op masks`: the mask family's rows (bf16, d = 128 or `--d`, H = 16, one sequence of
//! N = 16K or 64K tokens): causal, a 4K causal window, causal ALiBi, causal softcap, and block-sparse masks
//! at densities 1 to 1/16, forward and forward + backward; a tree of 64 draft tokens after a
//! prefix of N cached keys; and a ragged varlen batch (lengths
//! 128–16K, 64K tokens) beside the per-sequence calls it replaces. `xtask/scripts/bench_torch.py`
//! adds FlexAttention (compiled, the same mask and score modification) and SDPA's flash
//! backend (causal rows; the padded batch for varlen) measured in the same run.
//!
//! The block masks are a fixed hash of the block coordinates, so the PyTorch side builds the
//! same bits: block (i, j) is visible when `block_hash(i, j) % 16 < 16·density`.

use flash_attn::timing::{median, time_ms};
use flash_attn::{
    flash_attn_backward_into, flash_attn_into, flash_attn_varlen_backward_into,
    flash_attn_varlen_into, AttnParams, BlockMask, BwdMode, Device, DeviceTensor, Dropout,
    HostVarlen, Result, TreeMask, Varlen,
};
use half::bf16;
use serde_json::{json, Value};

const D: usize = 128;
const H: usize = 16;

/// The hash both sides use for the block masks of the density rows: three rounds of
/// squaring modulo the prime 32,749 (every intermediate below 2³¹, so PyTorch's int32 mask
/// functions compute the same values), then the low four bits. Its residues are spread evenly,
/// so `block_hash(i, j) < s` keeps `s/16` of the blocks (0.0619 at 128 × 128 blocks for
/// `s = 1`, 0.0614 at 512 × 512) in a pattern with no period: rows of blocks at density 1/16
/// hold 2–16 visible blocks of 128 at N = 16K, as a random mask's would.
pub fn block_hash(i: usize, j: usize) -> usize {
    const P: usize = 32_749;
    let x = (i * 7919 + j * 104_729 + 12_345) % P;
    let x = (x * x + 31 * i + 1) % P;
    let x = (x * x + 17 * j) % P;
    x % 16
}

/// One row's mask: its name, the options, and what the PyTorch side needs to rebuild it.
struct MaskCase {
    name: String,
    params: AttnParams<'static>,
    extra: Value,
}

/// ALiBi slopes of `H` heads (the usual geometric sequence `2^(−8h/H)`).
fn alibi_slopes() -> &'static [f32] {
    let v: Vec<f32> = (1..=H)
        .map(|h| 2f32.powf(-8.0 * h as f32 / H as f32))
        .collect();
    Box::leak(v.into_boxed_slice())
}

/// The mask rows at length `n`, with dropout `p` where given.
fn cases(n: usize, p: Option<f32>) -> Result<Vec<MaskCase>> {
    let plain = AttnParams {
        dropout: p.map(|p| Dropout::new(p, 1234, 0)),
        ..AttnParams::default()
    };
    let causal = AttnParams {
        causal: true,
        ..plain
    };
    let mut out = vec![
        MaskCase {
            name: "causal".into(),
            params: causal,
            extra: json!({}),
        },
        MaskCase {
            name: "window4k_causal".into(),
            params: AttnParams {
                window: Some((4096, 0)),
                ..causal
            },
            extra: json!({"window": 4096}),
        },
        MaskCase {
            name: "alibi_causal".into(),
            params: AttnParams {
                alibi_slopes: Some(alibi_slopes()),
                ..causal
            },
            extra: json!({"alibi": alibi_slopes()}),
        },
        MaskCase {
            name: "softcap30_causal".into(),
            params: AttnParams {
                softcap: Some(30.0),
                ..causal
            },
            extra: json!({"softcap": 30.0}),
        },
    ];
    let blocks = n.div_ceil(128);
    for sixteenths in [16usize, 8, 4, 2, 1] {
        let mask = BlockMask::from_fn([1, 1, blocks, blocks], |_, _, i, j| {
            block_hash(i, j) < sixteenths
        })?;
        let density = mask.density();
        let mask: &'static BlockMask = Box::leak(Box::new(mask));
        out.push(MaskCase {
            name: format!("block_{sixteenths}/16"),
            params: AttnParams {
                block_mask: Some(mask),
                ..plain
            },
            extra: json!({"block_sixteenths": sixteenths, "density": density}),
        });
    }
    Ok(out)
}

/// Random values in [-1, 1) on the device.
pub(crate) fn tensor(dev: &Device, shape: &[usize], seed: u64) -> Result<DeviceTensor<bf16>> {
    let n: usize = shape.iter().product();
    let v: Vec<bf16> = flash_attn_cli::sample::uniform(n, seed, -1.0, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    DeviceTensor::from_host(dev, shape, &v)
}

/// The mask rows (see the module docs); the mask family's at head dim `d` (`--d`, default
/// 128; the tree and varlen rows stay at 128), with attention dropout of probability
/// `dropout` where given (`--dropout`; rows with a `dropout` key).
pub fn bench_masks(
    dev: &Device,
    reps: usize,
    ns: &[usize],
    d: usize,
    dropout: Option<f32>,
) -> Result<Vec<Value>> {
    let mut rows = Vec::new();
    for &n in ns {
        let shape = [1, n, H, d];
        let (q, k, v, d_o) = (
            tensor(dev, &shape, 1)?,
            tensor(dev, &shape, 2)?,
            tensor(dev, &shape, 3)?,
            tensor(dev, &shape, 4)?,
        );
        let mut o = DeviceTensor::<bf16>::zeros(dev, &shape)?;
        let mut lse = DeviceTensor::<f32>::zeros(dev, &[1, H, n])?;
        let mut grads = [
            DeviceTensor::<bf16>::zeros(dev, &shape)?,
            DeviceTensor::<bf16>::zeros(dev, &shape)?,
            DeviceTensor::<bf16>::zeros(dev, &shape)?,
        ];
        for case in cases(n, dropout)? {
            let p = &case.params;
            let times = time_fwd_and_bwd(
                dev,
                reps,
                [&q, &k, &v, &d_o],
                p,
                &mut o,
                &mut lse,
                &mut grads,
            )?;
            for (op, ms) in times {
                eprintln!("{op:<7} {:<18} n={n:<6} {ms:>9.3} ms", case.name);
                let mut row = json!({
                    "op": op, "mask": case.name, "dtype": "bf16", "d": d, "h": H, "b": 1, "n": n,
                    "causal": p.causal, "ours_ms": ms,
                });
                for (key, value) in case.extra.as_object().expect("object") {
                    row[key] = value.clone();
                }
                if let Some(p) = dropout {
                    row["dropout"] = p.into();
                }
                rows.push(row);
            }
        }
        rows.extend(bench_tree(dev, reps, n)?);
    }
    rows.extend(bench_varlen(dev, reps)?);
    Ok(rows)
}

/// Median ms of the forward and of forward + backward (fast mode) of one call, as
/// `[("fwd", ms), ("fwd_bwd", ms)]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn time_fwd_and_bwd(
    dev: &Device,
    reps: usize,
    [q, k, v, d_o]: [&DeviceTensor<bf16>; 4],
    p: &AttnParams,
    o: &mut DeviceTensor<bf16>,
    lse: &mut DeviceTensor<f32>,
    [dq, dk, dv]: &mut [DeviceTensor<bf16>; 3],
) -> Result<[(&'static str, f32); 2]> {
    let fwd = median(&time_ms(dev, 3, reps, || {
        flash_attn_into(dev, q, k, v, p, o, lse)
    })?);
    let fwd_bwd = median(&time_ms(dev, 2, reps.min(10), || {
        flash_attn_into(dev, q, k, v, p, o, lse)?;
        flash_attn_backward_into(dev, q, k, v, o, d_o, lse, p, BwdMode::Fast, dq, dk, dv)
    })?);
    Ok([("fwd", fwd), ("fwd_bwd", fwd_bwd)])
}

/// Draft tokens of the tree rows.
const TREE_DRAFTS: usize = 64;

/// The tree rows: `TREE_DRAFTS` draft tokens in a binary tree (draft `i`'s parent is
/// `(i − 1) / 2`, the PyTorch side rebuilds it from the parents in the row) after a prefix of
/// `n` cached keys: queries `[1, 64, H, d]`, keys and values `[1, n + 64, H, d]`.
fn bench_tree(dev: &Device, reps: usize, n: usize) -> Result<Vec<Value>> {
    let parents: Vec<i32> = (0..TREE_DRAFTS as i32)
        .map(|i| if i == 0 { -1 } else { (i - 1) / 2 })
        .collect();
    let tree = TreeMask::from_parents(1, TREE_DRAFTS, &parents)?;
    let params = AttnParams {
        tree_mask: Some(tree.as_ref()),
        ..AttnParams::default()
    };
    let (q_shape, kv_shape) = ([1, TREE_DRAFTS, H, D], [1, n + TREE_DRAFTS, H, D]);
    let (q, k, v, d_o) = (
        tensor(dev, &q_shape, 1)?,
        tensor(dev, &kv_shape, 2)?,
        tensor(dev, &kv_shape, 3)?,
        tensor(dev, &q_shape, 4)?,
    );
    let mut o = DeviceTensor::<bf16>::zeros(dev, &q_shape)?;
    let mut lse = DeviceTensor::<f32>::zeros(dev, &[1, H, TREE_DRAFTS])?;
    let mut grads = [
        DeviceTensor::<bf16>::zeros(dev, &q_shape)?,
        DeviceTensor::<bf16>::zeros(dev, &kv_shape)?,
        DeviceTensor::<bf16>::zeros(dev, &kv_shape)?,
    ];
    let times = time_fwd_and_bwd(
        dev,
        reps,
        [&q, &k, &v, &d_o],
        &params,
        &mut o,
        &mut lse,
        &mut grads,
    )?;
    Ok(times
        .into_iter()
        .map(|(op, ms)| {
            eprintln!("{op:<7} tree{TREE_DRAFTS:<14} n={n:<6} {ms:>9.3} ms");
            json!({
                "op": op, "mask": format!("tree{TREE_DRAFTS}"), "dtype": "bf16", "d": D, "h": H,
                "b": 1, "n": n, "causal": false, "drafts": TREE_DRAFTS, "parents": parents,
                "ours_ms": ms,
            })
        })
        .collect())
}

/// Sequence lengths of the varlen rows: drawn from 128–16K (fixed seed), 64K tokens in all
/// (the last one trimmed).
fn varlen_lengths() -> Vec<usize> {
    let draws = flash_attn_cli::sample::uniform(64, 7, 0.0, 1.0);
    let mut lens = Vec::new();
    let mut total = 0;
    for x in draws {
        let len = (128.0 * 128f32.powf(x)) as usize; // log-uniform in [128, 16K)
        let len = len.min(65_536 - total);
        if len == 0 {
            break;
        }
        lens.push(len);
        total += len;
    }
    lens
}

/// The varlen rows: one causal call over the packed batch, and the sum of the same
/// sequences' calls one by one (the ≤ 1.1× target), forward and forward + backward; the
/// PyTorch side times SDPA's flash backend on the padded batch.
fn bench_varlen(dev: &Device, reps: usize) -> Result<Vec<Value>> {
    let lens = varlen_lengths();
    let total: usize = lens.iter().sum();
    let mut cu = vec![0i32];
    for &l in &lens {
        cu.push(cu.last().copied().unwrap_or(0) + l as i32);
    }
    let shape = [total, H, D];
    let (q, k, v, d_o) = (
        tensor(dev, &shape, 1)?,
        tensor(dev, &shape, 2)?,
        tensor(dev, &shape, 3)?,
        tensor(dev, &shape, 4)?,
    );
    let cu_d = DeviceTensor::from_host(dev, &[cu.len()], &cu)?;
    let varlen = Varlen {
        cu_seqlens_q: &cu_d,
        cu_seqlens_k: &cu_d,
        host: Some(HostVarlen {
            cu_seqlens_q: &cu,
            cu_seqlens_k: &cu,
        }),
    };
    let params = AttnParams {
        causal: true,
        ..AttnParams::default()
    };
    let mut o = DeviceTensor::<bf16>::zeros(dev, &shape)?;
    let mut lse = DeviceTensor::<f32>::zeros(dev, &[H, total])?;
    let mut g = [
        DeviceTensor::<bf16>::zeros(dev, &shape)?,
        DeviceTensor::<bf16>::zeros(dev, &shape)?,
        DeviceTensor::<bf16>::zeros(dev, &shape)?,
    ];
    let fwd = median(&time_ms(dev, 3, reps, || {
        flash_attn_varlen_into(dev, &q, &k, &v, &varlen, &params, &mut o, &mut lse)
    })?);
    let [dq, dk, dv] = &mut g;
    let fwd_bwd = median(&time_ms(dev, 2, reps.min(10), || {
        flash_attn_varlen_into(dev, &q, &k, &v, &varlen, &params, &mut o, &mut lse)?;
        flash_attn_varlen_backward_into(
            dev,
            &q,
            &k,
            &v,
            &o,
            &d_o,
            &lse,
            &varlen,
            &params,
            BwdMode::Fast,
            dq,
            dk,
            dv,
        )
    })?);
    // The same sequences, one padded call each (batch 1), timed one by one and summed.
    let (mut sum_fwd, mut sum_fwd_bwd) = (0.0f32, 0.0f32);
    for &n in &lens {
        let s = [1, n, H, D];
        let (q1, k1, v1, do1) = (
            tensor(dev, &s, 1)?,
            tensor(dev, &s, 2)?,
            tensor(dev, &s, 3)?,
            tensor(dev, &s, 4)?,
        );
        let mut o1 = DeviceTensor::<bf16>::zeros(dev, &s)?;
        let mut l1 = DeviceTensor::<f32>::zeros(dev, &[1, H, n])?;
        let mut g1 = [
            DeviceTensor::<bf16>::zeros(dev, &s)?,
            DeviceTensor::<bf16>::zeros(dev, &s)?,
            DeviceTensor::<bf16>::zeros(dev, &s)?,
        ];
        sum_fwd += median(&time_ms(dev, 2, reps, || {
            flash_attn_into(dev, &q1, &k1, &v1, &params, &mut o1, &mut l1)
        })?);
        let [dq1, dk1, dv1] = &mut g1;
        sum_fwd_bwd += median(&time_ms(dev, 2, reps.min(10), || {
            flash_attn_into(dev, &q1, &k1, &v1, &params, &mut o1, &mut l1)?;
            flash_attn_backward_into(
                dev,
                &q1,
                &k1,
                &v1,
                &o1,
                &do1,
                &l1,
                &params,
                BwdMode::Fast,
                dq1,
                dk1,
                dv1,
            )
        })?);
    }
    let mut rows = Vec::new();
    for (op, ms, sum) in [("fwd", fwd, sum_fwd), ("fwd_bwd", fwd_bwd, sum_fwd_bwd)] {
        eprintln!(
            "{op:<7} varlen ({} seqs, {total} tokens) {ms:>9.3} ms, per-sequence sum {sum:.3} ms",
            lens.len()
        );
        rows.push(json!({
            "op": op, "mask": "varlen", "dtype": "bf16", "d": D, "h": H, "b": lens.len(),
            "n": total, "causal": true, "lens": lens, "ours_ms": ms, "ours_sum_ms": sum,
            "ratio_vs_sum": ms / sum,
        }));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::block_hash;

    /// The density rows keep `s/16` of the blocks at both lengths, within 2 % of it.
    #[test]
    fn block_hash_keeps_sixteenths_of_the_blocks() {
        for blocks in [128usize, 512] {
            for s in [8usize, 4, 2, 1] {
                let kept = (0..blocks)
                    .flat_map(|i| (0..blocks).map(move |j| (i, j)))
                    .filter(|&(i, j)| block_hash(i, j) < s)
                    .count();
                let density = kept as f64 / (blocks * blocks) as f64;
                let want = s as f64 / 16.0;
                assert!(
                    (density / want - 1.0).abs() < 0.02,
                    "{blocks} blocks, s = {s}: density {density}, want {want}"
                );
            }
        }
    }
}
