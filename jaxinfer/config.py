"""Model and engine configuration: dataclasses, HF `config.json` parsing and TOML loading."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxinfer.errors import ConfigError
from jaxinfer.machine_shape import EXEC_LOOPS, MachineShape
from jaxinfer.moe_config import MoEConfig, moe_from_hf

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# config.json model_type -> architecture
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                  "mixtral": "mixtral"}
EXEC_STEPS_BY_PLATFORM = {"cpu": 4096, "default": 256}  # used where engine.exec_steps_per_step = 0
RAGGED_REFERENCE_MAX_LEN = 4096  # the plain-JAX TPU contract's memory grows with the context
# layers.backends.make_backend
ATTENTION_BACKENDS = ("auto", "reference", "pallas_gpu", "pallas_tpu", "ragged_reference")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type = "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Shape and variant of a decoder (Llama 3, SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per-dimension divisors of the inverse frequencies (GGUF's `rope_freqs.weight`).
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # the experts of the sparse layers (models/experts.py)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive whole number, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        sparse = len(self.moe.sparse_layers) * (self.moe.params_per_layer * self.hidden_size - mlp) if self.moe else 0
        return self.num_layers * per_layer + sparse + embed + self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        if data.get("rope_scaling"):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        for key in ("rope_freq_factors", "eos_token_ids"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        data["moe"] = MoEConfig.from_dict(data.get("moe"))
        return cls(**data)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a Hugging Face `config.json` dictionary (transformers 4.x or 5.x spelling)."""
        if not isinstance(hf, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type", "")
        architecture = HF_MODEL_TYPES.get(model_type)
        if architecture is None:
            raise ConfigError(
                f"unknown architecture: config.json has model_type {model_type!r}; "
                f"supported: {', '.join(HF_MODEL_TYPES)}"
            )
        _refuse_unsupported_variants(hf)
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            if num_heads <= 0:
                raise ConfigError(f"num_attention_heads must be positive, got {num_heads}")
            rope = _hf_rope(hf)
            eos = hf.get("eos_token_id")
            eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                architecture=architecture,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope[0],
                rope_scaling=rope[1],
                max_position_embeddings=_context_within_window(hf),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=architecture == "qwen2" or bool(hf.get("attention_bias", False)),
                qk_norm=architecture in ("qwen3", "qwen3_moe"),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                moe=moe_from_hf(hf, model_type, int(hf["num_hidden_layers"])),
            )
        except KeyError as missing:
            raise ConfigError(f"config.json lacks the field {missing.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:  # a null, a string for a number, a list for a table
            raise ConfigError(f"config.json has a field of the wrong type or value ({exc})") from None


def _refuse_unsupported_variants(hf: dict[str, Any]) -> None:
    """Settings that change the model's math in ways this engine does not implement: loading on
    without them would run a different model than the checkpoint's, silently."""
    if hf.get("quantization_config"):
        method = (hf["quantization_config"] or {}).get("quant_method", "?") if isinstance(
            hf["quantization_config"], dict) else "?"
        raise ConfigError(f"quantization_config: quantized checkpoints ({method}) are not supported; use float "
                          "weights or a GGUF file")
    activation = hf.get("hidden_act", "silu")
    if activation not in ("silu", "swish"):
        raise ConfigError(f"hidden_act: {activation!r} is not supported (silu only)")


def _context_within_window(hf: dict[str, Any]) -> int:
    """The positions the engine runs the model at: `max_position_embeddings`, or a sliding window
    shorter than it. The engine attends to every earlier token, which equals sliding-window
    attention exactly while the context fits in the window (Mistral v0.1's 4096 of 32768)."""
    longest = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    # qwen2 has a switch for it
    windowed = hf.get("use_sliding_window") or hf.get("model_type") in ("mistral", "mixtral")
    if windowed and isinstance(window, int) and not isinstance(window, bool) and 0 < window < longest:
        log.warning("sliding_window %d of %d positions: the context is capped at the window, where full "
                    "attention is the same", window, longest)
        return window
    return longest


def _hf_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, llama3 scaling) from either `rope_parameters` (transformers 5) or `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(f"unsupported rope scaling {rope_type!r}; supported: default, llama3")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def read_hf_config(path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


@dataclass(frozen=True)
class EngineConfig:
    """How the engine lays out memory and work. Every field can be set from TOML."""

    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU/TPU
    # projections kept packed on the device (weights/weight_plan.py): auto | packed | int8 | int4 | float32 | bfloat16
    weights_dtype: str = "auto"
    weights_group: int = 32  # input rows per scale for int8 / int4
    packed_matmul: str = "auto"  # auto (chunked on CPUs, else xla) | xla | chunked | pallas: layers/backends.py
    kv_dtype: str = "auto"  # KV pages: auto (the model's dtype) | int8 (row scales) | fp8 (page scales): kv_quant.py
    page_size: int = 16
    num_pages: int = 1024  # including the null page 0
    max_seqs: int = 32  # sequences in flight at once
    # Sequences with penalties running at once: each holds a row of vocab int32 token counts on every
    # device (-1: max_seqs; 0: penalties refused). Others wait for a row; none with a draft model.
    max_penalized_seqs: int = -1
    max_model_len: int = 0  # 0: the model's context length, capped at 8192
    # Structured output (docs/guided.md): compiled grammars resident on the device at once (0: guided off),
    # states of one automaton at most, states all resident grammars share, token classes of one automaton;
    # rows with a host-matched grammar (Lark, GBNF) running at once, each a vocab-bit mask in every step.
    guided_host_rows: int = 4
    guided_grammars: int = 8
    guided_max_states: int = 4096
    guided_pool_states: int = 8192
    guided_max_classes: int = 512
    guided_max_pairs: int = 16_000_000  # an automaton's (state, token) pairs, bounded before it is built (memory)
    token_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    attention_backend: str = "auto"  # auto (by platform) | reference | pallas_gpu | pallas_tpu | ragged_reference
    attention_block_tokens: int = 128  # keys visited per attention loop iteration
    attention_query_tile: int = 16  # tokens of one sequence that share each key block's read (all backends)
    mesh_data: int = 1
    mesh_model: int = 0  # 0: all remaining devices
    mesh_expert: int = 1  # devices the experts of a mixture-of-experts model are split over (docs/deployment.md)
    prefix_caching: bool = True
    async_scheduling: bool = True  # dispatch step N+1 before reading step N's sampled ids (overlap)
    kv_host_pages: int = 0  # L2: evicted prefix pages kept in host memory (0: none)
    kv_store: str = ""  # L3: a path or tensorstore kvstore URL for evicted prefix pages ("": none)
    kv_store_ttl_seconds: float = 0.0  # L3 entries older than this are ignored and swept (0: no limit)
    kv_store_max_bytes: int = 0  # L3 capacity for this model's pages: the oldest go first (0: no limit)
    kv_store_sweep_seconds: float = 600.0  # how often a running engine sweeps L3 (expired, other writers' pages)
    kv_store_timeout_seconds: float = 10.0  # the longest the engine waits on one L3 read or listing; later: a miss
    draft_model: str = ""  # speculative decoding: a registry name or path of a model with the same vocabulary
    num_draft_tokens: int = 4  # proposals per round at most
    draft_confidence: float = 0.0  # a round's proposals stop at the first whose draft top probability is lower
    exec_slots: int = 0  # processor slots run inside the step for requests with exec on (0: processor off)
    # machine iterations per engine step (bounds the delay to co-batched rows); 0: by platform
    exec_steps_per_step: int = 0
    exec_max_instructions: int = 10_000_000  # server cap on a program's instructions (fuel)
    exec_timeout_seconds: float = 30.0  # server cap on a program's wall time
    exec_memory_pages: int = 4  # 64 KiB pages of linear memory per slot
    exec_code_records: int = 4096  # micro-ops per program
    exec_registers: int = 4096  # register file per slot (globals, frames)
    exec_max_call_depth: int = 256
    exec_files_root: str = ""  # programs may map files of <root>/<tenant>/ as WASI descriptors ("": no files)
    exec_quota_bytes: int = 1 << 20  # a tenant's files may not grow past this (a trap)
    exec_session_bytes: int = 64 << 20  # memory kept between turns (exec_session), least recently used first out
    exec_session_ttl_seconds: float = 3600.0
    exec_trace_entries: int = 256  # instructions traced per program (for the audit log and exec_trace=full; 0: off)
    exec_max_trace_tokens: int = 256  # trace text a request's context may receive
    # the machine's loop: auto (one kernel on the CPU, a while loop elsewhere), while, or pallas (the
    # Pallas kernel on CUDA GPUs, its interpreter on the CPU; not yet timed on a GPU)
    exec_loop: str = "auto"
    max_adapters: int = 0  # LoRA adapters resident at once (0: LoRA off); each a slot in the step's stacks
    max_lora_rank: int = 16  # the slots' rank: an adapter of lower rank is zero-padded, a higher one refused
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters: tuple[str, ...] = ()  # loaded at start: "NAME" (a registry name) or "NAME=PATH"
    exec_adapter: str = ""  # requests with exec on that name no adapter use this one ("": none)
    exec_max_running: int = 0  # requests with exec on running at once (0: no separate cap)
    compile_guard: str = "warn"  # off | warn | raise
    tokenizer_guard: str = "downgrade"  # forged control tokens in user text: downgrade (plain text) | reject
    warmup: bool = True
    compilation_cache_dir: str = ""  # "": $JAXINFER_COMPILATION_CACHE or ~/.cache/jaxinfer/xla; "off"
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("page_size", "num_pages", "max_seqs", "attention_block_tokens", "attention_query_tile")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"engine.{name} must be positive, got {getattr(self, name)}")
        if self.num_pages < 2:
            raise ConfigError("engine.num_pages must be at least 2 (page 0 is the null page)")
        if not self.token_buckets or sorted(set(self.token_buckets)) != list(self.token_buckets):
            raise ConfigError(f"engine.token_buckets must be strictly increasing, got {self.token_buckets}")
        if self.compile_guard not in ("off", "warn", "raise"):
            raise ConfigError(f"engine.compile_guard must be off, warn or raise, got {self.compile_guard!r}")
        if self.tokenizer_guard not in ("downgrade", "reject"):
            raise ConfigError(f"engine.tokenizer_guard must be downgrade or reject, got {self.tokenizer_guard!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"engine.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.num_draft_tokens < 1:
            raise ConfigError(f"engine.num_draft_tokens must be at least 1, got {self.num_draft_tokens}")
        if not 0.0 <= self.draft_confidence <= 1.0:
            raise ConfigError(f"engine.draft_confidence must be in [0, 1], got {self.draft_confidence}")
        for name in ("kv_host_pages", "kv_store_max_bytes", "kv_store_ttl_seconds", "kv_store_sweep_seconds"):
            value = getattr(self, name)
            if not value >= 0:  # NaN fails too
                raise ConfigError(f"engine.{name} must be 0 (off) or positive, got {value}")
        if not 0 < self.kv_store_timeout_seconds < math.inf:
            raise ConfigError(f"engine.kv_store_timeout_seconds must be positive and finite, got "
                              f"{self.kv_store_timeout_seconds}")
        if self.exec_loop not in EXEC_LOOPS:
            raise ConfigError(f"engine.exec_loop must be one of {', '.join(EXEC_LOOPS)}, got {self.exec_loop!r}")
        if self.exec_steps_per_step < 0:
            raise ConfigError(f"engine.exec_steps_per_step must be 0 (by platform) or positive, got "
                              f"{self.exec_steps_per_step}")
        exec_limits = ("exec_max_instructions", "exec_timeout_seconds", "exec_memory_pages",
                       "exec_code_records", "exec_registers", "exec_max_call_depth")
        for name in exec_limits if self.exec_slots else ():
            if getattr(self, name) <= 0:
                raise ConfigError(f"engine.{name} must be positive, got {getattr(self, name)}")
        if self.exec_max_instructions > 2**31 - 1:
            raise ConfigError(f"engine.exec_max_instructions must be at most {2**31 - 1}, got "
                              f"{self.exec_max_instructions}")
        if not 0 <= self.exec_slots <= 1024:
            raise ConfigError(f"engine.exec_slots must be in [0, 1024], got {self.exec_slots}")
        self._check_lora()
        self._check_guided()
        if not -1 <= self.max_penalized_seqs <= self.max_seqs:
            raise ConfigError(f"engine.max_penalized_seqs must be in [-1, max_seqs = {self.max_seqs}], got "
                              f"{self.max_penalized_seqs}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"engine.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                              f"{self.attention_backend!r}")
        if self.attention_backend == "ragged_reference" and not 0 < self.max_model_len <= RAGGED_REFERENCE_MAX_LEN:
            raise ConfigError(f"engine.attention_backend = ragged_reference gathers each sequence's whole page list "
                              f"for every token (a test backend): set engine.max_model_len to at most "
                              f"{RAGGED_REFERENCE_MAX_LEN}, got {self.max_model_len or 'the model default'}")

    def _check_guided(self) -> None:
        if not 0 <= self.guided_host_rows <= 256:
            raise ConfigError(f"engine.guided_host_rows must be in [0, 256], got {self.guided_host_rows}")
        if not 0 <= self.guided_grammars <= 256:
            raise ConfigError(f"engine.guided_grammars must be in [0, 256], got {self.guided_grammars}")
        if self.guided_max_pairs <= 0:
            raise ConfigError(f"engine.guided_max_pairs must be positive, got {self.guided_max_pairs}")
        for name in ("guided_max_states", "guided_max_classes") if self.guided_grammars else ():
            if not 1 <= getattr(self, name) <= self.guided_pool_states:
                raise ConfigError(f"engine.{name} must be in [1, guided_pool_states = {self.guided_pool_states}], "
                                  f"got {getattr(self, name)}")

    def _check_lora(self) -> None:
        from jaxinfer.layers.lora import LORA_TARGETS

        if not 0 <= self.max_adapters <= 64:
            raise ConfigError(f"engine.max_adapters must be in [0, 64], got {self.max_adapters}")
        if not 1 <= self.max_lora_rank <= 256:
            raise ConfigError(f"engine.max_lora_rank must be in [1, 256], got {self.max_lora_rank}")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if unknown or not self.lora_targets:
            raise ConfigError(f"engine.lora_targets: unknown {unknown}; choose from {', '.join(LORA_TARGETS)}")
        if len(self.adapters) > self.max_adapters:
            raise ConfigError(f"engine.adapters: {len(self.adapters)} adapters, engine.max_adapters is "
                              f"{self.max_adapters}")
        if self.exec_adapter and (not self.max_adapters or self.draft_model):
            raise ConfigError("engine.exec_adapter needs engine.max_adapters > 0 and no engine.draft_model")
        if self.exec_max_running < 0:
            raise ConfigError(f"engine.exec_max_running must be >= 0, got {self.exec_max_running}")

    @property
    def exec_machine_shape(self) -> MachineShape:
        return MachineShape(self.exec_slots, self.exec_code_records, self.exec_registers, self.exec_memory_pages,
                            self.exec_max_call_depth, self.exec_trace_entries, self.exec_loop)

    def exec_steps_on(self, platform: str) -> int:
        """Machine iterations per engine step: the configured number, or the platform's default (an
        iteration costs about 0.1 us on the CPU, where the loop is one kernel, and 25 us on an H200)."""
        return self.exec_steps_per_step or EXEC_STEPS_BY_PLATFORM.get(platform, EXEC_STEPS_BY_PLATFORM["default"])

    @property
    def penalty_slots(self) -> int:
        """Rows of penalty counts: none with a draft model (penalties are refused there)."""
        if self.draft_model:
            return 0
        return self.max_seqs if self.max_penalized_seqs < 0 else self.max_penalized_seqs

    @property
    def max_tokens_per_step(self) -> int:
        return self.token_buckets[-1]

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        limit = self.max_model_len or min(model.max_position_embeddings, 8192)
        return min(limit, model.max_position_embeddings)

    def max_pages_per_seq(self, model: ModelConfig) -> int:
        pages = math.ceil(self.resolved_max_model_len(model) / self.page_size)
        per_block = max(1, self.attention_block_tokens // self.page_size)
        return math.ceil(pages / per_block) * per_block

    def replace(self, **changes: Any) -> EngineConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
        for name in ("token_buckets", "lora_targets", "adapters"):
            if isinstance(changes.get(name), list | tuple):
                changes[name] = tuple(changes[name])
        return dataclasses.replace(self, **changes)


def load_engine_config(path: str | Path | None, **overrides: Any) -> EngineConfig:
    """Reads the `[engine]` table of a TOML file (or none) and applies non-None overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML ({exc})") from None
        values.update(data.get("engine", {}))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return EngineConfig().replace(**values)
