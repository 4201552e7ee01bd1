"""The Python API: `LLM(model).generate(prompts, params)` and `generate_chat(conversations, params)`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer import tokenizer as tokenizers_
from jaxinfer.config import EngineConfig, load_engine_config
from jaxinfer.engine.adapters import AdapterInfo, parse_adapter_spec
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.params import Request, RequestOutput, SamplingParams
from jaxinfer.engine.replicas import ReplicaSet
from jaxinfer.engine.spec_step import SpecRunner
from jaxinfer.engine.step import ModelRunner
from jaxinfer.errors import CheckpointError, ConfigError, JaxinferError, RequestError
from jaxinfer.kv.page_value import ModelIdentity
from jaxinfer.kv.store import PageStore
from jaxinfer.kv.tiers import HostTier, TieredPages
from jaxinfer.layers.backends import make_backend, make_packed_matmul
from jaxinfer.layers.basic import use_packed_matmul
from jaxinfer.parallel import make_mesh, replica_meshes
from jaxinfer.parallel.distributed import ProcessGroup, initialize
from jaxinfer.parallel.lockstep import Follower, Leader, connect
from jaxinfer.processor.protocol import CONTROL_TOKENS
from jaxinfer.tokenizer.tokenizer import GuardReport
from jaxinfer.weights.fingerprint import check_same_as_leader, fingerprint, load_fingerprints
from jaxinfer.weights.gguf_file import GGUFCheckpoint
from jaxinfer.weights.loader import load_model, place_copy
from jaxinfer.weights.registry import ResolvedCheckpoint, resolve
from jaxinfer.weights.weight_plan import WeightsChoice

log = logging.getLogger(__name__)

# A prompt: text, token ids, or parts (strings and {"special": NAME} for explicit control tokens).
Prompt = str | list[int] | list[str | dict[str, str]]


def enable_compilation_cache(setting: str) -> None:
    """Persistent XLA cache: the setting, else $JAXINFER_COMPILATION_CACHE, else ~/.cache; "off" disables."""
    path = setting or os.environ.get("JAXINFER_COMPILATION_CACHE") or str(Path.home() / ".cache/jaxinfer/xla")
    if path != "off":
        jax.config.update("jax_compilation_cache_dir", path)


def resolve_dtype(name: str) -> jnp.dtype:
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(name)


def weights_setting(cfg: EngineConfig) -> tuple[WeightsChoice, str]:
    """The packing choice and the engine dtype it implies: `weights_dtype = "float32" | "bfloat16"`
    sets the dtype an `auto` dtype resolves to, and refuses another explicit one."""
    choice = WeightsChoice(cfg.weights_dtype, cfg.weights_group)
    if not choice.unpacked or cfg.dtype == choice.dtype:
        return choice, cfg.dtype
    if cfg.dtype != "auto":
        raise ConfigError(f"engine.weights_dtype = {cfg.weights_dtype!r} but engine.dtype = {cfg.dtype!r}: the "
                          "float weights are the model's dtype; set one of them")
    return choice, choice.dtype


# Settings with device work of their own (a draft's steps, KV tier copies) that followers do not
# replay and replicas do not share, yet. Adapter loads and the processor's slot changes are replayed
# (`ModelRunner.replay_call`) and resident on every replica.
ONE_ENGINE_ONLY = ("draft_model", "kv_host_pages", "kv_store")


def _refuse_one_engine_settings(cfg: EngineConfig, where: str) -> None:
    used = [name for name in ONE_ENGINE_ONLY if getattr(cfg, name)]
    if used:
        raise ConfigError(f"engine.{used[0]} is not supported with {where} "
                          f"(set {', '.join('engine.' + name for name in used)} off)")


def check_multi_process(cfg: EngineConfig) -> None:
    """Refuses settings that a process group cannot run in lockstep."""
    _refuse_one_engine_settings(cfg, "more than one process")


def check_group_settings(cfg: EngineConfig, group: ProcessGroup) -> Mesh:
    """The ('data', 'expert', 'model') mesh, after refusing what the group or the replicas cannot run. In a
    group, `LLM` checks once every process has joined the control channel: a follower's refusal
    reaches the leader, and a leader's stops the followers. With mesh_data > 1 each data row is one
    replica of the model."""
    if group.distributed:
        check_multi_process(cfg)
    mesh = make_mesh(cfg.mesh_data, cfg.mesh_model, expert=cfg.mesh_expert)
    if group.distributed and mesh.devices.size != jax.device_count():
        raise ConfigError(f"engine.mesh_data x mesh_expert x mesh_model = {mesh.devices.size} devices; with "
                          f"{group.num_processes} processes the mesh must span all {jax.device_count()}")
    if cfg.mesh_data > 1 and group.distributed:
        raise ConfigError("engine.mesh_data > 1 (replicas) is not supported with more than one process: run one "
                          "process group per replica behind a load balancer")
    if cfg.mesh_data > 1:
        _refuse_one_engine_settings(cfg, "engine.mesh_data > 1 (replicas)")
    return mesh


# Settings a host may set for itself: where its own files are. Every other engine setting shapes the
# step or its inputs, so the group's processes must agree on it.
HOST_SETTINGS = ("compilation_cache_dir", "exec_files_root")


def group_settings(cfg: EngineConfig) -> dict[str, Any]:
    """The engine settings every process of a group must share (adapters by name: paths are per host)."""
    settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in HOST_SETTINGS}
    settings["adapters"] = [entry.split("=", 1)[0] for entry in cfg.adapters]
    return json.loads(json.dumps(settings))  # as the control channel carries them (tuples become lists)


def check_same_settings(leader: dict[str, Any], own: dict[str, Any], process_id: int) -> None:
    """Raises ConfigError naming the first engine setting in which this process differs from the leader."""
    for name in sorted(set(leader) | set(own)):
        if leader.get(name) != own.get(name):
            raise ConfigError(f"engine.{name}: the leader (process 0) runs {leader.get(name)!r}, process "
                              f"{process_id} {own.get(name)!r}; every process of a group needs the same engine "
                              "settings")


class LLM:
    """A loaded model with its tokenizer, KV page pool and compiled step.

    With a `process_group` of several processes, every process builds the same LLM; process 0
    (the leader) runs requests, and the others call `serve_follower()` to replay its steps."""

    def __init__(self, model: str | Path = "smollm2-135m", config: EngineConfig | str | Path | None = None,
                 process_group: ProcessGroup | None = None, lockstep: Leader | Follower | None = None,
                 **overrides: Any):
        """`lockstep`: the group's control channel when the caller has joined it already (`connect`)."""
        cfg = config if isinstance(config, EngineConfig) else load_engine_config(config)
        self.config = cfg = cfg.replace(**overrides) if overrides else cfg
        self.group = initialize(process_group or ProcessGroup())
        # Joined before anything is checked or loaded, so a process that refuses (or fails, or is lost)
        # stops the whole group in order, each process reporting the real reason.
        channel = lockstep if lockstep is not None else connect(self.group)
        self.leader = channel if isinstance(channel, Leader) else None
        self.follower = channel if isinstance(channel, Follower) else None
        try:
            self.mesh = self._join_load(model, cfg)
            self._load(model, cfg)
        except BaseException:
            self.close()
            raise

    def _join_load(self, model: str | Path, cfg: EngineConfig) -> Mesh:
        """The mesh, once the settings are checked. In a group, loads together: the leader says what it
        loads and with which settings, and each follower checks that it runs the same settings and that
        its own copy of the checkpoints has the same content (each process reads its own files)."""
        if self.follower is None:
            mesh = check_group_settings(cfg, self.group)  # a leader that refuses stops its followers (close)
            if self.leader is not None:
                refusals = self.leader.begin_load(load_fingerprints(model, cfg.draft_model), group_settings(cfg))
                if refusals:
                    raise CheckpointError("; ".join(f"follower process {process_id} refused to load: {reason}"
                                                    for process_id, reason in sorted(refusals.items())))
            return mesh
        # raises LeaderStopped when the leader gives up first
        leader_checkpoints, leader_settings = self.follower.await_load()
        try:  # a refusal, even for missing files, goes to the leader, which stops the group in order
            check_same_settings(leader_settings, group_settings(cfg), self.group.process_id)
            mesh = check_group_settings(cfg, self.group)
            check_same_as_leader(leader_checkpoints, load_fingerprints(model, cfg.draft_model),
                                 self.group.process_id)
        except Exception as error:
            self.follower.answer_load(str(error) if isinstance(error, JaxinferError) else repr(error))
            raise
        self.follower.answer_load()  # returns when every follower is ready; LeaderStopped otherwise
        return mesh

    def _load(self, model: str | Path, cfg: EngineConfig) -> None:
        enable_compilation_cache(cfg.compilation_cache_dir)
        start = time.perf_counter()
        weights, dtype = weights_setting(cfg)
        self.dtype = resolve_dtype(dtype)
        checkpoint = resolve(model)
        gguf_file = GGUFCheckpoint(checkpoint.path) if checkpoint.kind == "gguf" else None
        backend = make_backend(cfg.attention_backend, block_tokens=cfg.attention_block_tokens,
                               query_tile=cfg.attention_query_tile, model_parallel=self.mesh.shape["model"],
                               expert_parallel=self.mesh.shape["expert"], kv_dtype=cfg.kv_dtype)
        matmul = make_packed_matmul(cfg.packed_matmul, model_parallel=self.mesh.shape["model"],
                                    expert_parallel=self.mesh.shape["expert"])
        meshes = replica_meshes(self.mesh)
        loaded = load_model(checkpoint, meshes[0], self.dtype, backend, gguf_file=gguf_file, weights=weights)
        use_packed_matmul(loaded.model, matmul)
        if cfg.mesh_expert > 1 and loaded.config.moe is None:
            raise ConfigError(f"engine.mesh_expert = {cfg.mesh_expert}: {checkpoint.name} has no experts to split "
                              "(a dense model runs on the model axis; set mesh_expert = 1)")
        self.model_config = loaded.config
        self.tokenizer = (
            tokenizers_.from_gguf(gguf_file) if gguf_file is not None else tokenizers_.load(checkpoint.path)
        )
        self.tokenizer.guard = cfg.tokenizer_guard
        if self.tokenizer.vocab_size > loaded.config.vocab_size:  # ids past the embedding could not be run
            raise CheckpointError(f"{checkpoint.path}: the tokenizer has {self.tokenizer.vocab_size} tokens but the "
                                  f"model's embedding only {loaded.config.vocab_size} rows (vocab_size)")
        if cfg.exec_slots:  # the processor's control tokens; the model grows zero rows for new ids
            ids = self.tokenizer.add_control_tokens(CONTROL_TOKENS)
            loaded.model.extend_vocabulary(max(ids.values()) + 1)  # no-op when the vocabulary has them
            self.model_config = loaded.model.config
        self.load_seconds = time.perf_counter() - start
        self.max_model_len = cfg.resolved_max_model_len(self.model_config)
        models = [loaded.model] + [place_copy(loaded.model, mesh) for mesh in meshes[1:]]
        self.runners = [ModelRunner(m, self.model_config, cfg, mesh) for m, mesh in zip(models, meshes, strict=True)]
        self.runner = self.runners[0]
        self.runner.lockstep = self.leader
        if cfg.draft_model:  # speculative decoding: the draft's KV pools share the target's page ids
            draft = load_model(cfg.draft_model, self.mesh, self.dtype, backend, target=loaded.model)
            use_packed_matmul(draft.model, matmul)
            self.runner.spec = SpecRunner(self.runner, draft.model, draft.config, cfg.num_draft_tokens)
        self.engine = self.new_engine(tiers=self._kv_tiers(checkpoint))
        for spec in cfg.adapters:  # engine.adapters: "NAME" or "NAME=PATH", loaded before any request
            if self.follower is not None:  # the leader reads it and sends the checked tensors, in order
                self.follower.replay_next_call(self.runner.replay_call)
            else:
                self.load_adapter(*parse_adapter_spec(spec))
        self.warmup_seconds = sum(runner.warmup() for runner in self.runners) if cfg.warmup else 0.0
        log.info("loaded %s in %.1fs, warm-up %.1fs", checkpoint.name, self.load_seconds, self.warmup_seconds)

    def new_engine(self, tiers: TieredPages | None = None) -> Engine | ReplicaSet:
        """An engine over this model's device state (one per replica, behind a ReplicaSet)."""
        count = len(self.runners)
        engines = [Engine(runner, self.tokenizer, self.max_model_len, tiers=tiers, first_index=i, index_stride=count)
                   for i, runner in enumerate(self.runners)]
        return engines[0] if count == 1 else ReplicaSet(engines)

    @property
    def num_compiles(self) -> int:
        return sum(runner.num_compiles for runner in self.runners)

    @property
    def is_leader(self) -> bool:
        return self.group.process_id == 0

    def serve_follower(self) -> int:
        """A follower's main loop: replays the leader's steps until it stops; returns how many ran."""
        if self.follower is None:
            raise ConfigError("serve_follower: this process is not a follower (process id 0 or one process)")
        return self.follower.serve(self.runner.replay, self.runner.replay_call)

    def close(self) -> None:
        """Leaves the process group: a leader stops its followers, a follower's leader sees it go."""
        if self.leader is not None:
            self.leader.stop()
        if self.follower is not None:
            self.follower.close()

    def _kv_tiers(self, checkpoint: ResolvedCheckpoint) -> TieredPages | None:
        """L2/L3 for evicted prefix pages, from `kv_host_pages` and `kv_store` (None when both are off)."""
        cfg, m = self.config, self.model_config
        if not cfg.kv_host_pages and not cfg.kv_store:
            return None
        store = None
        if cfg.kv_store:
            # The files' content, not their name or place: the same checkpoint anywhere shares pages.
            stored_dtype, stored_width = self.runner.model.kv_layout.stored_page(self.dtype)  # int8 KV: + scales
            identity = ModelIdentity(fingerprint(checkpoint.path), stored_dtype, cfg.page_size, m.num_layers,
                                     m.num_kv_heads, stored_width)
            store = PageStore(cfg.kv_store, identity, cfg.kv_store_ttl_seconds, cfg.kv_store_max_bytes,
                              cfg.kv_store_timeout_seconds)
        return TieredPages(HostTier(cfg.kv_host_pages) if cfg.kv_host_pages else None, store,
                           cfg.kv_store_sweep_seconds)

    def load_adapter(self, name: str, source: str = "") -> AdapterInfo:
        """Loads a LoRA adapter (a registry name or folder; default: `name`) for requests to name."""
        return self.engine.load_adapter(name, source)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.engine.list_adapters()

    def encode(self, prompt: Prompt, report: GuardReport | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt: must not be empty")
            return self.tokenizer.encode_prompt(prompt, report)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list):
            return self.tokenizer.encode_parts(prompt, report)
        raise RequestError("prompt: must be a string, a list of token ids, or a list of parts")

    def request(self, prompt: Prompt, params: SamplingParams, request_id: str = "") -> Request:
        """Encodes one prompt (guarded) into an engine request."""
        report = GuardReport()
        return Request(self.encode(prompt, report), params, request_id, report.downgraded)

    def chat_request(self, messages: list[dict[str, Any]], params: SamplingParams, request_id: str = "") -> Request:
        report = GuardReport()
        return Request(self.tokenizer.encode_chat(messages, report=report), params, request_id, report.downgraded)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_finish: Callable[[RequestOutput], None] | None = None,
        adapter: str | Sequence[str] = "",
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`: a list of prompts, or one prompt (a string, token ids, or
        parts such as ["Hi", {"special": "<|im_end|>"}]). A list of strings is several prompts.
        `adapter`: a loaded LoRA adapter's name for all prompts, or one per prompt ("": none)."""
        single = isinstance(prompts, list) and any(isinstance(p, int | dict) for p in prompts)
        if isinstance(prompts, str) or single:
            prompts = [prompts]
        per_request = self._per_request(params, len(prompts))
        adapters = self._per_request_adapter(adapter, len(prompts))
        requests = [dataclasses.replace(self.request(p, sp, str(i)), adapter=name)
                    for i, (p, sp, name) in enumerate(zip(prompts, per_request, adapters, strict=True))]
        return self.engine.generate(requests, on_finish)

    def generate_chat(
        self,
        conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_finish: Callable[[RequestOutput], None] | None = None,
        adapter: str | Sequence[str] = "",
    ) -> list[RequestOutput]:
        """Applies the model's chat template (with a generation prompt) to each conversation."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        per_request = self._per_request(params, len(conversations))
        adapters = self._per_request_adapter(adapter, len(conversations))
        requests = [dataclasses.replace(self.chat_request(list(c), sp, str(i)), adapter=name)
                    for i, (c, sp, name) in enumerate(zip(conversations, per_request, adapters, strict=True))]
        return self.engine.generate(requests, on_finish)

    @staticmethod
    def _per_request_adapter(adapter: str | Sequence[str], n: int) -> list[str]:
        if isinstance(adapter, str):
            return [adapter] * n
        adapters = list(adapter)
        if len(adapters) != n or not all(isinstance(a, str) for a in adapters):
            raise RequestError(f"adapter: {len(adapters)} adapter names for {n} prompts")
        return adapters

    @staticmethod
    def _per_request(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise RequestError(f"params: {len(params)} sampling params for {n} prompts")
        return params
