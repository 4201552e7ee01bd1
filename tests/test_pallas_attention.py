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
from attention_cases import CASES, HEAD_DIM, ragged_batch

from jaxinfer.errors import ConfigError
from jaxinfer.layers.attention import AttentionMetadata, ReferenceAttention, backend_name, make_backend
from jaxinfer.layers.kv_layout import KVCache
from jaxinfer.layers.pallas_attention import PallasGpuAttention


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_reference_backend(case: str, group: int, page_size: int) -> None:
    q, k_cache, v_cache, meta = ragged_batch(CASES[case], kv_heads=2, group=group, page_size=page_size,
                                             table_width=16)
    scale = HEAD_DIM**-0.5
    expected = ReferenceAttention(block_tokens=64, query_tile=4).attend(q, KVCache(k_cache, v_cache), meta, scale)
    kernel = PallasGpuAttention(block_tokens=64, interpret=True)
    got = jax.jit(kernel.attend, static_argnums=3)(q, KVCache(k_cache, v_cache), meta, scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)


def test_a_wrong_causal_mask_is_caught() -> None:
    """The comparison above can fail: a kernel that also sees the next position differs."""
    q, k_cache, v_cache, meta = ragged_batch(CASES["mixed"], kv_heads=2, group=2, page_size=16, table_width=16)
    shifted = AttentionMetadata(meta.positions + 1, meta.seq_rows, meta.page_table, meta.write_slots)
    expected = ReferenceAttention().attend(q, KVCache(k_cache, v_cache), meta, 0.2)
    got = PallasGpuAttention(interpret=True).attend(q, KVCache(k_cache, v_cache), shifted, 0.2)
    assert not np.allclose(np.asarray(got), np.asarray(expected), atol=1e-3)


def test_block_pages_tile_the_page_table_in_powers_of_two() -> None:
    kernel = PallasGpuAttention(block_tokens=128)
    assert kernel._block_pages(16, 16) == 8
    assert kernel._block_pages(32, 16) == 4
    assert kernel._block_pages(16, 12) == 4
    assert kernel._block_pages(16, 6) == 2


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
    expected = np.asarray(ReferenceAttention().attend(q, KVCache(k_cache, v_cache), meta, 0.2))
    low = KVCache(k_cache.astype(jnp.bfloat16), v_cache.astype(jnp.bfloat16))
    got = PallasGpuAttention(interpret=True).attend(q.astype(jnp.bfloat16), low, meta, 0.2)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=0.01 * np.abs(expected).max())
