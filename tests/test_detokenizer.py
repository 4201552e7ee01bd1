"""The streaming detokenizer against the tokenizer's own full decode.

For both real byte-level BPE tokenizers (SmolLM2 from its GGUF, Llama 3): whatever the id stream (real
text, arbitrary vocabulary ids that leave invalid UTF-8 mid-stream, special tokens anywhere), the
pushed chunks plus `flush()` spell `decode(all_ids)` exactly, no chunk shows a U+FFFD the full decode
does not have at that place, text is emitted as soon as it is final, and each token costs a decode of
a short window only.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as Backend

from jaxinfer.tokenizer import Tokenizer, load
from jaxinfer.tokenizer.detokenizer import _REANCHOR_AT, IncrementalDetokenizer

FFFD = "\ufffd"
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PIECES = [
    "中文字符",
    "日本語のテキスト",
    "한국어",
    "👩🏽‍💻",  # woman technologist, medium skin tone (ZWJ sequence)
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "👍🏿",
    "🇯🇵",
    "e\u0301",  # e + combining acute
    "a\u0308\u0323",  # stacked combining marks
    "ﷺ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x ** 2  # ok\n",
    '{"k": [1, 2.5, null]}',
    "\t\t",
    "    ",
    "\n\n\n",
    " \r\n ",
    "\u00a0\u2003",
    "<|im_end|>",  # typed by a user: ordinary text, never the control token
    "<|eot_id|>",
]
TEXT = st.lists(st.one_of(st.sampled_from(PIECES), st.text(st.characters(codec="utf-8"), max_size=8)), max_size=12).map(
    "".join
)


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Tokenizer:
    return load("smollm2-135m")


@pytest.fixture(scope="module", params=["smollm2", "llama3"])
def tok(request) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tokenizer")


_BROKEN: dict[int, list[int]] = {}


def broken_ids(tok: Tokenizer) -> list[int]:
    """Ids that alone decode to invalid UTF-8: lone bytes and pieces of multi-byte characters."""
    if id(tok) not in _BROKEN:
        _BROKEN[id(tok)] = [i for i in range(tok.vocab_size) if FFFD in tok.decode([i])]
    return _BROKEN[id(tok)]


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True, check_prompt: bool = True) -> list[str]:
    """Push ids one by one (checking after each that only unsettled U+FFFD is held back), then flush."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    chunks = []
    for k, token in enumerate(ids):
        chunks.append(detok.push(token))
        assert detok.text == "".join(chunks)
        if check_prompt:
            so_far = tok.decode(ids[: k + 1], skip_special_tokens=skip_special_tokens)
            assert so_far.startswith(detok.text)
            held = so_far[len(detok.text) :]
            assert len(held) <= 3 and set(held) <= {FFFD}, (ids[: k + 1], held)
    chunks.append(detok.flush())
    assert detok.text == "".join(chunks)
    return chunks


def assert_matches(chunks: list[str], full: str) -> None:
    assert "".join(chunks) == full
    at = 0
    for chunk in chunks:
        expected = full[at : at + len(chunk)]
        assert chunk == expected
        # Spelled out: a U+FFFD in a chunk is one the full decode shows at that very place.
        assert [i for i, c in enumerate(chunk) if c == FFFD] == [i for i, c in enumerate(expected) if c == FFFD]
        at += len(chunk)


@PROPERTY
@given(text=TEXT)
def test_streams_encoded_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode_user(text)
    full = tok.decode(ids)
    assert_matches(stream(tok, ids), full)


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_streams_arbitrary_ids(tok: Tokenizer, data: st.DataObject, skip: bool) -> None:
    any_id = st.integers(0, tok.vocab_size - 1)
    ids = data.draw(st.lists(st.one_of(any_id, st.sampled_from(broken_ids(tok))), max_size=60))
    assert_matches(stream(tok, ids, skip), tok.decode(ids, skip_special_tokens=skip))


