#!/usr/bin/env bash
# Issue 8's measurements on one H200, as one prepared command (not yet run: no device was lent).
#
# Here, first:  mkdir -p .device_carry && cp ../shared/bench/{plain_jax_decode,hf_peer}.py .device_carry/
#               (../shared does not travel; .device_carry/ and .cache/llama3/ are git-ignored, so carry both)
# Then:  run(command="bash tools/device_issue8.sh", carry=[".device_carry", ".cache/llama3"], timeout_s=540)
# plus the jaxinfer wheels the device lacks, as the device README says (.whl, carried, installed first).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue8}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# the bar to beat, then jaxinfer on the same shape, then transformers
python3 .device_carry/plain_jax_decode.py 1 64 256 2>&1 | tee "$OUT/plain_jax.jsonl"
python3 tools/bench.py --no-peer shape --shape llama3-8b --batch 1 64 256 \
    --offline 1024:128:128 2>&1 | tee "$OUT/jaxinfer_shape.jsonl"
python3 .device_carry/hf_peer.py --shape llama3-8b --device cuda --batch 1 64 256 2>&1 | tee "$OUT/hf_peer.jsonl"
# the processor's accelerator loop must pass the same spec files
python3 -m jaxinfer.processor.spec tests/data/wasm/*.wast --loop while 2>&1 | tail -1 | tee "$OUT/spec.txt"
