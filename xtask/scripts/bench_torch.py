#!/usr/bin/env python3
"""PyTorch SDPA next to flash-attn's benchmark, on the same device in the same run.

Reads the rows written by `flash-attn-bench --out ours.json`, times
torch.nn.functional.scaled_dot_product_attention on the same shapes with the flash, cuDNN and
memory-efficient backends (CUDA events, median of repetitions after warm-up, inputs laid out as
[B, N, H, d] like ours and viewed as [B, H, N, d]), and writes the merged rows plus a table.

By the row's `op` (absent: fwd): `fwd` times the forward call; `bwd` times
`out.backward(grad, retain_graph=True)` alone (the forward runs once, outside the timing, and
the input gradients are reset to None before each call so no accumulation is timed);
`fwd_bwd` times forward + backward per iteration. FLOPs: 4·B·H·N²·d for the forward, 2.5×
that for bwd, 3.5× for fwd_bwd, halved for causal (FlashAttention's convention, as ours).
Rows of our deterministic backward (`mode` = `deterministic`) get the same PyTorch numbers as
the fast rows of that shape (timed once; PyTorch's flash backward has no deterministic mode),
and `ratio_vs_fast`, our fast time over our deterministic time on that shape.

Decode rows (`op` = `decode`, from `flash-attn-bench --op decode`) time SDPA on one new query
over the whole context: q [B, Hq, 1, d], K and V [B, Hkv, N, d] with `enable_gqa=True`, under
the flash and cuDNN backends (a backend that rejects the call reads null, with its error), in
the cache layout of our row: our `heads` rows (a head-major cache) beside K and V
[B, Hkv, N, d] contiguous, and our token-major rows (`contiguous`, and the paged ones, whose
pages are token-major too; SDPA has no paged cache) beside the same bytes [B, N, Hkv, d]
viewed as [B, Hkv, N, d] (`torch_layout`: `heads` or `tokens`; with Hkv = 1 both are one
layout). Our rows carry `host_us`, the host's time inside one call (checks and launches).
They get `torch_{flash,cudnn}_ms`, the effective bandwidth `torch_*_gbps` (the same K and V
bytes as ours over PyTorch's time), `torch_{flash,cudnn}_heads_ms` (the head-major call's
time, on every row), `ratio_vs_cudnn` (our time over cuDNN's in the same layout: ≤ 1 is the
target) and `speedup_vs_flash` (flash's time over ours: ≥ 1.2 is the target).

Forward rows carry the path our forward took (`path`: `wgmma` on Hopper, else `mma`), backward
and forward + backward rows the path of our backward's main kernel; on Hopper, `fwd` and `bwd`
rows on `wgmma` also carry the `mma.sync` path's time on the same shape (`mma_ms`); rows get
`ratio_vs_cudnn`
(our TFLOP/s over cuDNN's: >= 1 is the Hopper target), `ratio_vs_mma` (the mma.sync path's time
over ours) and `gemm_fraction`, our TFLOP/s over a bf16 8192^3 torch.matmul timed in the same
run (`torch_gemm_tflops`).

Forward rows carry our `host_us` (the host's time inside one of our calls, measured by
`flash-attn-bench`) and get `torch_{flash,cudnn,efficient}_host_us`, the same for PyTorch's
call (Python, dispatch and launch; each call on an idle stream, its GPU work not waited for):
the event-timed `*_ms` of both sides include that time where the GPU waits for the launch.

Paired rounds (`--pair BENCH --rounds R`, forward and backward rows): ours and PyTorch's
flash and cuDNN backends are timed again R times per row, alternating (BENCH, the
`flash-attn-bench` binary, restricted to the row's shape, then PyTorch), so both sides of a
ratio come from the same minutes of the GPU's clock and temperature. The row then reports the
medians over the rounds (`ours_ms`, `mma_ms`, `torch_{flash,cudnn}_ms`; the sweep's own time
stays as `sweep_ms`), `rounds`, and the spread of the per-round ratios
(`ratio_vs_cudnn_rounds`: min, median, max of ours/cuDNN TFLOP/s). The efficient backend is
timed once; a deterministic backward row keeps its sweep's time (PyTorch's numbers are
the fast row's medians).

Usage: bench_torch.py ours.json merged.json [--reps N] [--pair BENCH --rounds R]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def time_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(fn, reps):
    """Median µs the host spends inside one call of `fn` (each call on an idle stream, the GPU
    work it queues not waited for), as our rows' `host_us`."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def tflops(row, ms):
    flops = 4.0 * row["b"] * row["h"] * row["n"] * row["n"] * row["d"]
    flops *= FLOP_FACTOR[row.get("op", "fwd")]
    if row["causal"]:
        flops /= 2
    return flops / (ms * 1e-3) / 1e12


