#!/usr/bin/env bash
# Runs flash-attn's tests or benchmark on a GPU machine that has the NVIDIA driver but no Rust.
# Built by `cargo xtask bundle`. Usage:
#   bash bundle/run.sh test    # every test binary (those that run the forward twice more on
#                              # Hopper, once per forward path, and those that run the
#                              # backward once more on its mma.sync path); a missing GPU is a
#                              # failure here (test-default: only the first pass; test-paths:
#                              # only the forward's Hopper reruns; test-bwd-paths: only the
#                              # backward's)
#   bash bundle/run.sh bench   # our forward benchmark, then PyTorch SDPA on the same shapes
#                              # (BENCH_ROUNDS=R: then R paired rounds per row, see
#                              # scripts/bench_torch.py)
#   bash bundle/run.sh masks   # the mask family and varlen, then FlexAttention and SDPA
#   bash bundle/run.sh dropout # attention dropout at p = 0.1 and 0, then SDPA with dropout
# Logs and JSON go to $OUT (or bundle/out when OUT is unset).
set -u -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
what=${1:-test}
shift || true
case "$what" in
  test|test-default|test-paths|test-bwd-paths)
    # test = test-default, test-paths, test-bwd-paths; each fits a 10-minute device call.
    export FLASH_ATTN_REQUIRE_GPU=1
    status=0
    if [ "$what" = test ] || [ "$what" = test-default ]; then
      for t in "$here"/tests/*; do
        echo "=== $(basename "$t")"
        "$t" --test-threads=4 "$@" 2>&1 | tee -a "$out/test.log" || status=1
      done
    fi
    # On Hopper the forward has two paths (wgmma and mma.sync; the default picks by length):
    # every suite that runs the forward again with each forced, and the forward suite once
    # more on wgmma without ping-pong, and (with varlen) with one block per query tile on the
    # persistent kernels, and with the plain kind's 176-key tiles on every call they cover.
    hopper=0
    nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | grep -q '^9\.0' && hopper=1
    if { [ "$what" = test ] || [ "$what" = test-paths ]; } && [ $hopper = 1 ]; then
      for run in "wgmma 1 1 0 gpu_forward gpu_dropout gpu_sparse gpu_tree gpu_varlen" \
                 "mma 1 1 0 gpu_forward gpu_dropout gpu_sparse gpu_tree gpu_varlen" \
                 "wgmma 0 1 0 gpu_forward" \
                 "wgmma 1 0 0 gpu_forward gpu_varlen" \
                 "wgmma 1 1 1 gpu_forward gpu_varlen"; do
        read -r path pingpong persistent wide suites <<< "$run"
        for suite in $suites; do
          echo "=== $suite with FLASH_ATTN_FWD=$path FLASH_ATTN_WGMMA_PINGPONG=$pingpong FLASH_ATTN_WGMMA_PERSISTENT=$persistent FLASH_ATTN_WGMMA_WIDE=$wide"
          FLASH_ATTN_FWD=$path FLASH_ATTN_WGMMA_PINGPONG=$pingpong \
            FLASH_ATTN_WGMMA_PERSISTENT=$persistent FLASH_ATTN_WGMMA_WIDE=$wide \
            "$here/tests/$suite-test" --test-threads=4 "$@" 2>&1 \
            | tee -a "$out/test.log" || status=1
        done
      done
    fi
    # The backward's default on Hopper is `wgmma` where a kernel exists: the suites whose
    # calls reach those kernels run once more on `mma.sync`.
    if { [ "$what" = test ] || [ "$what" = test-bwd-paths ]; } && [ $hopper = 1 ]; then
      for suite in gpu_backward gpu_dropout gpu_sparse gpu_tree gpu_varlen; do
        echo "=== $suite with FLASH_ATTN_BWD=mma"
        FLASH_ATTN_BWD=mma "$here/tests/$suite-test" --test-threads=4 "$@" 2>&1 \
          | tee -a "$out/test.log" || status=1
      done
    fi
    [ $status -eq 0 ] && echo "ALL TEST BINARIES PASSED" || echo "SOME TEST BINARY FAILED"
    exit $status
    ;;
  bench)
    export BENCH_DATE=${BENCH_DATE:-$(date -u +%Y-%m-%d)}
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/nvidia-smi.txt"
    "$here/bin/flash-attn-bench" --out "$out/ours.json" "$@" || exit 1
    # BENCH_ROUNDS=R: each row timed again R times, ours and PyTorch's alternating (medians).
    pair=()
    [ -n "${BENCH_ROUNDS:-}" ] && pair=(--pair "$here/bin/flash-attn-bench" --rounds "$BENCH_ROUNDS")
    python3 "$here/scripts/bench_torch.py" "$out/ours.json" "$out/bench.json" "${pair[@]}" | tee "$out/bench-table.txt"
    ;;
  masks)
    # The mask family's rows (flash-attn-bench --op masks) beside FlexAttention and SDPA.
    export BENCH_DATE=${BENCH_DATE:-$(date -u +%Y-%m-%d)}
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/nvidia-smi.txt"
    "$here/bin/flash-attn-bench" --op masks --out "$out/masks-ours.json" "$@" || exit 1
    python3 "$here/scripts/bench_masks_torch.py" "$out/masks-ours.json" "$out/masks.json" | tee "$out/masks-table.txt"
    ;;
  dropout)
    # Attention dropout's rows (flash-attn-bench --op dropout) beside SDPA with the same p.
    export BENCH_DATE=${BENCH_DATE:-$(date -u +%Y-%m-%d)}
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/nvidia-smi.txt"
    "$here/bin/flash-attn-bench" --op dropout --out "$out/dropout-ours.json" "$@" || exit 1
    python3 "$here/scripts/bench_dropout_torch.py" "$out/dropout-ours.json" "$out/dropout.json" | tee "$out/dropout-table.txt"
    ;;
  *)
    echo "usage: run.sh test|test-default|test-paths|test-bwd-paths|bench|masks|dropout [args]" >&2
    exit 2
    ;;
esac
