"""The prefix cache: hash-chained full pages, reference counts, LRU reuse, tenants, in-batch sharing."""

from __future__ import annotations

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.params import Request
from jaxinfer.kv import PrefixCachingPool, chain_keys

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, and never invent facts about "
    "people, places or numbers that you are unsure of. "
) * 3


def test_chain_keys_depend_on_every_earlier_token_and_the_salt():
    a = chain_keys(list(range(32)), 8)
    b = chain_keys([99, *range(1, 32)], 8)
    assert len(a) == 4 and all(x != y for x, y in zip(a, b, strict=True))  # a change in page 0 changes all keys
    assert chain_keys(list(range(32)), 8, salt="tenant-b") != a
    assert chain_keys(list(range(16, 32)), 8, start=a[1]) == a[2:]  # continuing a chain


def test_pool_reference_counts_and_lru_eviction():
    pool = PrefixCachingPool(5)  # pages 1..4
    first = pool.allocate(2)
    keys = [b"k1", b"k2"]
    for page, key in zip(first, keys, strict=True):
        pool.register(page, key)
    assert pool.lookup(keys) == first  # shared: two references each
    pool.free(first)
    pool.free(first)
    assert pool.num_free == 4 and pool.num_cached == 2  # free but still cached
    other = pool.allocate(3)  # two never-used pages, then the least recently freed cached page
    # A sequence's pages are released last page first, so eviction takes the chain's end and its head
    # stays a hit (evicting the head would strand the rest: unreachable, yet still cached).
    assert first[1] in other and first[0] not in other
    assert pool.lookup(keys) == [first[0]]
    pool.free([first[0]])
    with pytest.raises(AssertionError):
        pool.free([first[0]])  # refcount already 0


def test_a_released_prefix_is_evicted_from_its_end():
    pool = PrefixCachingPool(5)  # pages 1..4
    keys = chain_keys(list(range(48)), 16)
    pages = pool.allocate(3)
    for page, key in zip(pages, keys, strict=True):
        pool.register(page, key)
    pool.free(pages)
    pool.allocate(2)  # the one never-used page and the chain's last page
    assert pool.num_cached == 2 and pool.lookup(keys) == pages[:2]


def requests(llm, texts, salt="", system=SYSTEM):
    """Chat requests sharing a system prompt (each test uses its own: the pool is shared by the session)."""
    return [
        Request(
            llm.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": t}]),
            GREEDY,
            str(i),
            cache_salt=salt,
        )
        for i, t in enumerate(texts)
    ]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def fresh_engine(llm, caching=True) -> Engine:
    return Engine(llm.runner, llm.tokenizer, llm.max_model_len, prefix_caching=caching)


def test_second_request_prefills_only_the_remainder(smollm2_llm):
    page = smollm2_llm.config.page_size
    system = "Remainder test. " + SYSTEM
    first, second = requests(
        smollm2_llm, ["What is the boiling point of water?", "Name a prime number."], system=system
    )
    shared = common_prefix(first.prompt_ids, second.prompt_ids)
    assert shared >= 3 * page  # the two prompts share at least three full pages
    cached_engine, plain_engine = fresh_engine(smollm2_llm), fresh_engine(smollm2_llm, caching=False)
    cached_engine.generate([first])
    before = cached_engine.stats.prompt_tokens_computed
    (out,) = cached_engine.generate([second])
    computed = cached_engine.stats.prompt_tokens_computed - before
    assert out.usage.cached_tokens == (shared // page) * page
    assert computed == len(second.prompt_ids) - out.usage.cached_tokens
    (reference,) = plain_engine.generate(requests(smollm2_llm, ["Name a prime number."], system=system))
    assert out.token_ids == reference.token_ids and reference.usage.cached_tokens == 0


def test_in_batch_sharing_computes_a_common_prefix_once(smollm2_llm):
    page = smollm2_llm.config.page_size
    engine = fresh_engine(smollm2_llm)
    texts = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    batch = requests(smollm2_llm, texts, system="In-batch sharing test. " + SYSTEM * 2)
    common = min(common_prefix(batch[0].prompt_ids, r.prompt_ids) for r in batch[1:])
    prefix = (common // page) * page
    assert prefix >= 20 * page  # a long shared system prompt: at least 20 full pages
    outputs = engine.generate(batch)
    assert sum(o.usage.cached_tokens for o in outputs) == 7 * prefix
    assert engine.stats.prompt_tokens_computed == sum(len(r.prompt_ids) for r in batch) - 7 * prefix
    alone = fresh_engine(smollm2_llm, caching=False)
    assert [o.token_ids for o in outputs] == [alone.generate([r])[0].token_ids for r in batch]
    assert engine.pool.num_free == engine.pool.capacity


def test_tenants_share_pages_only_with_the_same_salt(smollm2_llm):
    engine = fresh_engine(smollm2_llm)
    (a,) = requests(smollm2_llm, ["Hello?"], salt="tenant-a")
    (b,) = requests(smollm2_llm, ["Hello?"], salt="tenant-b")
    (a2,) = requests(smollm2_llm, ["Hello?"], salt="tenant-a")
    engine.generate([a])
    assert engine.generate([b])[0].usage.cached_tokens == 0
    assert engine.generate([a2])[0].usage.cached_tokens > 0


def test_small_pool_evicts_cached_pages_and_stays_correct(smollm2_llm):
    engine = fresh_engine(smollm2_llm)
    texts = [f"Tell me one fact about the number {i}." for i in range(6)]
    with engine.pool.hold(keep_free=40):  # a few requests' pages: later ones evict cached pages
        outputs = [engine.generate([r])[0] for r in requests(smollm2_llm, texts)]
    alone = fresh_engine(smollm2_llm, caching=False)
    assert [o.token_ids for o in outputs] == [alone.generate([r])[0].token_ids for r in requests(smollm2_llm, texts)]
    assert engine.pool.num_free == engine.pool.capacity


def test_engines_on_one_runner_share_the_page_record(smollm2_llm):
    """A second engine on the same device pages must never overwrite pages the first one has cached."""
    (probe,) = requests(smollm2_llm, ["Which ocean is the largest?"], system="Sharing test. " + SYSTEM)
    first = smollm2_llm.engine.generate([probe])[0]
    other = fresh_engine(smollm2_llm, caching=False)
    other.generate(requests(smollm2_llm, [f"Count to {i}." for i in range(8)], system="Other engine. " + SYSTEM))
    again = smollm2_llm.engine.generate([probe])[0]
    assert again.usage.cached_tokens > 0 and again.token_ids == first.token_ids


def test_a_forgotten_page_is_never_found_and_frees_as_plain():
    """What `Scheduler._restore` does when writing restored pages fails: the pages' content never
    arrived, so no lookup may return them."""
    pool = PrefixCachingPool(4)
    keys = chain_keys(list(range(32)), 16)
    pages = pool.allocate(2)
    for page, key in zip(pages, keys, strict=True):
        pool.register(page, key)
    for page in pages:
        pool.forget(page)
    pool.free(pages)
    assert pool.lookup(keys) == [] and pool.num_cached == 0 and pool.num_free == pool.capacity
    assert pool.accounting_errors({}) == []