def clear_grads(*ts):
    for t in ts:
        t.grad = None


def time_op(op, q, k, v, grad, causal, reps):
    """Median ms of one op (see the module docstring) with the backend selected by the caller."""
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if op == "fwd":
        return time_ms(sdpa, reps)
    if op == "bwd":
        out = sdpa()

        def step():
            clear_grads(q, k, v)
            out.backward(grad, retain_graph=True)

        try:
            return time_ms(step, reps)
        finally:
            clear_grads(q, k, v)
            del out

    def step():
        clear_grads(q, k, v)
        sdpa().backward(grad)

    try:
        return time_ms(step, reps)
    finally:
        clear_grads(q, k, v)


def row_key(r):
    """A row's shape and op (our sweep's rows are unique by it and `mode`)."""
    return (r.get("op", "fwd"), r["dtype"], r["b"], r["n"], r["h"], r["d"], r["causal"])


def ours_again(bench, row, reps):
    """Our row timed again by a fresh `flash-attn-bench` restricted to its shape."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [
            bench, "--out", out, "--op", row.get("op", "fwd"), "--mode", row.get("mode", "fast"),
            "--d", str(row["d"]), "--n", str(row["n"]), "--dtype", row["dtype"],
            "--causal", str(row["causal"]).lower(), "--reps", str(reps),
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        again = [r for r in json.load(open(out)) if row_key(r) == row_key(row)]
    if len(again) != 1:
        raise SystemExit(f"bench_torch.py: {cmd} gave {len(again)} rows of {row_key(row)}")
    return again[0]


def paired_rounds(row, bench, rounds, timed_torch, reps):
    """Re-times `row` in `rounds` alternating rounds of ours then PyTorch (flash, cuDNN) and
    stores the medians and the spread of the per-round ratios (see the module docstring)."""
    ours, mma, torch_ms, ratios = [], [], {"flash": [], "cudnn": []}, []
    for _ in range(rounds):
        again = ours_again(bench, row, reps)
        ours.append(again["ours_ms"])
        if again.get("mma_ms"):
            mma.append(again["mma_ms"])
        for name in torch_ms:
            if row.get(f"torch_{name}_ms") is not None:
                torch_ms[name].append(timed_torch(name))
        if torch_ms["cudnn"]:
            ratios.append(torch_ms["cudnn"][-1] / ours[-1])
    row["sweep_ms"] = row["ours_ms"]
    row["ours_ms"] = statistics.median(ours)
    row["ours_tflops"] = tflops(row, row["ours_ms"])
    if mma:
        row["mma_ms"] = statistics.median(mma)
    for name, times in torch_ms.items():
        if times:
            row[f"torch_{name}_ms"] = statistics.median(times)
            row[f"torch_{name}_tflops"] = tflops(row, row[f"torch_{name}_ms"])
    row["rounds"] = rounds
    if ratios:
        row["ratio_vs_cudnn_rounds"] = [min(ratios), statistics.median(ratios), max(ratios)]


DECODE_BACKENDS = ("flash", "cudnn")


def time_gemm(reps):
    """TFLOP/s of a bf16 8192^3 torch.matmul on this GPU (the dense-GEMM yardstick)."""
    n = 8192
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, reps)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3) / 1e12


def time_decode(row, gen, reps):
    """PyTorch's numbers for one decode shape, for each cache layout (see the module
    docstring): {"heads": {...}, "tokens": {...}}, the second only where Hkv > 1."""
    b, n, hq, hkv, d = row["b"], row["n"], row["h"], row["h_kv"], row["d"]
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}[row["dtype"]]
    rand = lambda *shape: torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32).to(dt)
    q = rand(b, hq, 1, d)
    by_layout = {}
    # heads: K, V [B, Hkv, N, d] contiguous; tokens: [B, N, Hkv, d] in memory, viewed as
    # [B, Hkv, N, d] (FlashAttention's cache layout, our `contiguous` rows).
    for layout in ["heads", "tokens"] if hkv > 1 else ["heads"]:
        if layout == "heads":
            k, v = rand(b, hkv, n, d), rand(b, hkv, n, d)
        else:
            k, v = rand(b, n, hkv, d).transpose(1, 2), rand(b, n, hkv, d).transpose(1, 2)
        out = {}
        for name in DECODE_BACKENDS:
            try:
                with sdpa_kernel([BACKENDS[name]]):
                    ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), reps)
                out[f"torch_{name}_ms"] = ms
                out[f"torch_{name}_gbps"] = row["kv_bytes"] / (ms * 1e-3) / 1e9
            except Exception as e:  # a backend may not take GQA or this shape
                out[f"torch_{name}_ms"] = None
                out[f"torch_{name}_gbps"] = None
                out[f"torch_{name}_error"] = str(e).splitlines()[0][:200]
        by_layout[layout] = out
        del k, v
        torch.cuda.empty_cache()
    by_layout.setdefault("tokens", by_layout["heads"])  # Hkv = 1: one layout
    del q
    torch.cuda.empty_cache()
    return by_layout


def decode_main(rows, dst, reps, driver):
    gen = torch.Generator(device="cuda").manual_seed(0)
    timed = {}
    for row in rows:
        key = (row["dtype"], row["b"], row["n"], row["h"], row["h_kv"], row["d"])
        if key not in timed:
            timed[key] = time_decode(row, gen, reps)
        # Our `heads` rows beside SDPA on [B, Hkv, N, d]; the token-major ones (contiguous
        # and paged: pages are token-major too) beside SDPA on the same token-major bytes.
        # `torch_*_heads_ms` keeps the head-major time on every row.
        same = "heads" if row["layout"] == "heads" else "tokens"
        row.update(timed[key][same])
        row["torch_layout"] = same
        for name in DECODE_BACKENDS:
            row[f"torch_{name}_heads_ms"] = timed[key]["heads"].get(f"torch_{name}_ms")
        cudnn, flash = row.get("torch_cudnn_ms"), row.get("torch_flash_ms")
        row["ratio_vs_cudnn"] = row["ours_ms"] / cudnn if cudnn else None
        row["speedup_vs_flash"] = flash / row["ours_ms"] if flash else None
        row["torch_version"] = torch.__version__
        if driver:
            row["driver"] = driver
    json.dump(rows, open(dst, "w"), indent=1)
    fmt = lambda x, w=8, p=1: f"{x:{w}.{p}f}" if x is not None else " " * (w - 3) + "n/a"
    print(f"{'b':>3} {'n':>6} {'hkv':>3} {'layout':<10} {'meta':<6} {'spl':>3} {'ours us':>8} {'GB/s':>6} {'host us':>7} {'cudnn us':>8} {'flash us':>8} {'ours/cudnn':>10} {'flash/ours':>10} {'cudnn hnd':>9}")
    for r in rows:
        us = lambda ms: ms * 1e3 if ms is not None else None
        print(
            f"{r['b']:>3} {r['n']:>6} {r['h_kv']:>3} {r['layout']:<10} {r.get('meta', 'device'):<6} {r['splits']:>3} {fmt(us(r['ours_ms']))} {r['ours_gbps']:6.0f} {fmt(r.get('host_us'), 7)}"
            f" {fmt(us(r.get('torch_cudnn_ms')))} {fmt(us(r.get('torch_flash_ms')))} {fmt(r['ratio_vs_cudnn'], 10, 2)} {fmt(r['speedup_vs_flash'], 10, 2)} {fmt(us(r.get('torch_cudnn_heads_ms')), 9)}"
        )


def main():
    src, dst = sys.argv[1], sys.argv[2]
    flag = lambda name: sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None
    reps = int(flag("--reps") or 20)
    pair, rounds = flag("--pair"), int(flag("--rounds") or 0)
    if (pair is None) != (rounds == 0) or rounds < 0:
        raise SystemExit("bench_torch.py: --pair BENCH and --rounds R (R >= 1) go together")
    rows = json.load(open(src))
    dtypes = {"f16": torch.float16, "bf16": torch.bfloat16}
    gen = torch.Generator(device="cuda").manual_seed(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.split()[0]
    except Exception:  # no nvidia-smi: leave the driver out
        driver = None
    if rows and all(r.get("op") == "decode" for r in rows):
        return decode_main(rows, dst, reps, driver)
    gemm_tflops = time_gemm(reps)
    key = row_key
    timed = {}
    fast_ms = {key(r): r["ours_ms"] for r in rows if r.get("mode", "fast") == "fast"}
    for row in rows:
        if key(row) in timed:
            row.update(timed[key(row)])
            flash = row.get("torch_flash_tflops")
            row["ratio_vs_flash"] = row["ours_tflops"] / flash if flash else None
            if key(row) in fast_ms:
                row["ratio_vs_fast"] = fast_ms[key(row)] / row["ours_ms"]
            continue
        b, n, h, d = row["b"], row["n"], row["h"], row["d"]
        dt = dtypes[row["dtype"]]
        q, k, v = (
            (torch.rand((b, n, h, d), device="cuda", generator=gen, dtype=torch.float32) * 2 - 1)
            .to(dt)
            .transpose(1, 2)
            for _ in range(3)
        )
        op = row.get("op", "fwd")
        if op not in FLOP_FACTOR:
            raise SystemExit(f"bench_torch.py: unknown op {op!r} in {src}")
        for t in (q, k, v):
            t.requires_grad_(op != "fwd")
        grad = (
            (torch.rand((b, n, h, d), device="cuda", generator=gen, dtype=torch.float32) * 2 - 1)
            .to(dt)
            .transpose(1, 2)
            if op != "fwd"
            else None
        )
        for name, backend in BACKENDS.items():
            try:
                with sdpa_kernel([backend]):
                    ms = time_op(op, q, k, v, grad, row["causal"], reps)
                    if op == "fwd":
                        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=row["causal"])
                        row[f"torch_{name}_host_us"] = host_us(sdpa, reps)
                row[f"torch_{name}_ms"] = ms
                row[f"torch_{name}_tflops"] = tflops(row, ms)
            except Exception as e:  # a backend may not support a shape/dtype on this device
                row[f"torch_{name}_ms"] = None
                row[f"torch_{name}_tflops"] = None
                row[f"torch_{name}_error"] = str(e).splitlines()[0][:200]
        if pair:
            def timed_torch(name):
                with sdpa_kernel([BACKENDS[name]]):
                    return time_op(op, q, k, v, grad, row["causal"], reps)

            paired_rounds(row, pair, rounds, timed_torch, reps)
            if row.get("mode", "fast") == "fast":
                fast_ms[key(row)] = row["ours_ms"]
        flash = row.get("torch_flash_tflops")
        row["ratio_vs_flash"] = row["ours_tflops"] / flash if flash else None
        row["torch_version"] = torch.__version__
        if driver and not row.get("driver"):
            row["driver"] = driver
        timed[key(row)] = {k: v for k, v in row.items() if k.startswith("torch_") or k == "driver"}
        if row.get("mode", "fast") != "fast" and key(row) in fast_ms:
            row["ratio_vs_fast"] = fast_ms[key(row)] / row["ours_ms"]
        del q, k, v, grad
        torch.cuda.empty_cache()
    for row in rows:
        cudnn = row.get("torch_cudnn_tflops")
        row["ratio_vs_cudnn"] = row["ours_tflops"] / cudnn if cudnn else None
        mma = row.get("mma_ms")
        row["ratio_vs_mma"] = mma / row["ours_ms"] if mma else None
        row["torch_gemm_tflops"] = gemm_tflops
        row["gemm_fraction"] = row["ours_tflops"] / gemm_tflops
    json.dump(rows, open(dst, "w"), indent=1)
    print(f"bf16 GEMM 8192^3 (torch.matmul): {gemm_tflops:.1f} TFLOP/s")
    hdr = (
        f"{'op':<7} {'mode':<5} {'dtype':<5} {'d':>4} {'n':>6} {'causal':<6} {'path':<5} {'ours':>7} {'flash':>7} {'cudnn':>7}"
        f" {'effic':>7} {'ours/flash':>10} {'ours/cudnn':>10} {'mma/ours':>8} {'gemm%':>5}"
    )
    print(hdr)
    fmt = lambda x, w=7, p=1: f"{x:{w}.{p}f}" if x is not None else " " * (w - 3) + "n/a"
    for r in rows:
        print(
            f"{r.get('op', 'fwd'):<7} {r.get('mode', 'fast')[:5]:<5} {r['dtype']:<5} {r['d']:>4} {r['n']:>6} {str(r['causal']):<6}"
            f" {r.get('path', 'mma'):<5} {fmt(r['ours_tflops'])}"
            f" {fmt(r['torch_flash_tflops'])} {fmt(r['torch_cudnn_tflops'])} {fmt(r['torch_efficient_tflops'])}"
            f" {fmt(r['ratio_vs_flash'], 10, 2)} {fmt(r['ratio_vs_cudnn'], 10, 2)} {fmt(r['ratio_vs_mma'], 8, 2)}"
            f" {fmt(100 * r['gemm_fraction'], 5, 0)}"
        )


if __name__ == "__main__":
    main()
