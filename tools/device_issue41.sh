#!/usr/bin/env bash
# Issue 41's accelerator rows, as one prepared command (not yet run: no device was lent so far). Run it
# after tools/device_issue8.sh, on the same warm machine, so the bf16 rows of that script's
# jaxinfer_shape.jsonl are the baseline of these:
#   run(command="bash tools/device_issue41.sh", carry=[".whl"], timeout_s=300)
# Llama-3.1-8B shape, random weights packed on the device: decode ms per step at batch 1, 64, 256 for
# int8 and int4 (group 32), through XLA's fused dequantize and through the Pallas packed matmul, each
# beside the roofline floor of its own bytes (tools/shape_bench.py counts packed bytes).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
OUT=${OUT:-/tmp/issue41}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
for dtype in int8 int4; do
  for matmul in xla pallas; do
    log="shape_${dtype}_${matmul}.jsonl"
    timeout 70 python3 tools/bench.py --no-peer shape --shape llama3-8b --weights-dtype "$dtype" \
      --packed-matmul "$matmul" --batch 1 64 256 --offline --repeats 2 >"$OUT/$log" 2>&1
    rc=$?
    tail -n 5 "$OUT/$log"
    [ "$rc" = 0 ] || echo "STEP $log exited $rc (124: cut off at 70s)" | tee -a "$OUT/steps.txt"
  done
done
