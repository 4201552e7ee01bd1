"""Registers, spills and shared memory of the GPU attention kernel on sm_90 (H100/H200), without a GPU.

Pallas lowers the kernel to Triton IR at JAX lowering time, which needs no GPU. This tool captures
that IR for each GQA group, compiles it for sm_90 with a separately installed Triton (not a project
dependency: `python -m venv /tmp/triton && /tmp/triton/bin/pip install triton`) and reads
`ptxas -v`. Triton's own version may differ from the one inside jaxlib, so the numbers are a guide:

    python tools/kernel_resources.py --triton-python /tmp/triton/bin/python --groups 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_COMPILE = """
import json, re, subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
ttir, warps = sys.argv[1], int(sys.argv[2])
kernel = triton.compile(ttir, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=2))
ptx = Path(ttir).with_suffix(".ptx")
ptx.write_text(kernel.asm["ptx"])
ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"  # the one that reads its PTX
report = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                        capture_output=True, text=True).stderr
number = lambda pattern: int(re.search(pattern, report).group(1))
print(json.dumps(dict(shared_bytes=kernel.metadata.shared, registers=number(r"Used (\\d+) registers"),
                      spill_store_bytes=number(r"(\\d+) bytes spill stores"))))
"""


def triton_ir(group: int, head_dim: int, page_size: int, block_tokens: int, query_tile: int) -> tuple[str, int]:
    """The kernel's Triton IR for a bf16 batch of 64 tokens over 2 kv heads, and its warps."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from jax._src.pallas.triton import pallas_call_registration as registration
    from jax.experimental import pallas as pl

    from jaxinfer.layers.attention import AttentionMetadata
    from jaxinfer.layers.kv_layout import KVCache
    from jaxinfer.layers.pallas_attention import PallasGpuAttention, warps_for

    captured = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        module = lower(*args, **kwargs)
        captured.append(module.module.operation.get_asm(enable_debug_info=False))
        return module

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        tokens, kv_heads = 64, 2
        kernel = PallasGpuAttention(block_tokens=block_tokens, query_tile=query_tile)
        q = jnp.zeros((tokens, kv_heads * group, head_dim), jnp.bfloat16)
        pool = jnp.zeros((kv_heads, 64, page_size, head_dim), jnp.bfloat16)
        meta = AttentionMetadata(*(jnp.zeros(tokens, jnp.int32),) * 2, jnp.zeros((8, 32), jnp.int32),
                                 jnp.zeros(tokens, jnp.int32))
        attend = jax.jit(lambda q, k, v, meta: kernel.attend(q, KVCache(k, v), meta, 0.125))
        export.export(attend, platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            q, pool, pool, meta)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return captured[0], warps_for(kernel.tile_tokens(group) * pl.next_power_of_2(group))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--triton-python", required=True, help="a Python with the `triton` package installed")
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--block-tokens", type=int, default=128)
    p.add_argument("--query-tile", type=int, default=16)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        for group in args.groups:
            ir, warps = triton_ir(group, args.head_dim, args.page_size, args.block_tokens, args.query_tile)
            path = Path(directory) / f"group{group}.ttir"
            path.write_text(ir)
            done = subprocess.run([args.triton_python, "-c", _COMPILE, str(path), str(warps)], capture_output=True,
                                  text=True, env=dict(os.environ, TRITON_DEFAULT_FP_FUSION="1"))
            result = json.loads(done.stdout) if done.returncode == 0 else dict(error=done.stderr[-500:])
            print(json.dumps(dict(what="gpu_attention_resources", group=group, head_dim=args.head_dim,
                                  block_tokens=args.block_tokens, query_tile=args.query_tile, warps=warps, **result)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
