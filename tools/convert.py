"""Converts a checkpoint (registry name, GGUF file or HF folder) to the native orbax format.

    python tools/convert.py --model smollm2-135m --output /tmp/smollm2-orbax [--dtype bfloat16]
        [--weights-dtype auto|packed|int8|int4|float32|bfloat16] [--weights-group 32]

The output folder holds the orbax-saved weights, the model config, the tokenizer and `self_test.json`
(a fixed greedy prompt's tokens, which a server checks before it reports SERVING); `--model` of
the engine and the batch runner accepts it, and restore places every array directly with its
sharding on the target mesh (which may differ from the mesh used here). Packed projections
(`--weights-dtype`, docs/models.md "Packed weights") are stored packed and restored packed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax.numpy as jnp

from jaxinfer import tokenizer as tokenizers_
from jaxinfer.errors import JaxinferError
from jaxinfer.parallel import make_mesh
from jaxinfer.weights import orbax_io, self_test
from jaxinfer.weights.gguf_file import GGUFCheckpoint
from jaxinfer.weights.loader import load_model, parameters
from jaxinfer.weights.registry import resolve
from jaxinfer.weights.weight_plan import WEIGHTS_DTYPES, WeightsChoice, to_meta


def convert(model: str, output: Path, dtype: str, mesh_model: int, weights_dtype: str = "auto",
            weights_group: int = 32) -> float:
    """`weights_dtype` as the engine setting: "packed" keeps a GGUF's packed projections packed."""
    start = time.perf_counter()
    checkpoint = resolve(model)
    gguf_file = GGUFCheckpoint(checkpoint.path) if checkpoint.kind == "gguf" else None
    mesh = make_mesh(1, mesh_model)
    weights = WeightsChoice(weights_dtype, weights_group)
    loaded = load_model(checkpoint, mesh, jnp.dtype(dtype), gguf_file=gguf_file, weights=weights)
    tok = tokenizers_.from_gguf(gguf_file) if gguf_file else tokenizers_.load(checkpoint.path)
    output.mkdir(parents=True, exist_ok=True)
    tok.save(output)
    orbax_io.save(output, loaded.config, parameters(loaded.model), dtype=dtype, source=checkpoint.name,
                  packed=to_meta(dict(loaded.model.packed_formats)))
    write_fingerprint(output, dtype)
    return time.perf_counter() - start


def write_fingerprint(output: Path, dtype: str) -> None:
    """The warm-up self-test's fingerprint, from the converted checkpoint itself as the engine loads it."""
    from jaxinfer.llm import LLM

    llm = LLM(str(output), dtype=dtype, max_seqs=1, num_pages=16, page_size=16, token_buckets=(1, 8, 32))
    try:
        self_test.write(output, self_test.run_prompt(llm))
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="registry name, GGUF file or HF folder")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mesh-model", type=int, default=1, help="devices the weights are sharded over while saving")
    p.add_argument("--weights-dtype", default="auto", choices=WEIGHTS_DTYPES,
                   help="projections stored packed: packed keeps a GGUF's blocks, int8 and int4 quantize")
    p.add_argument("--weights-group", type=int, default=32, help="input rows per scale for int8 / int4")
    args = p.parse_args(argv)
    try:
        seconds = convert(args.model, args.output, args.dtype, args.mesh_model, args.weights_dtype,
                          args.weights_group)
    except JaxinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} in {seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
