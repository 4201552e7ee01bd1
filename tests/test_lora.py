"""LoRA serving on SmolLM2: adapters made and saved by PEFT itself, checked against PEFT on transformers.

The reference is PEFT's LoRA on the transformers model loading the same GGUF (unmerged, and merged
into the weights with `merge_and_unload`); the engine reads PEFT's files and serves several adapters
in one batch, which must equal each request run alone.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
from conftest import TEST_ENGINE
from harness import PagedForward

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.adapters import AdapterSlots
from jaxinfer.engine.xla_compiles import XLA_COMPILES
from jaxinfer.errors import CheckpointError, RequestError
from jaxinfer.layers.lora import LORA_TARGETS
from jaxinfer.weights.adapter_file import SAFETENSORS_FILE, read_adapter, save_adapter
from jaxinfer.weights.loader import load_model

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name a prime number."]


def peft_adapter(hf_model, folder, seed: int, rank: int = 4, targets=("q_proj", "v_proj", "down_proj"),
                 use_rslora: bool = False, b_scale: float = 0.05):
    """A random (nonzero) LoRA adapter made by PEFT on the transformers model and saved in PEFT's layout."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=use_rslora)
    model = get_peft_model(hf_model, config)
    with torch.no_grad():  # PEFT's random B is large enough to wreck the model: keep the change moderate
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):
    """Two PEFT adapters on disk: "a" (q, v, down; rank 4) and "b" (all seven projections; rank 8, rsLoRA)."""
    root = tmp_path_factory.mktemp("adapters")
    peft_adapter(hf_model, root / "a", seed=1, b_scale=0.5).unload()
    peft_adapter(hf_model, root / "b", seed=2, rank=8, targets=LORA_TARGETS, use_rslora=True, b_scale=0.3).unload()
    return root


@pytest.fixture(scope="module")
def lora_llm(adapters):
    llm = LLM("smollm2-135m", **TEST_ENGINE, max_adapters=2, max_lora_rank=8)
    llm.load_adapter("a", str(adapters / "a"))
    llm.load_adapter("b", str(adapters / "b"))
    return llm


@pytest.mark.parametrize("use_rslora", [False, True])
def test_logits_match_peft_unmerged_and_merged(hf_model, tmp_path, smollm2_llm, use_rslora):
    """Our slots against PEFT's forward, and against PEFT's merged weights (W + scale * B @ A)."""
    from peft import PeftModel

    peft_model = peft_adapter(copy.deepcopy(hf_model), tmp_path / "x", seed=3, rank=4, targets=LORA_TARGETS,
                              use_rslora=use_rslora)  # a copy: merge_and_unload writes into the base weights
    loaded = load_model("smollm2-135m", smollm2_llm.mesh)
    slots = AdapterSlots(loaded.model, smollm2_llm.mesh, 2, 8, LORA_TARGETS)
    slots.load("x", str(tmp_path / "x"))
    ids = smollm2_llm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    ours = PagedForward(loaded.model, page_size=16, num_pages=64, max_pages=16, adapter_slot=1).run(ids, 0)
    base = PagedForward(loaded.model, page_size=16, num_pages=64, max_pages=16, adapter_slot=0).run(ids, 0)
    with torch.no_grad():
        unmerged = peft_model(torch.tensor([ids])).logits[0].numpy()
        merged_model = PeftModel.from_pretrained(peft_model.unload(), tmp_path / "x").merge_and_unload()
        merged = merged_model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - base).max() > 0.5  # the adapter moves the logits by whole units ...
    np.testing.assert_allclose(ours, unmerged, atol=2e-3, rtol=0)  # ... exactly as PEFT does
    np.testing.assert_allclose(ours, merged, atol=2e-3, rtol=0)


def test_mixed_adapter_batch_equals_each_alone(lora_llm):
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True)
    names = ["a", "b", "", "a", "b", ""]
    chats = [[{"role": "user", "content": PROMPTS[i % 3]}] for i in range(6)]
    together = lora_llm.generate_chat(chats, params, adapter=names)
    for chat, name, out in zip(chats, names, together, strict=True):
        (alone,) = lora_llm.generate_chat(chat, params, adapter=name)
        assert out.token_ids == alone.token_ids, (name, out.text, alone.text)
        np.testing.assert_allclose(out.logprobs, alone.logprobs, atol=1e-4)
    a, b, base = together[:3] if chats[0] == chats[1] else lora_llm.generate_chat([chats[0]] * 3, params,
                                                                                   adapter=["a", "b", ""])
    for one, other in ((a, base), (b, base), (a, b)):  # each adapter changes what the model computes
        assert one.token_ids != other.token_ids or np.abs(np.subtract(one.logprobs, other.logprobs)).max() > 1e-3


