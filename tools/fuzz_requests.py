"""Hostile requests for tools/fuzz_serving.py, as hypothesis strategies: every field of every Inference RPC
(read from the proto's descriptors, so a new field is fuzzed without a change here) at and past its
limits, huge and empty strings, forged control tokens, deep chat histories, token ids outside the
vocabulary and at the context limit, raw and corrupted message bytes (invalid UTF-8 included), and
JSON bodies for the OpenAI-compatible HTTP routes with wrong types and values out of range.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from serving.proto.jaxinfer.v1 import inference_pb2 as pb

FORGED = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|exec|>", "<|/exec|>", "<|result|>", "<s>", "</s>",
          "<|begin_of_text|>", "\x00", "\ufffd", "\U0001F600")
ROLES = ("user", "system", "assistant", "tool", "", "User", "developer")
RPCS = ("Generate", "Tokenize", "Detokenize", "ListModels", "LoadAdapter", "UnloadAdapter", "ListAdapters")
UINT32_MAX, INT32_MAX = 2**32 - 1, 2**31 - 1


def field_names() -> set[str]:
    """Every field and oneof name of the service's messages, and "request" (the message as a whole):
    what a clear INVALID_ARGUMENT names."""
    names: set[str] = {"request"}

    def walk(message: Descriptor) -> None:
        names.update(oneof.name for oneof in message.oneofs if not oneof.name.startswith("_"))
        for field in message.fields:
            if field.name not in names:
                names.add(field.name)
                if field.message_type is not None:
                    walk(field.message_type)

    for message in pb.DESCRIPTOR.message_types_by_name.values():
        walk(message)
    return names


def texts(limit: int = 200) -> st.SearchStrategy[str]:
    """Ordinary, empty, huge and forged strings (always valid Unicode: a proto string must be)."""
    plain = st.text(st.characters(blacklist_categories=("Cs",)), max_size=limit)
    forged = st.lists(st.one_of(st.sampled_from(FORGED), plain), max_size=8).map("".join)
    huge = st.one_of(st.integers(1_000, 40_000), st.just(400_000)).map(lambda n: ("word " * (n // 5 + 1))[:n])
    return st.one_of(st.just(""), plain, plain, plain, forged, forged, huge)  # repeats weigh a branch


def token_ids(vocab: int, max_model_len: int) -> st.SearchStrategy[list[int]]:
    small = st.lists(st.integers(-3, vocab + 3), max_size=64)
    at_limit = st.tuples(st.integers(max_model_len - 3, max_model_len + 3), st.integers(0, vocab - 1)).map(
        lambda pair: [pair[1]] * pair[0])
    extremes = st.lists(st.sampled_from([-(2**31), -1, 0, vocab - 1, vocab, INT32_MAX]), min_size=1, max_size=8)
    return st.one_of(small, at_limit, extremes)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return texts()
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1.0, 2.0, -2.0, 100.0, 1e30]))
    if kind == FieldDescriptor.TYPE_UINT32:
        return st.one_of(st.integers(0, 40), st.sampled_from([0, 1, 20, 21, 64, 65, 2048, 2049, UINT32_MAX]))
    if kind == FieldDescriptor.TYPE_UINT64:
        return st.one_of(st.integers(0, 2**64 - 1), st.just(0))
    if kind == FieldDescriptor.TYPE_INT32:
        return st.one_of(st.integers(-2, 50_000), st.sampled_from([-(2**31), INT32_MAX]))
    if kind == FieldDescriptor.TYPE_INT64:
        return st.integers(-(2**63), 2**63 - 1)
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    raise TypeError(f"no strategy for field {field.full_name}")


def message_dict(message: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Any subset of a message's fields, each with a hostile value (oneofs: one member at most)."""
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in message.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            optional[field.name] = st.dictionaries(_scalar(key), _scalar(value), max_size=70)
            continue
        if field.message_type is not None:
            inner = message_dict(field.message_type, depth + 1) if depth < 3 else st.just({})
        else:
            inner = _scalar(field)
        many = st.lists(inner, max_size=6 if field.message_type else 12)
        optional[field.name] = many if field.is_repeated else inner
    oneofs = {o.name: [f.name for f in o.fields] for o in message.oneofs if not o.name.startswith("_")}
    return st.fixed_dictionaries({}, optional=optional).map(lambda d: _one_per_oneof(d, oneofs))


def _one_per_oneof(fields: dict[str, Any], oneofs: dict[str, list[str]]) -> dict[str, Any]:
    for members in oneofs.values():
        for extra in [name for name in members if name in fields][1:]:
            del fields[extra]
    return fields


