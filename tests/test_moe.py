"""Mixture-of-experts models (models/experts.py, layers/moe.py).

- Parity with transformers on tiny random Qwen3-MoE (with a dense layer among the sparse ones, and
  without the top-k renormalisation) and Mixtral models: every position's logits through the paged
  cache, whole and chunked prefill, greedy decode; the prompt's routing reaches every expert and a
  decode token's leaves some empty.
- The engine end to end: batched, chunked requests give transformers' greedy tokens.
- The grouped matmuls (tiled loop, `ragged_dot`) against the dense all-experts einsum, and routing
  edge cases: ties, every token to one expert, an empty bucket, a device's share of the experts.
- Expert parallelism on 1, 2 and 4 CPU devices, alone and with the model axis, through the harness,
  the engine and an orbax round trip that restores each device's experts only (a child process).
- GGUF files in llama.cpp's layout (`qwen3moe`; `llama` with experts for Mixtral) load to the same
  logits as transformers.
- Refusals: a mesh that would split an expert, attention kernels beside the expert axis, an expert
  axis for a dense model, shared experts, an adapter that targets experts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import llama3_tokenizer_json  # noqa: E402
from harness import prefill_then_decode  # noqa: E402

from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.errors import ConfigError  # noqa: E402
from jaxinfer.layers.backends import make_backend  # noqa: E402
from jaxinfer.layers.moe import dense_experts, local_experts, route, tile_rows  # noqa: E402
from jaxinfer.parallel import make_mesh  # noqa: E402
from jaxinfer.weights.gguf_file import checkpoint_name as gguf_name  # noqa: E402
from jaxinfer.weights.loader import LoadedModel, abstract_model, load_model, parameters  # noqa: E402

ATOL = 1e-4
PROMPT_LEN = 40
TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            num_experts_per_tok=2, initializer_range=0.1, attn_implementation="eager")
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1], head_dim=16)),
    "qwen3_moe_unnormalized": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                               dict(num_experts=8, moe_intermediate_size=16, norm_topk_prob=False, head_dim=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
}


def build_hf(name: str, folder: Path, vocab_size: int = 384, seed: int = 0, **extra: Any) -> Any:
    config_cls, model_cls, overrides = CASES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(vocab_size=vocab_size, **TINY, **{**overrides, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms start as ones in HF: make them non-trivial
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape) + 0.5)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    built: dict[str, tuple[Any, Any]] = {}

    def get(name: str):
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            hf = build_hf(name, folder)
            built[name] = hf, load_model(folder, make_mesh(1, 1, devices=jax.devices()[:1]), jnp.float32)
        return built[name]

    return get


def run_paged(model, prompt: list[int], chunks: tuple[int, ...], steps: int = 6) -> tuple[np.ndarray, list[int]]:
    return prefill_then_decode(model, prompt, chunks, steps)


def test_the_configs_parse_into_the_experts_they_declare(families):
    qwen = families("qwen3_moe")[1].config.moe
    assert (qwen.num_experts, qwen.top_k, qwen.intermediate_size, qwen.sparse_layers, qwen.renormalize) == (
        8, 2, 16, (0, 2), True)
    assert families("qwen3_moe_unnormalized")[1].config.moe.renormalize is False
    mixtral = families("mixtral")[1].config.moe
    assert (mixtral.num_experts, mixtral.intermediate_size, mixtral.sparse_layers) == (4, 32, (0, 1, 2))
    layers = families("qwen3_moe")[1].model.model.layers
    assert [layer.sparse for layer in layers] == [True, False, True]
    assert ModelConfig.from_dict(families("mixtral")[1].config.to_dict()) == families("mixtral")[1].config


@pytest.mark.parametrize("chunks", [(PROMPT_LEN,), (17, 23)], ids=["prefill", "chunked-17-23"])
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(families, name, chunks):
    hf, loaded = families(name)
    prompt = np.random.default_rng(3).integers(0, 384, PROMPT_LEN).tolist()
    ours, tokens = run_paged(loaded.model, prompt, chunks)
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), use_cache=False, output_router_logits=True)
    theirs = out.logits[0].numpy()
    diff = float(np.abs(ours - theirs).max())
    assert diff < ATOL, f"{name} {chunks}: max |logit diff| {diff:.2e}"
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    experts = loaded.config.moe.num_experts
    first_layer = out.router_logits[0].reshape(len(tokens), experts)
    routed = torch.topk(first_layer, loaded.config.moe.top_k, dim=-1).indices.numpy()
    assert len(set(routed[:PROMPT_LEN].ravel())) == experts, "the prompt reaches every expert"
    assert len(set(routed[-1].ravel())) < experts, "a decode token leaves experts without tokens"


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for `llama` files: halves -> interleaved pairs."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(loaded: LoadedModel, path: Path, experts_type: gguf.GGMLQuantizationType | None = None) -> Path:
    """The loaded model as llama.cpp writes it: its names, [out, in] matrices, stacked experts, and for
    `llama` (Mixtral) the q/k rows permuted. F32 tensors, so the numbers are the checkpoint's; with
    `experts_type`, the stacked experts quantized into it by the gguf package."""
    cfg = loaded.config
    arch = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}[cfg.architecture]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": cfg.num_layers, "embedding_length": cfg.hidden_size,
                       "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_heads,
                       "attention.head_count_kv": cfg.num_kv_heads, "attention.key_length": cfg.head_dim,
                       "context_length": 512, "expert_count": cfg.moe.num_experts,
                       "expert_used_count": cfg.moe.top_k}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    if arch == "qwen3moe":
        writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe.intermediate_size)
        writer.add_bool(f"{arch}.expert_weights_norm", cfg.moe.renormalize)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([])
    for name, param in parameters(loaded.model).items():
        array = np.asarray(param.get_value())
        array = array.T if array.ndim == 2 and name.endswith(".kernel") else array
        array = array.swapaxes(1, 2) if array.ndim == 3 else array
        if arch == "llama" and name.endswith(("q_proj.kernel", "k_proj.kernel")):
            array = permute_rows(array, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        if experts_type is not None and array.ndim == 3:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(np.ascontiguousarray(array), experts_type),
                              raw_dtype=experts_type)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_gguf_in_llama_cpp_s_layout_gives_transformers_logits(families, name, tmp_path):
    hf, loaded = families(name)
    path = write_gguf(loaded, tmp_path / f"{name}.gguf")
    names = {tensor.name for tensor in gguf.GGUFReader(str(path)).tensors}
    expected = {gguf.TENSOR_NAMES[t].format(bid=0) + ".weight" for t in (
        gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_EXP, gguf.MODEL_TENSOR.FFN_UP_EXP,
        gguf.MODEL_TENSOR.FFN_DOWN_EXP)}
    assert expected <= names
    from_gguf = load_model(path, make_mesh(1, 1, devices=jax.devices()[:1]), jnp.float32)
    assert from_gguf.config.architecture == name and from_gguf.config.moe == loaded.config.moe
    prompt = np.random.default_rng(5).integers(0, 384, PROMPT_LEN).tolist()
    ours, tokens = run_paged(from_gguf.model, prompt, (17, 23))
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
    assert float(np.abs(ours - theirs).max()) < ATOL


def random_experts(tokens: int, experts: int = 8, hidden: int = 32, width: int = 24, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (tokens, hidden))
    router = jax.random.normal(keys[1], (hidden, experts))
    gate, up = (jax.random.normal(k, (experts, hidden, width)) * 0.2 for k in keys[2:4])
    down = jax.random.normal(keys[4], (experts, width, hidden)) * 0.2
    return x, x @ router, gate, up, down


def all_matmuls(x, weights, ids, gate, up, down, real=None):
    real = jnp.ones(x.shape[0], bool) if real is None else real
    return {matmul: np.asarray(jax.jit(local_experts, static_argnames="matmul")(
        x, weights, ids, real, 0, gate, up, down, matmul=matmul)) for matmul in ("tiled", "ragged_dot")}


@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("top_k", [1, 2])
def test_both_grouped_matmuls_equal_the_dense_einsum(tokens, top_k):
    x, logits, gate, up, down = random_experts(tokens, seed=tokens)
    weights, ids = route(logits, top_k, renormalize=True)
    dense = np.asarray(dense_experts(x, weights, ids, gate, up, down))
    for matmul, out in all_matmuls(x, weights, ids, gate, up, down).items():
        np.testing.assert_allclose(out, dense, atol=2e-5, rtol=1e-5, err_msg=matmul)


def test_tied_router_scores_pick_the_lower_expert_ids():
    x, _, gate, up, down = random_experts(6)
    weights, ids = route(jnp.zeros((6, 8)), 3, renormalize=True)
    assert (np.asarray(ids) == [0, 1, 2]).all() and np.allclose(weights, 1 / 3)
    dense = np.asarray(dense_experts(x, weights, ids, gate, up, down))
    for matmul, out in all_matmuls(x, weights, ids, gate, up, down).items():
        np.testing.assert_allclose(out, dense, atol=2e-5, err_msg=matmul)


def test_every_token_to_one_expert_is_one_long_group():
    tokens = 100  # with top 1, one group of 100 rows: several tiles of one expert, seven empty groups
    x, logits, gate, up, down = random_experts(tokens)
    weights, ids = route(logits.at[:, 5].add(1e3), 1, renormalize=False)
    assert (np.asarray(ids) == 5).all() and tokens > tile_rows(tokens, 8)
    dense = np.asarray(dense_experts(x, weights, ids, gate, up, down))
    for matmul, out in all_matmuls(x, weights, ids, gate, up, down).items():
        np.testing.assert_allclose(out, dense, atol=2e-5, err_msg=matmul)


def test_padding_and_an_empty_bucket_compute_nothing():
    x, logits, gate, up, down = random_experts(16)
    weights, ids = route(logits, 2, renormalize=True)
    real = jnp.arange(16) < 9
    dense = np.asarray(dense_experts(x[:9], weights[:9], ids[:9], gate, up, down))
    for matmul, out in all_matmuls(x, weights, ids, gate, up, down, real).items():
        np.testing.assert_allclose(out[:9], dense, atol=2e-5, err_msg=matmul)
        assert not out[9:].any(), matmul
    for matmul, out in all_matmuls(x, weights, ids, gate, up, down, jnp.zeros(16, bool)).items():
        assert not out.any(), matmul


def test_the_devices_shares_of_the_experts_sum_to_the_whole():
    x, logits, gate, up, down = random_experts(40)
    weights, ids = route(logits, 2, renormalize=True)
    real = jnp.ones(40, bool)
    whole = np.asarray(dense_experts(x, weights, ids, gate, up, down))
    for matmul in ("tiled", "ragged_dot"):
        parts = [local_experts(x, weights, ids, real, first, gate[first:first + 2], up[first:first + 2],
                               down[first:first + 2], matmul) for first in range(0, 8, 2)]
        assert all(np.abs(np.asarray(part)).sum() > 0 for part in parts)
        np.testing.assert_allclose(np.asarray(sum(parts)), whole, atol=2e-5, err_msg=matmul)


@pytest.fixture(scope="module")
def served_folder(tmp_path_factory) -> tuple[Path, Any]:
    """A Qwen3-MoE with the Llama-3 vocabulary and its tokenizer: what the engine and server load."""
    folder = tmp_path_factory.mktemp("qwen3_moe_served")
    hf = build_hf("qwen3_moe", folder, vocab_size=128_256, tie_word_embeddings=True)
    shutil.copyfile(llama3_tokenizer_json(), folder / "tokenizer.json")
    return folder, hf


@pytest.fixture(scope="module")
def moe_llm(served_folder):
    from jaxinfer import LLM

    return LLM(str(served_folder[0]), max_seqs=4, num_pages=64, page_size=8, token_buckets=(4, 16),
               compile_guard="raise")


def test_the_engine_gives_transformers_greedy_tokens_batched_and_chunked(served_folder, moe_llm):
    from jaxinfer import SamplingParams

    _, hf = served_folder
    llm = moe_llm
    prompts = [np.random.default_rng(i).integers(0, 128_000, n).tolist() for i, n in enumerate((5, 23, 37))]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert output.token_ids == expected
    assert llm.runner.compiles_after_warmup == 0


def test_evicted_pages_of_a_moe_model_come_back_from_l2_and_l3(moe_llm, tmp_path):
    from jaxinfer import SamplingParams
    from jaxinfer.engine.engine import Engine
    from jaxinfer.kv.store import ModelIdentity, PageStore
    from jaxinfer.kv.tiers import HostTier, TieredPages

    m, page = moe_llm.model_config, moe_llm.config.page_size
    identity = ModelIdentity("qwen3-moe:test", "float32", page, m.num_layers, m.num_kv_heads, m.head_dim)
    tiers = TieredPages(HostTier(capacity=2), PageStore(str(tmp_path), identity))
    engine = Engine(moe_llm.runner, moe_llm.tokenizer, moe_llm.max_model_len, tiers=tiers)
    request = moe_llm.request(list(range(1000, 1045)), SamplingParams(max_tokens=6, temperature=0.0))
    reference = engine.generate([request])[0].token_ids
    with engine.pool.hold(keep_free=0):  # every free page taken: the cached prefix goes to L2, then L3
        pass
    engine.flush_tiers()
    assert engine.generate([request])[0].token_ids == reference
    assert engine.stats.prefix_hit_tokens_l2 == 2 * page and engine.stats.prefix_hit_tokens_l3 >= 2 * page


def test_grpc_and_the_openai_api_serve_a_moe_model(moe_llm):
    import openai
    from servers import RunningServer

    from jaxinfer import SamplingParams
    from serving.client import InferenceClient

    prompt = "Experts route tokens"
    expected = moe_llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].text
    running = RunningServer(moe_llm, http_port=0)
    try:
        running.call(running.server.load())  # the given model: warm-up only
        with InferenceClient(running.target, timeout=120) as client:
            text, last = client.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert text == expected and last.usage.completion_tokens == 6
        http = openai.OpenAI(base_url=f"http://127.0.0.1:{running.server.http_port}/v1", api_key="unused",
                             max_retries=0, timeout=120)
        model = http.models.list().data[0].id
        reply = http.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected
    finally:
        running.close()


def test_the_processor_runs_a_program_inside_a_moe_model_s_step(served_folder):
    from jaxinfer import LLM, SamplingParams

    llm = LLM(str(served_folder[0]), exec_slots=1, max_seqs=2, num_pages=64, page_size=8, token_buckets=(4, 16),
              compile_guard="raise")
    program = '(module (func (export "main") (result i32) (i32.mul (i32.const 6) (i32.const 7))))'
    prompt = ["What is 6 times 7?", {"special": "<|exec|>"}, program, {"special": "<|/exec|>"}]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, exec=True))[0]
    assert out.text.startswith("<|result|>42<|/result|>") and llm.engine.stats.exec_programs == 1


def hf_greedy(hf, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()


def test_speculative_decoding_with_a_same_family_draft_changes_no_greedy_token(served_folder):
    from jaxinfer import LLM, SamplingParams

    folder, hf = served_folder
    llm = LLM(str(folder), draft_model=str(folder), num_draft_tokens=3, max_seqs=4, num_pages=64, page_size=8,
              token_buckets=(4, 16), compile_guard="raise")
    prompts = [np.random.default_rng(10 + i).integers(0, 128_000, n).tolist() for i, n in enumerate((6, 19))]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 8) for p in prompts]
    assert llm.engine.metrics()["spec_acceptance_rate"] > 0.9  # the draft is the model itself


def test_lora_on_the_attention_of_a_moe_model_matches_peft(served_folder, tmp_path):
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.errors import CheckpointError
    from jaxinfer.weights.adapter_file import save_adapter

    folder, hf = served_folder
    torch.manual_seed(4)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(hf), config)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").merge_and_unload().eval()
    llm = LLM(str(folder), max_adapters=2, max_lora_rank=4, max_seqs=4, num_pages=64, page_size=8,
              token_buckets=(4, 16), compile_guard="raise")
    llm.load_adapter("attn", str(tmp_path / "adapter"))
    prompt = np.random.default_rng(20).integers(0, 128_000, 11).tolist()
    adapted = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), adapter="attn")[0].token_ids
    assert adapted == hf_greedy(merged, prompt, 8) != hf_greedy(hf, prompt, 8)
    expert = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    save_adapter(tmp_path / "experts", {"r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]},
                 {f"{expert}.lora_A.weight": np.zeros((4, 64), np.float32),
                  f"{expert}.lora_B.weight": np.zeros((16, 4), np.float32)}, layout="peft")
    with pytest.raises(CheckpointError, match=r"adapts an expert of a sparse layer; LoRA on experts is not supported"):
        llm.load_adapter("experts", str(tmp_path / "experts"))


def test_a_mesh_that_would_split_an_expert_is_refused():
    cfg = ModelConfig.from_dict({"architecture": "mixtral", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 8,
                                 "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "head_dim": 8,
                                 "moe": {"num_experts": 4, "top_k": 2, "intermediate_size": 8,
                                         "sparse_layers": [0]}})
    mesh = jax.sharding.AbstractMesh((1, 3, 1), ("data", "expert", "model"))
    with pytest.raises(ConfigError, match=r"engine.mesh_expert = 3 does not divide the model's 4 experts"):
        abstract_model(cfg, jnp.float32, None, mesh)


def test_attention_kernels_beside_the_expert_axis_are_refused():
    with pytest.raises(ConfigError, match=r"attention_backend = ragged_reference beside engine.mesh_expert = 2"):
        make_backend("ragged_reference", block_tokens=64, query_tile=16, expert_parallel=2)
    assert make_backend("auto", block_tokens=64, query_tile=16, expert_parallel=2, platform="cpu")


def test_shared_experts_and_bad_expert_counts_name_the_field():
    base = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        ModelConfig.from_hf({**base, "shared_expert_intermediate_size": 32})
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(5\) exceeds the number of experts \(4\)"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 5})
    with pytest.raises(ConfigError, match="lacks the field 'num_experts'"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "num_experts"})


CHILD = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[1])
from harness import PagedForward
from jaxinfer import LLM, SamplingParams
from jaxinfer.parallel import make_mesh
from jaxinfer.weights import orbax_io
from jaxinfer.weights.loader import load_model, parameters

folder, orbax_folder = sys.argv[2], sys.argv[3]
assert len(jax.devices()) == 4, jax.devices()
prompt = np.random.default_rng(0).integers(0, 128_000, 30).tolist()
EXPERTS = "model.layers.0.mlp.experts.gate_proj"

def harness_logits(model):
    fwd = PagedForward(model, page_size=8)
    return np.concatenate([fwd.run(prompt[:13], 0), fwd.run(prompt[13:], 13)])

report = {}
reference = None
for expert, model_axis in [(1, 1), (2, 1), (4, 1), (2, 2)]:
    mesh = make_mesh(1, model_axis, devices=jax.devices()[:expert * model_axis], expert=expert)
    loaded = load_model(folder, mesh, jnp.float32)
    logits = harness_logits(loaded.model)
    reference = logits if reference is None else reference
    shard = parameters(loaded.model)[EXPERTS].get_value().addressable_shards[0].data.shape
    report[f"{expert}x{model_axis}"] = dict(diff=float(np.abs(logits - reference).max()), shard=list(shard))
    if (expert, model_axis) in ((1, 1), (2, 2)):  # the engine's step too: one device, and both axes split
        llm = LLM(folder, mesh_expert=expert, mesh_model=model_axis, max_seqs=4, num_pages=64, page_size=8,
                  token_buckets=(4, 16), compile_guard="raise")
        prompts = [prompt[:n] for n in (7, 30)]
        tokens = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))]
        report[f"{expert}x{model_axis}"].update(tokens=tokens, compiles=llm.runner.compiles_after_warmup)
    if expert == 1 and model_axis == 1:
        orbax_io.save(__import__("pathlib").Path(orbax_folder), loaded.config, parameters(loaded.model),
                      dtype="float32", source="test")
restored = load_model(orbax_folder, make_mesh(1, 1, expert=4), jnp.float32)
value = parameters(restored.model)[EXPERTS].get_value()
report["orbax"] = dict(diff=float(np.abs(harness_logits(restored.model) - reference).max()),
                       shards=sorted({tuple(s.data.shape) for s in value.addressable_shards}),
                       spec=str(value.sharding.spec))
print("REPORT " + json.dumps(report))
"""