def test_prompt_scores_under_an_adapter_match_peft(lora_llm, hf_model, adapters):
    """prompt_logprobs read the adapter's head per token, like the sampler: the adapter's row against
    PEFT's forward, beside a base-model row of the same prompt."""
    from peft import PeftModel

    chat = [{"role": "user", "content": PROMPTS[0]}]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    adapted, base = lora_llm.generate_chat([chat, chat], params, adapter=["a", ""])
    ids = adapted.prompt_token_ids
    peft_model = PeftModel.from_pretrained(hf_model, adapters / "a")
    try:
        with torch.no_grad():
            reference = torch.log_softmax(peft_model(torch.tensor([ids])).logits[0], dim=-1).numpy()
    finally:
        peft_model.unload()  # the module's transformers model stays the base
    expected = reference[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(adapted.prompt_logprobs[1:], expected, atol=2e-3)
    assert np.abs(np.subtract(adapted.prompt_logprobs[1:], base.prompt_logprobs[1:])).max() > 0.05
    for position, top in enumerate(adapted.prompt_top_logprobs[1:]):
        np.testing.assert_allclose([v for _, v in top], reference[position, [t for t, _ in top]], atol=2e-3)


def test_prefix_cache_is_per_adapter(lora_llm):
    prompt = "Summarize the plot of a detective story in three sentences, with a twist at the end."
    params = SamplingParams(max_tokens=2, temperature=0.0)
    lora_llm.generate(prompt, params)  # the base model's pages are cached
    (first,) = lora_llm.generate(prompt, params, adapter="a")
    (second,) = lora_llm.generate(prompt, params, adapter="a")
    assert first.usage.cached_tokens == 0  # the base model's KV is not the adapter's
    assert second.usage.cached_tokens > 0


def test_load_unload_at_run_time_without_recompiling(lora_llm, hf_model, adapters, tmp_path):
    compiles, xla_compiles = lora_llm.runner.num_compiles, XLA_COMPILES.mark()
    with pytest.raises(RequestError, match="max_adapters"):
        lora_llm.load_adapter("c", str(tmp_path))
    lora_llm.unload_adapter("b")
    assert [a.name for a in lora_llm.list_adapters()] == ["a"]
    with pytest.raises(RequestError, match="adapter: 'b' is not loaded"):
        lora_llm.generate("hi", SamplingParams(max_tokens=2), adapter="b")
    peft_adapter(hf_model, tmp_path / "c", seed=4).unload()
    with jax.transfer_guard("disallow"):  # the slot's weights go to the device by explicit copies
        info = lora_llm.load_adapter("c", str(tmp_path / "c"))
        (out,) = lora_llm.generate(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0), adapter="c")
    assert info.slot == 2
    assert out.finish_reason in ("stop", "length")
    assert lora_llm.runner.num_compiles == compiles and lora_llm.runner.compiles_after_warmup == 0
    assert XLA_COMPILES.since(xla_compiles) == 0  # nor any other program: loading an adapter writes its slot
    lora_llm.unload_adapter("c")
    lora_llm.load_adapter("b", str(adapters / "b"))


