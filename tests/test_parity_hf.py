"""Logit parity with Hugging Face transformers (torch, CPU, float32) on random tiny models of every family.

Each case builds a random HF model, saves it as safetensors, loads it with `jaxinfer.weights.loader`
and runs it through the paged cache (`tests/harness.PagedForward`): a prefill (whole or in chunks that
straddle page boundaries), then greedy decode steps. Every position's logits must match one full HF
forward over the same tokens. Also covered: sharded safetensors, the orbax round trip, and the
errors a broken checkpoint must raise.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from harness import prefill_then_decode  # noqa: E402

from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.errors import CheckpointError  # noqa: E402
from jaxinfer.layers.attention import ReferenceAttention  # noqa: E402
from jaxinfer.layers.rope import inverse_frequencies  # noqa: E402
from jaxinfer.parallel import make_mesh  # noqa: E402
from jaxinfer.weights import orbax_io  # noqa: E402
from jaxinfer.weights.loader import LoadedModel, load_model, parameters  # noqa: E402
from jaxinfer.weights.registry import resolve  # noqa: E402

ATOL = 1e-4
PROMPT_LEN = 40
DECODE_STEPS = 8
PAGE_SIZE = 8

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, initializer_range=0.1)

# name -> (config class, model class, config overrides)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_theta=10000.0,
            # head_dim 16: wavelengths 6.3, 19.9, 62.8, 199, ... -> one high-frequency pair is kept,
            # two are smoothed (16 <= wavelen <= 64) and the rest divided by 8.
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "smollm2-tied-gqa": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=100000.0),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6)),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6),
    ),
}


@dataclass
class Case:
    name: str
    folder: Path
    hf: Any  # the torch model
    loaded: LoadedModel
    prompt: list[int]


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(1, 1, devices=jax.devices()[:1])


def _randomize(model: Any, seed: int) -> None:
    """Norm weights and attention biases start as ones/zeros in HF: make them non-trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)  # U(0.5, 1.5)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _build_hf(name: str, folder: Path, seed: int = 0) -> Any:
    config_cls, model_cls, overrides = CASES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**TINY, **overrides, attn_implementation="eager")
    model = getattr(transformers, model_cls)(config).eval()
    _randomize(model, seed + 1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def cases(tmp_path_factory, mesh):
    """Lazily built, cached per module: each family's HF model, its folder and the jaxinfer model."""
    built: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            hf = _build_hf(name, folder)
            loaded = load_model(folder, mesh, jnp.float32)
            rng = np.random.default_rng(len(built) + 7)
            prompt = rng.integers(0, TINY["vocab_size"], PROMPT_LEN).tolist()
            built[name] = Case(name, folder, hf, loaded, prompt)
        return built[name]

    return get


def hf_logits(model: Any, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False)
    return out.logits[0].float().numpy()


def run_paged(model: Any, prompt: list[int], chunks: tuple[int, ...], steps: int = DECODE_STEPS):
    return prefill_then_decode(model, prompt, chunks, steps, PAGE_SIZE)


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


def test_saved_configs_parse_as_intended(cases):
    """The HF config.json spellings (transformers 5 `rope_parameters`) reach ModelConfig as meant."""
    expect = {
        "llama": dict(architecture="llama", num_kv_heads=4, tie_word_embeddings=False, head_dim=16),
        "llama3-rope": dict(architecture="llama", num_kv_heads=2, max_position_embeddings=512),
        "smollm2-tied-gqa": dict(architecture="llama", tie_word_embeddings=True, rope_theta=100000.0),
        "qwen2": dict(architecture="qwen2", attention_bias=True, qk_norm=False, rope_theta=1e6),
        "qwen3": dict(architecture="qwen3", attention_bias=False, qk_norm=True, head_dim=32, rope_theta=1e6),
    }
    for name, fields in expect.items():
        case = cases(name)
        cfg: ModelConfig = case.loaded.config
        for key, value in fields.items():
            assert getattr(cfg, key) == value, (name, key)
        assert (cfg.rope_scaling is not None) == (name == "llama3-rope"), name
        # RoPE inverse frequencies equal HF's own buffer (so scaling is parsed and applied the same way).
        hf_inv = case.hf.model.rotary_emb.inv_freq.numpy()
        np.testing.assert_allclose(inverse_frequencies(cfg), hf_inv, rtol=1e-6, err_msg=name)

    raw = json.loads((cases("llama3-rope").folder / "config.json").read_text())
    scaling = raw.get("rope_parameters") or raw.get("rope_scaling")
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    cfg = cases("llama3-rope").loaded.config
    unscaled = inverse_frequencies(ModelConfig(**{**cfg.to_dict(), "rope_scaling": None}))
    changed = ~np.isclose(inverse_frequencies(cfg), unscaled)
    assert 0 < changed.sum() < changed.size, "llama3 scaling should change some but not all frequencies"
    for name in ("qwen2", "qwen3"):  # the non-trivial biases and q/k norms really are in the checkpoint
        hf = cases(name).hf
        attn = hf.model.layers[0].self_attn
        extra = attn.q_proj.bias if name == "qwen2" else attn.q_norm.weight
        assert extra is not None and not torch.allclose(extra, torch.full_like(extra, float(name == "qwen3")))


@pytest.mark.parametrize("chunks", [(PROMPT_LEN,), (17, 23)], ids=["prefill", "chunked-17-23"])
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(cases, name, chunks):
    case = cases(name)
    ours, tokens = run_paged(case.loaded.model, case.prompt, chunks)
    assert len(tokens) == PROMPT_LEN + DECODE_STEPS and ours.shape == (len(tokens), TINY["vocab_size"])
    theirs = hf_logits(case.hf, tokens)
    diff = max_diff(ours, theirs)
    print(f"{name} {chunks}: max |logit diff| {diff:.2e} (logit std {theirs.std():.2f})")
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=ATOL, err_msg=f"{name} {chunks}")
    # Greedy tokens: HF's argmax after each prefix is the token we fed next (and the final pick agrees).
    greedy_hf = theirs[PROMPT_LEN - 1 :].argmax(-1).tolist()
    greedy_ours = [*tokens[PROMPT_LEN:], int(ours[-1].argmax())]
    assert greedy_ours == greedy_hf