def test_expert_parallel_runs_equal_one_device(served_folder, tmp_path):
    folder, _ = served_folder
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    argv = [os.path.dirname(__file__), str(folder), str(tmp_path / "orbax")]
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    report = json.loads(lines[0].removeprefix("REPORT "))
    one = report["1x1"]
    for name, shard in {"1x1": [8, 64, 16], "2x1": [4, 64, 16], "4x1": [2, 64, 16], "2x2": [4, 64, 8]}.items():
        run = report[name]
        assert run["diff"] < 1e-5 and run["shard"] == shard, (name, run)
        assert run.get("tokens", one["tokens"]) == one["tokens"] and run.get("compiles", 0) == 0, (name, run)
    assert "tokens" in report["2x2"] and all(one["tokens"])
    assert report["orbax"]["diff"] < 1e-5 and report["orbax"]["shards"] == [[2, 64, 16]], report["orbax"]


MOE_GROUP_TOML = """[engine]
mesh_expert = 2
mesh_model = 1
token_buckets = [8]
max_seqs = 4
num_pages = 64
page_size = 8
compile_guard = "raise"
"""


def test_a_two_process_group_splits_the_experts_like_one_process(served_folder, tmp_path):
    """Two processes x 1 device, the experts split over the processes, give the greedy tokens of one
    process with 2 devices (`python -m jaxinfer.batch`, real processes on loopback)."""
    from test_multihost import GROUP_SECONDS, REPO, Group, cpu_env, token_ids

    folder, _ = served_folder
    (tmp_path / "engine.toml").write_text(MOE_GROUP_TOML)
    lines = [{"id": "a", "prompt": "The experts are", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
             {"id": "b", "prompt": "Routing tokens to experts, one by one,", "max_tokens": 6, "temperature": 0.0,
              "ignore_eos": True}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    group = Group(tmp_path, "--model", str(folder), "--input", str(tmp_path / "in.jsonl"))
    try:
        single = tmp_path / "single.jsonl"
        alone = subprocess.run([sys.executable, "-m", "jaxinfer.batch", "--config", str(tmp_path / "engine.toml"),
                                "--model", str(folder), "--input", str(tmp_path / "in.jsonl"), "--output", str(single),
                                "--no-progress"], cwd=REPO, env=cpu_env(2), capture_output=True, text=True,
                               timeout=GROUP_SECONDS)
        assert alone.returncode == 0, alone.stderr[-3000:]
        assert group.wait(0) == 0, group.log(0)[-3000:]
        assert group.wait(1) == 0, group.log(1)[-3000:]
    finally:
        group.kill_all()
    replayed = [line for line in group.log(1).splitlines() if "replayed" in line]
    assert "lockstep leader at" in group.log(0) and replayed and int(replayed[-1].split()[3]) > 0
    expected = token_ids(single)
    assert sorted(expected) == ["a", "b"] and [len(expected[k]) for k in "ab"] == [8, 6]
    assert token_ids(group.output) == expected
