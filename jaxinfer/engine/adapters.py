"""Resident LoRA adapters: which adapter holds which slot of the step's stacks, loads and unloads.

The runner's model carries `engine.max_adapters + 1` slots in every adapted projection (slot 0 is
"no adapter"). Loading writes an adapter's matrices (zero-padded to `engine.max_lora_rank`) into a
free slot and unloading zeroes it; shapes never change, so neither recompiles the step. An
adapter in use by a queued or running request cannot be unloaded.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.errors import CheckpointError, ConfigError, RequestError
from jaxinfer.layers.basic import Linear
from jaxinfer.models import CausalLM
from jaxinfer.parallel import named_sharding
from jaxinfer.parallel.transfer import to_devices
from jaxinfer.weights.adapter_file import AdapterWeights, read_adapter
from jaxinfer.weights.registry import resolve_adapter

log = logging.getLogger(__name__)


@dataclass
class AdapterInfo:
    name: str
    path: str
    slot: int
    rank: int
    digest: str
    users: int = 0  # queued and running requests


class AdapterSlots:
    def __init__(self, model: CausalLM, mesh: jax.sharding.Mesh, max_adapters: int, max_rank: int,
                 targets: tuple[str, ...]) -> None:
        self.model, self.max_adapters, self.max_rank, self.targets = model, max_adapters, max_rank, targets

        def zeros(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> jax.Array:
            # jnp.zeros fills each device's shard in place: nothing is sent or compared across processes.
            return jnp.zeros(shape, model.dtype, device=named_sharding(shape, axes, mesh))

        model.add_lora_slots(max_adapters + 1, max_rank, targets, zeros)
        self.linears: dict[str, Linear] = model.adaptable_linears(targets)
        self.by_name: dict[str, AdapterInfo] = {}

    # -- requests ---------------------------------------------------------------------------
    def slot_of(self, name: str, field: str = "adapter") -> AdapterInfo:
        """The loaded adapter `name`; RequestError naming `field` (where the name came from) if none is."""
        info = self.by_name.get(name)
        if info is None:
            loaded = ", ".join(sorted(self.by_name)) or "(none)"
            raise RequestError(f"{field}: {name!r} is not loaded; loaded adapters: {loaded}")
        return info

    # -- load / unload ------------------------------------------------------------------------
    def load(self, name: str, source: str | os.PathLike = "", read: ReadAdapter | None = None) -> AdapterInfo:
        """Loads `source` (a registry name or folder; default: `name` itself) as `name` into a free slot;
        `read` is the adapter already read by `read_adapter_source` (off the engine thread)."""
        return self.install(*self.prepare(name, source, read))

    def prepare(self, name: str, source: str | os.PathLike = "", read: ReadAdapter | None = None
                ) -> tuple[str, int, Path, AdapterWeights]:
        """Reads and checks an adapter and picks its slot, touching no device array (RequestError or
        CheckpointError naming the problem): (name, slot, path, weights) for `install`."""
        if not name or len(name) > 128:
            raise RequestError("adapter name: 1 to 128 characters")
        if name in self.by_name:
            raise RequestError(f"adapter name: {name!r} is already loaded (unload it first)")
        free = sorted(set(range(1, self.max_adapters + 1)) - {i.slot for i in self.by_name.values()})
        if not free:
            raise RequestError(f"adapters: engine.max_adapters ({self.max_adapters}) adapters are loaded; "
                               f"unload one first")
        path, weights = read if read is not None else read_adapter_source(str(source or name))
        self._check(path, weights)
        return name, free[0], path, weights

    def install(self, name: str, slot: int, path: Path, weights: AdapterWeights) -> AdapterInfo:
        """Writes a prepared adapter into its slot."""
        self._write(slot, weights)
        info = self.by_name[name] = AdapterInfo(name, str(path), slot, weights.rank, weights.digest)
        log.info("loaded adapter %s (rank %d) from %s into slot %d", name, weights.rank, path, slot)
        return info

    def check_unload(self, name: str) -> AdapterInfo:
        """The adapter to unload; RequestError while requests use it."""
        info = self.slot_of(name)
        if info.users:
            raise RequestError(f"adapter: {name!r} is in use by {info.users} request(s); unload it when they end")
        return info

    def unload(self, name: str) -> None:
        info = self.check_unload(name)
        self._write(info.slot, None)
        del self.by_name[name]

    def list(self) -> list[AdapterInfo]:
        return sorted(self.by_name.values(), key=lambda i: i.slot)

    # -- device arrays ------------------------------------------------------------------------
    def _check(self, path: Path, weights: AdapterWeights) -> None:
        if weights.rank > self.max_rank:
            raise CheckpointError(f"{path}: rank {weights.rank} exceeds engine.max_lora_rank ({self.max_rank})")
        for module, (a, b) in weights.modules.items():
            linear = self.linears.get(module)
            if linear is None:
                raise CheckpointError(f"{path}: targets {module}, which this engine does not adapt (the model has "
                                      f"{len(self.model.model.layers)} layers; engine.lora_targets is "
                                      f"{', '.join(self.targets)})")
            shape = linear.shape
            if (a.shape[0], b.shape[1]) != shape:
                raise CheckpointError(f"{path}: {module} maps {a.shape[0]} -> {b.shape[1]}, the model's projection "
                                      f"{shape[0]} -> {shape[1]}")
        embed = self.model.model.embed_tokens
        if weights.token_ids:
            start, rows = embed.added_start, embed.added_rows
            count = 0 if rows is None else rows[...].shape[1]
            outside = [i for i in weights.token_ids if not start <= i < start + count]
            if outside:
                added = f"ids {start}..{start + count - 1}" if count else "none"
                raise CheckpointError(f"{path}: trainable_token_indices {outside} are not tokens added to this "
                                      f"model (added: {added}; the processor's control tokens are added with "
                                      f"engine.exec_slots > 0, and adapters may train them with tied embeddings)")
            if weights.token_rows.shape[1] != embed.dim:
                raise CheckpointError(f"{path}: trainable token rows have width {weights.token_rows.shape[1]}, "
                                      f"the embedding {embed.dim}")

    def _write(self, slot: int, weights: AdapterWeights | None) -> None:
        """Puts `weights` into `slot` of the stacks it targets (a free slot is all zeros), or with None
        zeroes the slot everywhere."""
        for module, linear in self.linears.items():
            if weights is not None and module not in weights.modules:
                continue
            fan_in, _, rank = linear.lora_a[...].shape
            a = np.zeros((fan_in, rank), np.float32)
            b = np.zeros(linear.lora_b[...].shape[1:], np.float32)
            if weights is not None:
                wa, wb = weights.modules[module]
                a[:, : wa.shape[1]], b[: wb.shape[0]] = wa, wb
            _set_slot(linear.lora_a, slot, a, axis=1)
            _set_slot(linear.lora_b, slot, b)
        embed = self.model.model.embed_tokens
        if embed.added_rows is not None:
            _set_token_rows(embed, slot, weights)


def _set_token_rows(embed: nnx.Module, slot: int, weights: AdapterWeights | None) -> None:
    """Slot `slot`'s added rows: the adapter's trained rows where it has them, the table's elsewhere
    (merged on the devices, so no process reads back a table that other processes hold parts of)."""
    added = embed.added_rows[...]
    count, width = added.shape[1:]
    trained, rows = np.zeros(count, bool), np.zeros((count, width), added.dtype)
    ids = weights.token_ids if weights is not None else ()
    for token, row in zip(ids, weights.token_rows if ids else (), strict=True):  # rows only with ids
        trained[token - embed.added_start], rows[token - embed.added_start] = True, row
    replicated = NamedSharding(added.sharding.mesh, PartitionSpec())
    sent = to_devices((np.int32(slot), trained, rows), replicated)
    base = embed.rows(embed.added_start, embed.vocab)
    embed.added_rows.set_value(_with_token_rows(added, base, *sent, added.sharding))


ReadAdapter = tuple[Path, AdapterWeights]


def read_adapter_source(source: str) -> ReadAdapter:
    """Resolves and reads an adapter (file I/O and hashing: callers may run it off the engine thread)."""
    path = resolve_adapter(source)
    return path, read_adapter(path)


def _set_slot(variable: nnx.Variable, slot: int, value: np.ndarray, axis: int = 0) -> None:
    array = variable[...]
    replicated = NamedSharding(array.sharding.mesh, PartitionSpec())
    sent_slot, sent_value = to_devices((np.int32(slot), value.astype(array.dtype)), replicated)
    variable.set_value(_with_slot(array, sent_slot, sent_value, axis, array.sharding))


@functools.partial(jax.jit, static_argnames=("axis", "sharding"))
def _with_slot(array: jax.Array, slot: jax.Array, value: jax.Array, axis: int, sharding: NamedSharding) -> jax.Array:
    """`array` with index `slot` of dimension `axis` replaced by `value`, kept in `sharding` (the array's)."""
    return jax.lax.with_sharding_constraint(jax.lax.dynamic_update_index_in_dim(array, value, slot, axis), sharding)


@functools.partial(jax.jit, static_argnames=("sharding",))
def _with_token_rows(added: jax.Array, base: jax.Array, slot: jax.Array, trained: jax.Array, rows: jax.Array,
                     sharding: NamedSharding) -> jax.Array:
    """`added` with slot `slot` set to `rows` where `trained`, else to the table's rows `base`."""
    return _with_slot(added, slot, jnp.where(trained[:, None], rows, base.astype(added.dtype)), 0, sharding)


def parse_adapter_spec(spec: str) -> tuple[str, str]:
    """"NAME" or "NAME=PATH" (engine.adapters, --adapter) -> (name, source)."""
    name, _, source = spec.partition("=")
    if not name:
        raise ConfigError(f"adapter {spec!r}: expected NAME or NAME=PATH")
    return name, source or name
