"""The kernel backends under tensor parallelism, on 4 CPU devices (a child process owns the flags).

A Pallas call is opaque to XLA's partitioner, so the kernel backends run it in `shard_map` over the
model axis: each device attends with its own kv heads where the axis divides them, and with all of
them (replicated pools) where it does not. Checked against one device's reference backend, for the
GPU kernel under Pallas's interpreter and for the TPU path's contract in plain JAX, plus SmolLM2 in
the engine on the combined layout over 3 and 2 devices, and a one-kv-head model over 4 devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[1])
from attention_cases import CASES, moved_into, ragged_batch, reference_output
from jaxinfer import LLM, SamplingParams
from jaxinfer.layers.pallas_attention import PallasGpuAttention
from jaxinfer.layers.ragged_attention import RaggedPagedAttention
from jaxinfer.parallel import make_mesh, named_sharding
from jax.sharding import NamedSharding, PartitionSpec

assert len(jax.devices()) == 4, jax.devices()
report = {}

def run(backend, kv_heads, model_parallel):
    q, k, v, meta = ragged_batch(CASES["mixed"], kv_heads=kv_heads, group=2, page_size=16, table_width=16)
    expected = reference_output(q, k, v, meta, 0.2)
    mesh = make_mesh(1, model_parallel, devices=jax.devices()[:model_parallel])
    layout = backend.layout_for(kv_heads, q.shape[2], jnp.float32)
    cache = moved_into(layout, k, v, mesh)
    q = jax.device_put(q, named_sharding(q.shape, (None, "heads", None), mesh))
    meta = jax.device_put(meta, NamedSharding(mesh, PartitionSpec()))
    attend = jax.jit(lambda q, c, m: backend.attend(q, c, m, 0.2, layout))
    got = attend(q, cache, meta)
    compiled = attend.lower(q, cache, meta).compile().as_text()
    specs = [str(leaf.sharding.spec) for leaf in jax.tree.leaves(cache)]
    return dict(max_diff=float(np.abs(np.asarray(got) - np.asarray(expected)).max()), cache_specs=specs,
                all_gathers=compiled.count("all-gather-start") + compiled.count("all-gather("))

for model_parallel, kv_heads in [(2, 4), (4, 4), (2, 3)]:
    name = f"{model_parallel}x{kv_heads}"
    report["gpu_" + name] = run(PallasGpuAttention(block_tokens=64, interpret=True, model_parallel=model_parallel),
                                kv_heads, model_parallel)
    report["ragged_" + name] = run(RaggedPagedAttention.plain_jax(model_parallel=model_parallel), kv_heads,
                                   model_parallel)

engine = dict(token_buckets=(8,), max_seqs=8, page_size=8, num_pages=128, max_model_len=256,
              compile_guard="raise")
prompts = ["Name a color.", "What is 7 times 8?", "Say hello."]
greedy = SamplingParams(max_tokens=10, temperature=0.0)
single = [o.token_ids for o in LLM("smollm2-135m", mesh_model=1, **engine).generate(prompts, greedy)]
for model_parallel in (3, 2):  # SmolLM2's 3 kv heads: split over 3, replicated over 2
    llm = LLM("smollm2-135m", mesh_model=model_parallel, attention_backend="ragged_reference", **engine)
    tokens = [o.token_ids for o in llm.generate(prompts, greedy)]
    report[f"smollm2_{model_parallel}"] = dict(same_tokens=tokens == single,
                                               cache_spec=str(llm.runner.caches[0].sharding.spec),
                                               cache_shape=list(llm.runner.caches[0].shape))

# one kv head on a 4-way model axis: XLA once handed the caches back split on head_dim, and the
# second step refused them; the step now keeps the shardings the caches came in with
import shutil
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from shape_bench import SHAPES
folder = Path(sys.argv[2]) / "one_kv_head"
folder.mkdir()
config = dict(SHAPES["tiny-llama3"], num_key_value_heads=1, num_attention_heads=4)
(folder / "config.json").write_text(json.dumps(config))
(folder / "RANDOM_WEIGHTS").write_text("test\n")
shutil.copyfile(sys.argv[4], folder / "tokenizer.json")
one_head = {}
for backend in ("reference", "ragged_reference"):
    llm = LLM(str(folder), mesh_model=4, attention_backend=backend, **engine)
    one_head[backend] = [o.token_ids for o in llm.generate(prompts, greedy)]
report["one_kv_head"] = dict(same_tokens=one_head["reference"] == one_head["ragged_reference"],
                             lengths=[len(t) for t in one_head["reference"]])
print("REPORT " + json.dumps(report))
"""


def test_kernel_backends_shard_over_kv_heads(tmp_path):
    from conftest import REPO, llama3_tokenizer_json

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    argv = [os.path.dirname(__file__), str(tmp_path), str(REPO / "tools"), str(llama3_tokenizer_json())]
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
    for backend in ("gpu", "ragged"):
        for name in ("2x4", "4x4", "2x3"):
            assert report[f"{backend}_{name}"]["max_diff"] < 2e-5, report
        for name in ("2x4", "4x4"):  # split: each device keeps its own kv heads, nothing is gathered
            assert all("model" in spec for spec in report[f"{backend}_{name}"]["cache_specs"]), report
            assert report[f"{backend}_{name}"]["all_gathers"] == 0, report
        assert not any("model" in spec for spec in report[f"{backend}_2x3"]["cache_specs"]), report
    # over 3 devices each holds one kv head, padded to 1 pair; over 2 the 3 heads pad to 4, replicated
    assert report["smollm2_3"]["same_tokens"] and report["smollm2_3"]["cache_shape"] == [128, 8, 6, 128], report
    assert report["smollm2_3"]["cache_spec"] == "P(None, None, 'model')", report
    assert report["smollm2_2"]["same_tokens"] and report["smollm2_2"]["cache_shape"] == [128, 8, 8, 128], report
    assert "model" not in report["smollm2_2"]["cache_spec"], report
    assert report["one_kv_head"] == dict(same_tokens=True, lengths=[10, 10, 10]), report
