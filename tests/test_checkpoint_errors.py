"""Checkpoints whose config and tensors disagree, or that need features the engine lacks, are refused
with an error naming the file and the field, never loaded with missing or wrong weights.

Tiny real checkpoints written here with the `safetensors` and `gguf` packages (no torch needed).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import llama3_tokenizer_json
from safetensors.numpy import save_file

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.parallel import make_mesh
from jaxinfer.weights import hf
from jaxinfer.weights.gguf_file import GGUFCheckpoint
from jaxinfer.weights.gguf_file import checkpoint_name as gguf_name
from jaxinfer.weights.loader import abstract_model, load_model, parameters

CONFIG = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64,
              tie_word_embeddings=False)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh()


def torch_layout_tensors(config: dict, names=hf.checkpoint_name, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors for every parameter of `config`'s model, named and laid out as a checkpoint has them."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, param in parameters(abstract_model(ModelConfig.from_hf(config), jnp.float32, None)).items():
        array = rng.standard_normal(tuple(param.get_value().shape)).astype(np.float32)
        tensors[names(name)] = np.ascontiguousarray(array.T) if name.endswith(".kernel") else array
    return tensors


def write_hf(folder: Path, config: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    for shard in range(shards):
        save_file({n: tensors[n] for n in names[shard::shards]}, str(folder / f"model-{shard}.safetensors"))
    return folder


def test_a_well_formed_tiny_checkpoint_loads(tmp_path, mesh):
    loaded = load_model(write_hf(tmp_path / "ok", CONFIG, torch_layout_tensors(CONFIG)), mesh, jnp.float32)
    assert loaded.config.num_layers == 2


def test_layers_past_the_config_s_count_are_refused(tmp_path, mesh):
    """A 3-layer checkpoint whose config says 2 used to load its first two layers and drop the third."""
    tensors = torch_layout_tensors(dict(CONFIG, num_hidden_layers=3))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.2\.\S+ has no place in this model"):
        load_model(write_hf(tmp_path / "ckpt", CONFIG, tensors), mesh, jnp.float32)


def test_biases_the_config_does_not_declare_are_refused(tmp_path, mesh):
    tensors = torch_layout_tensors(CONFIG)
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(16, np.float32)
    with pytest.raises(CheckpointError, match=r"q_proj\.bias has no place"):
        load_model(write_hf(tmp_path / "ckpt", CONFIG, tensors), mesh, jnp.float32)


def test_a_tensor_in_two_shards_is_refused(tmp_path, mesh):
    folder = write_hf(tmp_path / "ckpt", CONFIG, torch_layout_tensors(CONFIG), shards=2)
    save_file({"model.norm.weight": np.ones(16, np.float32)}, str(folder / "model-9.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor model\.norm\.weight appears twice"):
        load_model(folder, mesh, jnp.float32)


def test_integer_tensors_are_refused_not_cast(tmp_path, mesh):
    tensors = torch_layout_tensors(CONFIG)
    tensors["model.layers.0.self_attn.q_proj.weight"] = np.ones((16, 16), np.int8)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight has dtype I8; this engine loads float weights"):
        load_model(write_hf(tmp_path / "ckpt", CONFIG, tensors), mesh, jnp.float32)


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config: quantized checkpoints \(fp8\)"),
    ({"num_hidden_layers": -1}, "num_layers must be a positive whole number, got -1"),
    ({"num_attention_heads": 0}, "num_attention_heads must be positive"),
    ({"vocab_size": None}, "config.json has a field of the wrong type or value"),
    ({"rope_scaling": "llama3"}, "config.json has a field of the wrong type or value"),
], ids=["gelu", "quantized", "negative_layers", "no_heads", "null", "string"])
def test_config_values_the_engine_cannot_honour_name_the_field(tmp_path, mesh, change, message):
    folder = write_hf(tmp_path / "ckpt", dict(CONFIG, **change), {})
    with pytest.raises(CheckpointError, match=message):
        load_model(folder, mesh, jnp.float32)


@pytest.mark.parametrize(("change", "positions"), [
    ({"model_type": "mistral", "sliding_window": 8}, 8),  # Mistral v0.1: 4096 of 32768
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16}, 16),
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 16}, 64),  # Qwen2.5's switch is off
    ({"model_type": "mistral", "sliding_window": 64}, 64),
], ids=["mistral", "qwen_on", "qwen_off", "window_as_long"])
def test_a_sliding_window_caps_the_context_where_full_attention_is_the_same(tmp_path, mesh, change, positions):
    """Sliding-window attention was ignored; the engine's full attention equals it within the window."""
    config = dict(CONFIG, **change)
    loaded = load_model(write_hf(tmp_path / "ckpt", config, torch_layout_tensors(config)), mesh, jnp.float32)
    assert loaded.config.max_position_embeddings == positions


