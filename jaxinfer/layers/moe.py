"""The mixture-of-experts math of one device: routing, grouping the (token, expert) pairs by expert,
and the experts' gated SiLU MLPs as a grouped matmul over the groups.

Dropless by construction: every pair a token's top-k picks is computed; no capacity is chosen and
none can overflow. The shapes are static (the bucket's T tokens give T * top_k pairs) and only the
group sizes depend on the routing.

Two grouped matmuls compute the same numbers:
- `"ragged_dot"`: `jax.lax.ragged_dot`, which XLA lowers to a grouped matmul on TPU and GPU;
- `"tiled"`: a loop over tiles of `tile` rows of one expert each, as many tiles as the groups need
  (a dynamic trip count over static shapes). XLA's CPU lowering of `ragged_dot` computes every pair
  against every expert with a mask, slower than even the dense einsum over all experts
  (docs/benchmarks.md, "CPU: mixture of experts"), so the CPU takes this one.
`dense_experts` (every expert on every token) is the yardstick both are measured against.

An expert stack may be kept packed (`PackedStack`, layers/quant.py's formats with a leading expert
axis): the tiled loop dequantizes only the expert of each tile, inside the iteration; `ragged_dot`
takes the whole stack dequantized inside the step's computation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.layers.quant import PackedFormat, dequantize

GROUPED_MATMULS = ("auto", "tiled", "ragged_dot")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedStack:
    """Stacked expert kernels [E, in, out] kept in `fmt`: q [E, rows, out], scale (and offset) [E, groups, out]."""

    q: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    fmt: PackedFormat = dataclasses.field(metadata=dict(static=True))
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, _, fan_out = self.q.shape
        return experts, self.scale.shape[1] * self.fmt.group, fan_out

    def expert(self, index: jax.Array) -> jax.Array:
        """Expert `index`'s kernel [in, out], dequantized."""
        offset = None if self.offset is None else self.offset[index]
        return dequantize(self.q[index], self.scale[index], offset, self.fmt, self.dtype)

    def whole(self) -> jax.Array:
        """Every expert's kernel [E, in, out], dequantized."""
        one = lambda q, scale, offset: dequantize(q, scale, offset, self.fmt, self.dtype)  # noqa: E731
        return jax.vmap(one)(self.q, self.scale, self.offset)


ExpertKernels = jax.Array | PackedStack  # one projection of every expert, float or packed


def expert_kernel(stack: ExpertKernels, index: jax.Array) -> jax.Array:
    return stack.expert(index) if isinstance(stack, PackedStack) else stack[index]


def whole_stack(stack: ExpertKernels) -> jax.Array:
    return stack.whole() if isinstance(stack, PackedStack) else stack


def route(router_logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] float32, expert ids [T, k]): softmax over the experts, the top k (the lower id
    first on a tie), divided by their sum where `renormalize`."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def resolve_matmul(name: str, platform: str | None = None) -> str:
    """The grouped matmul `name` ("auto": tiled on the CPU, ragged_dot elsewhere) means on `platform`."""
    if name not in GROUPED_MATMULS:
        raise ValueError(f"grouped matmul {name!r}; choose from {', '.join(GROUPED_MATMULS)}")
    if name != "auto":
        return name
    return "tiled" if (platform or jax.default_backend()) == "cpu" else "ragged_dot"


def tile_rows(pairs: int, experts: int) -> int:
    """Rows per tile: about the mean group, a power of two in 8..128 (a small tile wastes little of a
    small group, a large one runs a long group in few iterations)."""
    mean = max(1, pairs // max(1, experts))
    return min(128, max(8, 1 << (mean - 1).bit_length()))


def local_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, real: jax.Array, first: int | jax.Array,
                  gate: ExpertKernels, up: ExpertKernels, down: ExpertKernels, matmul: str) -> jax.Array:
    """x [T, H] through the experts `first .. first + E_local` held here (gate/up [E_local, H, I], down
    [E_local, I, H]): each token's weighted sum over the pairs routed to these experts, [T, H] in
    float32; pairs routed elsewhere, and tokens where `real` is False, add nothing."""
    tokens, top_k = ids.shape
    count = gate.shape[0]
    local = ids.reshape(-1) - first
    here = (local >= 0) & (local < count) & jnp.repeat(real, top_k)
    key = jnp.where(here, local, count)  # pairs not computed here sort after every group
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=count + 1)[:count].astype(jnp.int32)
    rows = x[order // top_k]
    grouped = _tiled if matmul == "tiled" else _ragged
    out_sorted = grouped(rows, sizes, gate, up, down)
    pair_weights = jnp.where(here, weights.reshape(-1), 0.0)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted) * pair_weights[:, None]
    return out.reshape(tokens, top_k, -1).sum(axis=1)


