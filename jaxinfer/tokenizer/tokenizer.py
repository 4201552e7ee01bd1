"""The engine's tokenizer: user text never produces control tokens; structure alone does.

Two backends share one vocabulary: `_user` has special-token matching off (a forged `<|im_end|>`
typed by a user becomes the ordinary tokens of its characters), `_trusted` has it on and encodes
only text the engine or the chat template wrote. Forged control tokens found in user text are
counted in a `GuardReport` (policy "downgrade", the default) or refused with an error naming the
token and the field (policy "reject").
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from jaxinfer.errors import RequestError
from jaxinfer.tokenizer.chat import ChatTemplate
from jaxinfer.tokenizer.segmented import SegmentedEncoder

GUARD_POLICIES = ("downgrade", "reject")


@dataclass
class GuardReport:
    """Forged control tokens met in one request's user text (each encoded as plain text)."""

    tokens: list[str] = field(default_factory=list)

    @property
    def downgraded(self) -> int:
        return len(self.tokens)


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        add_bos: bool = False,
        guard: str = "downgrade",
    ):
        if guard not in GUARD_POLICIES:
            raise ValueError(f"guard must be one of {GUARD_POLICIES}, got {guard!r}")
        self.guard = guard
        self._trusted = Backend.from_str(backend.to_str())
        self._trusted.encode_special_tokens = False
        self._user = Backend.from_str(backend.to_str())
        self._user.encode_special_tokens = True
        # Long user texts are cut where the pre-tokenizer cannot merge and encoded in parallel.
        self._user_segmented = SegmentedEncoder(self._user, segment_chars=4096)
        self.bos_token, self.eos_tokens, self.add_bos = bos_token, tuple(eos_tokens), add_bos
        self.bos_id = self.token_id(bos_token) if bos_token else None
        self.eos_ids = frozenset(i for i in (self.token_id(t) for t in self.eos_tokens) if i is not None)
        self._index_specials()
        specials = {"bos_token": bos_token, "eos_token": self.primary_eos}
        self.chat_template = ChatTemplate(chat_template, specials) if chat_template else None

    def _index_specials(self) -> None:
        self.special_ids = frozenset(
            i for i, tok in self._trusted.get_added_tokens_decoder().items() if tok.special
        )
        self._special_by_name = self.special_token_names()
        by_length = sorted(self._special_by_name, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, by_length)) or "(?!)")

    def add_control_tokens(self, names: Sequence[str]) -> dict[str, int]:
        """Adds special tokens (new ids after the vocabulary unless it has them); user text still
        encodes their spellings as plain text. Returns their ids."""
        added = [AddedToken(name, special=True, normalized=False) for name in names]
        self._trusted.add_special_tokens(added)
        self._user.add_special_tokens(added)
        self._index_specials()
        return {name: self.token_id(name) for name in names}

    @property
    def primary_eos(self) -> str | None:
        return self.eos_tokens[0] if self.eos_tokens else None

    @property
    def backend(self) -> Backend:
        """The tokenizers library's tokenizer (the trusted one: specials are specials), for reading the vocabulary."""
        return self._trusted

    @property
    def vocab_size(self) -> int:
        return self._trusted.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._trusted.token_to_id(token)

    def special_token_names(self) -> dict[str, int]:
        return {tok.content: i for i, tok in self._trusted.get_added_tokens_decoder().items() if tok.special}

    def forged_tokens(self, text: str) -> list[str]:
        """Control-token spellings that occur in `text`, in order."""
        return [m.group() for m in self._special_pattern.finditer(text)]

    def check_user_text(self, text: str, field: str, report: GuardReport | None) -> None:
        """Applies the guard policy to user text: record forged tokens, or refuse them. Text that is
        not valid Unicode (an unpaired surrogate, e.g. from a JSON escape) is refused."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise RequestError(f"{field}: an unpaired surrogate {text[error.start]!r} at character {error.start} "
                               "is not valid Unicode") from None
        forged = self.forged_tokens(text)
        if forged and self.guard == "reject":
            raise RequestError(f"{field}: contains the control token {forged[0]!r}, which user text may not produce")
        if report is not None:
            report.tokens += forged

    def encode_user(self, text: str, *, field: str = "text", report: GuardReport | None = None) -> list[int]:
        """User-supplied text: special-token matching off; forged control tokens stay plain text."""
        self.check_user_text(text, field, report)
        return self._encode_plain(text)

    def _encode_plain(self, text: str) -> list[int]:
        return self._user_segmented.encode(text) if text else []

    def encode_plain(self, text: str) -> list[int]:
        """Text the engine writes from untrusted content (a program's output): control-token spellings
        stay plain text, and nothing is refused or counted (it is not the user's input)."""
        return self._encode_plain(text)

    def encode_trusted(self, text: str) -> list[int]:
        """Engine- or template-written text: special tokens in it become their ids."""
        return self._trusted.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str, report: GuardReport | None = None) -> list[int]:
        """A raw completion prompt: BOS (when the model wants one) then the user's text."""
        prefix = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        return prefix + self.encode_user(text, field="prompt", report=report)

    def special_id(self, name: str) -> int:
        """The id of a special token named explicitly in a structured field (validated)."""
        if name not in self._special_by_name:
            known = ", ".join(sorted(self._special_by_name)[:12])
            raise RequestError(f"special token {name!r} is not one of this tokenizer's special tokens ({known}, ...)")
        return self._special_by_name[name]

    def encode_parts(self, parts: Sequence[str | dict[str, str]], report: GuardReport | None = None) -> list[int]:
        """A prompt given as parts: strings are user text, {"special": NAME} is that control token."""
        ids: list[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                ids += self.encode_user(part, field=f"prompt[{i}]", report=report)
            elif isinstance(part, dict) and set(part) == {"special"} and isinstance(part["special"], str):
                ids.append(self.special_id(part["special"]))
            else:
                raise RequestError(f'prompt[{i}]: must be a string or {{"special": NAME}}')
        return ids

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, report: GuardReport | None = None
    ) -> list[int]:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template= to load()")
        # Special tokens are taken only from the template's own text; everything between them
        # (template text and content joined, so whitespace runs across a boundary merge exactly as
        # in the plain rendering) is encoded with special-token matching off.
        ids: list[int] = []
        pending = ""
        for segment in self.chat_template.render_segments(messages, add_generation_prompt):
            if not segment.trusted:
                self.check_user_text(segment.text, f"messages[{segment.message}].content", report)
                pending += segment.text
                continue
            cursor = 0
            for match in self._special_pattern.finditer(segment.text):
                pending += segment.text[cursor : match.start()]
                ids += self._encode_plain(pending)
                ids.append(self._special_by_name[match.group()])
                pending, cursor = "", match.end()
            pending += segment.text[cursor:]
        return ids + self._encode_plain(pending)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()) -> str:
        """`keep`: special ids shown even when special tokens are skipped."""
        if skip_special_tokens and keep:
            ids, skip_special_tokens = [t for t in ids if t not in self.special_ids or t in keep], False
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
