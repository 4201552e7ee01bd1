"""The Pallas GPU attention kernel against the reference backend, run by Pallas's interpreter on the CPU.

Each case is a ragged batch of sequences, each with some cached context and some new tokens; pages
are handed out in a shuffled order (so a sequence's pages are scattered through the pool) and page 0
stays the null page. Both backends see the same caches and metadata.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import CASES, HEAD_DIM, ragged_batch, reference_output, with_padding

from jaxinfer.errors import ConfigError
from jaxinfer.layers.attention import AttentionMetadata, ReferenceAttention
from jaxinfer.layers.backends import backend_name, make_backend
from jaxinfer.layers.kv_layout import KVCache
from jaxinfer.layers.kv_quant import FP8, FP8_MAX, QuantizedKV, quantize_rows
from jaxinfer.layers.pallas_attention import PallasGpuAttention, max_query_tiles, query_tiles


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_reference_backend(case: str, group: int, page_size: int) -> None:
    q, k_cache, v_cache, meta = ragged_batch(CASES[case], kv_heads=2, group=group, page_size=page_size,
                                             table_width=16)
    scale = HEAD_DIM**-0.5
    expected = reference_output(q, k_cache, v_cache, meta, scale, block_tokens=64, query_tile=4)
    kernel = PallasGpuAttention(block_tokens=64, interpret=True)
    got = jax.jit(kernel.attend, static_argnums=3)(q, KVCache(k_cache, v_cache), meta, scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("case", "group", "query_tile"), [("prefill_only", 8, 4), ("many_pages", 1, 32)])
def test_tile_sizes_change_nothing_but_the_reads(case: str, group: int, query_tile: int) -> None:
    """Tiles of 4 tokens (32 rows with a GQA group of 8) split each prefill into several tiles; tiles of
    32 take a whole 24-token prefill in one."""
    q, k_cache, v_cache, meta = ragged_batch(CASES[case], kv_heads=2, group=group, page_size=16, table_width=16)
    expected = reference_output(q, k_cache, v_cache, meta, 0.2)
    kernel = PallasGpuAttention(block_tokens=32, query_tile=query_tile, interpret=True)
    assert kernel.tile_tokens(group) == query_tile
    got = kernel.attend(q, KVCache(k_cache, v_cache), meta, 0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)


def test_padding_tokens_get_zeros_and_leave_the_real_ones_alone() -> None:
    q, k_cache, v_cache, meta = ragged_batch(CASES["mixed"], kv_heads=2, group=3, page_size=16, table_width=16)
    expected = reference_output(q, k_cache, v_cache, meta, 0.2)
    q_padded = jnp.concatenate([q, jnp.ones((21, *q.shape[1:]), q.dtype)])
    got = PallasGpuAttention(interpret=True).attend(q_padded, KVCache(k_cache, v_cache), with_padding(meta, 21), 0.2)
    np.testing.assert_allclose(np.asarray(got[: q.shape[0]]), np.asarray(expected), atol=2e-5, rtol=2e-5)
    assert not np.any(np.asarray(got[q.shape[0] :])), "padding tokens' outputs are zero"


def test_a_row_past_its_page_table_reads_only_its_table() -> None:
    """A draft row past its budget keeps counting positions (its output is dropped); the kernel must
    stop at the row's table (on a GPU, reading past it leaves the row) and sees just the table's keys."""
    q, k_cache, v_cache, meta = ragged_batch([(250, 1), (30, 1)], kv_heads=2, group=4, page_size=16, table_width=16)
    table_keys = 16 * 16
    past = AttentionMetadata(meta.positions.at[0].set(table_keys + 40), meta.seq_rows, meta.page_table,
                             meta.write_slots)
    within = AttentionMetadata(meta.positions.at[0].set(table_keys - 1), meta.seq_rows, meta.page_table,
                               meta.write_slots)
    expected = reference_output(q, k_cache, v_cache, within, 0.2)
    got = PallasGpuAttention(interpret=True).attend(q, KVCache(k_cache, v_cache), past, 0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)


def test_query_tiles_of_a_small_batch() -> None:
    # row 0: positions 5..9; row 1: position 12; row 2: positions 0..2; then 4 padding tokens
    meta = with_padding(AttentionMetadata(jnp.array([5, 6, 7, 8, 9, 12, 0, 1, 2], jnp.int32),
                                          jnp.array([0, 0, 0, 0, 0, 1, 2, 2, 2], jnp.int32),
                                          jnp.zeros((3, 4), jnp.int32), jnp.zeros(9, jnp.int32)), 4)
    tiles = query_tiles(meta, 2)
    used = int(np.sum(np.asarray(tiles.length) > 0))
    assert np.asarray(tiles.start)[:used].tolist() == [0, 2, 4, 5, 6, 8, 9, 11]
    assert np.asarray(tiles.length)[:used].tolist() == [2, 2, 1, 1, 2, 1, 2, 2]
    assert np.asarray(tiles.row)[:used].tolist() == [0, 0, 0, 1, 2, 2, -1, -1]
    assert np.asarray(tiles.first_position)[:used].tolist() == [5, 7, 9, 12, 0, 2, 0, 0]
    assert tiles.start.shape[0] == max_query_tiles(13, 3, 2) == 11


@pytest.mark.parametrize("seed", range(4))
def test_query_tiles_cover_every_token_once_within_one_row(seed: int) -> None:
    """Random steps (1-token decodes, long prefills, padding or none): each token lies in exactly one
    tile, a tile never leaves its row, and the static bound always holds."""
    rng = np.random.default_rng(seed)
    sequences = [(int(rng.integers(0, 50)), int(rng.choice([1, 1, 2, 7, 16, 33]))) for _ in range(rng.integers(1, 9))]
    _, _, _, meta = ragged_batch(sequences, kv_heads=1, group=1, page_size=16, table_width=8, head_dim=4)
    padding = int(rng.integers(0, 20))
    meta = with_padding(meta, padding) if padding else meta
    tile_tokens = int(rng.choice([1, 4, 16]))
    tiles = jax.tree.map(np.asarray, jax.jit(query_tiles, static_argnums=1)(meta, tile_tokens))
    rows, positions = np.asarray(meta.seq_rows), np.asarray(meta.positions)
    num_real = len(rows) - padding
    covered = np.zeros(len(rows), int)
    for start, length, row, first in zip(tiles.start, tiles.length, tiles.row, tiles.first_position, strict=True):
        assert 0 <= length <= tile_tokens
        tokens = np.arange(start, start + length)
        covered[tokens] += 1
        if length and row >= 0:
            assert np.all(rows[tokens] == row) and np.all(positions[tokens] == first + np.arange(length))
        elif length:
            assert np.all(tokens >= num_real), "a padding tile holds only padding"
    assert np.all(covered == 1)


def test_a_wrong_causal_mask_is_caught() -> None:
    """The comparison above can fail: a kernel that also sees the next position differs."""
    q, k_cache, v_cache, meta = ragged_batch(CASES["mixed"], kv_heads=2, group=2, page_size=16, table_width=16)
    shifted = AttentionMetadata(meta.positions + 1, meta.seq_rows, meta.page_table, meta.write_slots)
    expected = reference_output(q, k_cache, v_cache, meta, 0.2)
    got = PallasGpuAttention(interpret=True).attend(q, KVCache(k_cache, v_cache), shifted, 0.2)
    assert not np.allclose(np.asarray(got), np.asarray(expected), atol=1e-3)


def test_block_pages_tile_the_page_table_in_powers_of_two() -> None:
    kernel = PallasGpuAttention(block_tokens=128)
    assert kernel._block_pages(16, 16, rows=16) == 8
    assert kernel._block_pages(32, 16, rows=16) == 4
    assert kernel._block_pages(16, 12, rows=16) == 4
    assert kernel._block_pages(16, 6, rows=16) == 2
    assert kernel._block_pages(16, 16, rows=64) == 4  # wide tiles take 64-key blocks (registers)


def test_tiles_stay_within_the_register_budget() -> None:
    kernel = PallasGpuAttention(query_tile=16)
    assert [kernel.tile_tokens(group) for group in (1, 2, 3, 4, 8, 16, 32)] == [16, 16, 16, 16, 16, 8, 4]
    assert PallasGpuAttention(query_tile=1).tile_tokens(4) == 4  # 16 rows for the tensor-core dot
    # steps with no more tokens than rows (decode batches) take the fewest tokens that fill 16 rows
    assert [kernel.tile_tokens(group, wide=False) for group in (1, 3, 4, 8, 16, 32)] == [16, 4, 4, 2, 1, 1]


def test_backend_names() -> None:
    gpu = make_backend("pallas_gpu", block_tokens=128, query_tile=16, model_parallel=2, platform="gpu")
    assert gpu == PallasGpuAttention(block_tokens=128, model_parallel=2)
    assert backend_name("auto", platform="gpu") == "pallas_gpu"
    assert isinstance(make_backend("reference", block_tokens=128, query_tile=16), ReferenceAttention)
    # auto picks by the platform: the reference backend on this CPU
    assert isinstance(make_backend("auto", block_tokens=128, query_tile=16), ReferenceAttention)
    with pytest.raises(ConfigError, match="pallas_gpu compiles only for GPUs, and this platform is cpu"):
        make_backend("pallas_gpu", block_tokens=128, query_tile=16)


@pytest.mark.parametrize("group", [1, 8])
def test_kernel_lowers_to_triton_for_cuda_on_this_cpu(group: int) -> None:
    """Pallas's Triton lowering runs at JAX lowering time, so lowering for CUDA here (no GPU needed)
    checks that the kernel is expressible in Triton; compiling and running it needs a GPU."""
    from jax import export

    q, k_cache, v_cache, meta = ragged_batch(CASES["mixed"], kv_heads=2, group=group, page_size=16,
                                             table_width=16)
    q, k_cache, v_cache = (x.astype(jnp.bfloat16) for x in (q, k_cache, v_cache))
    attend = jax.jit(lambda q, k, v, meta: PallasGpuAttention().attend(q, KVCache(k, v), meta, 0.125))
    exported = export.export(attend, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        q, k_cache, v_cache, meta)
    module = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in module and 'name = "jaxinfer_paged_attention"' in module


@pytest.mark.parametrize("case", ["mixed", "many_pages"])
def test_bfloat16_caches_stay_within_bfloat16_rounding(case: str) -> None:
    """GPUs run bf16 caches: the kernel's dots then take bf16 inputs (float32 accumulation and
    softmax); against the float32 reference the error is the inputs' rounding, about 1% of the scale."""
    q, k_cache, v_cache, meta = ragged_batch(CASES[case], kv_heads=2, group=4, page_size=16, table_width=16)
    expected = np.asarray(reference_output(q, k_cache, v_cache, meta, 0.2))
    low = KVCache(k_cache.astype(jnp.bfloat16), v_cache.astype(jnp.bfloat16))
    got = PallasGpuAttention(interpret=True).attend(q.astype(jnp.bfloat16), low, meta, 0.2)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=0.01 * np.abs(expected).max())


