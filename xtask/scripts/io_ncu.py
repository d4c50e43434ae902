#!/usr/bin/env python3
"""HBM traffic of attention, measured with Nsight Compute (the FlashAttention paper's Figure 2,
left): our forward and backward (through `flash-attn-cli --backward`) next to PyTorch SDPA's
math backend (standard attention) and flash backend, at the paper's shape (GPT-2 medium:
B = 64, N = 1024, H = 16, d = 64, f16, not causal).

For each (implementation, pass) it sums `dram__bytes_read.sum`, `dram__bytes_write.sum` and
`gpu__time_duration.sum` over the kernels of that pass (ncu replays each kernel, so the
durations are those of single kernels, not of an overlapped timeline). Our kernels are split
by name (`flash_fwd*`: forward; `flash_bwd*`: backward); PyTorch's passes are profiled
separately between cudaProfilerStart/Stop.

Usage: io_ncu.py CLI_BINARY OUT_DIR [--ncu PATH]
Writes OUT_DIR/io.json and prints a markdown table.
"""
import csv
import io
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

B, N, H, D = 64, 1024, 16, 64
METRICS = "dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum"


def write_safetensors(path, tensors):
    """Minimal safetensors writer (F16 arrays)."""
    header, offset, blobs = {}, 0, []
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a, dtype=np.float16).tobytes()
        header[name] = {"dtype": "F16", "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def ncu(cmd, ncu_bin, extra=()):
    """Runs `cmd` under ncu; returns [(kernel name, read bytes, write bytes, ns)]."""
    out = subprocess.run(
        [ncu_bin, "--metrics", METRICS, "--csv", "--page", "raw", *extra, *cmd],
        capture_output=True, text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"ncu failed ({out.returncode}): {out.stderr[-2000:]}")
    lines = [l for l in out.stdout.splitlines() if l.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    units = rows[0]
    result = []
    for r in rows[1:]:
        def val(key):
            x = float(r[key].replace(",", ""))
            unit = units[key]
            scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6,
                     "GB": 1e9, "nsecond": 1, "usecond": 1e3, "msecond": 1e6, "ns": 1,
                     "us": 1e3, "ms": 1e6}.get(unit, 1)
            return x * scale
        result.append((r["Kernel Name"], val("dram__bytes_read.sum"),
                       val("dram__bytes_write.sum"), val("gpu__time_duration.sum")))
    return result


TORCH_SCRIPT = r"""
import sys, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
backend, which = sys.argv[1], sys.argv[2]
B, N, H, D = {B}, {N}, {H}, {D}
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = ((torch.rand((B, N, H, D), device="cuda", generator=g) * 2 - 1).half().transpose(1, 2)
               for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)
be = {{"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}}[backend]
with sdpa_kernel([be]):
    for _ in range(2):  # warm-up
        F.scaled_dot_product_attention(q, k, v).backward(do)
    torch.cuda.synchronize()
    if which == "fwd":
        torch.cuda.cudart().cudaProfilerStart()
        out = F.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    else:
        out = F.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        out.backward(do)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
""".format(B=B, N=N, H=H, D=D)


def summarize(kernels):
    return {
        "kernels": len(kernels),
        "read_gb": sum(k[1] for k in kernels) / 1e9,
        "write_gb": sum(k[2] for k in kernels) / 1e9,
        "kernel_ms": sum(k[3] for k in kernels) / 1e6,
    }


def main():
    cli, out_dir = sys.argv[1], sys.argv[2]
    ncu_bin = sys.argv[sys.argv.index("--ncu") + 1] if "--ncu" in sys.argv else shutil.which("ncu")
    if not ncu_bin:
        for cand in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu"):
            if os.path.exists(cand):
                ncu_bin = cand
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    inp = os.path.join(out_dir, "gpt2m.safetensors")
    write_safetensors(inp, {n: rng.uniform(-1, 1, (B, N, H, D)).astype(np.float16)
                            for n in ("q", "k", "v", "do")})
    results = {}
    ours = ncu([cli, inp, "--backward", "-o", os.path.join(out_dir, "gpt2m-out.safetensors")], ncu_bin)
    results["ours fwd"] = summarize([k for k in ours if k[0].startswith("flash_fwd")])
    results["ours bwd"] = summarize([k for k in ours if k[0].startswith("flash_bwd")])
    results["ours kernels"] = sorted({k[0] for k in ours})
    script = os.path.join(out_dir, "torch_pass.py")
    open(script, "w").write(TORCH_SCRIPT)
    for backend in ("math", "flash"):
        for which in ("fwd", "bwd"):
            ks = ncu([sys.executable, script, backend, which], ncu_bin,
                     extra=("--profile-from-start", "off"))
            results[f"torch {backend} {which}"] = summarize(ks)
    flops_fwd = 4 * B * H * N * N * D
    results["shape"] = {"B": B, "N": N, "H": H, "d": D, "dtype": "f16", "causal": False,
                        "fwd_gflop": flops_fwd / 1e9, "bwd_gflop": 2.5 * flops_fwd / 1e9}
    elem = B * N * H * D * 2 / 1e9
    results["minimum_gb"] = {
        "fwd_read": 3 * elem, "fwd_write": elem + B * H * N * 4 / 1e9,
        "bwd_read": 5 * elem + B * H * N * 4 / 1e9,
        "bwd_write": 3 * elem,
    }
    json.dump(results, open(os.path.join(out_dir, "io.json"), "w"), indent=1)
    print("| implementation | pass | kernels | HBM read (GB) | HBM write (GB) | kernel time (ms) |")
    print("|---|---|---:|---:|---:|---:|")
    for key, r in results.items():
        if isinstance(r, dict) and "read_gb" in r:
            name, which = key.rsplit(" ", 1)
            print(f"| {name} | {which} | {r['kernels']} | {r['read_gb']:.3f} | {r['write_gb']:.3f} | {r['kernel_ms']:.3f} |")


if __name__ == "__main__":
    main()
