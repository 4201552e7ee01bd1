"""Chat templates rendered so that message contents stay separate segments.

The template (jinja2, as transformers renders it) is rendered with a unique placeholder in place
of each message's content. The text between placeholders is the template's own (trusted: special
tokens in it become special ids); each content segment is user text (special-token matching off).
A probe with padded placeholders tells whether the template trims content, so that the segments
equal what the template would have written.

Every split is checked against the plain render of the real messages: the segments joined must
equal it character for character. A template that the padded probe misreads (its own space next to
trimmed content) is split again with bare placeholders; one that transforms content (``tojson``,
``upper``, slicing) cannot be split without guessing, and the request gets an error naming the
template instead of a prompt that differs from what the template writes. Empty contents are
rendered as they are (no placeholder), so ``{% if message.content %}`` sees what it would.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxinfer.errors import RequestError


@dataclass(frozen=True)
class Segment:
    text: str
    trusted: bool  # True: template text; False: user-supplied content
    message: int | None = None  # index of the message whose content this is


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message: str) -> None:
        raise RequestError(f"chat template: {message}")

    env.globals["raise_exception"] = raise_exception
    return env


_ENV = _environment()


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]):
        self.source = source
        self.template = _ENV.from_string(source)
        self.special_tokens = {k: v or "" for k, v in special_tokens.items()}

    def render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Plain render, as transformers' apply_chat_template(tokenize=False) does."""
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )

    def render_segments(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[Segment]:
        _validate(messages)
        expected = self.render_text(messages, add_generation_prompt)
        nonce = secrets.token_hex(6)
        # \v pads the probe: whitespace that `trim` removes, but that no template writes itself (a
        # template's own space next to trimmed content would pass for the padding).
        for padding, trim in ("\v", None), ("", ""), ("", "strip"):
            segments = self._split(messages, add_generation_prompt, nonce, padding, trim)
            if "".join(s.text for s in segments) == expected:
                return segments
        raise RequestError("chat template: it changes message contents (for example tojson, upper or a slice), so "
                           "they cannot be kept apart from the template's own text; send the prompt as text or "
                           "token ids instead")

    def _split(self, messages: list[dict[str, Any]], add_generation_prompt: bool, nonce: str, padding: str,
               trim: str | None) -> list[Segment]:
        """Template and content segments from a render with placeholders. With ``padding`` "\\v" the
        pads that survive around a placeholder tell whether the template trims (``trim`` None);
        with bare placeholders the content is taken as it is ("") or stripped ("strip")."""
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        placed = [dict(m, content=f"{padding}{mark}{padding}" if m["content"] else "")
                  for m, mark in zip(messages, marks, strict=True)]
        text = self.render_text(placed, add_generation_prompt)
        spaces = f"({re.escape(padding)}?)" if padding else "()"
        pattern = re.compile(spaces + "\ue000" + nonce + r":(\d+)\ue001" + spaces)
        segments: list[Segment] = []
        cursor = 0
        for match in pattern.finditer(text):
            segments.append(Segment(text[cursor : match.start()], trusted=True))
            content = messages[int(match.group(2))]["content"]
            if trim is None:
                content = content if match.group(1) else content.lstrip()
                content = content if match.group(3) else content.rstrip()
            elif trim == "strip":
                content = content.strip()
            segments.append(Segment(content, trusted=False, message=int(match.group(2))))
            cursor = match.end()
        segments.append(Segment(text[cursor:], trusted=True))
        return [s for s in segments if s.text]


_ROLE = re.compile(r"[a-z][a-z_]{0,31}")


def _validate(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}]: must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or not _ROLE.fullmatch(role):
            raise RequestError(f"messages[{i}].role: must match {_ROLE.pattern} (for example user or assistant)")
        if not isinstance(message.get("content"), str):
            raise RequestError(f"messages[{i}].content: must be a string")
        extra = sorted(set(message) - {"role", "content"})
        if extra:  # a template would render them as its own (trusted) text, past the guard
            raise RequestError(f"messages[{i}]: unknown field(s) {', '.join(map(str, extra))} (only role and content)")
