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
from jaxinfer.engine.guide_loads import GuideLoads
from jaxinfer.engine.guide_tables import GuideTables, constrain
from jaxinfer.engine.logit_bias import add_bias
from jaxinfer.engine.page_copies import PageCopies, export_all_layers, import_all_layers
from jaxinfer.engine.params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from jaxinfer.engine.penalties import count_sampled, load_row, penalize
from jaxinfer.engine.prompt_logprobs import score_prompt
from jaxinfer.engine.sampler import MAX_BANNED, sample, top_logprobs
from jaxinfer.engine.step_inputs import HostBatch, PackedInputs, StepResult
from jaxinfer.errors import CompileAfterWarmupError, RequestError
from jaxinfer.kv.prefix_cache import PrefixCachingPool
from jaxinfer.kv.tiers import TieredPages
from jaxinfer.models import CausalLM
from jaxinfer.parallel.lockstep import Leader
from jaxinfer.parallel.transfer import to_devices
from jaxinfer.processor.unit import ExecUnit
from jaxinfer.weights.adapter_file import AdapterWeights

log = logging.getLogger(__name__)


def _step(graphdef, state, caches, counts: jax.Array, prev_tokens: jax.Array, packed: PackedInputs,
          guides: GuideTables, machine=None, code=None, *, cache_shardings, counts_sharding, exec_fn=None):
    inputs = packed.unpack()
    model = nnx.merge(graphdef, state)
    ids = jnp.where(inputs.from_prev >= 0, prev_tokens[jnp.maximum(inputs.from_prev, 0)], inputs.tokens)
    hidden, caches = model(ids, caches, inputs.meta, inputs.adapters)
    caches = keep_shardings(caches, cache_shardings)
    logits = model.logits(hidden[inputs.logits_rows], inputs.adapters[inputs.logits_rows])
    # The bias, the penalties, the guided mask, then the sampler's filters; the logprobs stay the raw model's.
    adjusted = constrain(penalize(add_bias(logits, inputs.bias), counts, inputs.penalties), guides, inputs.guide,
                         prev_tokens)
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


class ModelRunner(PageCopies, GuideLoads):
    """The device side of an engine: weights, KV pools, penalty counts, adapters, and each bucket's
    compiled step; `dispatch` enqueues a step, the page copies for the KV tiers are `PageCopies`',
    the guided-output tables' loads `GuideLoads`'."""

    def __init__(self, model: CausalLM, model_cfg: ModelConfig, cfg: EngineConfig, mesh: Mesh):
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
                               donate_argnums=(2, 3, 7) if exec_fn is not None else (2, 3))
        self._init_guides()
        self._export_pages = functools.partial(export_all_layers, model.kv_layout)
        self._export_fn = jax.jit(self._export_pages)
        self._import_fn = jax.jit(functools.partial(import_all_layers, model.kv_layout), donate_argnums=(0,),
                                  out_shardings=self.cache_shardings)
        self._import_rows_fn = None  # set by `warmup_tiers` where the platform has pinned host memory
        # Lower KV tiers for pages the pool evicts. Evicted pages are copied out before the next
        # step of any engine on this runner is dispatched, so no step can overwrite them first.
        self.tiers: TieredPages | None = None
        self._exports: list[tuple[list[bytes], list[jax.Array]]] = []
        self._executables: dict[int, jax.stages.Compiled] = {}
        self.warmed_up = False
        self.compiles_after_warmup = 0
        self._device_bytes: dict[str, int] | None = None
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
        elif method == "load_guide":
            self._install_guide(fields["slot"], fields["base"], fields["states"], arrays)
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

    def device_bytes(self) -> dict[str, int]:
        """`weight_bytes`: the model's parameters as stored on the devices (packed projections at their
        packed size); `kv_pool_bytes`: the KV page pools. Both from the arrays' global sizes, counted
        once: neither changes after the runner is built (adapter slots are not parameters)."""
        if self._device_bytes is None:
            weights = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(self.model, nnx.Param)))
            pools = sum(leaf.nbytes for leaf in jax.tree.leaves(self.caches))
            self._device_bytes = {"weight_bytes": weights, "kv_pool_bytes": pools}
        return self._device_bytes

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
            guide_state=np.full(rows, -1, np.int32),
            guide_grammar=np.zeros(rows, np.int32),
            guide_prev=np.full(rows, -1, np.int32),
            guide_mask_row=np.full(rows, -1, np.int32),
            guide_bitmask=np.zeros(self.bitmask_shape, np.int32),
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
            self.guide_tables, *self._exec_args()
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
        if not self.warmed_up and self.cfg.guided_grammars and not self.guide_slots.loaded:  # the grammar loader
            self._install_guide(0, 0, 0, self._empty_guide_blocks())
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
        outputs = executable(self.state, self.caches, self.penalty_counts, prev_tokens, inputs, self.guide_tables,
                             *self._exec_args())
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

    def run(self, batch: HostBatch) -> tuple[np.ndarray, np.ndarray]:
        """Runs one step and waits for it: (sampled token per row, its logprob)."""
        return self.dispatch(batch).fetch()
