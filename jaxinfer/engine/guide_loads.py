"""The runner's guided-output tables: made empty, given the tokenizer's EOS ids, and loaded with a
grammar where `GuideSlots` places it (sent to a process group's followers like an adapter load).

A mixin of `ModelRunner` (engine/step.py); the tables and the mask are engine/guide_tables.py's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import llguidance.numpy
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.guide_slots import GuideSlots, LoadedGrammar
from jaxinfer.engine.guide_tables import GuideTables, empty_tables, eos_row, install, install_arrays
from jaxinfer.guided.automaton import TokenAutomaton
from jaxinfer.parallel.transfer import to_devices


class GuideLoads:
    """`guide_tables` (device), `guide_slots` (host record), `guide_compiler` (set by the first engine)."""

    cfg: EngineConfig
    model_cfg: ModelConfig
    mesh: Mesh
    replicated: NamedSharding
    guide_tables: GuideTables
    _replicated: Callable

    def _init_guides(self) -> None:
        cfg, vocab = self.cfg, self.model_cfg.vocab_size
        tables = empty_tables(cfg.guided_grammars, cfg.guided_pool_states, cfg.guided_max_classes, vocab, [])
        self.guide_tables = to_devices(tables, self.replicated)
        self.guide_slots = GuideSlots(cfg.guided_grammars, cfg.guided_pool_states)
        self.guide_compiler = None  # a GuideCompiler, made by the first engine (it has the tokenizer)
        self._install_guide_fn = jax.jit(install, donate_argnums=(0,), out_shardings=self.replicated)
        self.grammar_matchers = None  # a GrammarMatchers (host-masked grammars), made by the first engine
        self.free_mask_rows = list(range(cfg.guided_host_rows - 1, -1, -1))
        # Each step carries [guided_host_rows, ceil(vocab / 32)] int32 of host-filled masks (1 x 1: none).
        rows = cfg.guided_host_rows
        self.bitmask_shape = llguidance.numpy.get_bitmask_shape(rows, vocab) if rows else (1, 1)

    def set_guide_eos(self, eos_ids: list[int]) -> None:
        """The ids the guided mask allows in accepting states (the tokenizer's EOS)."""
        eos = eos_row(eos_ids)
        self.guide_tables = dataclasses.replace(self.guide_tables, eos=to_devices(eos, self.replicated))

    def load_guide(self, key: str, automaton: TokenAutomaton) -> LoadedGrammar | None:
        """A grammar on the device for one more user: already there, or written now (None: no room yet)."""
        loaded = self.guide_slots.use(key)
        if loaded is not None:
            return loaded
        loaded = self.guide_slots.place(key, automaton.num_states)
        if loaded is not None:
            arrays = install_arrays(automaton, self.cfg.guided_max_states, self.cfg.guided_max_classes)
            try:
                self._replicated(lambda: self._install_guide(loaded.slot, loaded.base, loaded.states, arrays),
                                 "load_guide", {"slot": loaded.slot, "base": loaded.base, "states": loaded.states},
                                 arrays)
            except BaseException:
                self.guide_slots.forget(key)
                raise
        return loaded

    def _empty_guide_blocks(self) -> dict[str, np.ndarray]:
        """What warm-up writes to compile the loader: no states."""
        return install_arrays(TokenAutomaton.nothing(self.model_cfg.vocab_size), self.cfg.guided_max_states,
                              self.cfg.guided_max_classes)

    def _install_guide(self, slot: int, base: int, states: int, arrays: dict[str, np.ndarray]) -> None:
        scalars = to_devices((np.int32(slot), np.int32(base), np.int32(states)), self.replicated)
        blocks = to_devices((arrays["token_class"], arrays["class_next"], arrays["final"]), self.replicated)
        self.guide_tables = self._install_guide_fn(self.guide_tables, scalars[0], scalars[1], *blocks, scalars[2])