def quantized_pools(k_cache: jax.Array, v_cache: jax.Array, kv_dtype: str) -> QuantizedKV:
    """The float pools quantized as the engine stores them: int8 rows with their scales, or fp8 pages
    with one scale per page and head."""
    if kv_dtype == "int8":
        (kq, ks), (vq, vs) = quantize_rows(k_cache), quantize_rows(v_cache)
        return QuantizedKV(kq, vq, ks, vs)
    pools = []
    for pool in (k_cache, v_cache):
        page_scale = jnp.max(jnp.abs(pool), axis=(2, 3)) / FP8_MAX
        fp8 = jnp.clip(pool / jnp.where(page_scale > 0, page_scale, 1)[..., None, None], -FP8_MAX, FP8_MAX).astype(FP8)
        pools.append((jax.lax.bitcast_convert_type(fp8, jnp.uint8), page_scale))  # the pools hold the bits
    return QuantizedKV(pools[0][0], pools[1][0], pools[0][1], pools[1][1])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize(("case", "group"), [("mixed", 4), ("many_pages", 1), ("prefill_only", 8)])
def test_kernel_reads_quantized_pages_as_the_reference_backend_does(case: str, group: int, kv_dtype: str) -> None:
    """The same int8 / fp8 pools read by both backends: the kernel widens the stored values and applies
    the scales to the scores and weights, the reference dequantizes whole blocks; float32 rounding apart,
    the same numbers."""
    q, k_cache, v_cache, meta = ragged_batch(CASES[case], kv_heads=2, group=group, page_size=16, table_width=16)
    cache = quantized_pools(k_cache, v_cache, kv_dtype)
    expected = ReferenceAttention(block_tokens=64, query_tile=4, kv_dtype=kv_dtype).attend(q, cache, meta, 0.2)
    got = PallasGpuAttention(block_tokens=64, interpret=True, kv_dtype=kv_dtype).attend(q, cache, meta, 0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)
    unscaled = cache._replace(k_scale=jnp.ones_like(cache.k_scale))  # a kernel that dropped the scales
    wrong = PallasGpuAttention(block_tokens=64, interpret=True, kv_dtype=kv_dtype).attend(q, unscaled, meta, 0.2)
    assert float(jnp.max(jnp.abs(wrong - expected))) > 0.1
    assert PallasGpuAttention(kv_dtype=kv_dtype).layout_for(2, HEAD_DIM, jnp.float32).stored_page(jnp.float32)[1] \
        == HEAD_DIM + 4


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_kernel_on_quantized_pages_lowers_to_triton_for_cuda_on_this_cpu(kv_dtype: str) -> None:
    from jax import export

    q, k_cache, v_cache, meta = ragged_batch(CASES["mixed"], kv_heads=2, group=4, page_size=16, table_width=16)
    cache = quantized_pools(k_cache, v_cache, kv_dtype)
    attend = jax.jit(lambda q, cache, meta: PallasGpuAttention(kv_dtype=kv_dtype).attend(q, cache, meta, 0.125))
    exported = export.export(attend, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        q.astype(jnp.bfloat16), cache, meta)
    assert 'name = "jaxinfer_paged_attention"' in exported.mlir_module()
