"""The sparse mixture-of-experts block: a router and stacked experts, split over the mesh's expert
axis (expert parallelism) and each expert's width over its model axis.

Parameters mirror the checkpoint's names with the experts stacked: Qwen3-MoE's
`mlp.experts.{i}.gate_proj.weight` become `mlp.experts.gate_proj` [E, hidden, width] (Mixtral:
`block_sparse_moe.experts.w1`), loaded by weights/hf.py. The router (`gate`) is a plain linear.
A packed stack (layers/quant.py's formats, one per projection) is stored as `gate_proj_q`,
`gate_proj_scale` (and `_offset`) with the expert axis first, and multiplied as layers/moe.py's
`PackedStack`. Its groups run along each expert's input rows, so a model axis that splits those rows
(the down projection's width) must split whole groups.

Under expert parallelism every device of a replica holds every token (attention repeats along the
expert axis), so no token is sent anywhere: each device runs the pairs routed to its own experts,
and one all-reduce (`psum`) over the expert and model axes sums each token's partial outputs. Its
bytes per token are counted against the all-to-all minimum by `tools/bench.py moe`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from jaxinfer.errors import ConfigError
from jaxinfer.layers.basic import Linear, add_packed_params, initial_weights, packed_arrays
from jaxinfer.layers.moe import ExpertKernels, PackedStack, local_experts, resolve_matmul, route
from jaxinfer.layers.quant import PackedFormat
from jaxinfer.parallel.mesh import MESH_AXES


@dataclass(frozen=True)
class ExpertsSpec:
    """A family's sparse block: its module name, its experts' projection names (gate, up, down), and
    the routing (models/layer_kinds.LayerSpec.experts)."""

    module: str
    projections: tuple[str, str, str]
    num_experts: int
    top_k: int
    width: int
    renormalize: bool


@dataclass(frozen=True)
class ExpertPlacement:
    """The replica mesh's expert and model axis sizes, and which grouped matmul runs (layers/moe.py)."""

    expert: int = 1
    model: int = 1
    matmul: str = "auto"


ONE_DEVICE = ExpertPlacement()


class StackedExperts(nnx.Module):
    """Every expert's gated SiLU MLP, stacked on a leading expert axis."""

    def __init__(self, hidden: int, spec: ExpertsSpec, dtype: jnp.dtype, rngs: nnx.Rngs | None,
                 packed: dict[str, PackedFormat] | None = None):
        """`packed`: the packed projections' formats by projection name."""
        e, w = spec.num_experts, spec.width
        into, out_of = ("expert", "embed", "moe_mlp"), ("expert", "moe_mlp", "embed")
        self.formats = tuple((name, fmt) for name, fmt in (packed or {}).items())  # static: hashed with the graph
        self.dtype = dtype
        for name, shape, axes in zip(spec.projections, ((e, hidden, w), (e, hidden, w), (e, w, hidden)),
                                     (into, into, out_of), strict=True):
            fmt = dict(self.formats).get(name)
            if fmt is None:
                setattr(self, name, nnx.Param(initial_weights(rngs, shape, dtype), logical_axes=axes))
                continue
            add_packed_params(self, name, fmt, shape[1:], axes, stacked=e)
        self.projections = spec.projections

    def weights(self) -> tuple[ExpertKernels, ExpertKernels, ExpertKernels]:
        return tuple(self._kernels(name) for name in self.projections)

    def _kernels(self, name: str) -> ExpertKernels:
        fmt = dict(self.formats).get(name)
        if fmt is None:
            return getattr(self, name)[...]
        return PackedStack(*packed_arrays(self, name, fmt), fmt, self.dtype)


class SparseMoE(nnx.Module):
    """x -> the routed experts' weighted sum, dropless (layers/moe.py)."""

    def __init__(self, hidden: int, spec: ExpertsSpec, placement: ExpertPlacement, dtype: jnp.dtype,
                 rngs: nnx.Rngs | None, packed: dict[str, PackedFormat] | None = None):
        """`packed`: the block's packed weights by name ("experts.gate_proj"; decoder._layer_formats)."""
        if spec.num_experts % placement.expert:
            raise ConfigError(f"engine.mesh_expert = {placement.expert} does not divide the model's "
                              f"{spec.num_experts} experts")
        self.gate = Linear(hidden, spec.num_experts, ("embed", None), dtype=dtype, rngs=rngs)
        formats = {name.removeprefix("experts."): fmt for name, fmt in (packed or {}).items()
                   if name.startswith("experts.")}
        self.experts = StackedExperts(hidden, spec, dtype, rngs, formats)
        self.top_k, self.renormalize = spec.top_k, spec.renormalize
        self.placement = placement
        # the width splits over the model axis where the axis divides it (mesh.spec_for's rule)
        self.width_split = placement.model > 1 and spec.width % placement.model == 0
        down = formats.get(spec.projections[2])
        if self.width_split and down is not None and (spec.width // placement.model) % down.group:
            raise ConfigError(f"engine.mesh_model = {placement.model} splits the experts' {spec.width} input rows "
                              f"of {spec.projections[2]} into {spec.width // placement.model} a device, which the "
                              f"packed format {down.name}'s groups of {down.group} do not divide; use a mesh_model "
                              "that does, or weights_dtype = float32")

    def __call__(self, x: jax.Array, real: jax.Array) -> jax.Array:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        matmul = resolve_matmul(self.placement.matmul)
        gate, up, down = self.experts.weights()
        if self.placement.expert * self.placement.model == 1:
            return local_experts(x, weights, ids, real, 0, gate, up, down, matmul).astype(x.dtype)
        return self._on_each_device(x, weights, ids, real, gate, up, down, matmul).astype(x.dtype)

    def _on_each_device(self, x: jax.Array, weights: jax.Array, ids: jax.Array, real: jax.Array,
                        gate: ExpertKernels, up: ExpertKernels, down: ExpertKernels, matmul: str) -> jax.Array:
        """`shard_map` over the replica's (1, expert, model) mesh: a device's experts and width slice.
        The parts are summed in the model's dtype, the bytes the all-reduce moves."""
        width = "model" if self.width_split else None
        summed = ("expert", "model") if self.width_split else ("expert",)
        per_expert = gate.shape[0] // self.placement.expert
        mesh = AbstractMesh((1, self.placement.expert, self.placement.model), MESH_AXES,
                            axis_types=(AxisType.Auto,) * len(MESH_AXES))

        def one_device(x, weights, ids, real, gate, up, down):
            first = jax.lax.axis_index("expert") * per_expert
            part = local_experts(x, weights, ids, real, first, gate, up, down, matmul).astype(x.dtype)
            return jax.lax.psum(part, summed)

        wide, narrow = PartitionSpec("expert", None, width), PartitionSpec("expert", width, None)
        every = PartitionSpec()
        wide_gate, wide_up, narrow_down = (_specs_like(kernels, spec) for kernels, spec in
                                           ((gate, wide), (up, wide), (down, narrow)))
        return jax.shard_map(one_device, mesh=mesh,
                             in_specs=(every, every, every, every, wide_gate, wide_up, narrow_down),
                             out_specs=every, check_vma=False)(x, weights, ids, real, gate, up, down)


def _specs_like(kernels: ExpertKernels, spec: PartitionSpec) -> PartitionSpec | PackedStack:
    """`spec` for a float stack; for a packed one, `spec` for each of its stored arrays (their expert,
    input-row and column axes are the float stack's)."""
    if not isinstance(kernels, PackedStack):
        return spec
    return dataclasses.replace(kernels, q=spec, scale=spec, offset=None if kernels.offset is None else spec)
