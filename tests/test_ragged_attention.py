"""The TPU path (JAX's ragged paged attention contract over the combined KV layout) on the CPU.

JAX 0.10's TPU interpreter cannot run the shipped kernel (it fails on the kernel's ref reshape), so:
- `contract_reference`, our jittable statement of the kernel's contract, is checked against JAX's own
  reference for the kernel (`ref_ragged_paged_attention`, eager only);
- the backend (combined layout, metadata from the step's rows and padding) runs with
  `contract_reference` and is checked against the split-layout reference backend;
- the shipped kernel itself is lowered through our backend to Mosaic for a TPU (no TPU needed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import CASES, moved_into, ragged_batch, reference_output, with_padding
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from jaxinfer.errors import ConfigError
from jaxinfer.layers.attention import AttentionMetadata
from jaxinfer.layers.backends import backend_name, make_backend
from jaxinfer.layers.kv_layout import CombinedPages, SplitPages
from jaxinfer.layers.ragged_attention import RaggedPagedAttention, contract_reference, ragged_segments


def combined_copy(k_cache: jax.Array, v_cache: jax.Array) -> tuple[jax.Array, CombinedPages]:
    """The same pages in the combined layout."""
    layout = CombinedPages.for_mosaic(k_cache.shape[0], k_cache.shape[3], k_cache.dtype)
    return moved_into(layout, k_cache, v_cache), layout


@pytest.mark.parametrize("case", ["mixed", "many_pages"])
@pytest.mark.parametrize("group", [1, 4])
def test_contract_reference_matches_jax_reference(case: str, group: int) -> None:
    q, k_cache, v_cache, meta = ragged_batch(CASES[case], kv_heads=2, group=group, page_size=16, table_width=16)
    cache, layout = combined_copy(k_cache, v_cache)
    segments = ragged_segments(meta, 16)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, layout.padded_head_dim - q.shape[2])))
    args = (q, cache, segments.kv_lens, segments.page_indices, segments.cu_q_lens, segments.num_seqs)
    expected = ref_ragged_paged_attention(*args, sm_scale=0.2)
    got = jax.jit(lambda *a: contract_reference(*a, sm_scale=0.2))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)


def test_segments_follow_rows_and_stop_at_the_padding() -> None:
    # row 0: positions 5..7; row 1: position 12; row 2: position 0 (a one-token prefill); then padding
    meta = with_padding(AttentionMetadata(jnp.array([5, 6, 7, 12, 0], jnp.int32), jnp.array([0, 0, 0, 1, 2], jnp.int32),
                                          jnp.zeros((4, 3), jnp.int32), jnp.zeros(5, jnp.int32)), 3)
    segments = ragged_segments(meta, page_size=8)
    assert segments.cu_q_lens.tolist() == [0, 3, 4, 5, 5]
    assert segments.kv_lens.tolist() == [8, 13, 1, 0]
    assert segments.num_seqs.tolist() == [3]
    assert segments.real.tolist() == [True] * 5 + [False] * 3
    # a draft row past its budget counts on past its 3 pages of 4 slots: its keys stop at the table's end
    assert ragged_segments(meta, page_size=4).kv_lens.tolist() == [8, 12, 1, 0]


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_the_reference_backend(case: str, group: int, page_size: int) -> None:
    # 3 kv heads pad to 4 (Mosaic tiles 8 combined heads), head_dim 32 pads to 128 lanes
    q, k_cache, v_cache, meta = ragged_batch(CASES[case], kv_heads=3, group=group, page_size=page_size,
                                             table_width=16)
    scale = 32**-0.5
    expected = reference_output(q, k_cache, v_cache, meta, scale, block_tokens=64, query_tile=4)
    cache, layout = combined_copy(k_cache, v_cache)
    padded = with_padding(meta, 5)
    q_padded = jnp.concatenate([q, jnp.ones((5, *q.shape[1:]), q.dtype)])
    attend = jax.jit(lambda q, c, m: RaggedPagedAttention.plain_jax().attend(q, c, m, scale, layout))
    got = attend(q_padded, cache, padded)
    np.testing.assert_allclose(np.asarray(got[: q.shape[0]]), np.asarray(expected), atol=2e-5, rtol=2e-5)
    assert not np.any(np.asarray(got[q.shape[0] :])), "padding tokens' outputs are zero"


def test_bfloat16_pages_stay_within_bfloat16_rounding() -> None:
    q, k_cache, v_cache, meta = ragged_batch(CASES["mixed"], kv_heads=2, group=4, page_size=16, table_width=16)
    expected = np.asarray(reference_output(q, k_cache, v_cache, meta, 0.2))
    cache, layout = combined_copy(k_cache.astype(jnp.bfloat16), v_cache.astype(jnp.bfloat16))
    assert cache.dtype == jnp.bfloat16
    got = RaggedPagedAttention.plain_jax().attend(q.astype(jnp.bfloat16), cache, meta, 0.2, layout)
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=0.01 * np.abs(expected).max())


def test_padding_taken_for_queries_is_caught() -> None:
    """The comparison above can fail: counting the padding as queries of the last row shifts its
    causal window (the kernel aligns a sequence's queries to the end of its keys)."""
    q, k_cache, v_cache, meta = ragged_batch(CASES["mixed"], kv_heads=2, group=2, page_size=16, table_width=16)
    expected = reference_output(q, k_cache, v_cache, meta, 0.2)
    cache, _layout = combined_copy(k_cache, v_cache)
    padded = with_padding(meta, 4)
    segments = ragged_segments(padded, 16)
    counts_padding = segments.cu_q_lens.at[len(CASES["mixed"]):].add(4)
    q_padded = jnp.pad(jnp.concatenate([q, jnp.zeros((4, *q.shape[1:]), q.dtype)]), ((0, 0), (0, 0), (0, 96)))
    got = contract_reference(q_padded, cache, segments.kv_lens, segments.page_indices, counts_padding,
                             segments.num_seqs, sm_scale=0.2)[: q.shape[0], :, :32]
    last_row = np.asarray(meta.seq_rows) == len(CASES["mixed"]) - 1
    assert not np.allclose(np.asarray(got)[last_row], np.asarray(expected)[last_row], atol=1e-3)
    np.testing.assert_allclose(np.asarray(got)[~last_row], np.asarray(expected)[~last_row], atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim,shards", [(3, 64, 1), (8, 128, 1), (1, 64, 1), (5, 96, 1), (6, 64, 2)])
def test_layouts_write_and_move_the_same_pages(kv_heads: int, head_dim: int, shards: int, dtype) -> None:
    rng = np.random.default_rng(kv_heads)
    num_pages, page_size, tokens = 12, 16, 40
    split, combined = SplitPages(kv_heads, head_dim), CombinedPages.for_mosaic(kv_heads, head_dim, dtype, shards)
    assert combined.shards == shards
    assert combined.padded_head_dim % 128 == 0 and combined.padded_kv_heads * shards >= kv_heads
    k, v = (jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), dtype) for _ in range(2))
    slots = jnp.asarray(rng.permutation(np.arange(page_size, num_pages * page_size))[:tokens], jnp.int32)
    split_cache = split.update(split.empty(num_pages, page_size, dtype), k, v, slots)
    combined_cache = combined.update(combined.empty(num_pages, page_size, dtype), k, v, slots)
    pages = jnp.arange(num_pages)
    np.testing.assert_array_equal(np.asarray(combined.export(combined_cache, pages), np.float32),
                                  np.asarray(split.export(split_cache, pages), np.float32))
    # pages moved into an empty combined pool come back the same, and the padding stays zero
    moved = combined.import_pages(combined.empty(num_pages, page_size, dtype), pages[1:],
                                  split.export(split_cache, pages[1:]))
    np.testing.assert_array_equal(np.asarray(moved, np.float32), np.asarray(combined_cache, np.float32))