def generate_requests(vocab: int, max_model_len: int) -> st.SearchStrategy[pb.GenerateRequest]:
    """A GenerateRequest: any fields, a prompt that is usually present, small sizes mostly (so accepted
    requests are cheap), and the special prompts the fuzz must cover."""
    chat = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": texts(80)}),
                    max_size=400).map(lambda ms: {"messages": ms})
    prompt = st.one_of(
        texts().map(lambda t: {"text": t}),
        chat.map(lambda c: {"chat": c}),
        token_ids(vocab, max_model_len).map(lambda ids: {"token_ids": {"ids": ids}}),
        st.lists(st.one_of(texts(40).map(lambda t: {"text": t}), st.sampled_from(FORGED).map(lambda s: {"special": s})),
                 max_size=6).map(lambda parts: {"parts": {"parts": parts}}),
        st.just({}),
    )
    adapter = st.one_of(st.just(""), st.just("smollm2-135m-exec"), texts(40))
    base = message_dict(pb.GenerateRequest.DESCRIPTOR)
    return st.builds(_generate_request, base, prompt, adapter)


def _generate_request(base: dict[str, Any], prompt: dict[str, Any], adapter: str) -> pb.GenerateRequest:
    for name in ("text", "chat", "token_ids", "parts"):
        base.pop(name, None)
    base.update(prompt)
    base["adapter"] = adapter
    return pb.GenerateRequest(**base)


def rpc_requests(vocab: int, max_model_len: int) -> st.SearchStrategy[tuple[str, bytes]]:
    """(method, request bytes) for any RPC: a hostile message, raw bytes, or a message with corrupted bytes."""
    def of(name: str) -> st.SearchStrategy[tuple[str, bytes]]:
        if name == "Generate":
            messages = generate_requests(vocab, max_model_len)
        else:
            cls = getattr(pb, f"{name}Request")
            messages = message_dict(cls.DESCRIPTOR).map(lambda d, cls=cls: cls(**d))
        return messages.map(lambda m, name=name: (name, m.SerializeToString()))

    valid = st.one_of(*[of(name) for name in RPCS])
    raw = st.tuples(st.sampled_from(RPCS), st.binary(max_size=300))
    corrupted = st.builds(_corrupt, valid, st.integers(0, 10_000), st.binary(min_size=1, max_size=4))
    return st.one_of(valid, valid, valid, raw, corrupted)


def _corrupt(request: tuple[str, bytes], at: int, junk: bytes) -> tuple[str, bytes]:
    """Overwrites some bytes of a serialized message (often a string's: invalid UTF-8 inside a field)."""
    name, data = request
    if not data:
        return name, junk
    at %= len(data)
    return name, data[:at] + junk + data[at + len(junk):]


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False),
                         texts(60))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                                st.dictionaries(texts(12), inner, max_size=5)),
                           max_leaves=12)
HTTP_FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
               "stream", "stream_options", "logprobs", "top_logprobs", "echo", "stop", "seed", "logit_bias", "user",
               "presence_penalty", "frequency_penalty", "response_format", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "min_tokens", "ignore_eos", "best_of", "suffix", "tools")


def http_bodies() -> st.SearchStrategy[tuple[str, bytes]]:
    """(path, body) for the completion routes: known fields with values of any JSON type, plausible
    values, unknown fields, and bodies that are not JSON at all."""
    plausible = {
        "prompt": st.one_of(texts(), st.lists(st.integers(-2, 50_000), max_size=20), st.lists(texts(30), max_size=3)),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": texts(60)}),
                             max_size=30),
        "max_tokens": st.one_of(st.integers(-2, 8), st.sampled_from([0, 2048, 2049, 10**12])),
        "n": st.integers(-1, 130), "stream": st.booleans(), "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
        "temperature": st.floats(-1, 3), "response_format": st.sampled_from([
            {"type": "json_object"}, {"type": "text"}, {"type": "json_schema", "json_schema": {"schema": {}}},
            {"type": "json_schema"}, {"type": "nope"}]),
    }
    fields = {name: st.one_of(JSON_VALUES, plausible.get(name, JSON_VALUES)) for name in HTTP_FIELDS}
    bodies = st.fixed_dictionaries({}, optional=fields).flatmap(
        lambda d: st.dictionaries(texts(16), JSON_VALUES, max_size=2).map(lambda extra: {**extra, **d}))
    # Mostly valid: a good request with one or two fields replaced, so many bodies are accepted.
    base = {"/v1/completions": {"model": "", "prompt": "a river at night", "max_tokens": 4},
            "/v1/chat/completions": {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
    near = st.tuples(st.sampled_from(sorted(base)), st.dictionaries(st.sampled_from(HTTP_FIELDS), JSON_VALUES,
                                                                   max_size=2))
    near_valid = near.map(lambda pair: (pair[0], json.dumps({**base[pair[0]], **pair[1]}).encode()))
    encoded = bodies.map(lambda d: json.dumps(d).encode())
    raw = st.one_of(st.binary(max_size=200), st.just(b""), st.just(b"{"), st.just(b'{"prompt": "\xff\xfe"}'))
    paths = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
    return st.one_of(st.tuples(paths, st.one_of(encoded, encoded, raw)), near_valid, near_valid)
