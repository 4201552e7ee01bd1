"""int8 KV pages (`engine.kv_dtype = "int8"`, layers/kv_quant.py).

- Attention over int8 pages against the same keys and values in float32 pages, within a stated
  tolerance.
- Pages leave and come back bit for bit (values and scales), and the KV tiers (host, tensorstore
  file store) restore them with identical outputs.
- SmolLM2 on int8 KV: a quarter of the float32 pool's bytes plus the scales; greedy tokens mostly
  those of float KV.
- Refusals name the setting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TEST_ENGINE

from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import ConfigError
from jaxinfer.layers.attention import AttentionMetadata, ReferenceAttention
from jaxinfer.layers.backends import make_backend
from jaxinfer.layers.kv_layout import SplitPages
from jaxinfer.layers.kv_quant import Int8SplitPages, quantize_rows

KV_HEADS, HEADS, HEAD_DIM, PAGE, PAGES = 2, 4, 64, 8, 16


def filled(layout, k, v, slots):
    return layout.update(layout.empty(PAGES, PAGE, jnp.float32), k, v, slots)


def test_attention_over_int8_pages_stays_within_the_quantization_error():
    rng = np.random.default_rng(0)
    tokens = 40
    q = jnp.asarray(rng.standard_normal((tokens, HEADS, HEAD_DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
    pages = np.array([3, 7, 1, 12, 5], np.int32)
    positions = np.arange(tokens, dtype=np.int32)
    slots = jnp.asarray(pages[positions // PAGE] * PAGE + positions % PAGE)
    meta = AttentionMetadata(positions=jnp.asarray(positions), seq_rows=jnp.zeros(tokens, jnp.int32),
                             page_table=jnp.asarray(np.pad(pages, (0, 3))[None]), write_slots=slots)
    exact = ReferenceAttention().attend(q, filled(SplitPages(KV_HEADS, HEAD_DIM), k, v, slots), meta, 0.125)
    int8 = ReferenceAttention(kv_dtype="int8")
    ours = int8.attend(q, filled(int8.layout_for(KV_HEADS, HEAD_DIM, jnp.float32), k, v, slots), meta, 0.125)
    # Each stored value is within half a step of its float: amax/254, about 0.013 for these unit-normal
    # rows (amax about 3.3). The outputs, weighted means of such values, moved 1.5e-2 at most (measured);
    # 5e-2 leaves room, and a wrong scale or row moves them by about 1.
    error = float(jnp.max(jnp.abs(ours - exact)))
    assert 0 < error < 5e-2


def test_int8_pages_leave_and_come_back_bit_for_bit():
    rng = np.random.default_rng(1)
    layout = Int8SplitPages(KV_HEADS, HEAD_DIM)
    k, v = (jnp.asarray(rng.standard_normal((24, KV_HEADS, HEAD_DIM)) * 3, jnp.float32) for _ in range(2))
    cache = filled(layout, k, v, jnp.arange(8, 32))
    pages = jnp.array([1, 2, 3])
    stored = layout.export(cache, pages)
    assert stored.dtype == jnp.int8 and stored.shape == (3, 2, KV_HEADS, PAGE, HEAD_DIM + 4)
    assert layout.stored_page(jnp.float32) == ("int8", HEAD_DIM + 4)
    moved = layout.import_pages(layout.empty(PAGES, PAGE, jnp.float32), jnp.array([9, 4, 6]), stored)
    np.testing.assert_array_equal(layout.export(moved, jnp.array([9, 4, 6])), stored)
    values, scales = quantize_rows(jnp.swapaxes(k[:8], 0, 1))
    np.testing.assert_array_equal(moved.k[:, 9], values)
    np.testing.assert_array_equal(moved.k_scale[:, 9], scales)


@pytest.fixture(scope="module")
def int8_llm():
    return LLM("smollm2-135m", **{**TEST_ENGINE, "token_buckets": (8, 64)}, kv_dtype="int8")


def test_smollm2_on_int8_kv_keeps_most_greedy_tokens_in_a_quarter_of_the_bytes(int8_llm, smollm2_llm):
    prompts = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in int8_llm.generate(prompts, greedy)]
    theirs = [o.token_ids for o in smollm2_llm.generate(prompts, greedy)]
    agree = np.mean([a == b for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True)])
    assert agree >= 0.75, (ours, theirs)
    assert ours[0][:4] == theirs[0][:4]  # the first tokens of a prompt see the fewest rounded keys
    pool = int8_llm.engine.metrics()["kv_pool_bytes"]
    assert pool == smollm2_llm.engine.metrics()["kv_pool_bytes"] * (HEAD_DIM + 4) // (4 * HEAD_DIM)


def test_int8_pages_restore_from_l2_and_l3_with_identical_outputs(int8_llm, tmp_path):
    from test_kv_tiers import engine_on, evict_everything

    from jaxinfer.kv.store import ModelIdentity, PageStore
    from jaxinfer.kv.tiers import HostTier, TieredPages

    m, page = int8_llm.model_config, int8_llm.config.page_size
    stored_dtype, width = int8_llm.runner.model.kv_layout.stored_page(int8_llm.dtype)
    identity = ModelIdentity("smollm2-135m:int8-test", stored_dtype, page, m.num_layers, m.num_kv_heads, width)
    tiers = TieredPages(HostTier(capacity=2), PageStore(str(tmp_path), identity))
    engine = engine_on(int8_llm, tiers=tiers)
    request = int8_llm.request("Tides and lamps: " * 8 + "Which comes first?",
                               SamplingParams(max_tokens=8, temperature=0.0))
    reference = engine.generate([request])[0].token_ids
    with jax.transfer_guard("disallow"):  # pages move by explicit copies
        evict_everything(engine)
        again = engine.generate([request])[0].token_ids
    assert again == reference
    assert engine.stats.prefix_hit_tokens_l2 == 2 * page and engine.stats.prefix_hit_tokens_l3 > 0


def test_kv_dtype_settings_are_checked_by_name():
    with pytest.raises(ConfigError, match=r"engine.kv_dtype must be one of auto, int8, got 'fp4'"):
        make_backend("reference", block_tokens=64, query_tile=16, kv_dtype="fp4")
    with pytest.raises(ConfigError, match=r"engine.kv_dtype = int8 is read by the reference attention backend "
                                          r"only yet, and engine.attention_backend is ragged_reference"):
        make_backend("ragged_reference", block_tokens=64, query_tile=16, kv_dtype="int8")
