"""Where each loaded parameter lives on the mesh: its logical axes' sharding, with the one rule
packed kernels add (a quantization group never straddles two devices). The loader places tensors
with it and orbax restores them with it, so both read the same shards."""

from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.parallel import named_sharding


def param_sharding(name: str, param: nnx.Param, params: dict[str, nnx.Param], mesh: Mesh) -> NamedSharding:
    """The parameter's sharding from its logical axes; a packed kernel's values split their input rows
    over a mesh axis only where its groups' scales split too (the axis divides the group count), so a
    group never straddles two devices. Otherwise that dimension stays replicated, as any other that
    the axis does not divide. A rows-first embedding (`weight_q`) and an expert stack have their
    groups along their second dimension."""
    sharding = named_sharding(tuple(param.get_value().shape), param.logical_axes, mesh)
    axis = _grouped_axis(name)
    if axis is None:
        return sharding
    scale = params[name.removesuffix("_q") + "_scale"]
    grouped = named_sharding(tuple(scale.get_value().shape), scale.logical_axes, mesh).spec
    spec = list(sharding.spec) + [None] * (param.get_value().ndim - len(sharding.spec))
    spec[axis] = grouped[axis] if len(grouped) > axis else None
    return NamedSharding(mesh, PartitionSpec(*spec))


def _grouped_axis(name: str) -> int | None:
    """The axis of a packed weight's values that its groups run along (None: not packed values)."""
    if name.endswith(".kernel_q"):
        return 0
    if name.endswith(".weight_q") or (name.endswith("_q") and ".experts." in name):
        return 1  # rows-first embedding; a stack's input rows, after its expert axis
    return None
