#!/usr/bin/env python3
"""PyTorch beside flash-attn's mask rows (`flash-attn-bench --op masks`), same device, same run.

For each row (bf16, d = 128, H = 16, [B, N, H, d] viewed as [B, H, N, d]):
- `torch_flex_ms`: FlexAttention (`torch.compile(flex_attention)`) with the row's mask as a
  block mask (`create_block_mask`, 128 × 128 blocks, the causal / window / block-sparse / tree
  predicate; tree rows: 64 draft queries over n cached keys plus the drafts) and its score modification (ALiBi `score − slope_h·|q − kv|`, softcap
  `cap·tanh(score / cap)`); block-sparse rows rebuild the bits from `block_hash` below, the
  same function as `masks.rs`.
- `torch_flash_ms`: SDPA's flash backend where it applies (causal rows; varlen: the padded
  batch `[B, max_len]`, causal, which is what SDPA offers without nested tensors).
- `ratio_vs_flex` = ours / flex (≤ 1 is the target), and for block rows `vs_dense` = ours /
  ours at density 1 of the same op and n, beside the density (≤ 1.15 × density is the target).
`fwd` times the forward call; `fwd_bwd` forward + backward per iteration (CUDA events, median
after warm-up). A backend that fails records null and its error.

Usage: bench_masks_torch.py ours.json merged.json [--reps N]
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

# One compiled kernel per mask and score modification, forward and backward: more than
# dynamo's default of 8 recompilations per function.
torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.cache_size_limit = 256
flex = torch.compile(flex_attention, dynamic=False)

from bench_torch import time_ms  # noqa: E402  (same folder; the same timing as the SDPA rows)


def block_hash(i, j):
    """The block hash of `masks.rs` (integer tensors or ints)."""
    x = (i * 7919 + j * 104729 + 12345) % 32749
    x = (x * x + 31 * i + 1) % 32749
    x = (x * x + 17 * j) % 32749
    return x % 16


def tree_visible(parents):
    """[T, T] bool: draft i sees draft t when t is i or one of its ancestors."""
    t = len(parents)
    vis = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        a = i
        while a >= 0:
            vis[i, a] = True
            a = parents[a]
    return vis.cuda()


def flex_args(row, n):
    """The block mask and score_mod of a mask row."""
    name = row["mask"]
    score_mod = None
    if name.startswith("tree"):
        # Queries are the drafts; keys the n cached ones, then the drafts.
        vis, prefix = tree_visible(row["parents"]), n
        drafts = len(row["parents"])
        mask_mod = lambda b, h, q, kv: (kv < prefix) | vis[q, (kv - prefix).clamp(min=0)]
        bm = create_block_mask(mask_mod, 1, None, drafts, n + drafts, device="cuda", BLOCK_SIZE=128)
        return bm, score_mod
    # Constants as tensors: the compiled kernels take them as inputs instead of recompiling
    # for every value.
    if name.startswith("block_"):
        s = torch.tensor(row["block_sixteenths"], device="cuda")
        mask_mod = lambda b, h, q, kv: block_hash(q // 128, kv // 128) < s
    elif name.startswith("window"):
        w = torch.tensor(row["window"], device="cuda")
        mask_mod = lambda b, h, q, kv: (kv <= q) & (q - kv <= w)
    else:
        mask_mod = lambda b, h, q, kv: kv <= q
    if "alibi" in row:
        slopes = torch.tensor(row["alibi"], device="cuda", dtype=torch.float32)
        score_mod = lambda score, b, h, q, kv: score - slopes[h] * (q - kv).abs()
    if "softcap" in row:
        cap = torch.tensor(row["softcap"], device="cuda", dtype=torch.float32)
        score_mod = lambda score, b, h, q, kv: cap * torch.tanh(score / cap)
    # At 64K the eager mask evaluation would materialise N × N booleans (32 GiB): compile it
    # (PyTorch 2.11 warns that `_compile` is deprecated in favour of compiling
    # create_block_mask itself; this is the form the recorded rows ran with).
    bm = create_block_mask(mask_mod, 1, None, n, n, device="cuda", BLOCK_SIZE=128, _compile=n > 16384)
    return bm, score_mod


def rand(gen, *shape, grad=False):
    t = (torch.rand(shape, device="cuda", generator=gen, dtype=torch.float32) * 2 - 1)
    t = t.to(torch.bfloat16).transpose(1, 2)
    return t.requires_grad_(grad)


def timed(op, fn, grad, reps, *inputs):
    """Median ms of the forward (`fwd`) or forward + backward (`fwd_bwd`) of `fn()`."""
    if op == "fwd":
        with torch.no_grad():
            return time_ms(fn, reps)

    def step():
        for t in inputs:
            t.grad = None
        fn().backward(grad)

    return time_ms(step, min(reps, 10))


def time_flash(row, op, qkv, grad, reps):
    """SDPA's flash backend, causal, into `torch_flash_ms` (null and the error if it fails)."""
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            f = lambda: F.scaled_dot_product_attention(*qkv, is_causal=True)
            row["torch_flash_ms"] = timed(op, f, grad, reps, *qkv)
    except Exception as e:
        row["torch_flash_ms"], row["torch_flash_error"] = None, str(e).splitlines()[0][:200]


