"""The jitted step: model forward over a ragged batch, KV write, sampling; compiled per bucket.

`ModelRunner` owns the device state (weights, per-layer KV page pools) and one ahead-of-time
compiled executable per token-count bucket. A batch of T tokens is padded to the smallest bucket
>= T; the number of sequence rows is tied to it (`rows = min(bucket, max_seqs)`), so the set of
shapes, and so of compiles, is exactly the configured buckets. Calling an executable with any
other shape is impossible by construction; a bucket that warm-up did not compile is compiled on
first use and counted, and the compile guard turns that into an error where required.

Overlapped scheduling: a token whose id the host does not know yet (sampled by the step still in
flight) is sent as an index into that step's output (`from_prev`), which stays on the device and
is passed to the next step. The sampled ids are always padded to `max_seqs`, so this input has
one shape for every bucket; engines sharing a runner each pass their own previous step.
`dispatch` returns at once with a `StepResult` whose copy to the host is already under way.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.adapters import AdapterInfo, AdapterSlots, ReadAdapter
from jaxinfer.engine.logit_bias import BiasInputs, add_bias
from jaxinfer.engine.params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from jaxinfer.engine.penalties import PenaltyInputs, count_sampled, load_row, penalize
from jaxinfer.engine.prompt_logprobs import PromptScoring, score_prompt
from jaxinfer.engine.sampler import MAX_BANNED, SamplingInputs, sample, top_logprobs
from jaxinfer.errors import CompileAfterWarmupError, RequestError
from jaxinfer.kv.prefix_cache import PrefixCachingPool
from jaxinfer.kv.tiers import HostPage, TieredPages
from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.layers.kv_layout import KVLayout
from jaxinfer.models import LlamaForCausalLM
from jaxinfer.parallel.lockstep import Leader
from jaxinfer.parallel.transfer import to_devices
from jaxinfer.processor.unit import ExecReport, ExecUnit
from jaxinfer.weights.adapter_file import AdapterWeights

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    tokens: jax.Array  # [T] int32
    from_prev: jax.Array  # [T] int32: row of the previous step's sampled ids to use instead (-1: use `tokens`)
    meta: AttentionMetadata
    logits_rows: jax.Array  # [S] int32: index in `tokens` of each row's last token
    sampling: SamplingInputs
    bias: BiasInputs
    penalties: PenaltyInputs
    top_logprobs: jax.Array  # [S] int32: how many alternatives the row wants (0: none)
    adapters: jax.Array  # [T] int32: each token's LoRA adapter slot (0: none)
    prompt: PromptScoring  # the prompt positions to score (engine/prompt_logprobs.py)


@dataclasses.dataclass
class HostBatch:
    """The numpy arrays of one step, already padded to a bucket (see `ModelRunner.empty_batch`)."""

    tokens: np.ndarray
    from_prev: np.ndarray
    positions: np.ndarray
    seq_rows: np.ndarray
    write_slots: np.ndarray
    page_table: np.ndarray
    logits_rows: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    step: np.ndarray
    banned: np.ndarray
    bias_ids: np.ndarray
    bias_values: np.ndarray
    penalty_slot: np.ndarray
    repetition_penalty: np.ndarray
    frequency_penalty: np.ndarray
    presence_penalty: np.ndarray
    top_logprobs: np.ndarray
    adapters: np.ndarray
    prompt_targets: np.ndarray
    prompt_alternatives: np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def arrays(self) -> dict[str, np.ndarray]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def to_inputs(self) -> StepInputs:
        meta = AttentionMetadata(self.positions, self.seq_rows, self.page_table, self.write_slots)
        sampling = SamplingInputs(
            self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.step, self.banned
        )
        penalties = PenaltyInputs(self.penalty_slot, self.repetition_penalty, self.frequency_penalty,
                                  self.presence_penalty)
        return StepInputs(self.tokens, self.from_prev, meta, self.logits_rows, sampling,
                          BiasInputs(self.bias_ids, self.bias_values), penalties, self.top_logprobs, self.adapters,
                          PromptScoring(self.prompt_targets, self.prompt_alternatives))

    def packed(self) -> PackedInputs:
        """The arrays as one int32 buffer: one host-to-device copy per step instead of one per array."""
        arrays = self.arrays()
        layout = tuple((name, a.shape, a.dtype.str) for name, a in arrays.items())
        return PackedInputs(np.concatenate([a.reshape(-1).view(np.int32) for a in arrays.values()]), layout)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["words"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class PackedInputs:
    """A `HostBatch` in one int32 buffer (every field is 4 bytes wide), unpacked inside the step.

    The layout (each field's name, shape and dtype, in order) is static, so each bucket's layout is
    part of its compiled executable."""

    words: jax.Array | np.ndarray
    layout: tuple[tuple[str, tuple[int, ...], str], ...]

    def unpack(self) -> StepInputs:
        arrays, offset = {}, 0
        for name, shape, dtype in self.layout:
            size = int(np.prod(shape))
            part = self.words[offset : offset + size]
            if np.dtype(dtype) != np.int32:
                part = jax.lax.bitcast_convert_type(part, np.dtype(dtype))
            arrays[name] = part.reshape(shape)
            offset += size
        return HostBatch(**arrays).to_inputs()


@dataclasses.dataclass
class StepResult:
    """One dispatched step: its sampled ids and logprobs stay on the device until `fetch`."""

    tokens: jax.Array  # [max_seqs] int32
    logprobs: jax.Array  # [max_seqs] float32
    rows: int
    top: tuple[jax.Array, jax.Array] | None = None  # [max_seqs, MAX_TOP_LOGPROBS] ids, logprobs (rows asked)
    # Scored prompt positions (some asked): [T] target logprobs, [T, MAX_TOP_LOGPROBS] ids and logprobs.
    prompt: tuple[jax.Array, jax.Array, jax.Array] | None = None
    _top_host: tuple[np.ndarray, np.ndarray] | None = dataclasses.field(default=None, init=False, repr=False)
    _prompt_host: tuple[np.ndarray, ...] | None = dataclasses.field(default=None, init=False, repr=False)
    exec_report: ExecReport | None = None  # the processor's slots after this step (when it has any)
    number: int = -1  # dispatch order on its runner (followers of a process group replay by it)

    def fetch_exec(self) -> ExecReport | None:
        return None if self.exec_report is None else ExecReport(*jax.device_get(tuple(self.exec_report)))

    def fetch(self) -> tuple[np.ndarray, np.ndarray]:
        """Waits for the step and returns (sampled token per row, its logprob) on the host; the
        alternatives and prompt scores, when asked for, come in the same read (`fetch_top`, `fetch_prompt`)."""
        # explicit: the transfer guard allows it
        tokens, logprobs, top, prompt = jax.device_get((self.tokens, self.logprobs, self.top, self.prompt))
        self._top_host = None if top is None else (top[0][: self.rows], top[1][: self.rows])
        self._prompt_host = prompt
        return tokens[: self.rows], logprobs[: self.rows]

    def fetch_top(self) -> tuple[np.ndarray, np.ndarray] | None:
        """After `fetch`: each row's alternatives ([rows, MAX_TOP_LOGPROBS] ids and logprobs), if asked for."""
        return self._top_host

    def fetch_prompt(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """After `fetch`: the scored prompt positions ([T] logprobs, [T, MAX_TOP_LOGPROBS] ids and logprobs)."""
        return self._prompt_host


def _step(graphdef, state, caches, counts: jax.Array, prev_tokens: jax.Array, packed: PackedInputs, machine=None,
          code=None, *, cache_shardings, counts_sharding, exec_fn=None):
    inputs = packed.unpack()
    model = nnx.merge(graphdef, state)
    ids = jnp.where(inputs.from_prev >= 0, prev_tokens[jnp.maximum(inputs.from_prev, 0)], inputs.tokens)
    hidden, caches = model(ids, caches, inputs.meta, inputs.adapters)
    caches = keep_shardings(caches, cache_shardings)
    logits = model.logits(hidden[inputs.logits_rows], inputs.adapters[inputs.logits_rows])
    # The bias, then the penalties, then the sampler's filters (vLLM's order); the logprobs stay the raw model's.
    adjusted = penalize(add_bias(logits, inputs.bias), counts, inputs.penalties)
    tokens, logprobs = sample(logits, inputs.sampling, adjusted)
    counts = jax.lax.with_sharding_constraint(count_sampled(counts, inputs.penalties.slot, tokens), counts_sharding)
    pad = (0, prev_tokens.shape[0] - tokens.shape[0])
    alternatives = min(MAX_TOP_LOGPROBS, logits.shape[-1])  # a tiny test vocabulary has fewer ids
    top_ids, top_values = (jnp.pad(a, (pad, (0, 0))) for a in top_logprobs(logits, inputs.top_logprobs, alternatives))
    prompt = score_prompt(model.logits, hidden, inputs.adapters, inputs.prompt, alternatives)
    outputs = (caches, counts, jnp.pad(tokens, pad), jnp.pad(logprobs, pad), top_ids, top_values, *prompt)
    if exec_fn is None:
        return outputs
    machine, exec_report = exec_fn(machine, code)  # the processor's slots advance in the same step
    return *outputs, machine, exec_report


def keep_shardings(caches, shardings):
    """The caches with the shardings they came in with. Left to propagation, XLA may return them split
    another way (a single kv head on a 4-way model axis came back split on head_dim), and the next
    step, compiled for the first sharding, would refuse them."""
    return jax.lax.with_sharding_constraint(caches, shardings)


TIER_CHUNK = 8  # pages per export/import call: one shape, so one compile each


def _export(layout: KVLayout, caches, pages: jax.Array) -> jax.Array:
    """Pages of every layer -> [pages, layers, 2, kv_heads, page_size, head_dim] (the layouts' neutral form)."""
    return jnp.stack([layout.export(c, pages) for c in caches], axis=1)


def _import(layout: KVLayout, caches, pages: jax.Array, data: jax.Array):
    """Writes [pages, layers, 2, kv_heads, page_size, head_dim] into the caches (padding rows hit page 0)."""
    return tuple(layout.import_pages(c, pages, data[:, i]) for i, c in enumerate(caches))


def _import_rows(layout: KVLayout, device_sharding, caches, group: jax.Array, rows: jax.Array, pages: jax.Array):
    """Writes rows of a host group (pinned host memory) into device pages: one host-to-device copy."""
    return _import(layout, caches, pages, jax.device_put(group, device_sharding)[rows])


def host_pages(groups: list[jax.Array]) -> list[HostPage]:
    """The pages of `export_pages`' groups, in order (padding rows included), as host pages.

    Without pinned host memory the copies are device arrays: they become numpy copies here."""
    groups = [g if g.sharding.memory_kind == "pinned_host" else jax.device_get(g) for g in groups]
    return [HostPage(group, row) for group in groups for row in range(TIER_CHUNK)]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_cfg: ModelConfig, cfg: EngineConfig, mesh: Mesh):
        self.model_cfg, self.cfg, self.mesh = model_cfg, cfg, mesh
        self.model = model
        self.adapters = (AdapterSlots(model, mesh, cfg.max_adapters, cfg.max_lora_rank, cfg.lora_targets)
                         if cfg.max_adapters else None)
        self.graphdef, self.state = nnx.split(model)
        self.max_pages_per_seq = cfg.max_pages_per_seq(model_cfg)
        self.caches = model.empty_caches(cfg.num_pages, cfg.page_size, mesh)
        # The host's record of the device pages: one per KV pool, shared by every engine on it.
        self.pool = PrefixCachingPool(cfg.num_pages)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.no_tokens = to_devices(np.zeros(cfg.max_seqs, np.int32), self.replicated)
        self.no_logprobs = to_devices(np.zeros(cfg.max_seqs, np.float32), self.replicated)
        # Token counts of the sequences that use penalties (engine/penalties.py), a row per slot. With no
        # slots a 1 x 1 stand-in keeps the step's signature: every row's slot is -1, nothing is read.
        slots = cfg.penalty_slots
        shape = (slots, model_cfg.vocab_size) if slots else (1, 1)
        self.penalty_counts = jax.jit(lambda: jnp.zeros(shape, jnp.int32), out_shardings=self.replicated)()
        self.free_penalty_slots = list(range(slots - 1, -1, -1))
        self._load_penalties_fn = jax.jit(load_row, donate_argnums=(0,), out_shardings=self.replicated)
        exec_steps = cfg.exec_steps_on(mesh.devices.flat[0].platform)
        self.exec_unit = (ExecUnit(cfg.exec_machine_shape, exec_steps, self.replicated)
                          if cfg.exec_slots else None)
        if self.exec_unit is not None:  # its slot loads, resumes and stops reach followers like adapter loads
            self.exec_unit.replicate = self._replicated
        exec_fn = self.exec_unit.step_function if self.exec_unit is not None else None
        self.cache_shardings = jax.tree.map(lambda x: x.sharding, self.caches)
        self._jitted = jax.jit(functools.partial(_step, cache_shardings=self.cache_shardings,
                                                 counts_sharding=self.replicated, exec_fn=exec_fn),
                               static_argnums=0,
                               donate_argnums=(2, 3, 6) if exec_fn is not None else (2, 3))
        self._export_pages = functools.partial(_export, model.kv_layout)
        self._export_fn = jax.jit(self._export_pages)
        self._import_fn = jax.jit(functools.partial(_import, model.kv_layout), donate_argnums=(0,),
                                  out_shardings=self.cache_shardings)
        self._import_rows_fn = None  # set by `warmup_tiers` where the platform has pinned host memory
        # Lower KV tiers for pages the pool evicts. Evicted pages are copied out before the next
        # step of any engine on this runner is dispatched, so no step can overwrite them first.
        self.tiers: TieredPages | None = None
        self._exports: list[tuple[list[bytes], list[jax.Array]]] = []
        self._executables: dict[int, jax.stages.Compiled] = {}
        self.warmed_up = False
        self.compiles_after_warmup = 0
        self.warmup_seconds = 0.0
        self.spec = None  # a SpecRunner (engine/spec_step.py) when a draft model is attached
        self.lockstep: Leader | None = None  # multi-host: sends each step to the followers before dispatching it
        self._dispatched = 0

    # -- device state -----------------------------------------------------------------------
    # -- LoRA adapters -------------------------------------------------------------------------
    def load_adapter(self, name: str, source: str = "", read: ReadAdapter | None = None) -> AdapterInfo:
        """Loads an adapter into a free slot (engine.max_adapters > 0); the step is not recompiled.

        In a process group the leader reads and checks it, then sends the checked tensors: followers
        write the same slot without reading any file."""
        name, slot, path, weights = self._adapter_slots().prepare(name, source, read)
        fields, arrays = weights.to_arrays()
        return self._replicated(lambda: self.install_adapter(name, slot, path, weights), "load_adapter",
                                {"name": name, "slot": slot, "path": str(path), "weights": fields}, arrays)

    def install_adapter(self, name: str, slot: int, path: Path, weights: AdapterWeights) -> AdapterInfo:
        info = self._adapter_slots().install(name, slot, path, weights)
        self._refresh_state()
        return info

    def unload_adapter(self, name: str) -> None:
        self._adapter_slots().check_unload(name)  # refused on the leader before anything is sent
        self._replicated(lambda: self._unload(name), "unload_adapter", {"name": name})

    def _unload(self, name: str) -> None:
        self._adapter_slots().unload(name)
        self._refresh_state()

    def _replicated(self, apply, method: str, fields: dict, arrays: dict[str, np.ndarray] | None = None):
        """Runs `apply` (device work outside the step) after sending it to the followers, if any."""
        return self._sent_then(lambda leader: leader.call(method, fields, arrays or {}), apply)

    def _sent_then(self, send: Callable[[Leader], None], apply):
        """In a process group's leader: `send` the work to the followers, then `apply` it here. A leader
        that fails after sending ends the group (its collectives would no longer pair up)."""
        if self.lockstep is None:
            return apply()
        send(self.lockstep)
        try:
            return apply()
        except BaseException as error:
            self.lockstep.diverged(error)
            raise

    def replay_call(self, method: str, fields: dict, arrays: dict[str, np.ndarray]) -> None:
        """A follower's copy of device work the leader did outside the step (adapter loads and unloads,
        the processor's slot loads, resumes, stops and machine-only steps)."""
        if method == "load_adapter":
            weights = AdapterWeights.from_arrays(fields["weights"], arrays)
            self.install_adapter(fields["name"], fields["slot"], Path(fields["path"]), weights)
        elif method == "unload_adapter":
            self._unload(fields["name"])
        elif method == "load_penalties":
            self._load_penalties(fields["slot"], arrays["ids"], fields["num_prompt"])
        elif method.startswith("exec_") and self.exec_unit is not None:
            self.exec_unit.apply_call(method, fields, arrays)
        else:
            raise ValueError(f"control channel: unknown call {method!r}")

    # -- penalty counts ------------------------------------------------------------------------
    def acquire_penalty_slot(self) -> int | None:
        return self.free_penalty_slots.pop() if self.free_penalty_slots else None

    @property
    def penalty_slots_in_use(self) -> int:
        return self.cfg.penalty_slots - len(self.free_penalty_slots)

    def release_penalty_slot(self, slot: int) -> None:
        self.free_penalty_slots.append(slot)

    def load_penalties(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Sets a slot's counts to those of a sequence's ids (before the first step that samples it)."""
        ids = self._penalty_ids(prompt_ids + output_ids)
        self._replicated(lambda: self._load_penalties(slot, ids, len(prompt_ids)), "load_penalties",
                         {"slot": slot, "num_prompt": len(prompt_ids)}, {"ids": ids})

    def _penalty_ids(self, ids: list[int]) -> np.ndarray:
        """A sequence's ids padded with -1 to the loader's one shape (max_model_len rounded up to pages)."""
        padded = np.full(self.max_pages_per_seq * self.cfg.page_size, -1, np.int32)
        padded[: len(ids)] = ids
        return padded

    def _load_penalties(self, slot: int, ids: np.ndarray, num_prompt: int) -> None:
        scalars = to_devices((np.int32(slot), np.int32(num_prompt)), self.replicated)
        self.penalty_counts = self._load_penalties_fn(self.penalty_counts, scalars[0], to_devices(ids, self.replicated),
                                                      scalars[1])

    def _adapter_slots(self) -> AdapterSlots:
        if self.adapters is None:
            raise RequestError("adapters: this engine serves no LoRA adapters (engine.max_adapters is 0)")
        return self.adapters

    def _refresh_state(self) -> None:
        """The state the step reads: same tree and shapes, new adapter slot contents."""
        graphdef, self.state = nnx.split(self.model)
        assert graphdef == self.graphdef, "an adapter load must not change the model's structure"

    # -- buckets ---------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int:
        for bucket in self.cfg.token_buckets:
            if bucket >= num_tokens:
                return bucket
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.cfg.token_buckets[-1]}")

    def rows_for(self, bucket: int) -> int:
        return min(bucket, self.cfg.max_seqs)

    def empty_batch(self, bucket: int) -> HostBatch:
        """All-padding batch: tokens write to the null page and rows are greedy."""
        rows = self.rows_for(bucket)
        zeros_t = np.zeros(bucket, np.int32)
        return HostBatch(
            tokens=zeros_t.copy(),
            from_prev=np.full(bucket, -1, np.int32),
            positions=zeros_t.copy(),
            seq_rows=zeros_t.copy(),
            write_slots=zeros_t.copy(),
            page_table=np.zeros((rows, self.max_pages_per_seq), np.int32),
            logits_rows=np.zeros(rows, np.int32),
            temperature=np.zeros(rows, np.float32),
            top_k=np.zeros(rows, np.int32),
            top_p=np.ones(rows, np.float32),
            min_p=np.zeros(rows, np.float32),
            seed=np.zeros(rows, np.uint32),
            step=np.zeros(rows, np.int32),
            banned=np.full((rows, MAX_BANNED), -1, np.int32),
            bias_ids=np.full((rows, MAX_LOGIT_BIAS), -1, np.int32),
            bias_values=np.zeros((rows, MAX_LOGIT_BIAS), np.float32),
            penalty_slot=np.full(rows, -1, np.int32),
            repetition_penalty=np.ones(rows, np.float32),
            frequency_penalty=np.zeros(rows, np.float32),
            presence_penalty=np.zeros(rows, np.float32),
            top_logprobs=np.zeros(rows, np.int32),
            adapters=zeros_t.copy(),
            prompt_targets=np.full(bucket, -1, np.int32),
            prompt_alternatives=zeros_t.copy(),
        )

    # -- compile ---------------------------------------------------------------------------
    def abstract_inputs(self, bucket: int) -> PackedInputs:
        """The step's input for a bucket, as the compiler sees it (`HostBatch.packed`)."""
        packed = self.empty_batch(bucket).packed()
        return PackedInputs(jax.ShapeDtypeStruct(packed.words.shape, np.int32, sharding=self.replicated),
                            packed.layout)

    def _compile(self, bucket: int) -> jax.stages.Compiled:
        start = time.perf_counter()
        lowered = self._jitted.lower(
            self.graphdef, self.state, self.caches, self.penalty_counts, self.no_tokens, self.abstract_inputs(bucket),
            *self._exec_args()
        )
        executable = lowered.compile()
        log.info("compiled step for %d tokens in %.1fs", bucket, time.perf_counter() - start)
        return executable

    def warmup(self) -> float:
        """Compiles every bucket's step (with a draft model: its verify and propose steps instead)."""
        start = time.perf_counter()
        if self.exec_unit is not None:
            self.exec_unit.warmup()
        if not self.warmed_up and self.cfg.penalty_slots:  # compiles the count loader (slot 0 is free now)
            self._load_penalties(0, self._penalty_ids([]), 0)
        if self.spec is not None:
            self.spec.warmup()
        else:
            for bucket in self.cfg.token_buckets:
                if bucket not in self._executables:
                    self._executables[bucket] = self._compile(bucket)
        self.warmed_up = True
        self.warmup_seconds = time.perf_counter() - start
        return self.warmup_seconds

    def _executable(self, bucket: int) -> jax.stages.Compiled:
        return self.executable_from(self._executables, bucket, self._compile, "step")

    def executable_from(self, cache: dict[int, jax.stages.Compiled], bucket: int, compile_fn, what: str
                        ) -> jax.stages.Compiled:
        """The bucket's executable from `cache`, compiled on a miss (counted and guarded after warm-up)."""
        executable = cache.get(bucket)
        if executable is not None:
            return executable
        if self.warmed_up:
            self.compiles_after_warmup += 1
            message = f"{what} compiled after warm-up for a {bucket}-token bucket"
            if self.cfg.compile_guard == "raise":
                raise CompileAfterWarmupError(message)
            if self.cfg.compile_guard == "warn":
                log.warning(message)
        executable = cache[bucket] = compile_fn(bucket)
        return executable

    @property
    def num_compiles(self) -> int:
        return len(self._executables) + (self.spec.num_compiles if self.spec is not None else 0)

    # -- run -------------------------------------------------------------------------------
    def dispatch(self, batch: HostBatch, previous: StepResult | None = None) -> StepResult:
        """Enqueues one step and returns without waiting for it; `from_prev` indexes `previous`'s ids."""
        executable = self._executable(batch.num_tokens)
        self.copy_evicted_pages()
        number, self._dispatched = self._dispatched, self._dispatched + 1
        previous_number = previous.number if previous is not None else -1
        return self._sent_then(lambda leader: leader.step(number, previous_number, batch.arrays()),
                               lambda: self._launch(batch, previous, executable, number))

    def _launch(self, batch: HostBatch, previous: StepResult | None, executable: jax.stages.Compiled,
                number: int) -> StepResult:
        inputs = to_devices(batch.packed(), self.replicated)
        prev_tokens = previous.tokens if previous is not None else self.no_tokens
        outputs = executable(self.state, self.caches, self.penalty_counts, prev_tokens, inputs, *self._exec_args())
        self.caches, self.penalty_counts, tokens, logprobs, *top = outputs[:6]
        prompt = tuple(outputs[6:9]) if (batch.prompt_targets >= 0).any() else None  # else zeros: not copied
        exec_report = None
        if self.exec_unit is not None:
            self.exec_unit.state, exec_report = outputs[9:]
            for part in exec_report:
                part.copy_to_host_async()
        top = tuple(top) if batch.top_logprobs.any() else None
        for part in (tokens, logprobs, *(top or ()), *(prompt or ())):
            part.copy_to_host_async()
        return StepResult(tokens, logprobs, self.rows_for(batch.num_tokens), top, prompt, exec_report=exec_report,
                          number=number)

    def replay(self, arrays: dict[str, np.ndarray], previous: StepResult | None) -> StepResult:
        """A follower's copy of a step the leader dispatched (see parallel/lockstep.py)."""
        return self.dispatch(HostBatch(**arrays), previous)

    def dispatch_exec_only(self) -> StepResult:
        """A step of the processor alone (programs running, no tokens to compute): samples nothing."""
        exec_report = self.exec_unit.run_alone()
        for part in exec_report:
            part.copy_to_host_async()
        return StepResult(self.no_tokens, self.no_logprobs, 0, exec_report=exec_report)

    def _exec_args(self) -> tuple:
        """The processor's machine state and code, when the step carries them."""
        return () if self.exec_unit is None else (self.exec_unit.state, self.exec_unit.code)

    # -- KV tiers: copy whole pages out of and into the pools --------------------------------
    def warmup_tiers(self) -> None:
        """Compiles the page copy programs now rather than on the first eviction or restore.

        Where every device has pinned host memory, the copy out writes into it directly (so L2
        holds pinned buffers) and the copy back reads from it.
        """
        start = time.perf_counter()
        if self._import_rows_fn is None and self._has_pinned_host():
            probe = self._export_fn(self.caches, to_devices(np.zeros(TIER_CHUNK, np.int32), self.replicated))
            device = probe.sharding
            self._export_fn = jax.jit(self._export_pages, out_shardings=device.with_memory_kind("pinned_host"))
            self._import_rows_fn = jax.jit(functools.partial(_import_rows, self.model.kv_layout, device),
                                           donate_argnums=(0,), out_shardings=self.cache_shardings)
        if self.spec is not None:  # restored pages lack the draft's KV: it is computed on restore
            self.spec.warmup_refill()
        for group in self.export_pages([0]):  # the null page: reading and rewriting it is harmless
            self.import_pages([(0, HostPage(group, 0))])
            self.import_pages([(0, np.zeros(group.shape[1:], group.dtype))])
        log.info("compiled the KV tier page copies in %.1fs (L2 in %s memory)", time.perf_counter() - start,
                 "pinned host" if self._import_rows_fn else "pageable host")

    def _has_pinned_host(self) -> bool:
        return all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in self.mesh.devices.flat)

    def copy_evicted_pages(self) -> None:
        """Enqueues copies of the pages the pool evicted since the last call (their content is intact)."""
        evicted = self.pool.take_evicted()
        if evicted and self.tiers is not None:
            self._exports.append(([key for _, key in evicted], self.export_pages([page for page, _ in evicted])))

    def demote_copied_pages(self) -> None:
        """Hands the copied pages to the lower tiers (L2 keeps the host groups; L3 waits for their bytes)."""
        exports, self._exports = self._exports, []
        for keys, groups in exports:
            for key, page in zip(keys, host_pages(groups), strict=False):  # padding rows have no key
                self.tiers.demote(key, page)

    def export_pages(self, pages: list[int]) -> list[jax.Array]:
        """Enqueues copies of `pages` (in TIER_CHUNK groups, padded with page 0); host copies start at once.

        Enqueued before the next step, they read the pages before that step can overwrite them.
        """
        chunks = []
        for i in range(0, len(pages), TIER_CHUNK):
            group = np.zeros(TIER_CHUNK, np.int32)
            group[: len(pages[i : i + TIER_CHUNK])] = pages[i : i + TIER_CHUNK]
            out = self._export_fn(self.caches, to_devices(group, self.replicated))
            if out.sharding.memory_kind != "pinned_host":
                out.copy_to_host_async()
            chunks.append(out)
        return chunks

    def import_pages(self, entries: list[tuple[int, HostPage | np.ndarray]]) -> None:
        """Writes host pages (`HostPage`s, or numpy [layers, 2, kv_heads, page_size, head_dim]) into device pages."""
        by_group: dict[int, list[tuple[int, HostPage]]] = {}
        arrays = []
        for page, data in entries:
            if isinstance(data, HostPage) and self._import_rows_fn is not None:
                by_group.setdefault(id(data.group), []).append((page, data))
            else:
                arrays.append((page, data.numpy() if isinstance(data, HostPage) else data))
        for rows in by_group.values():
            self._import_group(rows)
        if arrays:
            self._import_arrays([page for page, _ in arrays], np.stack([data for _, data in arrays]))

    def _import_group(self, rows: list[tuple[int, HostPage]]) -> None:
        pages, picks = np.zeros(TIER_CHUNK, np.int32), np.zeros(TIER_CHUNK, np.int32)
        pages[: len(rows)] = [page for page, _ in rows]  # padding writes row 0 into the null page
        picks[: len(rows)] = [data.row for _, data in rows]
        self.caches = self._import_rows_fn(self.caches, rows[0][1].group, to_devices(picks, self.replicated),
                                           to_devices(pages, self.replicated))

    def _import_arrays(self, pages: list[int], data: np.ndarray) -> None:
        for i in range(0, len(pages), TIER_CHUNK):
            group = np.zeros(TIER_CHUNK, np.int32)
            rows = data[i : i + TIER_CHUNK]
            group[: len(rows)] = pages[i : i + TIER_CHUNK]
            padded = np.zeros((TIER_CHUNK, *data.shape[1:]), data.dtype)
            padded[: len(rows)] = rows
            self.caches = self._import_fn(self.caches, to_devices(group, self.replicated),
                                          to_devices(padded, self.replicated))

    def run(self, batch: HostBatch) -> tuple[np.ndarray, np.ndarray]:
        """Runs one step and waits for it: (sampled token per row, its logprob)."""
        return self.dispatch(batch).fetch()
