#!/usr/bin/env bash
# The GPU check, for a machine with CUDA, within five minutes: facts (versions, GPU, batch call,
# /dev/shm), the `gpu` tests, the CUDA copy benchmark (bench/gpu_copy.py), the expedited-load
# benchmark (bench/expedited.py) and vLLM 0.34's worker path with CUDA tensors as the KV caches
# (bench/vllm_worker.py: device pointers in, every byte checked), each under a timeout; a failed or timed-out stage is recorded
# and the next one runs. Every timed copy is checked byte for byte. Writes OUT_DIR/summary.json:
# each target beside its figure (bench/gpu_check.py summary). Exits non-zero when a stage failed
# or bytes were wrong.
#
#   scripts/gpu_check.sh [OUT_DIR]     # default: $OUT, else /tmp/kvtier-gpu-check
#
# Needs python3 with torch (CUDA), numpy, pyyaml, pytest and hypothesis, which the project's
# device machines have; nothing is installed, nothing is fetched. KVTIER_GPU_CHECK_FAKE=1 runs
# it on a CPU against the fake CUDA layer of the tests (small sizes; the timings mean nothing):
# how the script itself is tested (tests/kvtier/test_gpu_check.py). PYTHON picks the python.
# KVTIER_GPU_CHECK_VLLM_TREE: vLLM 0.34's Python files (`python -m kvtier.venv --tree 0.34.0`),
# put on the worker stage's path so that vLLM's own pointer resolution and kvtier's
# `KvtierWorker` run there (without it, the same formula and the worker's own calls).
set -uo pipefail # no -e: every stage runs whatever the one before did
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/kvtier-gpu-check}}"
mkdir -p "$out"
rm -f "$out/stages.txt" "$out/gpu-copy.jsonl" "$out/expedited.jsonl" "$out/vllm-worker.jsonl" \
  "$out/summary.json"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "${KVTIER_GPU_CHECK_FAKE:-0}" = 1 ]; then
  facts=(--fake)
  tests=(tests/tiers/test_copy_cuda.py tests/tiers/test_region_pin.py)
  copy=(--fake --sizes 64KiB,2MiB --total 8MiB --piece-sizes 4KiB --pieces 256 --repeat 2)
  expedited=(--device fake --block 64KiB --backlog 4MiB --repeat 2)
  worker=(--device fake --blocks 16 --page 16KiB --repeat 2)
else
  facts=()
  tests=(-m gpu tests/tiers/test_copy.py tests/tiers/test_region.py)
  copy=()
  expedited=(--device cuda)
  worker=(--device cuda)
fi
tree="${KVTIER_GPU_CHECK_VLLM_TREE:-}"

stage() { # NAME SECONDS COMMAND...: run it under a timeout, record its exit status, go on
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit}s)"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "$name $rc" >>"$out/stages.txt"
  echo "== $name: exit status $rc"
}

stage facts 30 "$py" bench/gpu_check.py facts "${facts[@]}" --out "$out/facts.json"
stage tests 100 "$py" -m pytest -p no:cacheprovider -q "${tests[@]}"
stage gpu_copy 90 "$py" bench/gpu_copy.py "${copy[@]}" --out "$out/gpu-copy.jsonl"
stage expedited 45 "$py" bench/expedited.py "${expedited[@]}" --out "$out/expedited.jsonl"
stage vllm_worker 30 env PYTHONPATH="${tree:+$tree:}$PYTHONPATH" \
  "$py" bench/vllm_worker.py "${worker[@]}" --out "$out/vllm-worker.jsonl"
"$py" bench/gpu_check.py summary "$out"
