"""GGUF files: model config from metadata, and dequantized tensors in the engine's layout.

llama.cpp's converter permutes the rows of Q and K for `llama` architecture files so that its
RoPE kernel can rotate interleaved pairs; the engine (like transformers) rotates halves, so that
permutation is undone here. Qwen2/Qwen3 files are written unpermuted.

Mixture-of-experts files (llama.cpp's `qwen3moe`, and `llama` with an expert count: Mixtral) keep
each sparse layer's experts stacked (`blk.N.ffn_gate_exps.weight`, [experts, out, in] in numpy
order) beside the router (`ffn_gate_inp`); they map onto the family's stacked experts
(models/experts.py) with the last two axes swapped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, ConfigError
from jaxinfer.models import model_class
from jaxinfer.moe_config import MoEConfig
from jaxinfer.weights.packing import FLOAT_TYPES, GGUF_FORMATS, PackedFormat, PackedTensor, repack_gguf, stack_experts
from jaxinfer.weights.weight_plan import packable

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.kernel",
    "attn_k.weight": "self_attn.k_proj.kernel",
    "attn_v.weight": "self_attn.v_proj.kernel",
    "attn_output.weight": "self_attn.o_proj.kernel",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.kernel",
    "ffn_up.weight": "mlp.up_proj.kernel",
    "ffn_down.weight": "mlp.down_proj.kernel",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.kernel",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}  # and mixtral
_EXPERT_TENSORS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}  # projection
_ROUTER = "ffn_gate_inp.weight"
_PROJECTION_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_STACKED = re.compile(r"^model\.layers\.(\d+)\.\w+\.(?:experts\.(\w+)|gate\.kernel)$")
READ_BY_CONFIG = ("rope_freqs.weight",)  # tensors that are settings, not parameters


def engine_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def checkpoint_name(name: str) -> str:
    """The GGUF tensor name for an engine parameter (inverse of `engine_name` and `expert_name`)."""
    stacked = _STACKED.match(name)
    if stacked:
        part = _PROJECTION_PART.get(stacked.group(2) or "")
        return f"blk.{stacked.group(1)}." + (f"ffn_{part}_exps.weight" if part else _ROUTER)
    for gguf_name, ours in _GLOBAL_NAMES.items():
        if ours == name:
            return gguf_name
    match = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    for gguf_suffix, ours in _LAYER_NAMES.items():
        if match and ours == match.group(2):
            return f"blk.{match.group(1)}.{gguf_suffix}"
    return name


def expert_name(gguf_name: str, cfg: ModelConfig) -> str | None:
    """The engine parameter of a sparse layer's router or stacked experts (None: not one of them)."""
    match = _BLOCK.match(gguf_name)
    if cfg.moe is None or not match or (match.group(2) not in _EXPERT_TENSORS and match.group(2) != _ROUTER):
        return None
    layer = int(match.group(1))
    experts = model_class(cfg.architecture).layer_spec(cfg, layer).experts if layer < cfg.num_layers else None
    if experts is None:
        return None
    prefix = f"model.layers.{layer}.{experts.module}"
    if match.group(2) == _ROUTER:
        return f"{prefix}.gate.kernel"
    return f"{prefix}.experts.{experts.projections[_EXPERT_TENSORS[match.group(2)]]}"


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows (h, pair, i) -> (h, i, pair), i.e. interleaved -> halves."""
    rows = weight.shape[0]
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


class _PlainViewReader(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain ndarray view of its memory map.

    The reader slices its buffer once or twice per metadata value (about 250,000 times for a
    49k-token vocabulary with its merges). A `np.memmap` slice runs `memmap.__array_finalize__`
    each time, which made up most of the 3 s that parsing SmolLM2's header took; a plain view of
    the same mapping reads the same bytes about 3x faster. The mapping stays open through the view's
    `base`.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain_data = mapped.view(np.ndarray)


class GGUFCheckpoint:
    """A GGUF file opened (memory-mapped) once; metadata, config and tensors read from it."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.reader = _PlainViewReader(str(path))
        except Exception as exc:  # the reader raises many types on a damaged file
            raise CheckpointError(f"{path}: not a readable GGUF file, or truncated ({exc})") from None
        if self.reader.byte_order != "I":  # "S": swapped; dequantize would read the bytes as native
            raise CheckpointError(f"{path}: a GGUF file of the other byte order (big-endian) is not supported")
        size = path.stat().st_size
        for tensor in self.reader.tensors:
            if tensor.data_offset + tensor.n_bytes > size:
                raise CheckpointError(f"{path}: truncated file (tensor {tensor.name} ends past the end)")

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    @cached_property
    def architecture(self) -> str:
        return str(self.field("general.architecture", ""))

    @cached_property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    def config(self) -> ModelConfig:
        arch = self.architecture
        if arch not in GGUF_ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: unknown architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

        def meta(key: str, default: Any = None) -> Any:
            value = self.field(f"{arch}.{key}", default)
            if value is None:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks {arch}.{key}")
            return value

        num_heads = self._per_model(f"{arch}.attention.head_count", meta("attention.head_count"))
        num_kv_heads = self._per_model(f"{arch}.attention.head_count_kv", meta("attention.head_count_kv", num_heads))
        hidden = int(meta("embedding_length"))
        if num_heads <= 0 or num_kv_heads <= 0:
            raise CheckpointError(f"{self.path}: GGUF metadata {arch}.attention.head_count and head_count_kv must "
                                  "be positive")
        scaling = str(self.field(f"{arch}.rope.scaling.type", "none"))
        if scaling != "none":
            raise CheckpointError(f"{self.path}: GGUF metadata {arch}.rope.scaling.type is {scaling!r}; this engine "
                                  "runs RoPE without scaling for GGUF files (or llama3 scaling from rope_freqs)")
        tokens = self.field("tokenizer.ggml.tokens") or []
        eos = [self.field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        rope_factors = self._rope_freq_factors()
        head_dim = int(meta("attention.key_length", hidden // num_heads))
        if rope_factors is not None and len(rope_factors) != head_dim // 2:
            raise CheckpointError(f"{self.path}: tensor rope_freqs.weight has {len(rope_factors)} values, expected "
                                  f"{head_dim // 2} (head_dim / 2)")
        moe = self._experts(arch, int(meta("block_count")), int(meta("feed_forward_length")))
        try:
            return ModelConfig(
                architecture="mixtral" if arch == "llama" and moe else GGUF_ARCHITECTURES[arch],
                vocab_size=int(self.field(f"{arch}.vocab_size") or len(tokens)),
                hidden_size=hidden,
                intermediate_size=int(meta("feed_forward_length")),
                num_layers=int(meta("block_count")),
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
                rope_theta=float(meta("rope.freq_base", 10000.0)),
                rope_freq_factors=rope_factors,
                max_position_embeddings=int(meta("context_length", 4096)),
                tie_word_embeddings="output.weight" not in self.tensor_names,
                attention_bias="blk.0.attn_q.bias" in self.tensor_names,
                qk_norm="blk.0.attn_q_norm.weight" in self.tensor_names,
                bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
                eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
                moe=moe,
            )
        except ConfigError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from None

    def _experts(self, arch: str, num_layers: int, dense_width: int) -> MoEConfig | None:
        """The experts `{arch}.expert_count` declares: the sparse layers are those with a router."""
        count = int(self.field(f"{arch}.expert_count", 0) or 0)
        if not count:
            return None
        used = self.field(f"{arch}.expert_used_count")
        if used is None:
            raise CheckpointError(f"{self.path}: GGUF metadata has {arch}.expert_count but lacks "
                                  f"{arch}.expert_used_count")
        sparse = tuple(i for i in range(num_layers) if f"blk.{i}.{_ROUTER}" in self.tensor_names)
        try:
            return MoEConfig(num_experts=count, top_k=int(used), sparse_layers=sparse,
                             intermediate_size=int(self.field(f"{arch}.expert_feed_forward_length", dense_width)),
                             renormalize=bool(self.field(f"{arch}.expert_weights_norm", True)))
        except ConfigError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from None

    def _per_model(self, key: str, value: Any) -> int:
        """A head count: llama.cpp allows one per layer; this engine runs one for every layer."""
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise CheckpointError(f"{self.path}: GGUF metadata {key} differs between layers ({value[:8]}); "
                                      "this engine runs one count for every layer")
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise CheckpointError(f"{self.path}: GGUF metadata {key} must be a whole number, got {value!r:.40}")
        return int(value)

    def _rope_freq_factors(self) -> tuple[float, ...] | None:
        for tensor in self.reader.tensors:
            if tensor.name == "rope_freqs.weight":
                return tuple(float(x) for x in self._dequantized(tensor))
        return None

    def _dequantized(self, tensor: gguf.ReaderTensor) -> np.ndarray:
        """The tensor as floats, in memory of its own: a view of the memory-mapped file (an F32 tensor)
        would change, or fault, if the file were rewritten or truncated while the weights are in use."""
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, NotImplementedError) as exc:
            raise CheckpointError(f"{self.path}: cannot dequantize tensor {tensor.name} ({exc})") from None
        return array.copy() if np.shares_memory(array, self.reader.data) else array

    def packed_formats(self, cfg: ModelConfig) -> dict[str, PackedFormat]:
        """The projections whose blocks stay packed (`weights_dtype = "auto"`), by kernel parameter name;
        a projection in a quantization the device layout has no format for is refused by name."""
        formats = {}
        for tensor in self.reader.tensors:
            name = expert_name(tensor.name, cfg) or engine_name(tensor.name)
            if name is None or not packable(name) or tensor.tensor_type in FLOAT_TYPES:
                continue
            fmt = GGUF_FORMATS.get(tensor.tensor_type)
            if fmt is None:
                raise CheckpointError(
                    f"{self.path}: tensor {tensor.name} is {tensor.tensor_type.name}, a quantization the engine does "
                    f"not keep packed (packed: {', '.join(t.name for t in GGUF_FORMATS)}); set engine.weights_dtype "
                    "= \"float32\" to dequantize it at load")
            formats[name] = fmt
        return formats

    def iter_tensors(self, cfg: ModelConfig, packed: frozenset[str] | set[str] = frozenset()
                     ) -> Iterator[tuple[str, str, np.ndarray | PackedTensor]]:
        """The tensors in the engine's layout; those named in `packed` as their blocks, repacked."""
        for tensor in self.reader.tensors:
            name = expert_name(tensor.name, cfg) or engine_name(tensor.name)
            if name is None:
                if tensor.name not in READ_BY_CONFIG:
                    raise CheckpointError(f"{self.path}: tensor {tensor.name} is not part of a model this engine "
                                          "runs (an unsupported variant of the architecture)")
                continue
            keep_packed = name in packed and tensor.tensor_type in GGUF_FORMATS
            array = np.asarray(tensor.data) if keep_packed else self._dequantized(tensor)
            permuted = ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")
            if cfg.architecture in ("llama", "mixtral") and tensor.name.endswith(permuted):
                heads = cfg.num_heads if "attn_q" in tensor.name else cfg.num_kv_heads
                if array.shape[0] % (2 * heads) == 0:  # whole rows move: the same for a row of blocks
                    array = unpermute_rows(array, heads)
            if keep_packed:
                fan_in, fan_out = (int(n) for n in tensor.shape[:2])
                if len(tensor.shape) == 3:  # stacked experts: each expert's rows of blocks, repacked
                    experts = array.reshape(int(tensor.shape[2]), fan_out, -1)
                    yield name, tensor.name, stack_experts([repack_gguf(expert, tensor.tensor_type, fan_out, fan_in)
                                                           for expert in experts])
                else:
                    yield name, tensor.name, repack_gguf(array, tensor.tensor_type, fan_out, fan_in)
                continue
            if name.endswith(".kernel"):
                array = np.ascontiguousarray(array.T)
            elif array.ndim == 3:  # stacked experts: [experts, out, in] -> [experts, in, out]
                array = np.ascontiguousarray(array.swapaxes(1, 2))
            yield name, tensor.name, array