def write_gguf(path: Path, metadata: dict | None = None, extra: dict[str, np.ndarray] | None = None,
               config: dict = CONFIG, token_types: list[int] | None = None, merges: list[str] = (),
               num_tokens: int | None = None, byte_order: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE,
               quantized: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """`quantized`: tensors written in that quantization (llama.cpp's blocks, by the gguf package)."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=byte_order)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    if "llama.attention.head_count_kv" not in (metadata or {}):
        writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_context_length(64)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in (metadata or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value) if isinstance(value, int) else writer.add_string(key, value)
    tokens = [f"t{i}" for i in range(num_tokens or config["vocab_size"])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens) if token_types is None else token_types)
    writer.add_token_merges(list(merges))
    writer.add_eos_token_id(1)
    for name, array in {**torch_layout_tensors(config, gguf_name), **(extra or {})}.items():
        qtype = (quantized or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            blocks = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_tiny_gguf_loads(tmp_path, mesh):
    assert load_model(write_gguf(tmp_path / "ok.gguf"), mesh, jnp.float32).config.num_layers == 2


def test_a_gguf_with_more_blocks_than_its_block_count_is_refused(tmp_path, mesh):
    second_block = {n: a for n, a in torch_layout_tensors(CONFIG, gguf_name).items() if n.startswith("blk.1.")}
    path = write_gguf(tmp_path / "model.gguf", config=dict(CONFIG, num_hidden_layers=1), extra=second_block)
    with pytest.raises(CheckpointError, match=r"tensor blk\.1\.\S+ has no place in this model"):
        load_model(path, mesh, jnp.float32)


@pytest.mark.parametrize(("metadata", "extra", "message"), [
    ({"llama.rope.scaling.type": "yarn"}, None, r"llama\.rope\.scaling\.type is 'yarn'"),
    ({}, {"rope_freqs.weight": np.ones(7, np.float32)}, r"rope_freqs\.weight has 7 values, expected 2"),
    ({}, {"blk.0.ffn_gate_exps.weight": np.ones((4, 4), np.float32)},
     r"tensor blk\.0\.ffn_gate_exps\.weight is not part of a model this engine runs"),
    ({}, {"rope_freqs.weight": np.ones(2, np.float64)}, r"cannot dequantize tensor rope_freqs\.weight"),
    ({"llama.attention.head_count_kv": [2, 1]}, None, r"llama\.attention\.head_count_kv differs between layers"),
], ids=["rope_scaling", "rope_freqs_length", "unknown_tensor", "rope_freqs_type", "per_layer_kv_heads"])
def test_gguf_settings_the_engine_cannot_honour_are_refused(tmp_path, mesh, metadata, extra, message):
    with pytest.raises(CheckpointError, match=message):
        load_model(write_gguf(tmp_path / "model.gguf", metadata, extra), mesh, jnp.float32)


def test_a_per_layer_kv_head_count_that_is_the_same_everywhere_loads(tmp_path, mesh):
    path = write_gguf(tmp_path / "model.gguf", {"llama.attention.head_count_kv": [2, 2]})
    assert load_model(path, mesh, jnp.float32).config.num_kv_heads == 2


def test_a_big_endian_gguf_is_refused_not_read_as_garbage(tmp_path, mesh):
    path = write_gguf(tmp_path / "model.gguf", byte_order=gguf.GGUFEndian.BIG)
    with pytest.raises(CheckpointError, match="other byte order"):
        load_model(path, mesh, jnp.float32)


def test_loaded_gguf_weights_do_not_change_when_the_file_is_rewritten(tmp_path, mesh):
    """F32 tensors are not left as views of the memory-mapped file: rewriting it in place (as `cp` over
    it would) changes nothing in a loaded model."""
    path = write_gguf(tmp_path / "model.gguf")
    loaded = parameters(load_model(path, mesh, jnp.float32).model)["model.norm.weight"]
    before = np.asarray(loaded.get_value()).copy()
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "output_norm.weight")
    with open(path, "r+b") as file:
        file.seek(tensor.data_offset)
        file.write(np.full(tensor.n_elements, 7.0, np.float32).tobytes())
    assert np.array_equal(np.asarray(loaded.get_value()), before)


def test_the_checkpoint_reads_what_the_gguf_library_reads(smollm2_path):
    """The reader runs over a plain view of the memory map (faster); every metadata value and tensor
    byte is the library's own, and nothing it returns is a `np.memmap`."""
    ours = GGUFCheckpoint(smollm2_path).reader
    library = gguf.GGUFReader(str(smollm2_path))
    assert list(ours.fields) == list(library.fields)
    for name, field in library.fields.items():
        assert ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset) for t in library.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, library.tensors, strict=True))
    assert not any(isinstance(t.data, np.memmap) for t in ours.tensors)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(token_types=[1] * 10), "tokenizer.ggml.token_type has 10 entries for 32 tokens"),
    (dict(merges=["t1t2"]), "tokenizer.ggml.merges holds an entry that is not two tokens"),
    (dict(merges=["zz t1"]), "tokenizer.ggml.merges: .*zz"),
], ids=["short_types", "merge_without_space", "merge_of_unknown_token"])
def test_malformed_gguf_vocabularies_name_the_field(tmp_path, kwargs, message):
    """Each used to escape as a ValueError, TypeError or bare Exception from the tokenizers library."""
    from jaxinfer.tokenizer.gguf_vocab import backend_from_gguf
    from jaxinfer.weights.gguf_file import GGUFCheckpoint

    with pytest.raises(CheckpointError, match=message):
        backend_from_gguf(GGUFCheckpoint(write_gguf(tmp_path / "model.gguf", **kwargs)))


