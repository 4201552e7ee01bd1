"""The Pallas packed matmul (layers/pallas_matmul.py), run by Pallas's interpreter on the CPU.

- Every packed format the device keeps, at SmolLM2's and Llama's shapes, gives x @ dequantize(W)
  within float32 rounding (bfloat16 activations: within bfloat16 rounding); a kernel that pairs the
  activations with the wrong nibbles is caught.
- SmolLM2 from its Q4_1 blocks through the kernel gives the XLA path's logits, and the compiled step
  then holds no float array of any packed weight's shape, where the XLA path's does (the CPU backend
  does not fuse the dequantize into the dot).
- The kernel lowers to Triton for CUDA and to Mosaic for TPUs here (no accelerator needed), with no
  weight-shaped float tensor outside it.
- The CPU's chunked dequantize (layers/chunked_matmul.py) gives the whole weight's numbers, and the
  CPU step over packed SmolLM2 then holds a few MB of temporaries, not a float copy of the model.
- `engine.packed_matmul` is checked by name.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import PagedForward
from jax import export

from jaxinfer.errors import ConfigError
from jaxinfer.layers import pallas_matmul
from jaxinfer.layers.backends import make_packed_matmul
from jaxinfer.layers.basic import use_packed_matmul
from jaxinfer.layers.chunked_matmul import ChunkedMatmul, chunk_count
from jaxinfer.layers.pallas_matmul import PallasPackedMatmul
from jaxinfer.layers.quant import Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, PackedFormat, dequantize, dequantize_rows, load_format
from jaxinfer.parallel import make_mesh
from jaxinfer.weights.loader import load_model
from jaxinfer.weights.weight_plan import WeightsChoice
from jaxinfer.xla_flags import CPU_SCHEDULER_FLAG

FORMATS = [Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, load_format(8, 64), load_format(4, 64)]
INTERPRET = PallasPackedMatmul(interpret=True)


def packed_kernel(fmt: PackedFormat, fan_in: int, fan_out: int, seed: int):
    """Random stored arrays of a [fan_in, fan_out] kernel in `fmt` (any bytes are valid values)."""
    rng = np.random.default_rng(seed)
    shapes = fmt.stored_shapes(fan_in, fan_out)
    q = rng.integers(0, 256, shapes["q"]).astype(np.uint8 if fmt.bits == 4 else np.int8)
    scale = (rng.standard_normal(shapes["scale"]) * 0.01).astype(fmt.scale_dtype)
    offset = (rng.standard_normal(shapes["scale"]) * 0.01).astype(fmt.scale_dtype) if fmt.offset else None
    return jnp.asarray(q), jnp.asarray(scale), None if offset is None else jnp.asarray(offset)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(("rows", "fan_in", "fan_out"), [(5, 576, 1536), (1, 1536, 576), (37, 1024, 256)])
def test_the_kernel_multiplies_as_dequantize_then_dot(fmt, rows, fan_in, fan_out):
    q, scale, offset = packed_kernel(fmt, fan_in, fan_out, rows)
    x = jnp.asarray(np.random.default_rng(fan_in).standard_normal((rows, fan_in)).astype(np.float32))
    expected = np.asarray(x @ dequantize(q, scale, offset, fmt, jnp.float32))
    got = np.asarray(jax.jit(INTERPRET, static_argnums=4)(x, q, scale, offset, fmt))
    assert got.shape == (rows, fan_out)
    np.testing.assert_allclose(got, expected, atol=2e-6 * np.abs(expected).max(), rtol=0)


def test_bfloat16_activations_stay_within_bfloat16_rounding():
    q, scale, offset = packed_kernel(Q4_1, 576, 1536, 0)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 576)).astype(np.float32))
    expected = np.asarray(x @ dequantize(q, scale, offset, Q4_1, jnp.float32))
    got = INTERPRET(x.astype(jnp.bfloat16), q, scale, offset, Q4_1)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, atol=0.02 * np.abs(expected).max())


def test_activations_paired_with_the_wrong_nibbles_are_caught(monkeypatch):
    q, scale, offset = packed_kernel(Q4_1, 256, 128, 2)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32))
    expected = x @ dequantize(q, scale, offset, Q4_1, jnp.float32)
    right = pallas_matmul.split_halves
    monkeypatch.setattr(pallas_matmul, "split_halves", lambda x, fmt: right(x, fmt)[::-1])
    wrong = INTERPRET(x, q, scale, offset, Q4_1)
    assert float(jnp.max(jnp.abs(wrong - expected))) > 0.1 * float(jnp.max(jnp.abs(expected)))


def test_shapes_the_blocks_cannot_tile_take_the_xla_path():
    assert INTERPRET.fits(Q4_1, 576, 1536) and INTERPRET.fits(Q4_1, 4096, 14336)
    assert not INTERPRET.fits(Q4_1, 576, 1000)  # no power-of-two column block of at least 16
    assert not PallasPackedMatmul(platform="tpu").fits(Q4_1, 4096, 100_000)  # columns in no lane-dense block


@pytest.fixture(scope="module")
def smollm2_packed():
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    return load_model("smollm2-135m", mesh, jnp.float32, weights=WeightsChoice("packed")).model


def float_weight_shapes(model) -> set[str]:
    """The HLO spellings of the float arrays a packed kernel would be dequantized into."""
    shapes = set()
    for layer in model.model.layers:
        for block in (layer.self_attn, layer.mlp):
            for projection in vars(block).values():
                if getattr(projection, "packed", None) is not None:
                    fan_in, fan_out = projection.shape
                    shapes |= {f"f32[{fan_in},{fan_out}]", f"f32[{fan_out},{fan_in}]"}
    return shapes


def test_smollm2_through_the_kernel_gives_the_xla_path_s_logits_without_a_float_weight(smollm2_packed):
    prompt = list(range(300, 309))
    weight_shaped = re.compile("|".join(re.escape(s) for s in float_weight_shapes(smollm2_packed)))
    xla_text = PagedForward(smollm2_packed).compiled_text(prompt, 0)
    assert weight_shaped.search(xla_text), "the check finds the XLA path's dequantized weights"
    expected = PagedForward(smollm2_packed).run(prompt, 0)
    assert use_packed_matmul(smollm2_packed, INTERPRET) == 30 * 7
    try:
        got = PagedForward(smollm2_packed).run(prompt, 0)
        kernel_text = PagedForward(smollm2_packed).compiled_text(prompt, 0)
    finally:
        assert use_packed_matmul(smollm2_packed, None) == 0
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert np.array_equal(got.argmax(-1), expected.argmax(-1))
    assert not weight_shaped.search(kernel_text)


@pytest.mark.parametrize(("platform", "custom_call"), [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
@pytest.mark.parametrize("fmt", [Q4_1, Q8_0], ids=lambda f: f.name)
def test_the_kernel_lowers_for_accelerators_on_this_cpu(platform, custom_call, fmt):
    """Pallas lowers to Triton (CUDA) and to Mosaic (TPU) at JAX lowering time; compiling and running the
    kernel needs the device. Outside the kernel the module holds no weight-shaped tensor."""
    q, scale, offset = packed_kernel(fmt, 576, 1536, 4)
    kernel = PallasPackedMatmul(platform="gpu" if platform == "cuda" else "tpu")
    matmul = jax.jit(lambda x, q, scale, offset: kernel(x, q, scale, offset, fmt))
    exported = export.export(matmul, platforms=[platform],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(custom_call)])(
        jnp.zeros((8, 576), jnp.bfloat16), q, scale, offset)
    module = exported.mlir_module()
    assert custom_call in module and "jaxinfer_packed_matmul" in module
    assert "576x1536xbf16" not in module and "576x1536xf32" not in module


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0], ids=lambda f: f.name)
def test_chunked_dequantize_gives_the_whole_weight_s_numbers(fmt):
    """The CPU's chunked matmul: columns a chunk at a time (a kernel) and vocabulary rows a chunk at a
    time (a rows-first table as the output head), each the whole weight's numbers (up to the dots' summation order)."""
    chunked = ChunkedMatmul(chunk_bytes=1 << 16)
    q, scale, offset = packed_kernel(fmt, 256, 512, 5)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((3, 256)).astype(np.float32))
    assert chunk_count(512, 256, 1 << 16) == 8
    whole = np.asarray(x @ dequantize(q, scale, offset, fmt, jnp.float32))
    bound = 2e-6 * np.abs(whole).max()  # float32 rounding of the sums
    np.testing.assert_allclose(np.asarray(chunked(x, q, scale, offset, fmt)), whole, rtol=0, atol=bound)
    table = [None if a is None else a.T for a in (q, scale, offset)]  # [512 rows, 256 values], rows-first
    np.testing.assert_allclose(np.asarray(chunked.rows_first(x, *table, fmt)),
                               np.asarray(x @ dequantize_rows(*table, fmt, jnp.float32).T), rtol=0, atol=bound)
    assert chunk_count(100, 256, 1 << 30) == 1 and chunk_count(97, 4096, 1 << 12) == 1  # small; no divisor


def test_the_cpu_step_holds_one_weight_chunk_not_the_float_model(smollm2_packed):
    """With XLA's CPU scheduler ordering for memory (jaxinfer/xla_flags.py) and the head chunked, the
    compiled step's temporaries are a few MB, where the float32 model is 538 MB; the same logits."""
    assert CPU_SCHEDULER_FLAG in os.environ["XLA_FLAGS"]
    prompt = list(range(300, 304))
    expected = PagedForward(smollm2_packed).run(prompt, 0)
    assert use_packed_matmul(smollm2_packed, ChunkedMatmul()) == 30 * 7 + 1  # the projections and the head
    try:
        forward = PagedForward(smollm2_packed)
        got = forward.run(prompt, 0)
        text = forward.compiled_text(prompt, 0)
        temp = forward.compiled_memory(prompt, 0).temp_size_in_bytes
    finally:
        use_packed_matmul(smollm2_packed, None)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert "f32[49152,576]" not in text and temp < 16e6, temp


def test_packed_matmul_settings_are_checked_by_name():
    assert make_packed_matmul("xla") is None
    assert make_packed_matmul("auto", platform="cpu") == ChunkedMatmul() == make_packed_matmul("chunked")
    assert make_packed_matmul("auto", platform="gpu") is None
    assert make_packed_matmul("pallas", platform="gpu") == PallasPackedMatmul(platform="gpu")
    assert make_packed_matmul("pallas", platform="tpu") == PallasPackedMatmul(platform="tpu")
    with pytest.raises(ConfigError, match=r"packed_matmul must be one of auto, xla, chunked, pallas, got 'triton'"):
        make_packed_matmul("triton")
    with pytest.raises(ConfigError, match="compiles only for GPUs and TPUs, and this platform is cpu"):
        make_packed_matmul("pallas", platform="cpu")
    with pytest.raises(ConfigError, match="has 2 on its model axis and 1 on its expert axis"):
        make_packed_matmul("pallas", model_parallel=2, platform="gpu")
