"""Test harness: run a model directly through the paged cache and get every token's logits.

This bypasses the engine loop on purpose: parity tests compare raw logits, not sampled tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.models import LlamaForCausalLM


class PagedForward:
    """One sequence at a time, written into a page pool whose pages are handed out in a shuffled order."""

    def __init__(self, model: LlamaForCausalLM, page_size: int = 8, num_pages: int = 64, max_pages: int = 32, seed=0,
                 adapter_slot: int | None = None):
        self.adapter_slot = adapter_slot  # a LoRA slot for every token (None: the model without adapters)
        self.page_size, self.max_pages = page_size, max_pages
        self.graphdef, self.state = nnx.split(model)
        self.caches = model.empty_caches(num_pages, page_size)
        order = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
        self.pages = order[:max_pages].astype(np.int32)  # non-contiguous, never the null page
        self._fn = jax.jit(self._forward, static_argnums=0)

    @staticmethod
    def _forward(graphdef, state, caches, tokens, meta, slots):
        model = nnx.merge(graphdef, state)
        hidden, caches = model(tokens, caches, meta, slots)
        return model.logits(hidden, slots), caches

    def run(self, tokens: list[int], start: int) -> np.ndarray:
        """Feeds tokens at positions start.. and returns their logits [len(tokens), vocab]."""
        logits, self.caches = self._fn(*self._arguments(tokens, start))
        return np.asarray(logits)

    def compiled_text(self, tokens: list[int], start: int) -> str:
        """The optimized HLO of the step `run(tokens, start)` would run."""
        return self._fn.lower(*self._arguments(tokens, start)).compile().as_text()

    def compiled_memory(self, tokens: list[int], start: int):
        """XLA's memory analysis of that step (its temporaries: `temp_size_in_bytes`)."""
        return self._fn.lower(*self._arguments(tokens, start)).compile().memory_analysis()

    def _arguments(self, tokens: list[int], start: int) -> tuple:
        positions = np.arange(start, start + len(tokens), dtype=np.int32)
        meta = AttentionMetadata(
            positions=jnp.asarray(positions),
            seq_rows=jnp.zeros(len(tokens), jnp.int32),
            page_table=jnp.asarray(self.pages[None, :]),
            write_slots=jnp.asarray(self.pages[positions // self.page_size] * self.page_size
                                    + positions % self.page_size),
        )
        slots = None if self.adapter_slot is None else jnp.full(len(tokens), self.adapter_slot, jnp.int32)
        return self.graphdef, self.state, self.caches, jnp.asarray(tokens, jnp.int32), meta, slots


def prefill_then_decode(model, prompt: list[int], chunks: tuple[int, ...], steps: int, page_size: int = 8
                        ) -> tuple[np.ndarray, list[int]]:
    """Prefill in `chunks`, then `steps` greedy decode steps: (logits [len(tokens), vocab], tokens fed)."""
    assert sum(chunks) == len(prompt)
    fwd = PagedForward(model, page_size=page_size)
    rows, start = [], 0
    for n in chunks:
        rows.append(fwd.run(prompt[start : start + n], start))
        start += n
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(rows[-1][-1])))
        rows.append(fwd.run(tokens[-1:], len(tokens) - 1))
    return np.concatenate(rows), tokens
