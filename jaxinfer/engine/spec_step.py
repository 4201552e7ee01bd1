"""The device side of speculative decoding: the draft's KV pools, its propose step, and the verify step.

The draft has its own KV pools with the target's page count and page size, indexed by the same
page ids: a sequence's page table serves both models, so prefix-cache hits, preemption and page
freeing need nothing of their own. Every engine step in speculative mode is a verify step: the
target runs the ragged batch (prefill chunks, and for a speculating row its last token followed by
the draft's proposals), the draft runs the same batch so its KV covers exactly what the target's
does, and `spec.verify` accepts proposals and draws each row's next token. Proposals come from the
propose step, one position per call over the speculating rows, reading the previous call's tokens
on the device. Shapes: one verify and one propose executable per token bucket; the proposals'
distributions are passed as K arrays of [max_seqs, vocab] whatever the bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.engine.guide_tables import GuideTables, constrain, constrain_path
from jaxinfer.engine.spec import propose, verify
from jaxinfer.engine.step import ModelRunner, keep_shardings
from jaxinfer.engine.step_inputs import HostBatch, PackedInputs
from jaxinfer.errors import ConfigError
from jaxinfer.models import CausalLM
from jaxinfer.parallel.transfer import to_devices

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecInputs:
    logits_rows: jax.Array  # [S, K+1] int32: token index of each scored position (the last repeated)
    draft_tokens: jax.Array  # [max_seqs, K] int32
    num_proposed: jax.Array  # [max_seqs] int32


@dataclasses.dataclass
class ProposeResult:
    tokens: jax.Array  # [max_seqs] int32
    probs: jax.Array  # [max_seqs, V] float32
    confidence: jax.Array  # [max_seqs] float32


@dataclasses.dataclass
class VerifyResult:
    tokens: jax.Array  # [S, K+1]
    counts: jax.Array  # [S]
    logprobs: jax.Array  # [S, K+1]

    def fetch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return jax.device_get((self.tokens, self.counts, self.logprobs))


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def _propose_step(graphdef, state, caches, prev_tokens: jax.Array, packed: PackedInputs, guides: GuideTables):
    inputs = packed.unpack()
    draft = nnx.merge(graphdef, state)
    ids = jnp.where(inputs.from_prev >= 0, prev_tokens[jnp.maximum(inputs.from_prev, 0)], inputs.tokens)
    hidden, caches = draft(ids, caches, inputs.meta)
    # A guided row's draft proposes only what its automaton allows (q is then the masked distribution,
    # which verification divides by: still lossless, and no proposal is wasted on a refused id).
    logits = constrain(draft.logits(hidden[inputs.logits_rows]), guides, inputs.guide, prev_tokens)
    tokens, probs, confidence = propose(logits, inputs.sampling)
    rows = prev_tokens.shape[0]
    return caches, _pad_rows(tokens, rows), _pad_rows(probs, rows), _pad_rows(confidence, rows)


def _scored_logits(model, hidden: jax.Array, logits_rows: jax.Array) -> jax.Array:
    """Target logits [rows, K+1, V] at each row's scored positions.

    The head runs on whichever is smaller: every token of the bucket (then the scored positions are
    gathered from its logits) or every (row, position) pair. At batch 1 a bucket of 4 tokens has 4
    rows of K+1 positions, so scoring the tokens is 4x less head work than scoring the pairs."""
    rows, width = logits_rows.shape
    if hidden.shape[0] < rows * width:
        return model.logits(hidden)[logits_rows]
    return model.logits(hidden[logits_rows.reshape(-1)]).reshape(rows, width, -1)


def _verify_step(graphdef, state, draft_graphdef, draft_state, caches, draft_caches, draft_probs,
                 packed: PackedInputs, spec: SpecInputs, guides: GuideTables, *, cache_shardings,
                 draft_cache_shardings):
    inputs = packed.unpack()
    model, draft = nnx.merge(graphdef, state), nnx.merge(draft_graphdef, draft_state)
    hidden, caches = model(inputs.tokens, caches, inputs.meta)
    _, draft_caches = draft(inputs.tokens, draft_caches, inputs.meta)  # the draft's KV keeps pace
    caches = keep_shardings(caches, cache_shardings)
    draft_caches = keep_shardings(draft_caches, draft_cache_shardings)
    rows = spec.logits_rows.shape[0]
    logits = _scored_logits(model, hidden, spec.logits_rows)
    probs = jnp.stack(draft_probs, axis=1)[:rows]
    drafts = spec.draft_tokens[:rows]
    guided = constrain_path(logits, guides, inputs.guide, drafts)  # a refused proposal is a rejected one
    tokens, counts, logprobs = verify(logits, probs, drafts, spec.num_proposed[:rows], inputs.sampling,
                                      adjusted=guided)
    return caches, draft_caches, tokens, counts, logprobs


class SpecRunner:
    """The draft model next to a target `ModelRunner`, proposing up to `num_draft_tokens` per round."""

    def __init__(self, target: ModelRunner, draft: CausalLM, draft_cfg: ModelConfig, num_draft_tokens: int):
        if draft_cfg.vocab_size != target.model_cfg.vocab_size:
            raise ConfigError(f"draft_model: vocabulary of {draft_cfg.vocab_size} ids, the target's has "
                              f"{target.model_cfg.vocab_size}; a draft must share the target's vocabulary")
        if num_draft_tokens < 1:
            raise ConfigError(f"engine.num_draft_tokens must be at least 1 with a draft model, got {num_draft_tokens}")
        self.target, self.draft_cfg, self.k = target, draft_cfg, num_draft_tokens
        self.graphdef, self.state = nnx.split(draft)
        self.caches = draft.empty_caches(target.cfg.num_pages, target.cfg.page_size, target.mesh)
        max_seqs, vocab = target.cfg.max_seqs, draft_cfg.vocab_size
        self._no_probs = to_devices(np.zeros((max_seqs, vocab), np.float32), target.replicated)
        # Proposals feed later calls compiled for replicated inputs: pin them replicated (with a
        # model-sharded vocabulary the compiler could otherwise leave `probs` sharded).
        cache_shardings = jax.tree.map(lambda x: x.sharding, self.caches)
        replicated = target.replicated
        self._propose_jit = jax.jit(_propose_step, static_argnums=0, donate_argnums=(2,),
                                    out_shardings=(cache_shardings, replicated, replicated, replicated))
        verify_step = functools.partial(_verify_step, cache_shardings=target.cache_shardings,
                                        draft_cache_shardings=cache_shardings)
        self._verify_jit = jax.jit(verify_step, static_argnums=(0, 2), donate_argnums=(4, 5))
        self._propose_exes: dict[int, jax.stages.Compiled] = {}
        self._verify_exes: dict[int, jax.stages.Compiled] = {}

    @property
    def num_compiles(self) -> int:
        return len(self._verify_exes) + len(self._propose_exes)

    # -- host arrays -----------------------------------------------------------------------------
    def empty_spec(self, bucket: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(logits_rows [S, K+1], draft_tokens [max_seqs, K], num_proposed [max_seqs]), all zero."""
        rows, max_seqs = self.target.rows_for(bucket), self.target.cfg.max_seqs
        return (np.zeros((rows, self.k + 1), np.int32), np.zeros((max_seqs, self.k), np.int32),
                np.zeros(max_seqs, np.int32))

    # -- compile ---------------------------------------------------------------------------------
    def _compile_propose(self, bucket: int) -> jax.stages.Compiled:
        t = self.target
        return self._propose_jit.lower(self.graphdef, self.state, self.caches, t.no_tokens,
                                       t.abstract_inputs(bucket), t.guide_tables).compile()

    def _compile_verify(self, bucket: int) -> jax.stages.Compiled:
        t = self.target
        spec = SpecInputs(*(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=t.replicated)
                            for a in self.empty_spec(bucket)))
        probs = tuple(self._no_probs for _ in range(self.k))
        return self._verify_jit.lower(t.graphdef, t.state, self.graphdef, self.state, t.caches, self.caches, probs,
                                      t.abstract_inputs(bucket), spec, t.guide_tables).compile()

    def propose_buckets(self) -> list[int]:
        """Buckets a propose call can use: one token per speculating row, at most max_seqs rows."""
        fits = [b for b in self.target.cfg.token_buckets if b < self.target.cfg.max_seqs]
        return [*fits, self.target.bucket_for(min(self.target.cfg.max_seqs, self.target.cfg.token_buckets[-1]))]

    @property
    def refill_bucket(self) -> int:
        """The largest propose bucket, compiled for computing the draft's KV of restored pages."""
        return self.target.cfg.token_buckets[-1]

    def smallest_propose_bucket(self, tokens: int, rows: int) -> int:
        """The smallest compiled propose bucket with room for `tokens` tokens in `rows` rows."""
        return min(b for b in self._propose_exes if b >= tokens and self.target.rows_for(b) >= rows)

    def warmup_refill(self) -> None:
        """Compiles the propose step for `refill_bucket` (needed where pages can be restored: KV tiers)."""
        if self.refill_bucket not in self._propose_exes:
            self._propose_exes[self.refill_bucket] = self._compile_propose(self.refill_bucket)

    def warmup(self) -> None:
        start = time.perf_counter()
        for bucket in self.target.cfg.token_buckets:
            if bucket not in self._verify_exes:
                self._verify_exes[bucket] = self._compile_verify(bucket)
        for bucket in self.propose_buckets():
            if bucket not in self._propose_exes:
                self._propose_exes[bucket] = self._compile_propose(bucket)
        log.info("compiled the speculative verify and propose steps in %.1fs", time.perf_counter() - start)

    # -- run ---------------------------------------------------------------------------------------
    def propose(self, batch: HostBatch, previous: ProposeResult | None) -> ProposeResult:
        exe = self.target.executable_from(self._propose_exes, batch.num_tokens, self._compile_propose, "propose")
        inputs = to_devices(batch.packed(), self.target.replicated)
        prev = previous.tokens if previous is not None else self.target.no_tokens
        self.caches, tokens, probs, confidence = exe(self.state, self.caches, prev, inputs, self.target.guide_tables)
        return ProposeResult(tokens, probs, confidence)

    def verify(self, batch: HostBatch, spec: tuple[np.ndarray, np.ndarray, np.ndarray],
               proposals: list[ProposeResult]) -> VerifyResult:
        t = self.target
        exe = t.executable_from(self._verify_exes, batch.num_tokens, self._compile_verify, "verify")
        t.copy_evicted_pages()
        inputs = to_devices(batch.packed(), t.replicated)
        spec_inputs = to_devices(SpecInputs(*spec), t.replicated)
        probs = tuple(p.probs for p in proposals) + (self._no_probs,) * (self.k - len(proposals))
        t.caches, self.caches, tokens, counts, logprobs = exe(t.state, self.state, t.caches, self.caches, probs,
                                                              inputs, spec_inputs, t.guide_tables)
        return VerifyResult(tokens, counts, logprobs)
