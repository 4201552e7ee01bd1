r"""Segmented encoding: a long text cut where no token can span, the pieces encoded in parallel.

Concern: speed only. `encode_segmented(backend, text)` returns exactly
`backend.encode(text, add_special_tokens=False).ids`, for any text; it cuts the text into segments
of about `segment_chars` characters and encodes them with one `encode_batch` call (Rust threads).
Where it cannot show that a cut is exact it does not cut; with no cut it makes one `encode` call.

Why a cut at p is exact. The ids of a text are BPE applied to each pre-token on its own, after the
added tokens are split out. So a cut is exact when (1) p is a pre-token boundary of the whole text and
(2) pre-tokenizing `text[:p]` and `text[p:]` alone gives the same pre-tokens. From p on, the
pre-tokens of the whole text and of `text[p:]` agree (the regexes have no look-behind or anchors), so
what remains is that p is a boundary and that no pre-token ending at p changes when the text stops
there. For the pre-tokenizers below that follows from `text[p-2 : p+2]` alone, whatever is before:

GPT-2 regex `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` (ByteLevel
with use_regex: SmolLM2, GPT-2), alone or after a Digits split (SmolLM2; it cuts around numerics only):
  word  p-1 an ASCII letter, p a space. Only the contractions and ` ?\p{L}+` cover a letter, and they
        end where the letters end, with or without text after p.
  line  p-2 not whitespace, p-1 a newline, p not whitespace. No alternative runs from a non-space
        character into whitespace, so the newline starts a pre-token; `\s+(?!\S)` fails before p's
        character and `\s+` takes the newline alone, as `\s+(?!\S)` does at the end of `text[:p]`.
        (After a longer whitespace run, the whole text splits the run before its last character but
        `text[:p]` keeps it whole: not a cut.)
  run   p-1 and p ASCII whitespace, p+1 neither whitespace nor numeric: `\s+(?!\S)` ends the run's
        first pre-token just before its last character, at p, and takes the same run to the end of
        `text[:p]`. (Before a numeric the Digits split ends the stretch there and the run stays whole.)
Llama 3 / Qwen2 split regex `(?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
\s*[\r\n]+|\s+(?!\S)|\s+` (`\p{N}` for Qwen2), then a byte-level mapping without regex:
  word  as above: `[^\r\n\p{L}\p{N}]?\p{L}+` also ends where the letters end.
  line  p-1 a newline; from p, spaces or tabs (or none), then a character that is not whitespace.
        Whatever covers the newline continues only over whitespace, and the last newline of that
        whitespace is p-1: `\s*[\r\n]+` ends there, at p, from any start in the whitespace before p
        (with or without the text after it; the alternatives before it fail on whitespace followed
        by whitespace, or on a newline), and the punctuation alternative's `[\r\n]*` tail stops at p
        either way. So an indented line starts a cut too: "\n" | "    x".

Character classes are read conservatively: ASCII letters and ASCII whitespace where a rule needs a
member of a class; "not whitespace" is not `str.isspace()` (a superset of White_Space) and assigned
in Python's Unicode tables (tokenizers' Rust may know a newer Unicode: a character Python sees as
unassigned could be a digit there); "not numeric" is not `str.isnumeric()` (a superset of N*).
Each cut is then confirmed on the real pre-tokenizer: `pre_tokenize_str` of a window around p must
equal that of its two halves.

Added tokens are matched before pre-tokenization (leftmost-longest; with `encode_special_tokens` on,
the non-special ones only) and cut the text into stretches that are pre-tokenized apart. A cut is
refused when any added token, matched or not, overlaps `text[p-2 : p+2]`: then no match crosses p,
so both sides find the same matches, and the characters the rules read are plain text of one
stretch. It is refused too when a token with lstrip, rstrip or single_word occurs by the whitespace
around p (it could take that whitespace across the cut). A normalizer, truncation, padding, BPE
dropout or any other pre-tokenizer means no cut at all.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from tokenizers import Tokenizer as Backend

__all__ = ["DEFAULT_SEGMENT_CHARS", "SegmentedEncoder", "encode_segmented"]

DEFAULT_SEGMENT_CHARS = 16384
WINDOW = 32  # characters each side of a cut for the pre-tokenizer check
_TRIES = 64  # candidates tried near one mark before moving on to the next
_RUN_LIMIT = 1024  # a whitespace run longer than this next to a cut (with lstrip/rstrip tokens): no cut

# The split regexes whose cut rules are argued above (llama.cpp's and Hugging Face's spellings).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_KNOWN_SPLITS = frozenset({LLAMA3_SPLIT, QWEN2_SPLIT})

_ASCII_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_ASCII_SPACE = frozenset(" \t\n\r")


def _solid(c: str) -> bool:
    """Surely not whitespace to the regex engine: not `str.isspace()` (a superset of White_Space), and
    assigned in Python's Unicode tables (the Rust side may know a newer Unicode)."""
    return not c.isspace() and unicodedata.category(c) != "Cn"