def main():
    src, dst = sys.argv[1], sys.argv[2]
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 20
    rows = json.load(open(src))
    gen = torch.Generator(device="cuda").manual_seed(0)
    dense = {(r["op"], r["n"]): r["ours_ms"] for r in rows if r["mask"] == "block_16/16"}
    for row in rows:
        op, n, h, d = row["op"], row["n"], row["h"], row["d"]
        grad_on = op != "fwd"
        if row.get("dropout"):
            continue  # FlexAttention has no dropout: ours alone (`--dropout`)
        if row["mask"] == "varlen":
            lens = row["lens"]
            b, m = len(lens), max(lens)
            q, k, v = (rand(gen, b, m, h, d, grad=grad_on) for _ in range(3))
            g = rand(gen, b, m, h, d) if grad_on else None
            time_flash(row, op, (q, k, v), g, reps)
            row["padded_tokens"] = b * m
            row["ratio_vs_flash"] = row["ours_ms"] / row["torch_flash_ms"] if row.get("torch_flash_ms") else None
        else:
            if row["mask"].startswith("tree"):
                t = row["drafts"]
                q = rand(gen, 1, t, h, d, grad=grad_on)
                k, v = (rand(gen, 1, n + t, h, d, grad=grad_on) for _ in range(2))
                g = rand(gen, 1, t, h, d) if grad_on else None
            else:
                q, k, v = (rand(gen, 1, n, h, d, grad=grad_on) for _ in range(3))
                g = rand(gen, 1, n, h, d) if grad_on else None
            try:
                bm, score_mod = flex_args(row, n)
                f = lambda: flex(q, k, v, score_mod=score_mod, block_mask=bm)
                row["torch_flex_ms"] = timed(op, f, g, reps, q, k, v)
                row["flex_density"] = 1.0 - bm.sparsity() / 100.0
            except Exception as e:
                row["torch_flex_ms"], row["torch_flex_error"] = None, str(e).splitlines()[0][:200]
            if row["mask"] == "causal":
                time_flash(row, op, (q, k, v), g, reps)
            flex_ms = row.get("torch_flex_ms")
            row["ratio_vs_flex"] = row["ours_ms"] / flex_ms if flex_ms else None
            if row["mask"].startswith("block_") and (op, n) in dense:
                row["vs_dense"] = row["ours_ms"] / dense[(op, n)]
        row["torch_version"] = torch.__version__
        del q, k, v
        torch.cuda.empty_cache()
        fmt = lambda x: f"{x:9.3f}" if isinstance(x, float) else "      n/a"
        print(
            f"{op:<7} {row['mask']:<18} n={n:<6} ours {fmt(row['ours_ms'])} flex {fmt(row.get('torch_flex_ms'))}"
            f" flash {fmt(row.get('torch_flash_ms'))} ours/flex {fmt(row.get('ratio_vs_flex'))}"
            + (f" density {row['density']:.3f} vs_dense {row.get('vs_dense', float('nan')):.3f}" if "density" in row else "")
            + (f" ours/sum {row['ratio_vs_sum']:.3f} ours/flash(padded) {fmt(row.get('ratio_vs_flash'))}" if row["mask"] == "varlen" else ""),
            flush=True,
        )
    json.dump(rows, open(dst, "w"), indent=1)
    svg = density_svg(rows)
    if svg:
        open(dst.rsplit(".", 1)[0] + "-density.svg", "w").write(svg)


def density_svg(rows):
    """Runtime against block density (log-log), per op at the smallest n: ours, FlexAttention,
    and the ideal `density × ours at density 1`. Plain SVG, no plotting library."""
    block = [r for r in rows if r["mask"].startswith("block_")]
    if not block:
        return None
    n = min(r["n"] for r in block)
    w, h, pad = 640, 420, 60
    series = []
    colors = {"fwd": ("#1f77b4", "#aec7e8"), "fwd_bwd": ("#d62728", "#ff9896")}
    for op in ("fwd", "fwd_bwd"):
        pts = sorted((r["density"], r["ours_ms"], r.get("torch_flex_ms")) for r in block if r["op"] == op and r["n"] == n)
        if not pts:
            continue
        dense = pts[-1][1]
        series.append((f"ours {op}", colors[op][0], [(x, y) for x, y, _ in pts], ""))
        series.append((f"flex {op}", colors[op][1], [(x, f) for x, _, f in pts if f], ""))
        series.append((f"ideal {op}", colors[op][0], [(x, x * dense) for x, _, _ in pts], "4,4"))
    import math

    xs = [x for _, _, p, _ in series for x, _ in p]
    ys = [y for _, _, p, _ in series for _, y in p if y > 0]
    lx0, lx1 = math.log2(min(xs)), math.log2(max(xs))
    ly0, ly1 = math.log2(min(ys)), math.log2(max(ys))
    sx = lambda x: pad + (math.log2(x) - lx0) / max(lx1 - lx0, 1e-9) * (w - 2 * pad)
    sy = lambda y: h - pad - (math.log2(y) - ly0) / max(ly1 - ly0, 1e-9) * (h - 2 * pad)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle">Block-sparse runtime vs density (bf16, d=128, H=16, N={n})</text>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">density of visible 128×128 blocks (log scale)</text>',
           f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle">ms (log scale)</text>']
    for x in sorted(set(xs)):
        out.append(f'<text x="{sx(x):.1f}" y="{h - pad + 15}" text-anchor="middle">{x:.3f}</text>')
    for k in range(int(math.floor(ly0)), int(math.ceil(ly1)) + 1):
        y = 2.0 ** k
        if ly0 - 0.01 <= k <= ly1 + 0.01:
            out.append(f'<text x="{pad - 5}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for i, (label, color, pts, dash) in enumerate(series):
        if not pts:
            continue
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/>')
        out.append(f'<text x="{w - pad - 150}" y="{pad + 15 * i}" fill="{color}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out)


if __name__ == "__main__":
    main()