def test_logits_match_hf_small_key_blocks(cases, mesh):
    """16-token key blocks (2 pages) and 4-query tiles: the online softmax runs over several blocks."""
    case = cases("smollm2-tied-gqa")
    backend = ReferenceAttention(block_tokens=16, query_tile=4)
    loaded = load_model(case.folder, mesh, jnp.float32, backend=backend)
    ours, tokens = run_paged(loaded.model, case.prompt, (17, 23))
    theirs = hf_logits(case.hf, tokens)
    print(f"small key blocks: max |logit diff| {max_diff(ours, theirs):.2e}")
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=ATOL)
    assert tokens[PROMPT_LEN:] == theirs[PROMPT_LEN - 1 : -1].argmax(-1).tolist()


def test_sharded_safetensors(cases, mesh, tmp_path):
    case = cases("llama")
    case.hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 2 and (tmp_path / "model.safetensors.index.json").exists()
    sharded = load_model(tmp_path, mesh, jnp.float32)
    ours, tokens = run_paged(sharded.model, case.prompt, (PROMPT_LEN,), steps=2)
    reference, _ = run_paged(case.loaded.model, case.prompt, (PROMPT_LEN,), steps=2)
    np.testing.assert_array_equal(ours, reference)
    np.testing.assert_allclose(ours, hf_logits(case.hf, tokens), rtol=0, atol=ATOL)


def test_orbax_round_trip(cases, mesh, tmp_path):
    case = cases("qwen3")
    folder = tmp_path / "orbax"
    orbax_io.save(folder, case.loaded.config, parameters(case.loaded.model), dtype="float32", source="test")
    assert resolve(folder).kind == "orbax"
    restored = load_model(folder, mesh, jnp.float32)
    assert restored.checkpoint.kind == "orbax"
    assert restored.config == case.loaded.config
    ours, _ = run_paged(restored.model, case.prompt, (PROMPT_LEN,), steps=2)
    reference, _ = run_paged(case.loaded.model, case.prompt, (PROMPT_LEN,), steps=2)
    np.testing.assert_array_equal(ours, reference)


# ---------------------------------------------------------------------------------------------- errors


def _copy_with_tensors(case: Case, dest: Path, edit) -> Path:
    """A copy of the case's checkpoint whose tensor dict went through `edit`."""
    dest.mkdir()
    shutil.copy(case.folder / "config.json", dest / "config.json")
    tensors = safetensors_numpy.load_file(case.folder / "model.safetensors")
    safetensors_numpy.save_file(edit(tensors), dest / "model.safetensors")
    return dest


def test_missing_tensor(cases, mesh, tmp_path):
    def drop(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        return tensors

    folder = _copy_with_tensors(cases("llama"), tmp_path / "ckpt", drop)
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder, mesh, jnp.float32)


def test_misshapen_tensor(cases, mesh, tmp_path):
    def reshape(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
        return tensors

    folder = _copy_with_tensors(cases("llama"), tmp_path / "ckpt", reshape)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(64, 48\)"):
        load_model(folder, mesh, jnp.float32)


def test_unknown_architecture(cases, mesh, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(cases("llama").folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unknown architecture.*gpt_neox"):
        load_model(folder, mesh, jnp.float32)


def test_missing_path(mesh, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "no" / "such-model", mesh, jnp.float32)


def test_unknown_registry_name(mesh, monkeypatch):
    monkeypatch.delenv("JAXINFER_CHECKPOINTS_DIR", raising=False)
    with pytest.raises(CheckpointError, match=r"unknown model 'no-such-model'.*smollm2-135m"):
        load_model("no-such-model", mesh, jnp.float32)


def test_truncated_safetensors(cases, mesh, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(cases("llama").folder, folder)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable or truncated"):
        load_model(folder, mesh, jnp.float32)
