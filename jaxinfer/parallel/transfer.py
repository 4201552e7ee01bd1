"""Host arrays onto a sharding, without JAX's cross-process equality check.

In a process group, `jax.device_put` of host data onto a sharding that spans other processes'
devices first gathers the whole value from every process and compares the copies
(`multihost_utils.assert_equal`): a collective, a compiled program per shape, and a wait for every
process on every call. jaxinfer's processes hold equal values by construction (the leader sends
each step's arrays to its followers, and every process reads the same checkpoint), so `to_devices`
builds those arrays from each process's own copy with `jax.make_array_from_callback`, which copies
each process's slices onto its own devices as `device_put` does, minus the comparison. Within one
process it is `jax.device_put`.

Only host (numpy) leaves skip the check: a `jax.Array` leaf goes through `jax.device_put` as it is.
Nothing here checks that the processes' copies are equal: the leader's frames are equal by
construction, and a group compares its checkpoints' fingerprints before loading
(`weights/fingerprint.py`). 64-bit leaves narrow as `device_put` narrows them (unless x64 is on);
a Python scalar becomes a strongly typed array, not a weakly typed one.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Sharding

Tree = TypeVar("Tree")


def to_devices(tree: Tree, sharding: Sharding) -> Tree:
    """Every host array of `tree` placed with `sharding`; device arrays go through `jax.device_put`."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda leaf: _from_local_copy(leaf, sharding), tree)


def _from_local_copy(leaf: Any, sharding: Sharding) -> jax.Array:
    if isinstance(leaf, jax.Array):
        return jax.device_put(leaf, sharding)
    local = np.asarray(leaf)
    # 64-bit to 32-bit unless x64 is on, as device_put; a Python scalar becomes a strongly typed array.
    dtype = jax.dtypes.canonicalize_dtype(local.dtype)
    return jax.make_array_from_callback(local.shape, sharding, lambda index: local[index].astype(dtype, copy=False),
                                        dtype=dtype)
