#!/usr/bin/env bash
# Peak device memory of one backward call at N = 64K (one head, d = 128, f16) through
# flash-attn-cli --backward, fast and deterministic: nvidia-smi's memory.used sampled every
# 20 ms while the CLI runs, minus the peak of the same run at N = 128 (context, module and
# allocator overhead). Usage: mem_peak.sh CLI OUT_DIR
set -eu
cli=$1; out=$2; mkdir -p "$out"
python3 - "$out" <<'PY'
import json, struct, sys
import numpy as np
def write(path, n):
    rng = np.random.default_rng(0)
    header, off, blobs = {}, 0, []
    for name in ("q", "k", "v", "do"):
        raw = rng.uniform(-1, 1, (1, n, 1, 128)).astype(np.float16).tobytes()
        header[name] = {"dtype": "F16", "shape": [1, n, 1, 128], "data_offsets": [off, off + len(raw)]}
        off += len(raw); blobs.append(raw)
    text = json.dumps(header).encode(); text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text))); f.write(text); [f.write(b) for b in blobs]
write(sys.argv[1] + "/n65536.safetensors", 65536)
write(sys.argv[1] + "/n128.safetensors", 128)
PY
peak() {  # peak memory.used (MiB) while "$@" runs
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 20 > "$out/smi.txt" &
  local smi=$!; sleep 0.5; "$@" > /dev/null; sleep 0.3; kill $smi; wait $smi 2>/dev/null || true
  sort -n "$out/smi.txt" | tail -1
}
for mode in fast deterministic; do
  flag=""; [ $mode = deterministic ] && flag=--deterministic
  base=$(peak "$cli" "$out/n128.safetensors" --backward $flag -o "$out/o128.safetensors")
  big=$(peak "$cli" "$out/n65536.safetensors" --backward $flag -o "$out/o65536.safetensors")
  echo "mode=$mode peak_mib_n128=$base peak_mib_n65536=$big difference_mib=$((big - base))"
done
