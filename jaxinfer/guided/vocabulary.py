"""The bytes each token id stands for, as outlines-core's `Vocabulary` needs them.

Byte-level BPE vocabularies (Llama 3, SmolLM2, Qwen: every family the engine loads) write each byte
as one printable character (GPT-2's table: "Ġ" is the space); this undoes that table. Other
vocabularies are read as SentencePiece writes them: "▁" is the space and "<0xNN>" the byte NN
(byte fallback). Special (added) tokens are left out: a constrained output never contains one, and EOS is allowed by the
automaton's accepting states instead (engine/guide_tables.py).
"""

from __future__ import annotations

import functools
import json
import re

from tokenizers import Tokenizer as Backend

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: printable bytes stand for themselves, the rest are
    shifted past 255 in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def _byte_level(backend: Backend) -> bool:
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


def token_bytes(backend: Backend) -> dict[int, bytes]:
    """Every non-special token id -> the bytes it decodes to."""
    specials = {token.content for token in backend.get_added_tokens_decoder().values()}
    vocab = {text: i for text, i in backend.get_vocab(with_added_tokens=True).items() if text not in specials}
    if _byte_level(backend):
        table = _byte_of_char()
        return {i: bytes(table[c] for c in text) for text, i in vocab.items() if all(c in table for c in text)}
    return {i: _sentencepiece_bytes(text) for text, i in vocab.items()}


def _sentencepiece_bytes(text: str) -> bytes:
    if BYTE_TOKEN.fullmatch(text):
        return bytes([int(text[3:5], 16)])
    return text.replace("▁", " ").encode()
