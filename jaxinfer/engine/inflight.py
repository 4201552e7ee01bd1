"""What the engine keeps of a dispatched step until it reads it back: its chunks, its device
result, its number, and the prompt positions it scores."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxinfer.engine.sequence import ScheduledChunk, Sequence
from jaxinfer.engine.step_inputs import StepResult


@dataclass(frozen=True)
class ScoredSpan:
    """Prompt positions [first, first + count) of a sequence, scored at [offset, offset + count) of a batch."""

    seq: Sequence
    offset: int
    first: int
    count: int


@dataclass
class InflightStep:
    chunks: list[ScheduledChunk]
    result: StepResult
    number: int  # the count of steps launched, this one included
    scored: list[ScoredSpan] = dataclasses.field(default_factory=list)  # prompt positions it scores
