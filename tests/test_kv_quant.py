"""Quantized KV pages (`engine.kv_dtype = "int8" | "fp8"`, layers/kv_quant.py).

- Attention over int8 and fp8 pages against the same keys and values in float32 pages, within a
  stated tolerance.
- fp8's page scales: a page written a token at a time holds what one write of all its tokens holds,
  a write that raises the scale re-rounds the earlier rows, and a page written from its first slot
  again starts afresh.
- Pages leave and come back bit for bit (values and scales), and the KV tiers (host, tensorstore
  file store) restore them with identical outputs.
- SmolLM2 on int8 / fp8 KV: a quarter of the float32 pool's bytes plus the scales; greedy tokens
  mostly those of float KV.
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
from jaxinfer.layers.kv_quant import Fp8SplitPages, Int8SplitPages, dequantize_block, quantize_rows

KV_HEADS, HEADS, HEAD_DIM, PAGE, PAGES = 2, 4, 64, 8, 16


def filled(layout, k, v, slots):
    return layout.update(layout.empty(PAGES, PAGE, jnp.float32), k, v, slots)


# Each int8 value is within half a step of its float: amax/254, about 0.013 for these unit-normal rows
# (amax about 3.3). e4m3 keeps 3 mantissa bits: a value is within 1/16 of itself (measured: 5.9%, 0.14
# at most), and those errors also move the scores of the first tokens, which attend to a few keys. The
# outputs moved 1.5e-2 (int8) and 1.2e-1 (fp8) at most (measured; the fp8 backend's output equals exact
# attention over the dequantized pages to the bit). The bounds leave room, and a wrong scale or row
# moves the outputs by about 1 or more.
@pytest.mark.parametrize(("kv_dtype", "bound"), [("int8", 5e-2), ("fp8", 2.5e-1)])
def test_attention_over_quantized_pages_stays_within_the_quantization_error(kv_dtype, bound):
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
    backend = ReferenceAttention(kv_dtype=kv_dtype)
    ours = backend.attend(q, filled(backend.layout_for(KV_HEADS, HEAD_DIM, jnp.float32), k, v, slots), meta, 0.125)
    error = float(jnp.max(jnp.abs(ours - exact)))
    print(f"{kv_dtype}: largest output error {error:.2e}")
    assert 0 < error < bound


def fp8_rows(cache, page: int) -> np.ndarray:
    return np.asarray(dequantize_block(cache.k[:, page], cache.k_scale[:, page]))


def test_fp8_page_scales_grow_with_their_page_and_restart_at_its_first_slot():
    rng = np.random.default_rng(3)
    layout = Fp8SplitPages(KV_HEADS, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal((PAGE, KV_HEADS, HEAD_DIM)) * np.linspace(0.1, 4, PAGE)[:, None, None],
                    jnp.float32)  # each row larger than the last: every write raises the scale
    slots = 2 * PAGE + jnp.arange(PAGE)
    at_once = filled(layout, k, k, slots)
    one_by_one = layout.empty(PAGES, PAGE, jnp.float32)
    for i in range(PAGE):
        one_by_one = layout.update(one_by_one, k[i:i + 1], k[i:i + 1], slots[i:i + 1])
    expected = np.swapaxes(np.asarray(k), 0, 1)
    np.testing.assert_array_equal(one_by_one.k_scale[:, 2], at_once.k_scale[:, 2])
    np.testing.assert_allclose(at_once.k_scale[:, 2], np.abs(expected).max(axis=(1, 2)) / 448, rtol=1e-6)
    # rounded once, or re-rounded at each of 7 raised scales: both near the floats (e4m3: 1/16 of a
    # value, or 2**-9 of the page's largest value near zero, per rounding)
    for cache, rounds in ((at_once, 1), (one_by_one, PAGE)):
        tolerance = rounds * (np.abs(expected) / 16 + float(cache.k_scale[:, 2].max()) * 448 * 2.0 ** -9)
        assert np.all(np.abs(fp8_rows(cache, 2) - expected) <= tolerance)
    small = k[:2] * 0.01  # the page handed out again: written from slot 0, its old scale is dropped
    again = layout.update(at_once, small, small, slots[:2])
    np.testing.assert_allclose(again.k_scale[:, 2], np.abs(np.asarray(small)).max(axis=(0, 2)) / 448, rtol=1e-6)
    np.testing.assert_array_equal(fp8_rows(again, 2)[:, 2:], 0)  # stale rows: zeros, never read
    assert at_once.k.dtype == jnp.uint8 and again.k_scale.shape == (KV_HEADS, PAGES)  # e4m3 bits


@pytest.mark.parametrize("layout", [Int8SplitPages(KV_HEADS, HEAD_DIM), Fp8SplitPages(KV_HEADS, HEAD_DIM)])
def test_quantized_pages_leave_and_come_back_bit_for_bit(layout):
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.standard_normal((24, KV_HEADS, HEAD_DIM)) * 3, jnp.float32) for _ in range(2))
    cache = filled(layout, k, v, jnp.arange(8, 32))
    pages = jnp.array([1, 2, 3])
    stored = layout.export(cache, pages)
    stored_dtype = "int8" if isinstance(layout, Int8SplitPages) else "uint8"  # different identities in a store
    assert stored.dtype == stored_dtype and stored.shape == (3, 2, KV_HEADS, PAGE, HEAD_DIM + 4)
    assert layout.stored_page(jnp.float32) == (stored_dtype, HEAD_DIM + 4)
    moved = layout.import_pages(layout.empty(PAGES, PAGE, jnp.float32), jnp.array([9, 4, 6]), stored)
    np.testing.assert_array_equal(layout.export(moved, jnp.array([9, 4, 6])), stored)
    for field in ("k", "v", "k_scale", "v_scale"):
        np.testing.assert_array_equal(getattr(moved, field)[:, 9].view(np.uint8), getattr(cache, field)[:, 1]
                                      .view(np.uint8))
    if isinstance(layout, Int8SplitPages):
        values, scales = quantize_rows(jnp.swapaxes(k[:8], 0, 1))
        np.testing.assert_array_equal(moved.k[:, 9], values)
        np.testing.assert_array_equal(moved.k_scale[:, 9], scales)


@pytest.fixture(scope="module", params=["int8", "fp8"])
def quantized(request):
    return LLM("smollm2-135m", **{**TEST_ENGINE, "token_buckets": (8, 64)}, kv_dtype=request.param)


def test_smollm2_on_quantized_kv_keeps_most_greedy_tokens_in_a_quarter_of_the_bytes(quantized, smollm2_llm):
    prompts = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in quantized.generate(prompts, greedy)]
    theirs = [o.token_ids for o in smollm2_llm.generate(prompts, greedy)]
    agree = np.mean([a == b for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True)])
    assert agree >= 0.75, (ours, theirs)
    assert ours[0][:4] == theirs[0][:4]  # the first tokens of a prompt see the fewest rounded keys
    pool, float_pool = quantized.engine.metrics()["kv_pool_bytes"], smollm2_llm.engine.metrics()["kv_pool_bytes"]
    if quantized.config.kv_dtype == "int8":
        assert pool == float_pool * (HEAD_DIM + 4) // (4 * HEAD_DIM)
    else:  # one float32 scale per page and head
        page = quantized.config.page_size
        assert pool == float_pool * (HEAD_DIM * page + 4) // (4 * HEAD_DIM * page)


def test_quantized_pages_restore_from_l2_and_l3_with_identical_outputs(quantized, tmp_path):
    from test_kv_tiers import engine_on, evict_everything

    from jaxinfer.kv.store import ModelIdentity, PageStore
    from jaxinfer.kv.tiers import HostTier, TieredPages

    m, page = quantized.model_config, quantized.config.page_size
    stored_dtype, width = quantized.runner.model.kv_layout.stored_page(quantized.dtype)
    identity = ModelIdentity("smollm2-135m:quantized-test", stored_dtype, page, m.num_layers, m.num_kv_heads, width)
    tiers = TieredPages(HostTier(capacity=2), PageStore(str(tmp_path), identity))
    engine = engine_on(quantized, tiers=tiers)
    request = quantized.request("Tides and lamps: " * 8 + "Which comes first?",
                               SamplingParams(max_tokens=8, temperature=0.0))
    reference = engine.generate([request])[0].token_ids
    with jax.transfer_guard("disallow"):  # pages move by explicit copies
        evict_everything(engine)
        again = engine.generate([request])[0].token_ids
    assert again == reference
    assert engine.stats.prefix_hit_tokens_l2 == 2 * page and engine.stats.prefix_hit_tokens_l3 > 0


def test_kv_dtype_settings_are_checked_by_name():
    with pytest.raises(ConfigError, match=r"engine.kv_dtype must be one of auto, int8, fp8, got 'fp4'"):
        make_backend("reference", block_tokens=64, query_tile=16, kv_dtype="fp4")
    with pytest.raises(ConfigError, match=r"engine.kv_dtype = int8 is read by the reference and pallas_gpu "
                                          r"attention backends only yet, and engine.attention_backend is "
                                          r"ragged_reference"):
        make_backend("ragged_reference", block_tokens=64, query_tile=16, kv_dtype="int8")
