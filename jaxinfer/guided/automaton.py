"""A finite token automaton in the form the step reads: token classes and a state x class table.

outlines-core's `Index` gives, per state, a map token -> next state. Tokens that every state treats
alike (the same next state everywhere, or refused everywhere) form one class; real schemas have
5,000+ states but under 200 classes over SmolLM2's 49,152 tokens (docs/guided.md), so the device
holds `token_class` [vocab] and `class_next` [states, classes] instead of a [states, vocab] table.

Classes are found by hashing each token's column of next states, two independent 64-bit hashes
updated one state at a time, then checked exactly against the index's transitions: a collision
would be an error, never a wrong mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REFUSED = -1
_MULTIPLIERS = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F))


@dataclass(frozen=True)
class TokenAutomaton:
    """States 0..n-1 (0 is the start); `class_next[s, token_class[t]]` is the state after token t, or -1."""

    token_class: np.ndarray  # [vocab] int32
    class_next: np.ndarray  # [states, classes] int32
    final: np.ndarray  # [states] bool: the text so far is a whole match (EOS allowed)

    @classmethod
    def nothing(cls, vocab_size: int) -> TokenAutomaton:
        """No states at all (what warm-up loads to compile the loader)."""
        return cls(np.zeros(vocab_size, np.int32), np.full((0, 1), REFUSED, np.int32), np.zeros(0, bool))

    @property
    def num_states(self) -> int:
        return self.class_next.shape[0]

    @property
    def num_classes(self) -> int:
        return self.class_next.shape[1]

    def next_state(self, state: int, token: int) -> int:
        """The state after `token` (REFUSED if the automaton does not allow it)."""
        return int(self.class_next[state, self.token_class[token]])

    def allowed(self, state: int) -> np.ndarray:
        """[vocab] bool: the tokens allowed in `state` (EOS not included: see `final`)."""
        return self.class_next[state][self.token_class] != REFUSED

    def walk(self, tokens: list[int], state: int = 0) -> int:
        """The state after `tokens` from `state`; REFUSED once a token is refused."""
        for token in tokens:
            if state == REFUSED:
                break
            state = self.next_state(state, token)
        return state


def from_transitions(transitions: dict[int, dict[int, int]], initial: int, finals: set[int], vocab_size: int,
                     allowed_ids: np.ndarray) -> TokenAutomaton:
    """Builds the tables from an index's transitions; tokens where `allowed_ids` ([vocab] bool) is false
    (specials, EOS) are dropped, which leaves EOS to `final`."""
    reached = {n for row in transitions.values() for n in row.values()}
    states = [initial, *sorted((transitions.keys() | reached | finals) - {initial})]
    number = np.full(max(states) + 1, REFUSED, np.int32)
    number[states] = np.arange(len(states), dtype=np.int32)
    rows = [_row(transitions.get(state, {}), number, allowed_ids) for state in states]
    token_class = _classes(rows, vocab_size)
    class_next = np.full((len(states), int(token_class.max()) + 1), REFUSED, np.int32)
    for i, (tokens, nexts) in enumerate(rows):
        class_next[i, token_class[tokens]] = nexts
    automaton = TokenAutomaton(token_class, class_next, np.array([s in finals for s in states]))
    _check_exact(automaton, rows)
    return automaton


def _row(row: dict[int, int], number: np.ndarray, allowed_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.fromiter(row.keys(), np.int64, len(row))
    nexts = number[np.fromiter(row.values(), np.int64, len(row))]
    kept = allowed_ids[tokens]
    return tokens[kept], nexts[kept]


def _classes(rows: list[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """[vocab] int32: each token's class, numbered in order of first appearance (class of id 0 first)."""
    hashes = np.zeros((2, vocab_size), np.uint64)
    with np.errstate(over="ignore"):
        for tokens, nexts in rows:
            for h, multiplier in zip(hashes, _MULTIPLIERS, strict=True):
                h *= multiplier
                h[tokens] += nexts.astype(np.uint64) + np.uint64(1)
    _, first, inverse = np.unique(hashes.T, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))  # renumber by first token so the numbering is stable
    return order[inverse.reshape(-1)].astype(np.int32)


def _check_exact(automaton: TokenAutomaton, rows: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for state, (tokens, nexts) in enumerate(rows):
        allowed = automaton.allowed(state)
        if allowed.sum() != tokens.size or not (automaton.class_next[state, automaton.token_class[tokens]]
                                                == nexts).all():
            raise RuntimeError(f"guided: token classes collided at state {state}; the automaton is not exact")