def test_mosaic_tiling_pads() -> None:
    assert CombinedPages.for_mosaic(3, 64, jnp.bfloat16) == CombinedPages(3, 64, 4, 128)  # SmolLM2-135M
    assert CombinedPages.for_mosaic(8, 128, jnp.bfloat16) == CombinedPages(8, 128, 8, 128)  # Llama-3-8B: none
    assert CombinedPages.for_mosaic(2, 64, jnp.float32) == CombinedPages(2, 64, 2, 128)
    assert CombinedPages.for_mosaic(5, 128, jnp.float32) == CombinedPages(5, 128, 8, 128)
    assert CombinedPages.for_mosaic(1, 128, jnp.bfloat16) == CombinedPages(1, 128, 1, 128)
    # split over the model axis where it divides the kv heads, each shard padded on its own
    assert CombinedPages.for_mosaic(6, 64, jnp.float32, model_parallel=2) == CombinedPages(6, 64, 4, 128, shards=2)
    assert CombinedPages.for_mosaic(3, 64, jnp.float32, model_parallel=2) == CombinedPages(3, 64, 4, 128, shards=1)


def test_backend_names() -> None:
    tpu = make_backend("auto", block_tokens=128, query_tile=16, model_parallel=4, platform="tpu")
    assert isinstance(tpu, RaggedPagedAttention) and tpu.model_parallel == 4
    assert tpu.kernel is not contract_reference
    assert make_backend("ragged_reference", block_tokens=128, query_tile=16) == RaggedPagedAttention.plain_jax()
    with pytest.raises(ConfigError, match="pallas_tpu compiles only for TPUs, and this platform is cpu"):
        make_backend("pallas_tpu", block_tokens=128, query_tile=16)
    assert backend_name("auto") == "reference"  # this CPU


