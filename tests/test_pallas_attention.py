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

from jaxinfer.errors import ConfigError
from jaxinfer.layers.attention import AttentionMetadata, ReferenceAttention, backend_name, make_backend
from jaxinfer.layers.pallas_attention import PallasGpuAttention

HEAD_DIM = 32


def ragged_batch(sequences: list[tuple[int, int]], *, kv_heads: int, group: int, page_size: int,
                 table_width: int, seed: int = 0):
    """sequences: (tokens already cached, new tokens) per sequence; returns q, caches and metadata."""
    rng = np.random.default_rng(seed)
    needed = sum(-(-(cached + new) // page_size) for cached, new in sequences)
    num_pages = needed + 3
    free = list(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((len(sequences), table_width), np.int32)
    positions, rows = [], []
    k_cache = np.zeros((kv_heads, num_pages, page_size, HEAD_DIM), np.float32)
    v_cache = np.zeros_like(k_cache)
    for row, (cached, new) in enumerate(sequences):
        length = cached + new
        for index in range(-(-length // page_size)):
            page_table[row, index] = free.pop()
        for position in range(length):
            page, offset = page_table[row, position // page_size], position % page_size
            k_cache[:, page, offset] = rng.standard_normal((kv_heads, HEAD_DIM))
            v_cache[:, page, offset] = rng.standard_normal((kv_heads, HEAD_DIM))
        positions += range(cached, length)
        rows += [row] * new
    q = rng.standard_normal((len(positions), kv_heads * group, HEAD_DIM)).astype(np.float32)
    meta = AttentionMetadata(jnp.asarray(positions, jnp.int32), jnp.asarray(rows, jnp.int32),
                             jnp.asarray(page_table), jnp.zeros(len(positions), jnp.int32))
    return jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), meta


CASES = {
    "prefill_only": [(0, 24), (0, 9)],
    "decode_only": [(40, 1), (7, 1), (63, 1), (1, 1)],
    "mixed": [(30, 1), (0, 17), (12, 1), (5, 6)],
    "many_pages": [(200, 1), (150, 10)],
}


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_reference_backend(case: str, group: int, page_size: int) -> None:
    q, k_cache, v_cache, meta = ragged_batch(CASES[case], kv_heads=2, group=group, page_size=page_size,
                                             table_width=16)
    scale = HEAD_DIM**-0.5
    expected = ReferenceAttention(block_tokens=64, query_tile=4).attend(q, k_cache, v_cache, meta, scale)
    kernel = PallasGpuAttention(block_tokens=64, interpret=True)
    got = jax.jit(kernel.attend, static_argnums=4)(q, k_cache, v_cache, meta, scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)


def test_a_wrong_causal_mask_is_caught() -> None:
    """The comparison above can fail: a kernel that also sees the next position differs."""
    q, k_cache, v_cache, meta = ragged_batch(CASES["mixed"], kv_heads=2, group=2, page_size=16, table_width=16)
    shifted = AttentionMetadata(meta.positions + 1, meta.seq_rows, meta.page_table, meta.write_slots)
    expected = ReferenceAttention().attend(q, k_cache, v_cache, meta, 0.2)
    got = PallasGpuAttention(interpret=True).attend(q, k_cache, v_cache, shifted, 0.2)
    assert not np.allclose(np.asarray(got), np.asarray(expected), atol=1e-3)


def test_block_pages_tile_the_page_table_in_powers_of_two() -> None:
    kernel = PallasGpuAttention(block_tokens=128)
    assert kernel._block_pages(16, 16) == 8
    assert kernel._block_pages(32, 16) == 4
    assert kernel._block_pages(16, 12) == 4
    assert kernel._block_pages(16, 6) == 2


def test_backend_names() -> None:
    assert isinstance(make_backend("pallas_gpu", block_tokens=128, query_tile=16), PallasGpuAttention)
    assert isinstance(make_backend("reference", block_tokens=128, query_tile=16), ReferenceAttention)
    # auto picks by the platform: the reference backend on this CPU
    assert isinstance(make_backend("auto", block_tokens=128, query_tile=16), ReferenceAttention)
    # the kernel is not split over kv heads yet: a model axis of several devices keeps the reference
    assert backend_name("auto", model_parallel=2) == "reference"
    with pytest.raises(ConfigError, match="pallas_gpu runs on one device per model replica"):
        make_backend("pallas_gpu", block_tokens=128, query_tile=16, model_parallel=2)


@pytest.mark.parametrize("group", [1, 8])
def test_kernel_lowers_to_triton_for_cuda_on_this_cpu(group: int) -> None:
    """Pallas's Triton lowering runs at JAX lowering time, so lowering for CUDA here (no GPU needed)
    checks that the kernel is expressible in Triton; compiling and running it needs a GPU."""
    from jax import export

    q, k_cache, v_cache, meta = ragged_batch(CASES["mixed"], kv_heads=2, group=group, page_size=16,
                                             table_width=16)
    q, k_cache, v_cache = (x.astype(jnp.bfloat16) for x in (q, k_cache, v_cache))
    attend = jax.jit(lambda q, k, v, meta: PallasGpuAttention().attend(q, k, v, meta, 0.125))
    exported = export.export(attend, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        q, k_cache, v_cache, meta)
    module = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in module and 'name = "jaxinfer_paged_attention"' in module