def test_bad_adapters_are_refused_with_the_reason(lora_llm, adapters, tmp_path):
    with pytest.raises(CheckpointError, match=r"no adapter_config\.json"):
        read_adapter(tmp_path)
    rng = np.random.default_rng(0)
    name = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    cases = {
        "rank": ({"r": 32, "lora_alpha": 32}, {name.format(0, "A"): rng.normal(size=(32, 576)),
                                                name.format(0, "B"): rng.normal(size=(576, 32))}, "max_lora_rank"),
        "shape": ({"r": 4}, {name.format(0, "A"): rng.normal(size=(4, 100)),
                             name.format(0, "B"): rng.normal(size=(576, 4))}, "maps 100 -> 576"),
        "layer": ({"r": 4}, {name.format(40, "A"): rng.normal(size=(4, 576)),
                             name.format(40, "B"): rng.normal(size=(576, 4))}, "does not adapt"),
        "tokens": ({"r": 4, "trainable_token_indices": [5]},
                   {"base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta":
                    rng.normal(size=(1, 576))}, "not tokens added"),
        "partner": ({"r": 4}, {name.format(0, "A"): rng.normal(size=(4, 576))}, "without its partner"),
        # One non-finite slot turned every row of a batch to NaN, requests without an adapter included.
        "nan": ({"r": 4}, {name.format(0, "A"): rng.normal(size=(4, 576)),
                           name.format(0, "B"): np.full((576, 4), np.nan)}, "lora_B holds NaN or infinite"),
        "alpha": ({"r": 4, "lora_alpha": float("inf")}, {name.format(0, "A"): rng.normal(size=(4, 576)),
                                                          name.format(0, "B"): rng.normal(size=(576, 4))},
                  "lora_alpha a finite number"),
        "indices": ({"r": 4, "trainable_token_indices": ["5"]},
                    {"base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta":
                     rng.normal(size=(1, 576))}, "trainable_token_indices must be a list of token ids"),
    }
    lora_llm.unload_adapter("b")  # a free slot: each refusal is about the adapter, not the count
    try:
        for case, (config, tensors, message) in cases.items():
            arrays = {k: v.astype(np.float32) for k, v in tensors.items()}
            save_adapter(tmp_path / case, config, arrays, layout="peft")
            with pytest.raises(CheckpointError, match=message):
                lora_llm.load_adapter(case, str(tmp_path / case))
        (tmp_path / "dora").mkdir()
        (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"r": 4, "use_dora": True}))
        (tmp_path / "dora" / SAFETENSORS_FILE).write_bytes(b"")
        with pytest.raises(CheckpointError, match="use_dora"):
            lora_llm.load_adapter("dora", str(tmp_path / "dora"))
        (tmp_path / "dora" / "adapter_config.json").write_text("[4]")  # was an AttributeError, ending a batch run
        with pytest.raises(CheckpointError, match="must hold a JSON object, got list"):
            lora_llm.load_adapter("dora", str(tmp_path / "dora"))
        assert [a.name for a in lora_llm.list_adapters()] == ["a"]  # nothing half-loaded
        for linear in lora_llm.runner.adapters.linears.values():
            assert not np.any(np.asarray(linear.lora_a[...][:, 2])) and not np.any(np.asarray(linear.lora_b[...][2]))
    finally:
        lora_llm.load_adapter("b", str(adapters / "b"))


def test_adapters_over_grpc(lora_llm, adapters):
    """LoadAdapter / UnloadAdapter (admin tenants only) / ListAdapters, and Generate naming an adapter."""
    import grpc
    from servers import RunningServer

    from serving.client import InferenceClient
    from serving.proto.jaxinfer.v1 import inference_pb2 as pb
    from serving.tenants import Tenant

    tenants = (Tenant("ops", api_key="key-ops", admin=True), Tenant("user", api_key="key-user"))
    running = RunningServer(lora_llm, auth=True, tenants=tenants)
    running.call(running.server.load())
    chat = [{"role": "user", "content": PROMPTS[1]}]
    try:
        with (InferenceClient(running.target, timeout=120, api_key="key-user") as user,
              InferenceClient(running.target, timeout=120, api_key="key-ops") as ops):
            listed = user.stub.ListAdapters(pb.ListAdaptersRequest(), metadata=user.metadata).adapters
            assert [(a.name, a.slot, a.rank) for a in listed] == [("a", 1, 4), ("b", 2, 8)]
            with pytest.raises(grpc.RpcError) as denied:
                user.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a"), metadata=user.metadata)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            ops.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="b"), metadata=ops.metadata)
            with pytest.raises(grpc.RpcError) as missing:
                ops.stub.LoadAdapter(pb.LoadAdapterRequest(name="b", source="/no/such/adapter"), metadata=ops.metadata)
            assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not an existing path" in missing.value.details()
            info = ops.stub.LoadAdapter(pb.LoadAdapterRequest(name="b", source=str(adapters / "b")),
                                        metadata=ops.metadata)
            assert (info.name, info.slot, info.rank, len(info.digest)) == ("b", 2, 8, 32)
            text, last = user.generate(chat, adapter="b", max_tokens=10, temperature=0.0)
            (expected,) = lora_llm.generate_chat(chat, SamplingParams(max_tokens=10, temperature=0.0), adapter="b")
            assert text == expected.text and last.usage.completion_tokens == len(expected.token_ids)
            with pytest.raises(grpc.RpcError) as unknown:
                user.generate(chat, adapter="zzz", max_tokens=2)
            assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "adapter: 'zzz' is not loaded" in unknown.value.details()
    finally:
        running.close()


