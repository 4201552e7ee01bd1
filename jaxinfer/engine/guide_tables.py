"""Structured output on the device: compiled automata's tables, and the mask each step applies.

The runner keeps `GuideTables`: `engine.guided_grammars` slots of per-token classes ([slots, vocab]
int32), and one pool of `engine.guided_pool_states` automaton states shared by the loaded grammars
([pool, guided_max_classes] next-state rows, absolute row numbers, -1 refused; [pool] accepting).
A grammar occupies a contiguous run of rows while loaded; unused grammars are evicted, least
recently used first, when a new one needs room (`GuideSlots`).

Each step row of a constrained sequence names its grammar slot and the absolute row of the state
the host knows (after the ids it has read back). If the row's newest token is still on the device
(overlapped scheduling), `prev` points at it in the previous step's output and the step advances
the state over it first: the mask for step N+1 needs nothing from the host, so overlap stays on.

The mask comes after the logit bias and the penalties and before the sampler's filters (top-k,
top-p, min-p then see only allowed tokens); EOS ids are allowed exactly in accepting states. The
logprobs a request gets back stay the raw model's, as in vLLM.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.guided.automaton import REFUSED, TokenAutomaton

MAX_EOS_IDS = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GuideTables:
    token_class: jax.Array  # [grammars, vocab] int32
    class_next: jax.Array  # [pool, classes] int32: absolute next row, -1 refused
    final: jax.Array  # [pool] bool
    eos: jax.Array  # [MAX_EOS_IDS] int32 (-1: none)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GuideInputs:
    """Per-row, each [S] int32."""

    state: jax.Array  # absolute pool row of the state the host knows (-1: no automaton)
    grammar: jax.Array  # the grammar's slot
    prev: jax.Array  # index into the previous step's ids of a token to apply first (-1: none)
    mask_row: jax.Array  # the row's host-filled bitmask in `bitmask` (-1: none; jaxinfer/guided/host_matcher.py)
    bitmask: jax.Array  # [engine.guided_host_rows, ceil(vocab / 32)] int32: bit v of a row allows id v


def empty_tables(grammars: int, pool_states: int, classes: int, vocab: int, eos_ids: list[int]) -> GuideTables:
    """Host arrays of tables with nothing loaded (1 x 1 stand-ins with guided output off)."""
    if not grammars:
        grammars = pool_states = classes = vocab = 1
    return GuideTables(np.zeros((grammars, vocab), np.int32), np.full((pool_states, classes), REFUSED, np.int32),
                       np.zeros(pool_states, bool), eos_row(eos_ids))


def eos_row(eos_ids: list[int]) -> np.ndarray:
    """The tables' EOS ids, padded with -1 to MAX_EOS_IDS."""
    eos = np.full(MAX_EOS_IDS, -1, np.int32)
    eos[: len(eos_ids)] = sorted(eos_ids)[:MAX_EOS_IDS]
    return eos


def constrain(logits: jax.Array, tables: GuideTables, inputs: GuideInputs, prev_tokens: jax.Array) -> jax.Array:
    """logits [S, V] with each constrained row's refused tokens at -inf (other rows unchanged): from the
    automaton for rows with a state, from the host's bitmask for rows with a mask row."""

    def automaton() -> jax.Array:
        vocab = logits.shape[1]
        grammar = jnp.maximum(inputs.grammar, 0)
        state = jnp.maximum(inputs.state, 0)
        newest = prev_tokens[jnp.maximum(inputs.prev, 0)]
        advanced = tables.class_next[state, tables.token_class[grammar, jnp.minimum(newest, vocab - 1)]]
        state = jnp.maximum(jnp.where(inputs.prev >= 0, advanced, state), 0)
        allowed = jnp.take_along_axis(tables.class_next[state], tables.token_class[grammar], axis=1) >= 0
        eos_columns = jnp.where(tables.eos >= 0, tables.eos, vocab)  # out of range: dropped
        allowed = allowed.at[:, eos_columns].set(tables.final[state][:, None], mode="drop")
        return jnp.where(allowed | (inputs.state < 0)[:, None], logits, -jnp.inf)

    def host_masked(logits: jax.Array) -> jax.Array:
        ids = jnp.arange(logits.shape[1])
        words = inputs.bitmask[jnp.maximum(inputs.mask_row, 0)][:, ids // 32]
        allowed = ((words >> (ids % 32)) & 1) == 1
        return jnp.where(allowed | (inputs.mask_row < 0)[:, None], logits, -jnp.inf)

    if tables.token_class.shape[1] == logits.shape[1]:  # else automata are off (engine.guided_grammars 0)
        logits = lax.cond(jnp.any(inputs.state >= 0), automaton, lambda: logits)
    if inputs.bitmask.shape[1] * 32 < logits.shape[1]:  # host-matched grammars off: a 1 x 1 stand-in
        return logits
    return lax.cond(jnp.any(inputs.mask_row >= 0), host_masked, lambda x: x, logits)


def constrain_path(logits: jax.Array, tables: GuideTables, inputs: GuideInputs, drafts: jax.Array) -> jax.Array:
    """Speculative verification: logits [S, K+1, V] at each proposed position, masked with the state after
    the row's proposals before it (drafts [S, K]). A proposal the automaton refuses leaves the later
    positions' states refused, hence unmasked; they are never used, since verification rejects there."""
    if tables.token_class.shape[1] != logits.shape[-1]:
        return logits
    rows, width, vocab = logits.shape
    grammar = jnp.maximum(inputs.grammar, 0)

    def advance(state: jax.Array, token: jax.Array) -> tuple[jax.Array, jax.Array]:
        following = tables.class_next[jnp.maximum(state, 0), tables.token_class[grammar, token]]
        following = jnp.where(state >= 0, following, REFUSED)
        return following, following

    _, later = lax.scan(advance, inputs.state, drafts.T)
    states = jnp.concatenate([inputs.state[None], later]).T.reshape(-1)
    none = jnp.full(rows * width, -1, jnp.int32)
    at_positions = GuideInputs(states, jnp.repeat(inputs.grammar, width), none, none, inputs.bitmask)
    flat = constrain(logits.reshape(rows * width, vocab), tables, at_positions, jnp.zeros(1, jnp.int32))
    return flat.reshape(rows, width, vocab)


def install(tables: GuideTables, slot: jax.Array, base: jax.Array, token_class: jax.Array, class_next: jax.Array,
            final: jax.Array, count: jax.Array) -> GuideTables:
    """The tables with a grammar written to `slot` and pool rows [base, base + count): `class_next` and
    `final` are [guided_max_states, ...] blocks (rows past `count` are padding and not written), their
    next states local (made absolute here)."""
    local = jnp.arange(class_next.shape[0])
    rows = jnp.where(local < count, base + local, tables.final.shape[0])  # out of range: dropped
    absolute = jnp.where(class_next >= 0, class_next + base, REFUSED)
    return GuideTables(tables.token_class.at[slot].set(token_class),
                       tables.class_next.at[rows].set(absolute, mode="drop"),
                       tables.final.at[rows].set(final, mode="drop"), tables.eos)


def install_arrays(automaton: TokenAutomaton, max_states: int, classes: int) -> dict[str, np.ndarray]:
    """An automaton as `install`'s fixed-shape blocks (one compile for every grammar)."""
    n = automaton.num_states
    class_next = np.full((max_states, classes), REFUSED, np.int32)
    class_next[:n, : automaton.num_classes] = automaton.class_next
    final = np.zeros(max_states, bool)
    final[:n] = automaton.final
    return {"token_class": automaton.token_class, "class_next": class_next, "final": final}
