"""Tensor parallelism on 8 CPU devices equals one device (run in a child process that owns the flags)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[1])
from harness import PagedForward
from jaxinfer import LLM, ModelConfig, SamplingParams
from jaxinfer.parallel import make_mesh
from jaxinfer.weights.loader import abstract_model, fill, parameters, random_model

assert len(jax.devices()) == 8, jax.devices()
report = {}
cfg = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=8, num_kv_heads=4, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False)
one = make_mesh(1, 1, devices=jax.devices()[:1])
base = random_model(cfg, one, jnp.float32, seed=3)
tensors = [(n, n, np.asarray(p.get_value())) for n, p in parameters(base).items()]
prompt = np.random.default_rng(0).integers(0, 512, 40).tolist()

def logits_and_greedy(model):
    fw = PagedForward(model, page_size=8, num_pages=32, max_pages=8)
    rows, ids = [fw.run(prompt, 0)], list(prompt)
    for _ in range(8):
        ids.append(int(rows[-1][-1].argmax()))
        rows.append(fw.run([ids[-1]], len(ids) - 1))
    return np.concatenate(rows), ids[len(prompt):]

ref_logits, ref_tokens = logits_and_greedy(base)
for data, model_axis in [(1, 8), (2, 4)]:
    mesh = make_mesh(data, model_axis)
    model = fill(abstract_model(cfg, jnp.float32, None), tensors, mesh, "copy")
    q_spec = parameters(model)["model.layers.0.self_attn.q_proj.kernel"].get_value().sharding.spec
    logits, tokens = logits_and_greedy(model)
    report[f"{data}x{model_axis}"] = dict(max_diff=float(np.abs(logits - ref_logits).max()),
                                         same_tokens=tokens == ref_tokens, q_spec=str(q_spec))

# int4 weights (projections, embedding, head): the same numbers on 8 devices; groups of 32 rows of
# down_proj's 128 input rows (4 groups) cannot split 8 ways, so those rows stay whole
from jaxinfer.weights.weight_plan import WeightsChoice, load_time_formats
formats = load_time_formats(WeightsChoice("int4", 32), parameters(abstract_model(cfg, jnp.float32, None)))
packed_base = random_model(cfg, one, jnp.float32, seed=4, packed=formats)
packed_tensors = [(n, n, np.asarray(p.get_value())) for n, p in parameters(packed_base).items()]
packed_ref, _ = logits_and_greedy(packed_base)
sharded_packed = fill(abstract_model(cfg, jnp.float32, None, packed=formats), packed_tensors, make_mesh(1, 8), "copy")
specs = {n: str(p.get_value().sharding.spec) for n, p in parameters(sharded_packed).items()}
report["int4"] = dict(max_diff=float(np.abs(logits_and_greedy(sharded_packed)[0] - packed_ref).max()),
                      embed=specs["model.embed_tokens.weight_q"], head=specs["lm_head.kernel_q"],
                      down=specs["model.layers.0.mlp.down_proj.kernel_q"], formats=len(formats))

engine = dict(token_buckets=(8,), max_seqs=8, num_pages=128, compile_guard="raise")
chats = [[{"role": "user", "content": c}] for c in ("Name a color.", "What is 7 times 8?", "Say hello.")]
greedy = SamplingParams(max_tokens=12, temperature=0.0)
single = [o.token_ids for o in LLM("smollm2-135m", mesh_model=1, **engine).generate_chat(chats, greedy)]
sharded_llm = LLM("smollm2-135m", mesh_model=8, **engine)
sharded = [o.token_ids for o in sharded_llm.generate_chat(chats, greedy)]
up = parameters(sharded_llm.runner.graphdef and __import__("flax").nnx.merge(sharded_llm.runner.graphdef,
                sharded_llm.runner.state))["model.layers.0.mlp.up_proj.kernel"].get_value()
report["smollm2"] = dict(same_tokens=single == sharded, up_spec=str(up.sharding.spec), tokens=sharded)
print("REPORT " + json.dumps(report))
"""


def test_sharded_equals_single_device(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    tests_dir = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, "-c", CHILD, tests_dir], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))
    report = json.loads(line[len("REPORT "):])
    for mesh in ("1x8", "2x4"):
        assert report[mesh]["max_diff"] < 1e-4, report
        assert report[mesh]["same_tokens"], report
        assert "model" in report[mesh]["q_spec"], report  # heads really are split across devices
    assert report["int4"]["formats"] == 2 * 7 + 2 and report["int4"]["max_diff"] < 1e-4, report
    assert report["int4"]["embed"].startswith("P('model'"), report  # vocab rows split
    assert "'model'" in report["int4"]["head"] and "'model'" not in report["int4"]["down"], report
    assert report["smollm2"]["same_tokens"], report
    assert "model" in report["smollm2"]["up_spec"], report
