"""The bytes each token id stands for, as outlines-core's `Vocabulary` needs them.

llguidance's tokenizer reads them from the tokenizers JSON (`LLTokenizer.decode_bytes`): GPT-2's
byte-level table (Llama 3, SmolLM2, Qwen) as well as SentencePiece's "▁" and byte-fallback
"<0xNN>" pieces, the same bytes its own grammar masks use. Special (added) tokens are left out:
a constrained output never contains one, and EOS is allowed by the automaton's accepting states
instead (engine/guide_tables.py).
"""

from __future__ import annotations

from llguidance import LLTokenizer


def token_bytes(tokenizer: LLTokenizer) -> dict[int, bytes]:
    """Every non-special token id -> the bytes it decodes to."""
    return {i: tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size) if not tokenizer.is_special_token(i)}