def _word_cut(text: str, p: int) -> bool:
    return text[p - 1] in _ASCII_LETTERS and text[p] == " "


def _gpt2_line_cut(text: str, p: int) -> bool:
    return p >= 2 and text[p - 1] == "\n" and _solid(text[p - 2]) and _solid(text[p])


def _gpt2_run_cut(text: str, p: int) -> bool:
    if p + 1 >= len(text) or text[p - 1] not in _ASCII_SPACE or text[p] not in _ASCII_SPACE:
        return False
    after = text[p + 1]
    return _solid(after) and not after.isnumeric()


def _split_line_cut(text: str, p: int) -> bool:
    if text[p - 1] != "\n":
        return False
    end = p
    while end < len(text) and end - p <= _RUN_LIMIT and text[end] in " \t":
        end += 1
    return end < len(text) and _solid(text[end])


@dataclass(frozen=True)
class _Family:
    name: str
    # Matches at a whitespace character near a possible cut, which is where its empty group matched
    # (a superset: `rules` decide). Anchoring on whitespace keeps the scan fast.
    candidates: re.Pattern[str]
    rules: tuple[Callable[[str, int], bool], ...]

    def accepts(self, text: str, p: int) -> bool:
        return any(rule(text, p) for rule in self.rules)


_GPT2 = _Family(
    "gpt2-regex",
    re.compile(r"(?=[\t\n\r ])(?:(?<=\S)\n()(?=\S)|[\t\n\r ]()(?=[\t\n\r ]\S)|(?<=[A-Za-z])() )"),
    (_gpt2_line_cut, _gpt2_run_cut, _word_cut),
)
_LLAMA3 = _Family(
    "llama3-split",
    re.compile(r"(?=[\t\n\r ])(?:\n()(?=[ \t]*\S)|(?<=[A-Za-z])() )"),
    (_split_line_cut, _word_cut),
)


def _family(state: dict) -> _Family | None:
    """The cut rules for a serialized pre-tokenizer, or None when it is not one argued above."""
    kind = state.get("type")
    if kind == "ByteLevel":
        return _GPT2 if state.get("use_regex") and not state.get("add_prefix_space") else None
    if kind != "Sequence":
        return None
    steps = list(state.get("pretokenizers") or [])
    while steps and steps[0].get("type") == "Digits":  # cuts at numerics only: local
        steps.pop(0)
    if len(steps) == 1:
        return _family(steps[0]) if steps[0].get("type") == "ByteLevel" else None
    if len(steps) != 2:
        return None
    split, byte_level = steps
    pattern = (split.get("pattern") or {}).get("Regex")
    if (
        split.get("type") == "Split"
        and pattern in _KNOWN_SPLITS
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex")
        and not byte_level.get("add_prefix_space")
    ):
        return _LLAMA3
    return None