def _tpu_v5e_mesh():
    from jax._src import mesh as mesh_lib  # the abstract device a lowering targets: no public constructor yet

    device = mesh_lib.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


@pytest.mark.parametrize("shape", ["smollm2", "llama3_8b"])
@pytest.mark.parametrize("page_size", [16, 32])
def test_shipped_kernel_lowers_to_mosaic_for_a_tpu(shape: str, page_size: int) -> None:
    """JAX's TPU kernel, called by the engine's `pallas_tpu` backend (its default block settings) with
    bf16 KV in the combined layout, lowers for a TPU v5e here (the Pallas-to-Mosaic lowering runs at
    JAX lowering time); compiling it needs a TPU."""
    kv_heads, heads, head_dim = {"smollm2": (3, 9, 64), "llama3_8b": (8, 32, 128)}[shape]
    tokens, rows, pages_per_seq = 64, 8, 32
    backend = make_backend("pallas_tpu", block_tokens=128, query_tile=16, platform="tpu")
    layout = backend.layout_for(kv_heads, head_dim, jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((256, page_size, 2 * layout.padded_kv_heads, layout.padded_head_dim), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((tokens, heads, head_dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    meta = AttentionMetadata(ids, ids, jax.ShapeDtypeStruct((rows, pages_per_seq), jnp.int32), ids)
    attend = jax.jit(lambda q, c, m: backend.attend(q, c, m, head_dim**-0.5, layout))
    with jax.sharding.use_abstract_mesh(_tpu_v5e_mesh()):
        exported = jax.export.export(attend, platforms=["tpu"])(q, cache, meta)
    module = exported.mlir_module()
    assert "tpu_custom_call" in module and "ragged_paged_attention_kernel" in module
    assert exported.out_avals[0].shape == (tokens, heads, head_dim)


def test_engine_on_the_combined_layout_generates_what_the_reference_does(smollm2_llm, tmp_path):
    """The whole TPU path but the kernel, in the engine: a mixed batch, then pages evicted to host
    memory and a tensorstore store and restored through the combined layout, with the same tokens."""
    from conftest import TEST_ENGINE
    from test_kv_tiers import GREEDY, SYSTEM, engine_on, evict_everything, identity

    from jaxinfer import LLM
    from jaxinfer.kv.store import PageStore
    from jaxinfer.kv.tiers import HostTier, TieredPages

    llm = LLM("smollm2-135m", **{**TEST_ENGINE, "attention_backend": "ragged_reference", "max_model_len": 256})
    assert isinstance(llm.runner.caches[0], jax.Array) and llm.runner.caches[0].shape == (512, 8, 8, 128)
    prompts = [SYSTEM + "When is high tide?", "Name a lamp.", "Count to five:"]
    expected = [out.token_ids for out in smollm2_llm.generate(prompts, GREEDY)]
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == expected
    tiers = TieredPages(HostTier(capacity=2), PageStore(str(tmp_path), identity(llm)))
    engine = engine_on(llm, tiers=tiers)
    request = llm.request(prompts[0], GREEDY)
    assert engine.generate([request])[0].token_ids == expected[0]
    evict_everything(engine)
    again = engine.generate([request])[0]
    assert again.token_ids == expected[0]
    assert engine.stats.prefix_hit_tokens_l2 > 0 and engine.stats.prefix_hit_tokens_l3 > 0
    assert llm.runner.compiles_after_warmup == 0
