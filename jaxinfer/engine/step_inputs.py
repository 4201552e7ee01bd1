"""What the jitted step takes and gives: the host's padded arrays (`HostBatch`), their one-buffer
form (`PackedInputs`), the device-side view (`StepInputs`), and a dispatched step (`StepResult`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxinfer.engine.guide_tables import GuideInputs
from jaxinfer.engine.logit_bias import BiasInputs
from jaxinfer.engine.penalties import PenaltyInputs
from jaxinfer.engine.prompt_logprobs import PromptScoring
from jaxinfer.engine.sampler import SamplingInputs
from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.processor.unit import ExecReport


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    tokens: jax.Array  # [T] int32
    from_prev: jax.Array  # [T] int32: row of the previous step's sampled ids to use instead (-1: use `tokens`)
    meta: AttentionMetadata
    logits_rows: jax.Array  # [S] int32: index in `tokens` of each row's last token
    sampling: SamplingInputs
    bias: BiasInputs
    guide: GuideInputs
    penalties: PenaltyInputs
    top_logprobs: jax.Array  # [S] int32: how many alternatives the row wants (0: none)
    adapters: jax.Array  # [T] int32: each token's LoRA adapter slot (0: none)
    prompt: PromptScoring  # the prompt positions to score (engine/prompt_logprobs.py)


@dataclasses.dataclass
class HostBatch:
    """The numpy arrays of one step, already padded to a bucket (see `ModelRunner.empty_batch`)."""

    tokens: np.ndarray
    from_prev: np.ndarray
    positions: np.ndarray
    seq_rows: np.ndarray
    write_slots: np.ndarray
    page_table: np.ndarray
    logits_rows: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    step: np.ndarray
    banned: np.ndarray
    bias_ids: np.ndarray
    bias_values: np.ndarray
    guide_state: np.ndarray
    guide_grammar: np.ndarray
    guide_prev: np.ndarray
    guide_mask_row: np.ndarray
    guide_bitmask: np.ndarray
    penalty_slot: np.ndarray
    repetition_penalty: np.ndarray
    frequency_penalty: np.ndarray
    presence_penalty: np.ndarray
    top_logprobs: np.ndarray
    adapters: np.ndarray
    prompt_targets: np.ndarray
    prompt_alternatives: np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def arrays(self) -> dict[str, np.ndarray]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def to_inputs(self) -> StepInputs:
        meta = AttentionMetadata(self.positions, self.seq_rows, self.page_table, self.write_slots)
        sampling = SamplingInputs(
            self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.step, self.banned
        )
        penalties = PenaltyInputs(self.penalty_slot, self.repetition_penalty, self.frequency_penalty,
                                  self.presence_penalty)
        return StepInputs(self.tokens, self.from_prev, meta, self.logits_rows, sampling,
                          BiasInputs(self.bias_ids, self.bias_values),
                          GuideInputs(self.guide_state, self.guide_grammar, self.guide_prev, self.guide_mask_row,
                                      self.guide_bitmask), penalties,
                          self.top_logprobs, self.adapters,
                          PromptScoring(self.prompt_targets, self.prompt_alternatives))

    def packed(self) -> PackedInputs:
        """The arrays as one int32 buffer: one host-to-device copy per step instead of one per array."""
        arrays = self.arrays()
        layout = tuple((name, a.shape, a.dtype.str) for name, a in arrays.items())
        return PackedInputs(np.concatenate([a.reshape(-1).view(np.int32) for a in arrays.values()]), layout)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["words"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class PackedInputs:
    """A `HostBatch` in one int32 buffer (every field is 4 bytes wide), unpacked inside the step.

    The layout (each field's name, shape and dtype, in order) is static, so each bucket's layout is
    part of its compiled executable."""

    words: jax.Array | np.ndarray
    layout: tuple[tuple[str, tuple[int, ...], str], ...]

    def unpack(self) -> StepInputs:
        arrays, offset = {}, 0
        for name, shape, dtype in self.layout:
            size = int(np.prod(shape))
            part = self.words[offset : offset + size]
            if np.dtype(dtype) != np.int32:
                part = jax.lax.bitcast_convert_type(part, np.dtype(dtype))
            arrays[name] = part.reshape(shape)
            offset += size
        return HostBatch(**arrays).to_inputs()


@dataclasses.dataclass
class StepResult:
    """One dispatched step: its sampled ids and logprobs stay on the device until `fetch`."""

    tokens: jax.Array  # [max_seqs] int32
    logprobs: jax.Array  # [max_seqs] float32
    rows: int
    top: tuple[jax.Array, jax.Array] | None = None  # [max_seqs, MAX_TOP_LOGPROBS] ids, logprobs (rows asked)
    # Scored prompt positions (some asked): [T] target logprobs, [T, MAX_TOP_LOGPROBS] ids and logprobs.
    prompt: tuple[jax.Array, jax.Array, jax.Array] | None = None
    _top_host: tuple[np.ndarray, np.ndarray] | None = dataclasses.field(default=None, init=False, repr=False)
    _prompt_host: tuple[np.ndarray, ...] | None = dataclasses.field(default=None, init=False, repr=False)
    exec_report: ExecReport | None = None  # the processor's slots after this step (when it has any)
    number: int = -1  # dispatch order on its runner (followers of a process group replay by it)

    def fetch_exec(self) -> ExecReport | None:
        return None if self.exec_report is None else ExecReport(*jax.device_get(tuple(self.exec_report)))

    def fetch(self) -> tuple[np.ndarray, np.ndarray]:
        """Waits for the step and returns (sampled token per row, its logprob) on the host; the
        alternatives and prompt scores, when asked for, come in the same read (`fetch_top`, `fetch_prompt`)."""
        # explicit: the transfer guard allows it
        tokens, logprobs, top, prompt = jax.device_get((self.tokens, self.logprobs, self.top, self.prompt))
        self._top_host = None if top is None else (top[0][: self.rows], top[1][: self.rows])
        self._prompt_host = prompt
        return tokens[: self.rows], logprobs[: self.rows]

    def fetch_top(self) -> tuple[np.ndarray, np.ndarray] | None:
        """After `fetch`: each row's alternatives ([rows, MAX_TOP_LOGPROBS] ids and logprobs), if asked for."""
        return self._top_host

    def fetch_prompt(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """After `fetch`: the scored prompt positions ([T] logprobs, [T, MAX_TOP_LOGPROBS] ids and logprobs)."""
        return self._prompt_host
