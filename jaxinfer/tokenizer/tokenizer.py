"""The engine's tokenizer: user text never produces control tokens; structure alone does.

Two backends share one vocabulary: `_user` has special-token matching off (a forged `<|im_end|>`
typed by a user becomes the ordinary tokens of its characters), `_trusted` has it on and encodes
only text the engine or the chat template wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from jaxinfer.tokenizer.chat import ChatTemplate


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        add_bos: bool = False,
    ):
        self._trusted = Backend.from_str(backend.to_str())
        self._trusted.encode_special_tokens = False
        self._user = Backend.from_str(backend.to_str())
        self._user.encode_special_tokens = True
        self.bos_token, self.eos_tokens, self.add_bos = bos_token, tuple(eos_tokens), add_bos
        self.bos_id = self.token_id(bos_token) if bos_token else None
        self.eos_ids = frozenset(i for i in (self.token_id(t) for t in self.eos_tokens) if i is not None)
        self.special_ids = frozenset(
            i for i, tok in self._trusted.get_added_tokens_decoder().items() if tok.special
        )
        self._special_by_name = self.special_token_names()
        by_length = sorted(self._special_by_name, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, by_length)) or "(?!)")
        specials = {"bos_token": bos_token, "eos_token": self.primary_eos}
        self.chat_template = ChatTemplate(chat_template, specials) if chat_template else None

    @property
    def primary_eos(self) -> str | None:
        return self.eos_tokens[0] if self.eos_tokens else None

    @property
    def vocab_size(self) -> int:
        return self._trusted.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._trusted.token_to_id(token)

    def special_token_names(self) -> dict[str, int]:
        return {tok.content: i for i, tok in self._trusted.get_added_tokens_decoder().items() if tok.special}

    def encode_user(self, text: str) -> list[int]:
        """User-supplied text: special-token matching off."""
        return self._user.encode(text, add_special_tokens=False).ids

    def encode_trusted(self, text: str) -> list[int]:
        """Engine- or template-written text: special tokens in it become their ids."""
        return self._trusted.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt: BOS (when the model wants one) then the user's text."""
        prefix = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        return prefix + self.encode_user(text)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template= to load()")
        # Special tokens are taken only from the template's own text; everything between them
        # (template text and content joined, so whitespace runs across a boundary merge exactly as
        # in the plain rendering) is encoded with special-token matching off.
        ids: list[int] = []
        pending = ""
        for segment in self.chat_template.render_segments(messages, add_generation_prompt):
            if not segment.trusted:
                pending += segment.text
                continue
            cursor = 0
            for match in self._special_pattern.finditer(segment.text):
                pending += segment.text[cursor : match.start()]
                ids += self.encode_user(pending) if pending else []
                ids.append(self._special_by_name[match.group()])
                pending, cursor = "", match.end()
            pending += segment.text[cursor:]
        return ids + (self.encode_user(pending) if pending else [])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._trusted.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        self._trusted.save(str(folder / "tokenizer.json"))
        config = {
            "chat_template": self.chat_template.source if self.chat_template else None,
            "bos_token": self.bos_token,
            "eos_token": self.primary_eos,
            "eos_tokens": list(self.eos_tokens),
            "add_bos_token": self.add_bos,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