@PROPERTY
@given(data=st.data(), text=TEXT, skip=st.booleans())
def test_special_tokens_interleaved(tok: Tokenizer, data: st.DataObject, text: str, skip: bool) -> None:
    ids = tok.encode_user(text)
    special = st.sampled_from(sorted(tok.special_ids))
    # Anywhere, including between the byte-level pieces of one character.
    for _ in range(data.draw(st.integers(1, 4))):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(special))
    assert_matches(stream(tok, ids, skip), tok.decode(ids, skip_special_tokens=skip))


def test_emoji_split_into_bytes_is_held_until_complete(llama3_tokenizer: Tokenizer) -> None:
    tok = llama3_tokenizer
    ids = tok.encode_user("a👩🏽‍💻b")
    pieces = [tok.decode([i]) for i in ids]
    assert any(FFFD in p for p in pieces), pieces  # the tokenizer does split the sequence
    chunks = stream(tok, ids)
    assert FFFD not in "".join(chunks)
    assert "".join(chunks) == "a👩🏽‍💻b"


def test_flush_shows_an_unfinished_character_as_a_full_decode_does(tok: Tokenizer) -> None:
    ids = tok.encode_user("x👩🏽‍💻")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD))  # stop mid-character
    detok = IncrementalDetokenizer(tok)
    pushed = "".join(detok.push(i) for i in ids[:cut])
    assert FFFD not in pushed
    rest = detok.flush()
    assert rest.endswith(FFFD)
    assert pushed + rest == detok.text == tok.decode(ids[:cut])
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.push(ids[cut])
    assert IncrementalDetokenizer(tok).flush() == ""


def test_per_token_work_is_bounded(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths: list[int] = []
    decode = tok.decode

    def recording(ids, skip_special_tokens=True):
        lengths.append(len(ids))
        return decode(ids, skip_special_tokens=skip_special_tokens)

    text = "".join(PIECES) + " The quick brown fox jumps over the lazy dog. "
    ids = (tok.encode_user(text) * 200)[:2000]
    broken = broken_ids(tok)
    # A stall: pieces of characters back to back, so the text keeps ending mid-character.
    stalled = [broken[(i * 7919) % len(broken)] for i in range(2000)]
    for case, stalls in ((ids, False), (stalled, True)):
        lengths.clear()
        monkeypatch.setattr(tok, "decode", recording)
        chunks = stream(tok, case, check_prompt=False)
        monkeypatch.undo()
        assert_matches(chunks, tok.decode(case))
        assert max(lengths) < 64
        if stalls:
            assert max(lengths) > _REANCHOR_AT  # the stall did build a window up, and re-anchoring cut it
        assert len(lengths) <= 3 * len(case) + 1
        assert sum(lengths) <= 16 * len(case)


def sentencepiece_style() -> Tokenizer:
    """A Llama-2-style vocabulary: `▁` for spaces, `<0xNN>` byte fallback, leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "h", "e", "l", "o", "▁h", "▁he", "▁hel", "▁hell", "▁hello", "ll", "x", ".", "中", "é"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o"), ("l", "l")]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(backend, bos_token="<s>", eos_tokens=["</s>"])


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(st.sampled_from(["hello", " ", "  ", "x", ".", "中", "文", "é", "e\u0301", "€", "👩🏽‍💻"])).map(
        "".join
    ),
    data=st.data(),
)
def test_byte_fallback_and_leading_space_strip(text: str, data: st.DataObject) -> None:
    tok = sentencepiece_style()
    ids = tok.encode_user(text)
    for _ in range(data.draw(st.integers(0, 3))):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from([1, 2])))
    # Skipped specials never split a byte run, so even Strip's leading-space rule must come out exact.
    # (No promptness check: a full decode of a stream cut mid-run shows the whole run as U+FFFD.)
    assert_matches(stream(tok, ids, check_prompt=False), tok.decode(ids))
