"""Tokenizers for the engine: loading by registry name or path, the guard, chat templates.

`load(NAME_OR_PATH)` accepts a registry name (`smollm2-135m`), a GGUF file, a `tokenizer.json`,
a Hugging Face folder or a native checkpoint folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from jaxinfer.errors import CheckpointError
from jaxinfer.tokenizer.tokenizer import Tokenizer
from jaxinfer.weights.gguf_file import GGUFCheckpoint
from jaxinfer.weights.registry import resolve

__all__ = ["Tokenizer", "load"]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def load(name_or_path: str | Path, chat_template: str | None = None) -> Tokenizer:
    path = Path(name_or_path)
    if path.is_file() and path.suffix == ".json":
        return _from_tokenizer_json(path, chat_template)
    checkpoint = resolve(name_or_path)
    if checkpoint.kind == "gguf":
        return from_gguf(GGUFCheckpoint(checkpoint.path), chat_template)
    return _from_folder(checkpoint.path, chat_template)


def from_gguf(checkpoint: GGUFCheckpoint, chat_template: str | None = None) -> Tokenizer:
    from jaxinfer.tokenizer.gguf_vocab import LLAMA3_VOCAB_PRE, backend_from_gguf

    backend = backend_from_gguf(checkpoint)
    tokens = checkpoint.field("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = checkpoint.field(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    eos = [token(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return Tokenizer(
        backend,
        chat_template=chat_template or checkpoint.field("tokenizer.chat_template"),
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_tokens=[t for t in dict.fromkeys(eos) if t],
        add_bos=bool(checkpoint.field("tokenizer.ggml.add_bos_token",
                                      checkpoint.field("tokenizer.ggml.pre") in LLAMA3_VOCAB_PRE)),
    )


def _family_template(backend: Backend) -> tuple[str | None, str | None, list[str]]:
    """(chat template, bos, eos tokens) for a bare tokenizer.json whose family is recognizable."""
    vocab = backend.get_vocab(with_added_tokens=True)
    if "<|start_header_id|>" in vocab and "<|eot_id|>" in vocab:
        return LLAMA3_TEMPLATE, "<|begin_of_text|>", ["<|eot_id|>", "<|end_of_text|>"]
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        return CHATML_TEMPLATE, None, ["<|im_end|>"]
    return None, None, []


def _adds_bos(backend: Backend, bos: str | None) -> bool:
    if bos is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == backend.token_to_id(bos)


def _from_tokenizer_json(path: Path, chat_template: str | None) -> Tokenizer:
    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"{path}: not a tokenizers JSON file ({exc})") from None
    template, bos, eos = _family_template(backend)
    # Llama 3 models expect BOS even when a bare tokenizer.json lacks the post-processor that adds it.
    add_bos = _adds_bos(backend, bos) or bos == "<|begin_of_text|>"
    return Tokenizer(backend, chat_template=chat_template or template, bos_token=bos, eos_tokens=eos, add_bos=add_bos)


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _from_folder(folder: Path, chat_template: str | None) -> Tokenizer:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.exists():
        raise CheckpointError(f"{folder}: no tokenizer.json")
    try:
        backend = Backend.from_file(str(tokenizer_file))
    except Exception as exc:  # the tokenizers library raises a bare Exception for a malformed file
        raise CheckpointError(f"{tokenizer_file}: not a tokenizers file ({exc})") from None
    config = _json_object(folder / "tokenizer_config.json")
    template_file = folder / "chat_template.jinja"
    family_template, family_bos, family_eos = _family_template(backend)
    template = chat_template or config.get("chat_template")
    if template is None and template_file.exists():
        template = template_file.read_text()
    bos = _token_text(config.get("bos_token")) or family_bos
    eos = list(config.get("eos_tokens") or [t for t in [_token_text(config.get("eos_token"))] if t])
    eos += _generation_eos(folder, backend) + family_eos
    add_bos = config["add_bos_token"] if "add_bos_token" in config else _adds_bos(backend, bos)
    return Tokenizer(
        backend,
        chat_template=template or family_template,
        bos_token=bos,
        eos_tokens=[t for t in dict.fromkeys(eos) if backend.token_to_id(t) is not None],
        add_bos=bool(add_bos),
    )


def _generation_eos(folder: Path, backend: Backend) -> list[str]:
    ids = _json_object(folder / "generation_config.json").get("eos_token_id")
    ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
    valid = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < backend.get_vocab_size()]
    return [t for t in (backend.id_to_token(i) for i in valid) if t]


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} when the file is absent."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value