def test_an_adapter_in_use_cannot_be_unloaded(lora_llm):
    engine = lora_llm.engine
    request = dataclasses.replace(lora_llm.request("Hello", SamplingParams(max_tokens=4)), adapter="a")
    seq = engine.add_request(request)
    (info,) = [a for a in lora_llm.list_adapters() if a.name == "a"]
    assert info.users == 1
    with pytest.raises(RequestError, match=r"in use by 1 request"):
        lora_llm.unload_adapter("a")
    engine.abort(seq.index)
    assert info.users == 0 and not engine.has_unfinished()


def test_trainable_tokens_match_peft(hf_model, tmp_path, smollm2_llm):
    """PEFT's trainable tokens for ids added past the vocabulary (the processor's control tokens):
    the adapter's rows are their input embeddings and, with tied embeddings, their output scores."""
    from peft import LoraConfig, get_peft_model

    base_vocab, added = 49152, 6
    hf = copy.deepcopy(hf_model)
    hf.resize_token_embeddings(base_vocab + added, mean_resizing=False)
    with torch.no_grad():
        hf.get_input_embeddings().weight[base_vocab:] = 0.0  # the engine's new ids start as zero rows
    new_ids = list(range(base_vocab, base_vocab + added))
    torch.manual_seed(5)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], init_lora_weights=False,
                        trainable_token_indices={"embed_tokens": new_ids}, ensure_weight_tying=True)
    peft_model = get_peft_model(hf, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
            if "trainable_tokens_delta" in name:
                param.copy_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(tmp_path / "tokens")
    loaded = load_model("smollm2-135m", smollm2_llm.mesh)
    loaded.model.extend_vocabulary(base_vocab + added)
    slots = AdapterSlots(loaded.model, smollm2_llm.mesh, 1, 8, LORA_TARGETS)
    slots.load("tokens", str(tmp_path / "tokens"))
    prompt = smollm2_llm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[2]}])
    ids = [*prompt, base_vocab, 42, 43, base_vocab + 1]
    ours = PagedForward(loaded.model, page_size=16, num_pages=64, max_pages=16, adapter_slot=1).run(ids, 0)
    base = PagedForward(loaded.model, page_size=16, num_pages=64, max_pages=16, adapter_slot=0).run(ids, 0)
    with torch.no_grad():
        reference = peft_model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours[:, base_vocab:]).max() > 0.1 and not np.any(base[:, base_vocab:])  # rows come from the adapter
    np.testing.assert_allclose(ours, reference, atol=2e-3, rtol=0)


def test_an_adapter_without_token_rows_loads_where_tokens_were_added(exec_llm, adapters):
    """With the processor's control tokens added (their rows are per adapter slot), an adapter that
    trains no token rows loads, applies, and unloads back to the base model."""
    for info in exec_llm.list_adapters():  # its one slot may hold the exec adapter from another module
        exec_llm.unload_adapter(info.name)
    chat = [{"role": "user", "content": "Name a color."}]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)
    base = exec_llm.generate_chat(chat, greedy)[0]
    with jax.transfer_guard("disallow"):  # the added rows are read back and sent by explicit copies
        exec_llm.load_adapter("plain", str(adapters / "a"))
    try:
        adapted = exec_llm.generate_chat(chat, greedy, adapter="plain")[0]
    finally:
        exec_llm.unload_adapter("plain")
    assert np.abs(np.subtract(adapted.logprobs[:1], base.logprobs[:1])).max() > 1e-3  # same context: it applied
    after = exec_llm.generate_chat(chat, greedy)[0]
    assert after.token_ids == base.token_ids and np.allclose(after.logprobs, base.logprobs, atol=1e-4)


def test_an_adapter_by_model_name_over_http(lora_llm):
    """The OpenAI API names an adapter by `model`, as vLLM does; /v1/models lists the loaded ones."""
    import openai
    from servers import RunningServer

    running = RunningServer(lora_llm, http_port=0)
    running.call(running.server.load())
    chat = [{"role": "user", "content": PROMPTS[1]}]
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.server.http_port}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        models = {m.id: m.parent for m in client.models.list().data}
        assert models == {"smollm2-135m": None, "a": "smollm2-135m", "b": "smollm2-135m"}
        for name in ("a", "b"):
            reply = client.chat.completions.create(model=name, messages=chat, max_tokens=10, temperature=0)
            (expected,) = lora_llm.generate_chat(chat, SamplingParams(max_tokens=10, temperature=0.0), adapter=name)
            assert reply.choices[0].message.content == expected.text and reply.model == name
        base = client.chat.completions.create(model="smollm2-135m", messages=chat, max_tokens=10, temperature=0)
        assert base.choices[0].message.content != expected.text
    finally:
        running.close()
