"""The ('data', 'expert', 'model') device mesh and logical-axis rules for tensor and expert parallelism.

Each 'data' row is one replica. Within it, attention and dense weights split on 'model' and repeat
along 'expert'; a mixture-of-experts layer splits its experts along 'expert' and each expert's
width along 'model' (models/experts.py).

Weights name their dimensions with logical axes ('vocab', 'embed', 'heads', 'kv_heads', 'mlp', ...).
`RULES` maps each to a mesh axis; a dimension that the mesh axis does not divide evenly stays
replicated (for example SmolLM2's 3 KV heads on a 4-way 'model' axis), so any model runs on any mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxinfer.errors import ConfigError

MESH_AXES = ("data", "expert", "model")

RULES: dict[str, str | None] = {
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "expert": "expert",
    "moe_mlp": "model",
    "embed": None,
    "head_dim": None,
    "pages": None,
    "page_slot": None,
}


def make_mesh(data: int = 1, model: int = 0, devices: Sequence[jax.Device] | None = None, expert: int = 1) -> Mesh:
    """A mesh of `data x expert x model` devices; `model=0` takes every device left after the others."""
    devices = list(devices if devices is not None else jax.devices())
    if data <= 0 or model < 0 or expert <= 0:
        raise ConfigError(f"mesh sizes must be positive, got data={data} expert={expert} model={model}")
    if model == 0:
        if len(devices) % (data * expert):
            raise ConfigError(f"mesh data={data} x expert={expert} does not divide the {len(devices)} devices")
        model = len(devices) // (data * expert)
    needed = data * expert * model
    if needed > len(devices):
        raise ConfigError(f"mesh data={data} x expert={expert} x model={model} needs {needed} devices, "
                          f"have {len(devices)}")
    grid = np.array(devices[:needed], dtype=object).reshape(data, expert, model)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """Each 'data' row of the mesh as a mesh of its own: the devices of one data-parallel replica."""
    return [Mesh(mesh.devices[row : row + 1], MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
            for row in range(mesh.devices.shape[0])]


def spec_for(shape: Sequence[int], logical_axes: Sequence[str | None], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for an array: each logical axis goes to its mesh axis when that divides it."""
    if len(shape) != len(logical_axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(logical_axes)} differ in rank")
    spec: list[str | None] = []
    used: set[str] = set()
    for dim, name in zip(shape, logical_axes, strict=True):
        axis = RULES.get(name) if name else None
        if axis is None or axis in used or dim % mesh.shape[axis]:
            spec.append(None)
            continue
        spec.append(axis)
        used.add(axis)
    return PartitionSpec(*spec)


def named_sharding(shape: Sequence[int], logical_axes: Sequence[str | None], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, spec_for(shape, logical_axes, mesh))