@pytest.mark.parametrize(("name", "text", "message"), [
    ("tokenizer.json", "{not json", r"tokenizer\.json: not a tokenizers file"),
    ("tokenizer_config.json", "{not json", r"tokenizer_config\.json: unreadable JSON"),
    ("generation_config.json", "[2]", r"generation_config\.json: must hold a JSON object, got list"),
])
def test_malformed_tokenizer_folders_name_the_file(tmp_path, name, text, message):
    import shutil

    from jaxinfer import tokenizer

    shutil.copy(llama3_tokenizer_json(), tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))  # a Hugging Face folder
    (tmp_path / name).write_text(text)
    with pytest.raises(CheckpointError, match=message):
        tokenizer.load(str(tmp_path))


def test_out_of_range_eos_ids_in_generation_config_are_dropped(tmp_path):
    import shutil

    from jaxinfer import tokenizer

    shutil.copy(llama3_tokenizer_json(), tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [-1, 10000000, 128009]}')  # -1 overflowed
    assert 128009 in tokenizer.load(str(tmp_path)).eos_ids  # was an OverflowError


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(tmp_path):
    """Its extra ids could never be embedded: before, the model loaded and a prompt that tokenized to
    one of them failed as if the client had sent a bad id."""
    from jaxinfer import LLM

    path = write_gguf(tmp_path / "model.gguf", metadata={"llama.vocab_size": 32}, num_tokens=40)
    with pytest.raises(CheckpointError, match="the tokenizer has 40 tokens but the model's embedding only 32 rows"):
        LLM(str(path), warmup=False, num_pages=16, page_size=8, max_seqs=2, token_buckets=(8,))
