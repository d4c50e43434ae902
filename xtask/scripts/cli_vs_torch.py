#!/usr/bin/env python3
"""Cross-checks `flash-attn-cli` against PyTorch on random cases, the way its users would.

For each case: random Q, K, V (and dO) are written to a safetensors file, the CLI runs on
it (GPU backend unless --cpu, and backward mode for a share of the cases), and its `o`,
`lse` (and `dq`, `dk`, `dv`) are compared with PyTorch in float64. The accuracy rule is
FlashAttention's: our max error ≤ 2 × the max error of PyTorch's own attention in the same
dtype (SDPA's math path, with GQA heads repeated; 3 × for the gradients) + atol + 1e-5, where
atol is FlashAttention's own tests' absolute term (their `fwd_atol`, and the same for each
gradient): twice the largest error of arithmetic on the reference rounded to the output's
dtype, |((r + 0.3) − 0.3) − r|, about an ulp at the output's magnitude. It is the library's
rule (tests/src/lib.rs `arithmetic_error`): without it an f16 or bf16 output above 1 fails
when ours rounds one way and PyTorch the other, as small cases with few outputs (and with
dropout, fewer still that are not 0) do. Prints one line per case and a summary; exits 1 if
any case fails.

With --decode-share F, that share of the cases runs `--decode` instead: a random KV cache
(contiguous, or paged with shuffled pages of 16, 32 or 256 keys and NaN in every row no
sequence owns), random cache lengths (0 included), optionally new keys and values, 1 to 16 new
queries; `o` and `lse` are held to the same rule against PyTorch on each sequence's keys, and
the returned caches must equal the expected ones bit for bit.

With --mask-share F (default 0.3), that share of the cases also draws the mask family's
options: a sliding window (--window L,R, -1 for an unbounded side), a softcap (--softcap C)
and ALiBi slopes (`alibi_slopes`, F32 [Hq] or [B, Hq], in the input file), each in about
half of those cases; the PyTorch side applies them the FlashAttention way (softcap on the
scaled scores, then the bias −slope·|i + Nk − Nq − j|, the window bottom-right aligned).

A fifth of the masked cases with Nq ≤ Nk (outside varlen batches and key padding) is a tree
mask alone (`tree_parents` I32 [B or 1, Nq]: random parents; the last Nq keys are the drafts),
and a quarter of the rest a block-sparse mask alone: the I32
tensor `block_mask` [B or 1, Hq or 1, ceil(Nq/128), ceil(Nk/128)] at a random density (0
included); PyTorch hides the keys of its zero blocks.

With --varlen-share F (default 0.2), that share of the forward/backward cases has
sequences of different lengths (0 and 1 included): half of them a packed varlen batch (q, k,
v `[total, H, d]` with `cu_seqlens_q`, `cu_seqlens_k` I32 `[B + 1]` in the input file; the
outputs `o`, `dq` `[total_q, Hq, d]`, `lse` `[Hq, total_q]`), half a padded batch with key
padding (`seqlens_k` I32 `[B]`); PyTorch runs each sequence on its own rows and keys.

With --dropout-share F (default 0.25), that share of the forward/backward cases outside
packed varlen batches (key padding included) runs with attention dropout: `--dropout P --seed S
--offset O --return-dropout-mask` (P in {0, 0.1, 0.17, 0.5, 0.9}, seeds and offsets over the
whole u64 range), and, when no other mask was drawn, a sliding window in 40% of them. The CLI's
`dropout_mask` (U8 [B, Hq, Nq, Nk], 1 = kept) must hold 0/1 only with a kept fraction near
1 − P, `rng_state` must be (seed, offset) as I64 (absent for P = 0) and the metadata `dropout`
P; PyTorch applies that mask to the softmax probabilities, P ∘ mask / (1 − P) (in float64 for
the reference, in the dtype for the yardstick), and the accuracy rule above applies to o, lse
and the gradients, the gradients' allowance plus what the rounding of the CLI's own O costs an
exact float64 backward (its D = rowsum(dO ∘ O); the library's rule too), which PyTorch's
yardstick does not pay where a row sees a single key. The dropout draws come from a generator
of their own, so a given --seed draws the same other cases with or without them.

Usage: cli_vs_torch.py CLI_BINARY [--cases N] [--seed S] [--cpu] [--backward-share F]
       [--decode-share F] [--mask-share F] [--varlen-share F] [--dropout-share F]
"""
import math
import os
import random
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def attention(q, k, v, causal, scale, masks=None):
    """Naive attention in q's dtype and device: [B, N, H, d] layout, GQA by repetition.
    `masks` (optional): dict with `window` (left, right; None = unbounded side), `softcap`,
    `alibi` (slopes [Hq] or [B, Hq], float64), `dropout` (keep [B, Hq, Nq, Nk] 0/1, P: the
    probabilities become P ∘ keep / (1 − P) in their dtype). Returns O and the natural-log LSE
    [B, Hq, Nq] of the softmax before dropout (f32 for low precision)."""
    masks = masks or {}
    hq, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    nq, nk = q.shape[1], k.shape[1]
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    diag = i + nk - nq
    if masks.get("softcap") is not None:
        cap = masks["softcap"]
        s = cap * torch.tanh(s / cap)
    if masks.get("alibi") is not None:
        slopes = masks["alibi"].to(device=q.device, dtype=s.dtype)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        s = s - slopes * (diag - j).abs().to(s.dtype)
    hidden = torch.zeros(nq, nk, dtype=torch.bool, device=q.device)
    left, right = masks.get("window") or (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        hidden |= j < diag - left
    if right is not None:
        hidden |= j > diag + right
    if masks.get("tree") is not None:
        # [B or 1, T, T] ancestor sets over the last T keys; the prefix stays visible.
        anc = masks["tree"].to(device=q.device).bool()
        prefix = nk - nq
        seen = torch.ones(anc.shape[0], 1, nq, nk, dtype=torch.bool, device=q.device)
        seen[..., prefix:] = anc[:, None]
        hidden = hidden | ~seen
    if masks.get("block") is not None:
        bm = masks["block"].to(device=q.device).bool()
        bm = bm.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)[..., :nq, :nk]
        hidden = hidden | ~bm
    s = s.masked_fill(hidden, float("-inf"))
    # Rows that see no key get LSE = −∞ through a finite logsumexp, so that the LSE can be
    # differentiated (the dropout cases' allowance below) without NaN from those rows.
    sl = s.float() if s.dtype != torch.float64 else s
    dead = torch.isneginf(sl).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(sl.masked_fill(dead, 0.0), dim=-1).masked_fill(dead[..., 0], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key
    if masks.get("dropout") is not None:
        keep, drop = masks["dropout"]
        p = p * keep.to(device=q.device, dtype=p.dtype) / (1.0 - drop)
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return o, lse


def draw_masks(rng, b, hq, share, lens=None):
    """Random mask-family options (or {} outside `share`), and the CLI flags that set them.
    With `lens` = (Nq, Nk), a quarter of them is a block-sparse mask alone (`block`: I32
    [B or 1, Hq or 1, ceil(Nq/128), ceil(Nk/128)], random density)."""
    if rng.random() >= share:
        return {}, []
    masks, flags = {}, []
    if lens is not None and lens[0] <= lens[1] and rng.random() < 0.2:
        # A tree of Nq drafts after Nk − Nq prefix keys, from random parent arrays.
        nb, t = rng.choice([1, b]), lens[0]
        parents = [[-1 if i == 0 or rng.random() < 0.2 else rng.randrange(i) for i in range(t)] for _ in range(nb)]
        anc = torch.zeros(nb, t, t, dtype=torch.int32)
        for bi in range(nb):
            for i in range(t):
                node = i
                while node >= 0:
                    anc[bi, i, node] = 1
                    node = parents[bi][node]
        masks["tree"] = anc
        masks["tree_parents"] = torch.tensor(parents, dtype=torch.int32)
        return masks, flags
    if lens is not None and rng.random() < 0.25:
        nqb, nkb = -(-lens[0] // 128), -(-lens[1] // 128)
        dims = [rng.choice([1, b]), rng.choice([1, hq]), nqb, nkb]
        density = rng.choice([0.0, 0.3, 0.6, 1.0])
        masks["block"] = (torch.rand(*dims) < density).to(torch.int32)
        return masks, flags
    if rng.random() < 0.5:
        side = lambda: None if rng.random() < 0.2 else rng.choice([0, 1, 5, 17, 40, 100, 300])
        left, right = side(), side()
        masks["window"] = (left, right)
        flags += ["--window", f"{-1 if left is None else left},{-1 if right is None else right}"]
    if rng.random() < 0.5:
        masks["softcap"] = rng.choice([2.0, 10.0, 30.0, 50.0])
        flags += ["--softcap", repr(masks["softcap"])]
    if rng.random() < 0.5:
        shape = [hq] if rng.random() < 0.5 else [b, hq]
        masks["alibi"] = torch.rand(*shape, dtype=torch.float64) * 0.5
    return masks, flags


def seq_attention(q, k, v, causal, scale, masks, seqs):
    """`attention` per sequence: `seqs` is None (one padded call), ("varlen", cu_q, cu_k) with
    packed [total, H, d] tensors (returns O [total_q, Hq, d], LSE [Hq, total_q]), or
    ("keys", lens) for a padded batch whose entry b sees its first lens[b] keys."""
    if seqs is None:
        return attention(q, k, v, causal, scale, masks)

    def seq_masks(b, n=None):
        m = dict(masks)
        if m.get("alibi") is not None and m["alibi"].dim() == 2:
            m["alibi"] = m["alibi"][b]
        if m.get("block") is not None:
            m["block"] = m["block"][b % m["block"].shape[0]][None]
        if m.get("dropout") is not None:
            # The padded batch's mask: entry b's rows, its first n keys.
            keep, drop = m["dropout"]
            m["dropout"] = (keep[b : b + 1, :, :, :n], drop)
        return m

    os_, lses = [], []
    if seqs[0] == "varlen":
        assert masks.get("dropout") is None, "the CLI returns no dropout mask for a varlen batch"
        _, cu_q, cu_k = seqs
        for b in range(len(cu_q) - 1):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            o, lse = attention(q[rq][None], k[rk][None], v[rk][None], causal, scale, seq_masks(b))
            os_.append(o[0])
            lses.append(lse[0])
        return torch.cat(os_, dim=0), torch.cat(lses, dim=1)
    _, lens = seqs
    for b, n in enumerate(lens):
        o, lse = attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal, scale, seq_masks(b, n))
        os_.append(o)
        lses.append(lse)
    return torch.cat(os_, dim=0), torch.cat(lses, dim=0)


def draw_seqs(rng, b, nq, nk):
    """Random per-sequence lengths: ("varlen", cu_q, cu_k) or ("keys", lens)."""
    lengths = [0, 1, 7, 16, 63, 64, 65, 128, 129, 200, 257]
    if rng.random() < 0.5:
        lens = [rng.choice(lengths + [nk] * 3) for _ in range(b)]
        return ("keys", [min(n, nk) for n in lens])
    cu_q, cu_k = [0], [0]
    for _ in range(b):
        cu_q.append(cu_q[-1] + rng.choice(lengths))
        cu_k.append(cu_k[-1] + rng.choice(lengths))
    cu_q[-1] += 1 if cu_q[-1] == 0 else 0  # the packed tensors are never empty
    cu_k[-1] += 1 if cu_k[-1] == 0 else 0
    return ("varlen", cu_q, cu_k)


def describe_seqs(seqs):
    if seqs is None:
        return ""
    if seqs[0] == "keys":
        return f" seqlens_k={seqs[1]}"
    lens = lambda cu: [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    return f" varlen q={lens(seqs[1])} k={lens(seqs[2])}"


def arithmetic_error(ref, dtype):
    """FlashAttention's tests' absolute term for an output of `dtype` (see the module doc):
    2·max|((r + 0.3) − 0.3) − r| over the finite elements of `ref` rounded to `dtype`, each
    operation rounded to it."""
    r = ref.detach().to(dtype)
    err = (((r + 0.3) - 0.3).double() - r.double()).abs()
    err = torch.where(torch.isfinite(err), err, torch.zeros_like(err))
    return 2 * err.max().item() if err.numel() else 0.0


def max_err(a, ref):
    a, ref = a.double(), ref.double()
    both_inf = torch.isinf(a) & torch.isinf(ref) & (torch.sign(a) == torch.sign(ref))
    d = (a - ref).abs()
    d = torch.where(both_inf, torch.zeros_like(d), d)
    if torch.isnan(d).any():
        return float("inf")
    return d.max().item() if d.numel() else 0.0


def draw_dropout(rng):
    """Random dropout options: (P, seed, offset), seeds and offsets over the whole u64 range."""
    p = rng.choice([0.0, 0.1, 0.17, 0.5, 0.9])
    seed = rng.choice([0, 1, 42, rng.randrange(2**64)])
    offset = rng.choice([0, 1, rng.randrange(2**64)])
    return p, seed, offset


def as_i64(x):
    """The u64 `x` as the I64 the CLI's `rng_state` holds (its bits)."""
    return x - 2**64 if x >= 2**63 else x


def check_dropout(got, meta, dropout, shape):
    """The CLI's dropout outputs: `dropout_mask` U8 `shape` of 0/1 with a kept fraction near
    1 − P (6 standard deviations), `rng_state` (seed, offset) as I64 (absent for P = 0), and
    the metadata `dropout`. Returns (ok, message, the mask)."""
    p, seed, offset = dropout
    msgs, ok = [], True
    keep = got.get("dropout_mask")
    if keep is None or keep.dtype != torch.uint8 or list(keep.shape) != list(shape):
        desc = "missing" if keep is None else f"{keep.dtype} {list(keep.shape)}"
        return False, f"dropout_mask {desc}, expected uint8 {list(shape)} !!", None
    if keep.numel() and keep.max().item() > 1:
        ok = False
        msgs.append("dropout_mask not 0/1 !!")
    n = keep.numel()
    kept = keep.double().mean().item() if n else 1.0
    bound = 6 * math.sqrt(p * (1 - p) / max(n, 1)) + 1e-3 if p > 0 else 0.0
    good = abs(kept - (1 - p)) <= bound
    ok &= good
    msgs.append(f"kept {kept:.3f}/{1 - p:.3f}{'' if good else ' !!'}")
    state = got.get("rng_state")
    if p > 0:
        want = [as_i64(seed), as_i64(offset)]
        good = state is not None and state.dtype == torch.int64 and state.tolist() == want
        good &= meta.get("dropout") is not None and abs(float(meta["dropout"]) - p) < 1e-6
        good &= meta.get("seed") == str(seed) and meta.get("offset") == str(offset)
    else:
        good = state is None and meta.get("dropout") == "none"
    ok &= good
    if not good:
        msgs.append(f"rng_state {None if state is None else state.tolist()} metadata {meta.get('dropout')} !!")
    return ok, ", ".join(msgs), keep


def decode_case(rng, dt, cpu):
    """A random decode problem: the input tensors and, per sequence, its keys after the append."""
    b = rng.choice([1, 2, 3])
    nq = rng.randint(1, 16)
    hkv = rng.choice([1, 2, 4])
    hq = hkv * rng.choice([1, 2, 4, 8])
    d = rng.choice([32, 64, 72, 96, 128, 256])
    n_new = rng.choice([0, 0, rng.randint(1, nq)])
    lens = [rng.choice([0, rng.randint(1, 16), rng.randint(1, 3000)]) for _ in range(b)]
    cap = max(lens) + n_new + rng.randint(1, 40)  # the API takes block tables of >= 1 page
    page = rng.choice([None, 16, 32, 256])
    nan = float("nan")
    if page is None:
        kc = torch.full((b, cap, hkv, d), nan, dtype=torch.float64)
        vc = kc.clone()
        slot = lambda bi, j: (bi, j)
        table = None
    else:
        per = -(-cap // page)
        ids = list(range(b * per + 2))
        rng.shuffle(ids)
        table = torch.tensor(ids[: b * per], dtype=torch.int32).reshape(b, per)
        kc = torch.full((b * per + 2, page, hkv, d), nan, dtype=torch.float64)
        vc = kc.clone()
        slot = lambda bi, j: (int(table[bi, j // page]), j % page)
    for bi, n in enumerate(lens):
        for j in range(n):
            e, r = slot(bi, j)
            kc[e, r] = torch.randn(hkv, d, dtype=torch.float64)
            vc[e, r] = torch.randn(hkv, d, dtype=torch.float64)
    tensors = {
        "q": torch.randn(b, nq, hq, d, dtype=torch.float64).to(dt),
        "k_cache": kc.to(dt),
        "v_cache": vc.to(dt),
        "cache_seqlens": torch.tensor(lens, dtype=torch.int32),
    }
    if table is not None:
        tensors["block_table"] = table
    expected_k, expected_v = tensors["k_cache"].clone(), tensors["v_cache"].clone()
    if n_new:
        tensors["k_new"] = torch.randn(b, n_new, hkv, d, dtype=torch.float64).to(dt)
        tensors["v_new"] = torch.randn(b, n_new, hkv, d, dtype=torch.float64).to(dt)
        for bi in range(b):
            for i in range(n_new):
                e, r = slot(bi, lens[bi] + i)
                expected_k[e, r] = tensors["k_new"][bi, i]
                expected_v[e, r] = tensors["v_new"][bi, i]
    keys = []
    for bi in range(b):
        n = lens[bi] + n_new
        idx = [slot(bi, j) for j in range(n)]
        gk = torch.stack([expected_k[e, r] for e, r in idx]) if n else None
        gv = torch.stack([expected_v[e, r] for e, r in idx]) if n else None
        keys.append((gk, gv))
    desc = f"decode B={b} Nq={nq} Hq={hq} Hkv={hkv} d={d} lens={lens} new={n_new} page={page}"
    return tensors, (expected_k, expected_v), keys, desc


def check_decode(got, tensors, expected, keys, causal, sc, dev, masks):
    """The decode outputs against PyTorch, sequence by sequence; the caches bit for bit."""
    msgs, ok = [], True
    for name, want in zip(["k_cache", "v_cache"], expected):
        same = torch.equal(got[name].view(torch.int16), want.contiguous().view(torch.int16))
        ok &= same
        msgs.append(f"{name} {'same' if same else 'DIFFERS !!'}")
    q = tensors["q"]
    worst = {"o": [0.0, 0.0, 0.0], "lse": [0.0, 0.0, 0.0]}
    for bi, (gk, gv) in enumerate(keys):
        qb = q[bi : bi + 1].to(dev)
        if gk is None:
            o_ok = torch.all(got["o"][bi] == 0).item()
            lse_ok = torch.all(torch.isneginf(got["lse"][bi])).item()
            ok &= bool(o_ok and lse_ok)
            continue
        kb, vb = gk[None].to(dev), gv[None].to(dev)
        entry = dict(masks)
        if "alibi" in masks and masks["alibi"].dim() == 2:
            entry["alibi"] = masks["alibi"][bi : bi + 1]
        o_ref, lse_ref = attention(qb.double(), kb.double(), vb.double(), causal, sc, entry)
        o_lp, lse_lp = attention(qb, kb, vb, causal, sc, entry)
        for name, ours, ref, lp in [("o", got["o"][bi : bi + 1], o_ref, o_lp), ("lse", got["lse"][bi : bi + 1], lse_ref, lse_lp)]:
            worst[name][0] = max(worst[name][0], max_err(ours.to(dev), ref))
            worst[name][1] = max(worst[name][1], max_err(lp, ref))
            worst[name][2] = max(worst[name][2], arithmetic_error(ref, ours.dtype))
    for name, (e_ours, e_lp, atol) in worst.items():
        allowed = 2 * e_lp + atol + 1e-5
        good = e_ours <= allowed
        ok &= good
        msgs.append(f"{name} {e_ours:.2e}/{allowed:.2e}{'' if good else ' !!'}")
    return ok, msgs


def describe(masks):
    """A short text of the mask options of a case."""
    parts = []
    if "window" in masks:
        parts.append(f"window={masks['window']}")
    if "softcap" in masks:
        parts.append(f"softcap={masks['softcap']}")
    if "alibi" in masks:
        parts.append(f"alibi{list(masks['alibi'].shape)}")
    if "block" in masks:
        parts.append(f"block{list(masks['block'].shape)}@{masks['block'].float().mean().item():.2f}")
    if "tree" in masks:
        parts.append(f"tree{list(masks['tree'].shape)}")
    return ",".join(parts) or "none"


def main():
    args = sys.argv[1:]
    cli = args[0]
    n_cases = int(args[args.index("--cases") + 1]) if "--cases" in args else 40
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 1
    share = float(args[args.index("--backward-share") + 1]) if "--backward-share" in args else 0.2
    decode_share = float(args[args.index("--decode-share") + 1]) if "--decode-share" in args else 0.0
    mask_share = float(args[args.index("--mask-share") + 1]) if "--mask-share" in args else 0.3
    varlen_share = float(args[args.index("--varlen-share") + 1]) if "--varlen-share" in args else 0.2
    dropout_share = float(args[args.index("--dropout-share") + 1]) if "--dropout-share" in args else 0.25
    cpu = "--cpu" in args
    rng = random.Random(seed)
    drop_rng = random.Random(seed * 1_000_003 + 17)  # the dropout draws, apart from the rest
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for case in range(n_cases):
            dtype_name = rng.choice(["f16", "bf16", "f32"] if cpu else ["f16", "bf16"])
            dt = DTYPES[dtype_name]
            if rng.random() < decode_share:
                tensors, expected, keys, desc = decode_case(rng, dt, cpu)
                causal = rng.random() < 0.5
                scale = rng.choice([None, 0.3, -0.2])
                qs = tensors["q"].shape
                masks, flags = draw_masks(rng, qs[0], qs[2], mask_share)
                inp, out = os.path.join(tmp, f"in{case}.safetensors"), os.path.join(tmp, f"out{case}.safetensors")
                files = dict(tensors)
                if "alibi" in masks:
                    files["alibi_slopes"] = masks["alibi"].float()
                save_file({n: t.contiguous() for n, t in files.items()}, inp)
                cmd = [cli, inp, "-o", out, "--decode"] + (["--causal"] if causal else []) + flags
                cmd += (["--scale", repr(scale)] if scale is not None else []) + (["--cpu"] if cpu else [])
                desc = f"{dtype_name} {desc} causal={causal} scale={scale} masks={describe(masks)}"
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"FAIL {desc}: exit {r.returncode}: {' | '.join(r.stderr.strip().splitlines())}")
                    failures += 1
                    continue
                sc = scale if scale is not None else 1.0 / math.sqrt(tensors["q"].shape[3])
                if "alibi" in masks:
                    masks["alibi"] = masks["alibi"].float().double()  # what the CLI read
                ok, msgs = check_decode(load_file(out), tensors, expected, keys, causal, sc, dev, masks)
                print(("ok   " if ok else "FAIL ") + desc + ": " + ", ".join(msgs))
                failures += 0 if ok else 1
                continue
            b = rng.choice([1, 2, 3])
            nq = rng.choice([1, 7, 16, 63, 64, 65, 128, 129, 200, 257])
            nk = rng.choice([1, 7, 16, 63, 64, 65, 128, 129, 200, 257])
            hkv = rng.choice([1, 2, 3])
            hq = hkv * rng.choice([1, 2, 4])
            d = rng.choice([8, 16, 24, 32, 40, 64, 72, 80, 96, 100, 128, 160, 256])
            causal = rng.random() < 0.5
            scale = rng.choice([None, 0.3, -0.2, 1.0 / math.sqrt(d)])
            backward = rng.random() < share
            seqs = draw_seqs(rng, b, nq, nk) if rng.random() < varlen_share else None
            q_shape, kv_shape = [b, nq, hq, d], [b, nk, hkv, d]
            if seqs is not None and seqs[0] == "varlen":
                q_shape, kv_shape = [seqs[1][-1], hq, d], [seqs[2][-1], hkv, d]
            q = torch.randn(*q_shape, dtype=torch.float64)
            k = torch.randn(*kv_shape, dtype=torch.float64)
            v = torch.randn(*kv_shape, dtype=torch.float64)
            tensors = {"q": q.to(dt), "k": k.to(dt), "v": v.to(dt)}
            if backward:
                tensors["do"] = torch.randn(*q_shape, dtype=torch.float64).to(dt)
            lens = (nq, nk) if seqs is None else None  # block masks take neither varlen nor key padding
            masks, flags = draw_masks(rng, b, hq, mask_share, lens)
            dropout = None
            if (seqs is None or seqs[0] == "keys") and drop_rng.random() < dropout_share:
                dropout = draw_dropout(drop_rng)
                if not masks and drop_rng.random() < 0.4:
                    left, right = drop_rng.choice([0, 5, 40, 300]), drop_rng.choice([-1, 0, 17, 100])
                    masks["window"] = (left, None if right < 0 else right)
                    flags += ["--window", f"{left},{right}"]
            files = dict(tensors)
            if "block" in masks:
                files["block_mask"] = masks["block"]
            if "tree_parents" in masks:
                files["tree_parents"] = masks.pop("tree_parents")
            if seqs is not None and seqs[0] == "varlen":
                files["cu_seqlens_q"] = torch.tensor(seqs[1], dtype=torch.int32)
                files["cu_seqlens_k"] = torch.tensor(seqs[2], dtype=torch.int32)
            elif seqs is not None:
                files["seqlens_k"] = torch.tensor(seqs[1], dtype=torch.int32)
            if "alibi" in masks:
                files["alibi_slopes"] = masks["alibi"].float()
                masks["alibi"] = masks["alibi"].float().double()  # what the CLI reads
            inp, out = os.path.join(tmp, f"in{case}.safetensors"), os.path.join(tmp, f"out{case}.safetensors")
            save_file({n: t.contiguous() for n, t in files.items()}, inp)
            cmd = [cli, inp, "-o", out] + flags
            if causal:
                cmd.append("--causal")
            if scale is not None:
                cmd += ["--scale", repr(scale)]
            if cpu:
                cmd.append("--cpu")
            if backward:
                cmd.append("--backward")
            if dropout is not None:
                cmd += ["--dropout", repr(dropout[0]), "--seed", str(dropout[1]), "--offset", str(dropout[2])]
                cmd.append("--return-dropout-mask")
            r = subprocess.run(cmd, capture_output=True, text=True)
            drop_desc = "" if dropout is None else f" dropout={dropout[0]} seed={dropout[1]} offset={dropout[2]}"
            desc = f"{dtype_name} B={b} Nq={nq} Nk={nk} Hq={hq} Hkv={hkv} d={d} causal={causal} scale={scale} bwd={backward} masks={describe(masks)}{describe_seqs(seqs)}{drop_desc}"
            if r.returncode != 0:
                print(f"FAIL {desc}: exit {r.returncode}: {r.stderr.strip()}")
                failures += 1
                continue
            got = load_file(out)
            sc = scale if scale is not None else 1.0 / math.sqrt(d)
            ok = True
            msgs = []
            if dropout is not None:
                with safe_open(out, framework="pt") as f:
                    meta = f.metadata() or {}
                good, msg, keep = check_dropout(got, meta, dropout, [b, hq, nq, nk])
                ok &= good
                msgs.append(msg)
                if keep is None:
                    print("FAIL " + desc + ": " + ", ".join(msgs))
                    failures += 1
                    continue
                p32 = torch.tensor(dropout[0], dtype=torch.float32).item()  # what the CLI reads
                masks["dropout"] = (keep, p32)
            # float64 reference and the same-dtype naive attention, with autograd for backward
            ins = [t.double().to(dev).requires_grad_(backward) for t in (tensors["q"], tensors["k"], tensors["v"])]
            o_ref, lse_ref = seq_attention(*ins, causal, sc, masks, seqs)
            ins_lp = [t.to(dev).requires_grad_(backward) for t in (tensors["q"], tensors["k"], tensors["v"])]
            o_lp, lse_lp = seq_attention(*ins_lp, causal, sc, masks, seqs)
            checks = [("o", got["o"], o_ref, o_lp), ("lse", got["lse"], lse_ref, lse_lp)]
            if backward:
                g = tensors["do"].to(dev)
                # allow_unused: with key padding or empty sequences some inputs may not be read
                fill = lambda gs, xs: [torch.zeros_like(x) if gr is None else gr for gr, x in zip(gs, xs)]
                keep_graph = dropout is not None
                refs = fill(torch.autograd.grad(o_ref, ins, g.double(), allow_unused=True, retain_graph=keep_graph), ins)
                lps = fill(torch.autograd.grad(o_lp, ins_lp, g, allow_unused=True), ins_lp)
                givens = [None] * 3
                if dropout is not None:
                    # The CLI's backward takes D = rowsum(dO ∘ O) from its own O, rounded to the
                    # dtype (FlashAttention's backward does too). With dropout that O carries
                    # 1/(1 − P) and is rarely exact, and a row with one visible key leaves
                    # PyTorch's own gradient exact (dS = P ∘ (G − D) = 0), so the rule also allows
                    # what that rounding alone costs the exact backward, as the library's rule
                    # does (tests/src/lib.rs check_gradient_accuracy; LSE's f32 rounding left
                    # out here): dS − ΔD·P, ΔD = rowsum(dO ∘ ΔO), is the gradient of the loss
                    # less ΔD·LSE (∂LSE/∂S = P).
                    delta = ((got["o"].to(dev).double() - o_ref.detach()) * g.double()).sum(-1)
                    delta = delta.transpose(0, 1) if delta.dim() == 2 else delta.transpose(1, 2)
                    corr = fill(torch.autograd.grad(lse_ref, ins, delta.contiguous(), allow_unused=True), ins)
                    givens = [r - c for r, c in zip(refs, corr)]
                for name, r64, rlp, given in zip(["dq", "dk", "dv"], refs, lps, givens):
                    checks.append((name, got[name], r64, rlp, given))
            for name, ours, ref, lp, *given in checks:
                e_ours = max_err(ours.to(dev), ref)
                e_lp = max_err(lp.detach(), ref)
                atol = arithmetic_error(ref, ours.dtype)
                allowed = 2 * e_lp + atol + 1e-5
                if name in ("dq", "dk", "dv"):
                    allowed = 3 * e_lp + atol + 1e-5  # gradients: FlashAttention's tests allow 2-3x
                if given and given[0] is not None:
                    allowed += max_err(given[0], ref)
                good = e_ours <= allowed
                ok &= good
                msgs.append(f"{name} {e_ours:.2e}/{allowed:.2e}{'' if good else ' !!'}")
            print(("ok   " if ok else "FAIL ") + desc + ": " + ", ".join(msgs))
            failures += 0 if ok else 1
    print(f"cli_vs_torch: {n_cases - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
