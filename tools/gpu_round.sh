#!/usr/bin/env bash
# The lent GPU's short run: what this CPU cannot measure (docs/measurements.md, rounds 27-28: here a compressed
# setting pays the same prefill as the full cache, which bounds compress-once-ask-many near 1.7x).
#
# On the lent machine, from the repository's root, after `make venv` (pip takes a CUDA build of torch==2.13.0 there):
#     tools/gpu_round.sh [OUT]          # OUT: results/gpu-YYYY-MM-DD by default
# Each step writes OUT/STEP.txt when it finishes; a rerun skips the steps that have one, so an interrupted run loses
# nothing it finished. Record the results in docs/ with the hardware (OUT/hardware.txt).
#
# DEVICE=cpu SMOKE=1 tools/gpu_round.sh /tmp/gpu-smoke   checks the script on a CPU, on small sizes, in minutes.
set -euo pipefail

OUT=${1:-results/gpu-$(date +%F)}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-.venv/bin/python}
KVEVICT=${KVEVICT:-.venv/bin/kvevict}
if [[ -n "${SMOKE:-}" ]]; then
    ENTRIES=64 BATCHES=1 LENGTHS=512 PROMPTS=1 QUESTIONS=2 LENGTH=512 POLICIES=fastkvzip REPEATS=1
else
    ENTRIES=2048 BATCHES=1,8 LENGTHS=2048,4096 PROMPTS=6 QUESTIONS=8 LENGTH=2048 POLICIES=fastkvzip,kvzip REPEATS=3
fi
mkdir -p "$OUT"

step() { # NAME COMMAND...: run COMMAND once, its output into OUT/NAME.txt
    local name=$1
    shift
    if [[ -s "$OUT/$name.txt" ]]; then
        echo "$name: done before ($OUT/$name.txt)"
        return
    fi
    echo "$name: $*"
    "$@" 2>&1 | tee "$OUT/$name.partial"
    mv "$OUT/$name.partial" "$OUT/$name.txt"
}

hardware() {
    if [[ $DEVICE == cuda* ]]; then nvidia-smi; fi
    lscpu | grep -E '^(Model name|CPU\(s\)):' || true
    "$PYTHON" -c 'import torch, transformers, kvevict
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print("kvevict", kvevict.__version__, "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
}

step hardware hardware
# every policy's left-padded batch on the GPU against each row alone and the CPU's tokens (skipped without CUDA)
step test_cuda "$PYTHON" -m pytest tests/test_cuda.py -q -p no:cacheprovider
# a decode step under eviction against a full DynamicCache of the same entries: paired ratios
step decode_speed "$KVEVICT" bench decode-speed --device "$DEVICE" --entries "$ENTRIES" --batch-sizes "$BATCHES" \
    --repeats "$REPEATS"
# compressing a prompt against a plain prefill: paired ratios (fastkvzip's goal: <= 1.15x)
step prefill_speed "$KVEVICT" bench prefill-speed --device "$DEVICE" --lengths "$LENGTHS" --keep 0.1 \
    --policies "$POLICIES" --repeats "$REPEATS"
# the prefill's peak memory per path (cuda.max_memory_allocated)
step memory "$KVEVICT" bench memory --device "$DEVICE" --lengths "$LENGTHS" --out "$OUT/memory"
# compress once, ask many (Q = 8): answers per second against the full cache with prefix reuse, and the score
step ask "$KVEVICT" bench throughput --device "$DEVICE" --workload ask --prompts "$PROMPTS" --questions "$QUESTIONS" \
    --length "$LENGTH" --new-tokens 16 --memory-cap 320 --policies "$POLICIES" --keep 0.25,0.1 --out "$OUT/ask"
echo "results: $OUT"
