"""Builds a sharded model from a checkpoint: abstract tree first, then each tensor placed directly.

The model is created with `nnx.eval_shape` (no memory), and every parameter is filled from the
checkpoint's tensor stream with `to_devices` to the sharding its logical axes give on the mesh, so at
most one host copy of one tensor exists at a time; in a process group no process waits for another's
copy to be compared with its own (parallel/transfer.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, ConfigError
from jaxinfer.layers.attention import AttentionBackend
from jaxinfer.layers.quant import PackedFormat
from jaxinfer.models import CausalLM, model_class
from jaxinfer.models.experts import ONE_DEVICE, ExpertPlacement
from jaxinfer.parallel import named_sharding
from jaxinfer.parallel.transfer import to_devices
from jaxinfer.weights import gguf_file as gguf_names
from jaxinfer.weights import hf, orbax_io
from jaxinfer.weights.gguf_file import GGUFCheckpoint
from jaxinfer.weights.registry import ResolvedCheckpoint, resolve
from jaxinfer.weights.shardings import param_sharding
from jaxinfer.weights.weight_plan import WeightsChoice, from_meta, load_time_formats, packed_stream

log = logging.getLogger(__name__)
FROM_CHECKPOINT = WeightsChoice()  # weights_dtype auto: the checkpoint's own packing


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    checkpoint: ResolvedCheckpoint


def abstract_model(cfg: ModelConfig, dtype: jnp.dtype, backend: AttentionBackend | None,
                   mesh: Mesh | None = None, packed: dict[str, PackedFormat] | None = None) -> CausalLM:
    """The model's tree without memory; its sparse layers split over `mesh`'s expert and model axes,
    and the projections in `packed` kept in their formats (layers/quant.py)."""
    cls = model_class(cfg.architecture)
    placement = ExpertPlacement(mesh.shape["expert"], mesh.shape["model"]) if mesh is not None else ONE_DEVICE
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype, backend=backend, rngs=None, placement=placement,
                                      packed=packed))


def parameters(model: nnx.Module) -> dict[str, nnx.Param]:
    """Engine names ("model.layers.0.mlp.up_proj.kernel") of every parameter."""
    return {
        ".".join(str(p) for p in path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Param)
    }


def fill(
    model: CausalLM,
    tensors: Iterable[tuple[str, str, np.ndarray | jax.Array]],
    mesh: Mesh,
    source: str,
    checkpoint_name: Callable[[str], str] = str,
) -> CausalLM:
    """Assigns checkpoint tensors to the abstract model's parameters, checking names and shapes.

    `checkpoint_name` maps an engine parameter name to the checkpoint's, for error messages."""
    params = parameters(model)
    filled: dict[str, str] = {}
    for name, tensor_name, array in tensors:
        param = params.get(name)
        if param is None:
            if not _ignorable(name):  # a layer past num_layers, a bias the config says is absent: wrong weights
                raise CheckpointError(f"{source}: tensor {tensor_name} has no place in this model (its config "
                                      "disagrees with its tensors, or it is a variant this engine does not run)")
            log.debug("%s: ignoring tensor %s", source, tensor_name)
            continue
        if name in filled:
            raise CheckpointError(f"{source}: tensor {tensor_name} appears twice (also as {filled[name]})")
        expected = tuple(param.get_value().shape)
        if tuple(array.shape) != expected:
            raise CheckpointError(
                f"{source}: tensor {tensor_name} has shape {tuple(array.shape)}, expected {expected} "
                f"(after converting to the engine layout)"
            )
        dtype = param.get_value().dtype
        sharding = param_sharding(name, param, params, mesh)
        param.set_value(to_devices(_cast(array, dtype), sharding))
        filled[name] = tensor_name
    missing = sorted(checkpoint_name(name) for name in set(params) - set(filled))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{source}: missing tensor(s) {shown}")
    return model


def _ignorable(name: str) -> bool:
    """Checkpoint tensors with no parameter that change nothing: precomputed RoPE frequencies, and an
    output projection that a tied model replaces with its embeddings (transformers ignores it too)."""
    return name.endswith("rotary_emb.inv_freq") or name == "lm_head.kernel"


