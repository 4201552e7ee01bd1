"""Streaming detokenization: turning a growing list of token ids into text, one token at a time.

`IncrementalDetokenizer.push(id)` returns only text that no later token can change, at a cost that
depends on a short window of recent ids, never on how long the output already is.

How it works (the prefix-offset / read-offset technique): the detokenizer keeps a window of recent
ids starting at a "clean" boundary (one where the decoded text ended on a complete character) and the
window-relative text it has already accounted for (`_prefix`). Each push decodes the window once;
whatever the window text holds beyond `_prefix` is new. Decoding from a clean boundary rather than
from the newest token is what keeps the tokenizer's own context rules intact: a window decode strips
or mangles only its own first characters (Metaspace/`Strip` dropping a leading space, a window
starting inside a split UTF-8 character), and those lie in `_prefix` on both sides of the difference.

Text is held back only while the window text ends in U+FFFD: an incomplete UTF-8 sequence decodes as
one U+FFFD (byte-level BPE) or one per byte (byte fallback) that the next token may turn into a real
character, so up to three trailing U+FFFD are kept until a later token or `flush()` settles them.
Everything before them is final. A stall (every new token ending mid-character, e.g. rare CJK or
random ids) is bounded by re-anchoring the window on a later token once the texts of the old and new
windows provably agree.

Byte-fallback caveat: a run of `<0xNN>` tokens that is not valid UTF-8 as a whole decodes as one
U+FFFD per byte of the *whole* run, including characters that were already complete; no bounded
window can reproduce that. For byte runs that are valid UTF-8 (everything real text encodes to) and
for byte-level BPE vocabularies (Llama 3, SmolLM2, Qwen), the concatenation of every `push` and the
final `flush` equals `tokenizer.decode(all_ids)` exactly.
"""

from __future__ import annotations

from jaxinfer.tokenizer.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
_MAX_HELD = 3  # trailing U+FFFD that a later token may still rewrite (a 4-byte character's first three bytes)
_REANCHOR_AT = 16  # window length (tokens) at which a stalled window is moved forward
_KEEP = 8  # tokens a re-anchored window keeps
_HARD_CAP = 48  # window length at which re-anchoring is forced (only non-local decoders get here)
_SYNC_CHARS = 3  # a window starting mid-character resynchronizes within its first three bytes


def _held(text: str, floor: int) -> int:
    """How many trailing U+FFFD of text[floor:] a later token could still rewrite."""
    held = 0
    while held < _MAX_HELD and len(text) - held > floor and text[-held - 1] == REPLACEMENT:
        held += 1
    return held


class IncrementalDetokenizer:
    """Streams the text of one sequence of token ids; one instance per sequence.

        detok = IncrementalDetokenizer(tokenizer)
        chunks = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(chunks) == detok.text == tokenizer.decode(ids)

    `push` after `flush` raises: the flushed text may already show an unfinished character as U+FFFD.
    Ids the tokenizer does not know (a model's padded vocabulary rows) decode to nothing, as in `decode`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()):
        """`keep`: special ids shown even when special tokens are skipped (the exec markers)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens and not keep
        # Skipped special tokens are filtered before the backend's decoder runs, so leaving them out
        # of the window changes nothing but the window's length.
        self._skipped = tokenizer.special_ids - keep if skip_special_tokens else frozenset()
        self._window: list[int] = []  # ids from the window start on
        self._read = 0  # index in _window of the last clean boundary (all text before it emitted)
        self._prefix = ""  # window-relative text already accounted for
        self._chunks: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completed (often "", e.g. mid-character)."""
        if self._finished:
            raise RuntimeError("push() after flush(): start a new IncrementalDetokenizer")
        if token_id in self._skipped:
            return ""
        self._window.append(token_id)
        window_text = self._decode(self._window)
        if not window_text.startswith(self._prefix):
            # The decoder rewrote text it had already shown (a byte-fallback run holding an
            # unfinished character): wait for the run to settle.
            return self._emit(self._bound(window_text))
        held = _held(window_text, len(self._prefix))
        new = window_text[len(self._prefix) : len(window_text) - held]
        if held == 0:
            self._anchor(window_text)
            return self._emit(new)
        self._prefix = window_text[: len(window_text) - held]
        return self._emit(new + self._bound(window_text))

    def flush(self) -> str:
        """End of stream: return whatever is held back, as a full decode shows it (U+FFFD included)."""
        if self._finished:
            return ""
        self._finished = True
        rest = self._decode(self._window)[len(self._prefix) :] if self._window else ""
        self._window, self._read, self._prefix = [], 0, ""
        return self._emit(rest)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, new: str) -> str:
        if new:
            self._chunks.append(new)
        return new

    def _anchor(self, window_text: str) -> None:
        """The window text is complete and emitted: restart the window at the previous clean boundary."""
        start, self._read = self._read, len(self._window)
        # The restarted window must keep some text before the new token: a window decode may drop
        # its own first character (a Metaspace / `Strip` leading space), which is harmless only there.
        prefix = self._decode(self._window[start:]) if start else ""
        if not prefix:
            self._prefix = window_text
            return
        del self._window[:start]
        self._read -= start
        self._prefix = prefix

    def _bound(self, window_text: str) -> str:
        """Keep a stalled window (text still ending mid-character) from growing without bound.

        Returns text emitted by a forced re-anchor (only non-local decoders ever need one).
        """
        if len(self._window) <= _REANCHOR_AT:
            return ""
        held = window_text[len(self._prefix) :] if window_text.startswith(self._prefix) else None
        keep = _KEEP
        while held is not None and keep < len(self._window):
            candidate = self._window[-keep:]
            text = self._decode(candidate)
            # A window starting mid-character differs from the old one only in its first few
            # characters (each stray continuation byte is one U+FFFD): past them the two must agree,
            # and what is still held back must lie past that point.
            if text.endswith(held) and len(text) - len(held) > _SYNC_CHARS and window_text.endswith(text[_SYNC_CHARS:]):
                self._reset(candidate, text[: len(text) - len(held)])
                return ""
            keep *= 2
        if len(self._window) < _HARD_CAP:
            return ""
        # Only a decoder whose output is not local (an invalid byte-fallback run) gets here: give up
        # exactness for that run rather than let the per-token cost grow.
        forced = "" if held is not None else window_text[len(self._prefix) : len(window_text) - _held(window_text, 0)]
        candidate = self._window[-_KEEP:]
        text = self._decode(candidate)
        self._reset(candidate, text[: len(text) - _held(text, 0)])
        return forced

    def _reset(self, window: list[int], prefix: str) -> None:
        self._window, self._read, self._prefix = list(window), 0, prefix
