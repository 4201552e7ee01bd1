"""Which compiled grammars are on the device, where, and who uses them (the host's record of
`GuideTables`, engine/guide_tables.py).

A grammar holds one of `engine.guided_grammars` slots and a contiguous run of pool rows while
loaded. Running sequences count as its users; a grammar nobody uses stays loaded (the next request
with the same constraint needs no copy) until a new grammar needs its slot or rows, then the least
recently used goes first. When nothing can be evicted the new sequence waits, like one waiting for
pages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass
class LoadedGrammar:
    slot: int
    base: int  # its first pool row
    states: int
    users: int = 0
    last_use: int = 0


class GuideSlots:
    """Places grammars in slots and pool rows; `place` says where a new one goes (None: no room now)."""

    def __init__(self, grammars: int, pool_states: int):
        self.grammars, self.pool_states = grammars, pool_states
        self.loaded: dict[str, LoadedGrammar] = {}
        self._clock = itertools.count(1)

    @property
    def users(self) -> int:
        return sum(g.users for g in self.loaded.values())

    def use(self, key: str) -> LoadedGrammar | None:
        """The grammar if loaded, with one more user."""
        grammar = self.loaded.get(key)
        if grammar is not None:
            grammar.users += 1
            grammar.last_use = next(self._clock)
        return grammar

    def release(self, key: str) -> None:
        self.loaded[key].users -= 1

    def place(self, key: str, states: int) -> LoadedGrammar | None:
        """Room for a new grammar of `states` states (evicting unused ones as needed), recorded with one
        user; the caller writes it to the device there. None while the room is held by users (then
        nothing is evicted)."""
        if self._free_spot(states, [g for g in self.loaded.values() if g.users]) is None:
            return None
        while (spot := self._free_spot(states, list(self.loaded.values()))) is None:
            idle = [k for k, g in self.loaded.items() if g.users == 0]
            del self.loaded[min(idle, key=lambda k: self.loaded[k].last_use)]
        grammar = self.loaded[key] = LoadedGrammar(*spot, states, 1, next(self._clock))
        return grammar

    def forget(self, key: str) -> None:
        """Drops a grammar whose write to the device failed."""
        self.loaded.pop(key, None)

    def _free_spot(self, states: int, kept: list[LoadedGrammar]) -> tuple[int, int] | None:
        """(slot, base) for a grammar of `states` states beside `kept`: the first gap that fits."""
        slots = set(range(self.grammars)) - {g.slot for g in kept}
        if not slots:
            return None
        start = 0
        for grammar in sorted(kept, key=lambda g: g.base):
            if grammar.base - start >= states:
                break
            start = grammar.base + grammar.states
        if start + states > self.pool_states:
            return None
        return min(slots), start
