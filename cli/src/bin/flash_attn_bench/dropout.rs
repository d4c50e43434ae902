//! `--op dropout`: attention dropout's rows. FlashAttention's configuration (B·N = 16K tokens,
//! total width 2048, d ∈ {64, 128}, bf16, causal or not) at N ∈ {1K, 4K, 16K} (`--quick`:
//! 4K), forward and forward + backward (fast mode), at p = 0.1 beside p = 0 (rows with a
//! `dropout` key). `xtask/scripts/bench_dropout_torch.py` adds PyTorch SDPA with the same
//! dropout (its flash and efficient backends) measured in the same run.

use flash_attn::{AttnParams, Device, DeviceTensor, Dropout, Result};
use half::bf16;
use serde_json::{json, Value};

use crate::masks::{tensor, time_fwd_and_bwd};

/// The probabilities of the rows.
const PROBS: [f32; 2] = [0.0, 0.1];

/// The dropout rows (see the module docs), restricted to head dim `only_d` and length
/// `only_n` when given.
pub fn bench_dropout(
    dev: &Device,
    reps: usize,
    quick: bool,
    only_d: Option<usize>,
    only_n: Option<usize>,
) -> Result<Vec<Value>> {
    let ns: &[usize] = if quick { &[4096] } else { &[1024, 4096, 16384] };
    let mut rows = Vec::new();
    for d in [64usize, 128]
        .into_iter()
        .filter(|&d| only_d.is_none_or(|x| x == d))
    {
        for &n in ns.iter().filter(|&&n| only_n.is_none_or(|x| x == n)) {
            let (b, h) = (16384 / n, 2048 / d);
            let shape = [b, n, h, d];
            let [q, k, v, d_o] = [1, 2, 3, 4].map(|seed| tensor(dev, &shape, seed));
            let (q, k, v, d_o) = (q?, k?, v?, d_o?);
            let mut o = DeviceTensor::<bf16>::zeros(dev, &shape)?;
            let mut lse = DeviceTensor::<f32>::zeros(dev, &[b, h, n])?;
            let [g0, g1, g2] = [(); 3].map(|_| DeviceTensor::<bf16>::zeros(dev, &shape));
            let mut grads = [g0?, g1?, g2?];
            for causal in [false, true] {
                for p in PROBS {
                    let params = AttnParams {
                        causal,
                        dropout: Some(Dropout::new(p, 1234, 0)),
                        ..AttnParams::default()
                    };
                    let times = time_fwd_and_bwd(
                        dev,
                        reps,
                        [&q, &k, &v, &d_o],
                        &params,
                        &mut o,
                        &mut lse,
                        &mut grads,
                    )?;
                    for (op, ms) in times {
                        eprintln!("{op:<7} dropout {p:<4} d={d:<3} n={n:<6} causal={causal:<5} {ms:>9.3} ms");
                        rows.push(json!({
                            "op": op, "dropout": p, "mode": "fast", "dtype": "bf16", "d": d,
                            "b": b, "h": h, "n": n, "causal": causal, "ours_ms": ms,
                        }));
                    }
                }
            }
        }
    }
    Ok(rows)
}