def _ragged(rows: jax.Array, sizes: jax.Array, gate: ExpertKernels, up: ExpertKernels, down: ExpertKernels
            ) -> jax.Array:
    gate, up, down = whole_stack(gate), whole_stack(up), whole_stack(down)
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes, preferred_element_type=jnp.float32))
    hidden = (hidden * jax.lax.ragged_dot(rows, up, sizes, preferred_element_type=jnp.float32)).astype(rows.dtype)
    out = jax.lax.ragged_dot(hidden, down, sizes, preferred_element_type=jnp.float32)
    grouped = jnp.arange(rows.shape[0]) < jnp.sum(sizes)  # rows past the groups: pairs of other devices
    return jnp.where(grouped[:, None], out, 0.0)


def _tiled(rows: jax.Array, sizes: jax.Array, gate: ExpertKernels, up: ExpertKernels, down: ExpertKernels
           ) -> jax.Array:
    """Each iteration runs one tile: `tile` consecutive rows of one expert's group through its MLP.
    A group's last tile may reach into the next group's rows; those rows add zero there."""
    pairs, width = rows.shape
    tile = tile_rows(pairs, gate.shape[0])  # a PackedStack has the float stack's shape
    tiles_per_group = (sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles_per_group)
    tile_starts = tile_ends - tiles_per_group
    group_starts = jnp.cumsum(sizes) - sizes
    padded = jnp.concatenate([rows, jnp.zeros((tile, width), rows.dtype)])

    def body(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        index, out = carry
        expert = jnp.searchsorted(tile_ends, index, side="right")
        offset = (index - tile_starts[expert]) * tile
        start = group_starts[expert] + offset
        block = jax.lax.dynamic_slice_in_dim(padded, start, tile)
        hidden = jax.nn.silu(jnp.dot(block, expert_kernel(gate, expert), preferred_element_type=jnp.float32))
        hidden = hidden * jnp.dot(block, expert_kernel(up, expert), preferred_element_type=jnp.float32)
        result = jnp.dot(hidden.astype(rows.dtype), expert_kernel(down, expert), preferred_element_type=jnp.float32)
        inside = (offset + jnp.arange(tile)) < sizes[expert]
        before = jax.lax.dynamic_slice_in_dim(out, start, tile)
        out = jax.lax.dynamic_update_slice_in_dim(out, before + jnp.where(inside[:, None], result, 0.0), start, 0)
        return index + 1, out

    total = tile_ends[-1]
    _, out = jax.lax.while_loop(lambda carry: carry[0] < total, body,
                                (jnp.int32(0), jnp.zeros((pairs + tile, width), jnp.float32)))
    return out[:pairs]


def dense_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, gate: ExpertKernels, up: ExpertKernels,
                  down: ExpertKernels) -> jax.Array:
    """Every expert on every token, weighted by the routing (zero off the top k): the dense einsum
    a grouped matmul is measured against, [T, H] float32."""
    gate, up, down = whole_stack(gate), whole_stack(up), whole_stack(down)
    dense_weights = jnp.zeros((x.shape[0], gate.shape[0]), jnp.float32)
    dense_weights = dense_weights.at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    hidden = jax.nn.silu(jnp.einsum("th,ehi->tei", x, gate, preferred_element_type=jnp.float32))
    hidden = (hidden * jnp.einsum("th,ehi->tei", x, up, preferred_element_type=jnp.float32)).astype(x.dtype)
    out = jnp.einsum("tei,eih->teh", hidden, down, preferred_element_type=jnp.float32)
    return jnp.einsum("teh,te->th", out, dense_weights)
