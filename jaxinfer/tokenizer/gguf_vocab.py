"""Builds a `tokenizers.Tokenizer` from a GGUF file's vocabulary, merges and pre-tokenizer name.

Only byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`) are supported: Llama 3, SmolLM2,
Qwen2/2.5/3. The pre-tokenizer split follows llama.cpp's per-`tokenizer.ggml.pre` regexes.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from jaxinfer.errors import CheckpointError
from jaxinfer.weights.gguf_file import GGUFCheckpoint

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp's LLAMA3 pre-tokenizer names that this module splits like Llama 3 and that look a whole
# pre-token up in the vocabulary before merging (Llama 3's tokenizer.json says `ignore_merges`): 588
# of its tokens are not reachable by merges. llama.cpp also adds BOS for them unless the file says.
LLAMA3_VOCAB_PRE = ("llama3", "llama-v3", "llama-bpe")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), byte_level_plain])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"), byte_level_plain])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp splits every digit first, then applies the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def backend_from_gguf(checkpoint: GGUFCheckpoint) -> Backend:
    kind = checkpoint.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{checkpoint.path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    tokens: list[str] = list(checkpoint.field("tokenizer.ggml.tokens") or [])
    merges = [tuple(m.split(" ", 1)) for m in checkpoint.field("tokenizer.ggml.merges") or []]
    types = list(checkpoint.field("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(f"{checkpoint.path}: tokenizer.ggml.token_type has {len(types)} entries for "
                              f"{len(tokens)} tokens")
    if any(len(merge) != 2 for merge in merges):
        raise CheckpointError(f"{checkpoint.path}: tokenizer.ggml.merges holds an entry that is not two tokens")
    pre = str(checkpoint.field("tokenizer.ggml.pre", "gpt2"))
    try:
        backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                     ignore_merges=pre in LLAMA3_VOCAB_PRE))
    except Exception as exc:  # the tokenizers library raises a bare Exception (a merge of an unknown token)
        raise CheckpointError(f"{checkpoint.path}: tokenizer.ggml.merges: {exc}") from None
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, types, strict=True))
    control = [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED]
    backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
    return backend
