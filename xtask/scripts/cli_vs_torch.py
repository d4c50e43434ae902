#!/usr/bin/env python3
"""Cross-checks `flash-attn-cli` against PyTorch on random cases, the way its users would.

For each case: random Q, K, V (and dO) are written to a safetensors file, the CLI runs on
it (GPU backend unless --cpu, and backward mode for a share of the cases), and its `o`,
`lse` (and `dq`, `dk`, `dv`) are compared with PyTorch in float64. The accuracy rule is
FlashAttention's: our max error ≤ 2 × the max error of PyTorch's own attention in the same
dtype (SDPA's math path, with GQA heads repeated) + 1e-5. Prints one line per case and a
summary; exits 1 if any case fails.

Usage: cli_vs_torch.py CLI_BINARY [--cases N] [--seed S] [--cpu] [--backward-share F]
"""
import math
import os
import random
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def attention(q, k, v, causal, scale):
    """Naive attention in q's dtype and device: [B, N, H, d] layout, GQA by repetition.
    Returns O and the natural-log LSE [B, Hq, Nq] (f32 for low precision)."""
    hq, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    nq, nk = q.shape[1], k.shape[1]
    if causal:
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + nk - nq, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return o, lse


def max_err(a, ref):
    a, ref = a.double(), ref.double()
    both_inf = torch.isinf(a) & torch.isinf(ref) & (torch.sign(a) == torch.sign(ref))
    d = (a - ref).abs()
    d = torch.where(both_inf, torch.zeros_like(d), d)
    if torch.isnan(d).any():
        return float("inf")
    return d.max().item() if d.numel() else 0.0


def main():
    args = sys.argv[1:]
    cli = args[0]
    n_cases = int(args[args.index("--cases") + 1]) if "--cases" in args else 40
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 1
    share = float(args[args.index("--backward-share") + 1]) if "--backward-share" in args else 0.2
    cpu = "--cpu" in args
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for case in range(n_cases):
            dtype_name = rng.choice(["f16", "bf16", "f32"] if cpu else ["f16", "bf16"])
            dt = DTYPES[dtype_name]
            b = rng.choice([1, 2, 3])
            nq = rng.choice([1, 7, 16, 63, 64, 65, 128, 129, 200, 257])
            nk = rng.choice([1, 7, 16, 63, 64, 65, 128, 129, 200, 257])
            hkv = rng.choice([1, 2, 3])
            hq = hkv * rng.choice([1, 2, 4])
            d = rng.choice([8, 16, 24, 32, 40, 64, 72, 80, 96, 100, 128, 160, 256])
            causal = rng.random() < 0.5
            scale = rng.choice([None, 0.3, -0.2, 1.0 / math.sqrt(d)])
            backward = rng.random() < share
            q = torch.randn(b, nq, hq, d, dtype=torch.float64)
            k = torch.randn(b, nk, hkv, d, dtype=torch.float64)
            v = torch.randn(b, nk, hkv, d, dtype=torch.float64)
            tensors = {"q": q.to(dt), "k": k.to(dt), "v": v.to(dt)}
            if backward:
                tensors["do"] = torch.randn(b, nq, hq, d, dtype=torch.float64).to(dt)
            inp, out = os.path.join(tmp, f"in{case}.safetensors"), os.path.join(tmp, f"out{case}.safetensors")
            save_file({n: t.contiguous() for n, t in tensors.items()}, inp)
            cmd = [cli, inp, "-o", out]
            if causal:
                cmd.append("--causal")
            if scale is not None:
                cmd += ["--scale", repr(scale)]
            if cpu:
                cmd.append("--cpu")
            if backward:
                cmd.append("--backward")
            r = subprocess.run(cmd, capture_output=True, text=True)
            desc = f"{dtype_name} B={b} Nq={nq} Nk={nk} Hq={hq} Hkv={hkv} d={d} causal={causal} scale={scale} bwd={backward}"
            if r.returncode != 0:
                print(f"FAIL {desc}: exit {r.returncode}: {r.stderr.strip()}")
                failures += 1
                continue
            got = load_file(out)
            sc = scale if scale is not None else 1.0 / math.sqrt(d)
            # float64 reference and the same-dtype naive attention, with autograd for backward
            ins = [t.double().to(dev).requires_grad_(backward) for t in (tensors["q"], tensors["k"], tensors["v"])]
            o_ref, lse_ref = attention(*ins, causal, sc)
            ins_lp = [t.to(dev).requires_grad_(backward) for t in (tensors["q"], tensors["k"], tensors["v"])]
            o_lp, lse_lp = attention(*ins_lp, causal, sc)
            checks = [("o", got["o"], o_ref, o_lp), ("lse", got["lse"], lse_ref, lse_lp)]
            if backward:
                g = tensors["do"].to(dev)
                refs = torch.autograd.grad(o_ref, ins, g.double())
                lps = torch.autograd.grad(o_lp, ins_lp, g)
                for name, r64, rlp in zip(["dq", "dk", "dv"], refs, lps):
                    checks.append((name, got[name], r64, rlp))
            ok = True
            msgs = []
            for name, ours, ref, lp in checks:
                e_ours = max_err(ours.to(dev), ref)
                e_lp = max_err(lp.detach(), ref)
                allowed = 2 * e_lp + 1e-5
                if name in ("dq", "dk", "dv"):
                    allowed = 3 * e_lp + 1e-5  # gradients: FlashAttention's tests allow 2-3x
                good = e_ours <= allowed
                ok &= good
                msgs.append(f"{name} {e_ours:.2e}/{allowed:.2e}{'' if good else ' !!'}")
            print(("ok   " if ok else "FAIL ") + desc + ": " + ", ".join(msgs))
            failures += 0 if ok else 1
    print(f"cli_vs_torch: {n_cases - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