def _cast(array: np.ndarray | jax.Array, dtype: jnp.dtype) -> np.ndarray | jax.Array:
    if isinstance(array, np.ndarray):
        return np.asarray(array, dtype=dtype)
    return array.astype(dtype)


def load_model(
    name_or_path: str | Path | ResolvedCheckpoint,
    mesh: Mesh,
    dtype: jnp.dtype = jnp.float32,
    backend: AttentionBackend | None = None,
    gguf_file: GGUFCheckpoint | None = None,
    target: CausalLM | None = None,
    weights: WeightsChoice = FROM_CHECKPOINT,
) -> LoadedModel:
    """Loads a registry name or path; pass an already opened `gguf_file` to avoid reading it twice.

    `target`: the model a draft is loaded for; a draft checkpoint may take tensors from it.
    `weights`: which projections stay packed on the device, and how (weights/weight_plan.py)."""
    checkpoint = name_or_path if isinstance(name_or_path, ResolvedCheckpoint) else resolve(name_or_path)
    source = str(checkpoint.path)
    if checkpoint.kind == "gguf":
        gguf_file = gguf_file or GGUFCheckpoint(checkpoint.path)
        cfg = gguf_file.config()
        packed = _formats(weights, cfg, lambda: gguf_file.packed_formats(cfg), mesh)
        tensors: Iterable = gguf_file.iter_tensors(cfg, set() if weights.quantizes_at_load else set(packed))
        names: Callable[[str], str] = gguf_names.checkpoint_name
    elif checkpoint.kind == "hf":
        cfg = hf.read_config(checkpoint.path)
        packed = _formats(weights, cfg, dict, mesh)
        tensors, names = hf.iter_tensors(checkpoint.path, cfg), hf.checkpoint_name
    elif checkpoint.kind == "random":  # a model shape for benchmarks: config.json, no weights
        cfg = hf.read_config(checkpoint.path)
        model = random_model(cfg, mesh, dtype, backend, packed=_formats(weights, cfg, dict, mesh))
        return LoadedModel(cfg, model, checkpoint)
    else:
        return _load_orbax(checkpoint, mesh, dtype, backend, target, weights)
    model = abstract_model(cfg, dtype, backend, mesh, packed)
    return LoadedModel(cfg, fill(model, packed_stream(tensors, packed), mesh, source, names), checkpoint)


def _formats(weights: WeightsChoice, cfg: ModelConfig, stored: Callable[[], dict[str, PackedFormat]], mesh: Mesh
             ) -> dict[str, PackedFormat]:
    """The formats the model is built with: quantized at load, or what the checkpoint keeps packed
    (`stored()`, read and its quantizations checked only where they are kept on this platform)."""
    if weights.quantizes_at_load:
        return load_time_formats(weights, parameters(abstract_model(cfg, jnp.float32, None)))
    return stored() if weights.keeps_checkpoint_packing(mesh.devices.flat[0].platform) else {}


def _load_orbax(checkpoint: ResolvedCheckpoint, mesh: Mesh, dtype: jnp.dtype, backend: AttentionBackend | None,
                target: CausalLM | None, weights: WeightsChoice) -> LoadedModel:
    """An orbax checkpoint restored with each array's serving sharding; its packed projections are
    restored packed (re-packing a stored checkpoint at load is not supported: convert it again)."""
    source = str(checkpoint.path)
    cfg = orbax_io.read_config(checkpoint.path)
    stored = from_meta(orbax_io.read_meta(checkpoint.path).get("packed"))
    if (stored and weights.dtype not in ("auto", "packed")) or (not stored and weights.quantizes_at_load):
        raise ConfigError(f"engine.weights_dtype = {weights.dtype!r}: {source} is stored "
                          f"{'packed' if stored else 'as floats'}; convert it with that setting "
                          "(tools/convert.py --weights-dtype), or use auto or packed")
    shared = orbax_io.from_target(checkpoint.path)
    if shared and target is None:
        raise CheckpointError(f"{source}: a draft that takes {', '.join(shared)} from its target model; load "
                              "it as engine.draft_model of that target")
    shared_packed = {name: fmt for name, fmt in target.packed_formats if name in shared} if shared else {}
    stored = {**stored, **shared_packed}  # a weight the target keeps packed is shared packed
    model = abstract_model(cfg, dtype, backend, mesh, stored)
    params = parameters(model)
    shared = [stored_name for name in shared for stored_name in (
        [f"{name}_{suffix}" for suffix in shared_packed[name].suffixes] if name in shared_packed else [name])]
    kept = {name: param for name, param in params.items() if name not in shared}
    tensors = itertools.chain(orbax_io.restore_tensors(checkpoint.path, kept, mesh),
                              _target_tensors(shared, target, params, source))
    return LoadedModel(cfg, fill(model, tensors, mesh, source), checkpoint)


