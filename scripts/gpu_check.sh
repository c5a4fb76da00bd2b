#!/usr/bin/env bash
# The GPU check, for a machine with CUDA (a few minutes): the `gpu` tests (the copy engines,
# their expedited lane included, and the region), then the CUDA copy benchmark (bench/gpu_copy.py)
# and the expedited-load benchmark (bench/expedited.py --device cuda). Needs python3 with torch (CUDA), numpy, pyyaml, pytest and
# hypothesis, which the project's device machines have; nothing is installed. Results go to
# the folder given as $1 (default: $OUT, else /tmp/kvtier-gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/kvtier-gpu-check}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

python3 - <<'PY' | tee "$out/gpu.txt"
import torch
assert torch.cuda.is_available(), "scripts/gpu_check.sh needs CUDA"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
PY
python3 -m pytest -m gpu -p no:cacheprovider -q tests/tiers/test_copy.py tests/tiers/test_region.py 2>&1 | tee "$out/gpu-tests.txt"
python3 bench/gpu_copy.py --json > "$out/gpu-bench.json"
python3 - "$out/gpu-bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for t in r["throughput"]:
    print(f"block {t['block_bytes'] >> 10} KiB: store {t['store_ratio']:.2f}, load {t['load_ratio']:.2f} of one memcpy (target >= 0.9 from 2 MiB); batched={t['batched']}")
for p in r["per_piece"]:
    print(f"piece {p['piece_bytes'] >> 10} KiB: {p['batched_us']:.2f} us batched, {p['per_piece_us']:.2f} us per piece, {p['speedup']:.1f}x (targets <= 1.2 us, >= 3.5x)")
PY
python3 bench/expedited.py --device cuda --json > "$out/gpu-expedited.json"
python3 - "$out/gpu-expedited.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"load of {r['load_blocks']} blocks behind {r['backlog_bytes'] >> 20} MiB of stores and loads: idle {r['idle_ms']:.2f} ms, regular {r['regular_ms']:.2f} ms ({r['regular_ratio']:.1f}x), expedited {r['expedited_ms']:.2f} ms ({r['expedited_ratio']:.1f}x; target <= 1.5x idle)")
PY
