#!/usr/bin/env python3
"""PyTorch beside flash-attn's dropout rows (`flash-attn-bench --op dropout`), same device, same run.

For each row (bf16, [B, N, H, d] viewed as [B, H, N, d], causal or not, `dropout` = p):
- `torch_flash_ms`, `torch_efficient_ms`: `scaled_dot_product_attention(dropout_p=p)` on SDPA's
  flash and memory-efficient backends (each draws its own Philox mask in the forward and
  regenerates it in the backward, as ours does).
- `ratio_vs_flash` = ours / flash (≤ 1 is the target), and for p > 0 `vs_p0` = ours / ours at
  p = 0 of the same op and shape (≤ 1.15 is the target: dropout costs at most 15 %).
`fwd` times the forward call; `fwd_bwd` forward + backward per iteration (CUDA events, median
after warm-up, the timing of bench_torch.py). A backend that fails records null and its error.

Usage: bench_dropout_torch.py ours.json merged.json [--reps N]
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_torch import clear_grads, time_ms  # noqa: E402  (same folder)

BACKENDS = {"torch_flash_ms": SDPBackend.FLASH_ATTENTION, "torch_efficient_ms": SDPBackend.EFFICIENT_ATTENTION}


def time_sdpa(row, backend, qkv, g, reps):
    """Median ms of SDPA on `backend` with the row's dropout, forward or forward + backward."""
    p, causal = row["dropout"], row["causal"]
    q, k, v = qkv

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)

    def fwd_bwd():
        clear_grads(q, k, v)
        fwd().backward(g)

    with sdpa_kernel(backend):
        return time_ms(fwd if row["op"] == "fwd" else fwd_bwd, reps)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 20
    rows = json.load(open(src))
    base = {(r["op"], r["d"], r["n"], r["causal"]): r["ours_ms"] for r in rows if r["dropout"] == 0}
    for row in rows:
        b, n, h, d = row["b"], row["n"], row["h"], row["d"]
        make = lambda: torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q, k, v = make(), make(), make()
        g = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        for key, backend in BACKENDS.items():
            try:
                row[key] = time_sdpa(row, backend, (q, k, v), g, reps)
            except Exception as e:  # noqa: BLE001  (a backend that cannot run the shape)
                row[key] = None
                row[key.replace("_ms", "_error")] = str(e).splitlines()[0][:200]
        flash = row.get("torch_flash_ms")
        row["ratio_vs_flash"] = row["ours_ms"] / flash if flash else None
        p0 = base.get((row["op"], d, n, row["causal"]))
        row["vs_p0"] = row["ours_ms"] / p0 if p0 else None
        row["torch_version"] = torch.__version__
        del q, k, v, g
        torch.cuda.empty_cache()
        fmt = lambda x: f"{x:8.3f}" if isinstance(x, float) else "     n/a"
        print(
            f"{row['op']:<7} p={row['dropout']:<4} d={d:<3} n={n:<6} causal={str(row['causal']):<5}"
            f" ours {fmt(row['ours_ms'])} flash {fmt(flash)} efficient {fmt(row.get('torch_efficient_ms'))}"
            f" ours/flash {fmt(row['ratio_vs_flash'])} ours/ours(p=0) {fmt(row['vs_p0'])}",
            flush=True,
        )
    json.dump(rows, open(dst, "w"), indent=1)


if __name__ == "__main__":
    main()