def place_copy(model: CausalLM, mesh: Mesh) -> CausalLM:
    """A copy of a loaded model on another mesh of the same shape (a data-parallel replica's devices)."""
    graphdef, state = nnx.split(model)

    def move(value):
        if not isinstance(value, jax.Array):
            return value
        spec = value.sharding.spec if isinstance(value.sharding, NamedSharding) else PartitionSpec()
        return jax.device_put(value, NamedSharding(mesh, spec))

    return nnx.merge(graphdef, jax.tree.map(move, state))


def _target_tensors(names: list[str], target: CausalLM, draft: dict[str, nnx.Param], source: str
                    ) -> Iterator[tuple[str, str, jax.Array]]:
    """The target's tensors a draft shares, cut to the draft's rows: a target that grew its vocabulary
    (the processor's control tokens) has rows the draft never had."""
    params = parameters(target) if names else {}
    for name in names:
        if name not in params:
            raise CheckpointError(f"{source}: the target model has no {name} to share")
        value = params[name].get_value()
        rows = draft[name].get_value().shape[0]
        yield name, f"{name} (from the target)", value[:rows] if value.shape[0] > rows else value


# One program per (shape, dtype, sharding): the layers of a model share them, so a 32-layer model
# compiles about ten, not one per tensor.
@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding) -> jax.Array:
    values = (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)
    return jax.lax.with_sharding_constraint(values, sharding)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _ones(shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(jnp.ones(shape, dtype), sharding)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _bits(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding) -> jax.Array:
    values = jax.random.bits(key, shape, jnp.uint8).view(dtype)
    return jax.lax.with_sharding_constraint(values, sharding)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding", "value"))
def _full(shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding, value: float) -> jax.Array:
    return jax.lax.with_sharding_constraint(jnp.full(shape, value, dtype), sharding)


def random_model(
    cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype, backend: AttentionBackend | None = None, seed: int = 0,
    packed: dict[str, PackedFormat] | None = None,
) -> CausalLM:
    """A model with N(0, 0.02) weights generated directly on device with their shardings (benchmarks);
    packed projections get random values with a scale of about that size."""
    model = abstract_model(cfg, dtype, backend, mesh, packed)
    key = jax.random.key(seed)

    def tensors():
        for i, (name, param) in enumerate(sorted(parameters(model).items())):
            value = param.get_value()
            shape, stored = tuple(value.shape), value.dtype
            sharding = named_sharding(shape, param.logical_axes, mesh)
            if name.endswith("norm.weight"):
                yield name, name, _ones(shape, dtype, sharding)
            elif name.endswith(("kernel_q", "weight_q")):
                yield name, name, _bits(jax.random.fold_in(key, i), shape, stored, sharding)
            elif name.endswith(("_scale", "_offset")):
                yield name, name, _full(shape, stored, sharding, 0.005 if name.endswith("scale") else -0.04)
            else:
                yield name, name, _normal(jax.random.fold_in(key, i), shape, dtype, sharding)

    return fill(model, tensors(), mesh, f"random {cfg.architecture}")
