"""The shipped exec adapter (`smollm2-135m-exec`) on SmolLM2: questions answered with programs, routing, caps.

With the adapter, the model writes a WebAssembly program for an arithmetic question, the processor
runs it inside the step, and the model's final sentence repeats the exact result.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.engine import Engine

pytestmark = pytest.mark.slow

ADAPTER = "smollm2-135m-exec"
QUESTIONS = {  # (question, exact answer): one of each kind the adapter was trained on, fresh numbers
    "What is 48213 * 99817?": 48213 * 99817,
    "Add 731904118273 and 55102938477.": 731904118273 + 55102938477,
    "What is 9081726354 - 123456789012?": 9081726354 - 123456789012,
    "Compute gcd(7200, 9324).": 36,
    "Compute the Fibonacci number F(50), where F(1) = F(2) = 1.": 12586269025,
}


@pytest.fixture(scope="module")
def adapted(exec_llm: LLM) -> LLM:
    if ADAPTER not in [a.name for a in exec_llm.list_adapters()]:
        exec_llm.load_adapter(ADAPTER)
    return exec_llm


def test_questions_are_answered_with_programs(adapted: LLM) -> None:
    chats = [[{"role": "user", "content": question}] for question in QUESTIONS]
    outputs = adapted.generate_chat(chats, SamplingParams(max_tokens=400, temperature=0.0, exec=True), adapter=ADAPTER)
    for (question, answer), out in zip(QUESTIONS.items(), outputs, strict=True):
        text = out.text
        assert text.startswith("<|exec|>(module") and "<|/exec|>" in text, (question, text)
        assert f"<|result|>{answer}<|/result|>" in text, (question, text)  # the program computed it exactly
        final = re.findall(r"-?\d+", text.rsplit("<|/result|>", 1)[1])
        assert final and int(final[-1]) == answer, (question, text)  # and the model's answer uses it


def test_exec_requests_route_to_the_compute_adapter(adapted: LLM) -> None:
    engine = Engine(adapted.runner, adapted.tokenizer, adapted.max_model_len)
    engine.cfg = dataclasses.replace(engine.cfg, exec_adapter=ADAPTER)
    compute = engine.add_request(adapted.chat_request([{"role": "user", "content": "What is 2 + 2?"}],
                                                      SamplingParams(max_tokens=2, exec=True)))
    chat = engine.add_request(adapted.request("Hello", SamplingParams(max_tokens=2)))
    (slot,) = [a.slot for a in adapted.list_adapters() if a.name == ADAPTER]
    assert compute.adapter_slot == slot and chat.adapter is None
    users = next(a.users for a in adapted.list_adapters() if a.name == ADAPTER)
    while engine.has_unfinished():
        engine.step()
    assert next(a.users for a in adapted.list_adapters() if a.name == ADAPTER) == users - 1


def test_exec_requests_have_their_own_concurrency_cap(adapted: LLM) -> None:
    engine = Engine(adapted.runner, adapted.tokenizer, adapted.max_model_len)
    engine.scheduler.cfg = dataclasses.replace(engine.cfg, exec_max_running=1)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    compute = [engine.add_request(adapted.request(f"Compute {i} + {i}.", dataclasses.replace(params, exec=True)))
               for i in range(3)]
    chat = engine.add_request(adapted.request("Tell me a story.", params))  # queued behind the three
    engine.step()
    running = engine.scheduler.running
    assert sum(seq in running for seq in compute) == 1 and chat in running  # chat is not crowded out
    while engine.has_unfinished():
        engine.step()
        assert sum(seq in engine.scheduler.running for seq in compute) <= 1
    assert all(seq.finish_reason == "length" for seq in [*compute, chat])