class SegmentedEncoder:
    """Cut-and-batch encoding for one backend; the backend's settings are read once, here.

    Build it after configuring the backend (`encode_special_tokens`, added tokens): it keeps a
    snapshot of what decides the cuts.
    """

    def __init__(self, backend: Backend, *, segment_chars: int = DEFAULT_SEGMENT_CHARS):
        if segment_chars < 1:
            raise ValueError(f"segment_chars must be at least 1, got {segment_chars}")
        self.backend, self.segment_chars = backend, segment_chars
        self.family = self._analyse(backend)
        added = [t for t in backend.get_added_tokens_decoder().values() if t.content]
        self._by_first: dict[str, list[str]] = {}
        for token in sorted({t.content for t in added}, key=len, reverse=True):
            self._by_first.setdefault(token[0], []).append(token)
        self._longest = max((len(t.content) for t in added), default=0)
        self._strippers = sorted({t.content for t in added if t.lstrip or t.rstrip or t.single_word})

    @staticmethod
    def _analyse(backend: Backend) -> _Family | None:
        if backend.normalizer is not None or backend.truncation or backend.padding:
            return None
        if getattr(backend.model, "dropout", None):
            return None
        if backend.pre_tokenizer is None:
            return None
        return _family(json.loads(backend.pre_tokenizer.__getstate__()))

    def is_safe_cut(self, text: str, p: int) -> bool:
        """Whether encoding `text[:p]` and `text[p:]` separately gives exactly the ids of `text`."""
        if self.family is None or not 0 < p < len(text):
            return False
        return self.family.accepts(text, p) and self._clear_of_added_tokens(text, p) and self._window_agrees(text, p)

    def _clear_of_added_tokens(self, text: str, p: int) -> bool:
        # The rules read text[p-2 : p+2]; an added token overlapping it voids their argument (all
        # added tokens are checked, matched or not: conservative).
        lo, hi = max(0, p - 2), min(len(text), p + 2)
        for start in range(max(0, lo - self._longest + 1), hi):
            for token in self._by_first.get(text[start], ()):
                if start + len(token) > lo and text.startswith(token, start):
                    return False
        if not self._strippers:
            return True
        # A token that strips whitespace next to it could take the whitespace at the cut.
        lo = p
        while lo > 0 and text[lo - 1].isspace() and p - lo <= _RUN_LIMIT:
            lo -= 1
        hi = p
        while hi < len(text) and text[hi].isspace() and hi - p <= _RUN_LIMIT:
            hi += 1
        if p - lo > _RUN_LIMIT or hi - p > _RUN_LIMIT:
            return False
        return not any(text.find(t, max(0, lo - len(t)), hi + len(t)) != -1 for t in self._strippers)

    def _window_agrees(self, text: str, p: int) -> bool:
        pre = self.backend.pre_tokenizer
        left, right = text[max(0, p - WINDOW) : p], text[p : p + WINDOW]

        def pieces(s: str) -> list[str]:
            return [piece for piece, _ in pre.pre_tokenize_str(s)]

        return pieces(left + right) == pieces(left) + pieces(right)

    def cuts(self, text: str) -> list[int]:
        """Cut positions: near each mark `segment_chars` past the last cut, the first safe candidate.

        Empty for a text under two segments, or when this backend's pre-tokenizer is not supported.
        At most `_TRIES` candidates are tried within `segment_chars` of a mark; failing that, the
        search moves on to the next mark (so the Python work stays small on any text). Every
        segment, the last included, is at least `segment_chars` long.
        """
        size, n = self.segment_chars, len(text)
        if self.family is None or n < 2 * size:
            return []
        cuts: list[int] = []
        mark = size
        while n - mark >= size:
            found, limit = None, min(n - size, mark + size - 1)  # the last segment keeps `size` too
            # The candidate patterns look at most _RUN_LIMIT + 2 characters ahead.
            matches = self.family.candidates.finditer(text, mark, min(n, limit + _RUN_LIMIT + 3))
            for tries, match in enumerate(matches):
                p = match.start(match.lastindex or 0)
                if tries == _TRIES or p > limit:
                    break
                if self.is_safe_cut(text, p):
                    found = p
                    break
            if found is None:
                mark += size
                continue
            cuts.append(found)
            mark = found + size
        return cuts

    def encode(self, text: str) -> list[int]:
        cuts = self.cuts(text)
        if not cuts:
            return self.backend.encode(text, add_special_tokens=False).ids
        bounds = [0, *cuts, len(text)]
        segments = [text[a:b] for a, b in pairwise(bounds)]
        ids: list[int] = []
        for encoding in self.backend.encode_batch(segments, add_special_tokens=False):
            ids += encoding.ids
        return ids

    __call__ = encode


def encode_segmented(backend: Backend, text: str, *, segment_chars: int = DEFAULT_SEGMENT_CHARS) -> list[int]:
    """`backend.encode(text, add_special_tokens=False).ids`, computed segment-parallel for long texts."""
    if len(text) < 2 * segment_chars:
        return backend.encode(text, add_special_tokens=False).ids
    return SegmentedEncoder(backend, segment_chars=segment_chars).encode(text)
