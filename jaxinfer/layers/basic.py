"""Linear, embedding and RMSNorm modules whose parameters carry logical axis names; a Linear's kernel
and an embedding table may be kept packed (layers/quant.py)."""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.layers.lora import LoraParam, ZerosFn, added_rows_logits, added_rows_lookup, lora_delta
from jaxinfer.layers.quant import PackedFormat, dequantize, dequantize_rows, stored_dtype


def add_packed_params(module: nnx.Module, name: str, fmt: PackedFormat, shape: tuple[int, int],
                      axes: tuple[str | None, ...], rows_first: bool = False, stacked: int = 0) -> None:
    """Zeroed stored arrays `{name}_q`, `{name}_scale` (and `{name}_offset`) of a [in, out] weight in
    `fmt`, transposed where `rows_first` (an embedding table's [vocab, embed]), with a leading axis of
    `stacked` copies where that is set (an expert stack's)."""
    fan_in, fan_out = shape[::-1] if rows_first else shape
    for suffix, stored in fmt.stored_shapes(fan_in, fan_out).items():
        stored = stored[::-1] if rows_first else stored
        stored = (stacked, *stored) if stacked else stored
        setattr(module, f"{name}_{suffix}", nnx.Param(jnp.zeros(stored, stored_dtype(fmt, suffix)), logical_axes=axes))


def weight_params(module: nnx.Module, name: str, fmt: PackedFormat | None) -> list[nnx.Param]:
    """The parameters holding weight `name`: itself, or its stored arrays when packed in `fmt`."""
    return [getattr(module, name)] if fmt is None else [getattr(module, f"{name}_{s}") for s in fmt.suffixes]


def packed_arrays(module: nnx.Module, name: str, fmt: PackedFormat) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The stored (q, scale, offset) of the packed weight `name`."""
    q, scale, *offset = (param[...] for param in weight_params(module, name, fmt))
    return q, scale, offset[0] if offset else None


class PackedMatmul(Protocol):
    """A kernel for x [M, K] @ a packed [K, N] weight -> [M, N] float32 (layers/pallas_matmul.py)."""

    def fits(self, fmt: PackedFormat, fan_in: int, fan_out: int) -> bool: ...

    def __call__(self, x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None,
                 fmt: PackedFormat) -> jax.Array: ...


def use_packed_matmul(model: nnx.Module, kernel: PackedMatmul | None) -> int:
    """Route every packed Linear of `model` whose shape the kernel takes through `kernel`, and a packed
    embedding's output head where the kernel has a `rows_first` form (None: back to XLA's
    dequantize-and-dot everywhere); returns how many weights now use it."""
    routed = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Linear) and module.packed is not None:
            fits = kernel is not None and kernel.fits(module.packed, *module.shape)
        elif isinstance(module, Embed) and module.packed is not None:
            fits = hasattr(kernel, "rows_first") and kernel.fits(module.packed, module.dim, module.vocab)
        else:
            continue
        module.matmul = kernel if fits else None
        routed += fits
    return routed


def initial_weights(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype: jnp.dtype, scale: float = 0.02) -> jax.Array:
    if rngs is None:
        return jnp.zeros(shape, dtype)
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ LoRA delta) (+ bias); kernel is stored [in, out] (the transpose of torch's Linear).

    With `packed`, the kernel is kept in that format (`kernel_q`, `kernel_scale`, `kernel_offset`;
    layers/quant.py) and dequantized inside the matmul's computation, or multiplied by `matmul`
    (`use_packed_matmul`: a Pallas kernel that dequantizes tile by tile).
    `add_lora_slots` gives it adapter slots (layers/lora.py); `lora` is then the tokens' one-hot slot."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        axes: tuple[str, str],
        *,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs | None = None,
        packed: PackedFormat | None = None,
    ):
        self.shape = (in_features, out_features)
        self.packed = packed
        if packed is None:
            self.kernel = nnx.Param(initial_weights(rngs, self.shape, dtype), logical_axes=axes)
        else:
            add_packed_params(self, "kernel", packed, self.shape, axes)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), logical_axes=(axes[1],)) if bias else None
        self.axes = axes
        self.matmul: PackedMatmul | None = None
        self.lora_a: LoraParam | None = nnx.data(None)
        self.lora_b: LoraParam | None = nnx.data(None)

    def add_lora_slots(self, slots: int, rank: int, zeros: ZerosFn) -> None:
        """Zeroed adapter stacks a [in, slots, rank], b [slots, rank, out]; `zeros(shape, logical_axes)`
        places them."""
        fan_in, fan_out = self.shape
        a_axes, b_axes = (self.axes[0], "lora_slots", "lora_rank"), ("lora_slots", "lora_rank", self.axes[1])
        self.lora_a = LoraParam(zeros((fan_in, slots, rank), a_axes), logical_axes=a_axes)
        self.lora_b = LoraParam(zeros((slots, rank, fan_out), b_axes), logical_axes=b_axes)

    def weight(self, dtype: jnp.dtype) -> jax.Array:
        """The kernel [in, out] in `dtype` (a packed one dequantized as part of the caller's computation)."""
        if self.packed is None:
            return self.kernel[...]
        return dequantize(*packed_arrays(self, "kernel", self.packed), self.packed, dtype)

    def __call__(self, x: jax.Array, lora: jax.Array | None = None) -> jax.Array:
        if self.matmul is not None:
            flat = self.matmul(x.reshape(-1, self.shape[0]), *packed_arrays(self, "kernel", self.packed), self.packed)
            y = flat.reshape(*x.shape[:-1], self.shape[1])
        else:
            y = jnp.dot(x, self.weight(x.dtype), preferred_element_type=jnp.float32)
        if lora is not None and self.lora_a is not None:
            y = y + lora_delta(x, self.lora_a[...], self.lora_b[...], lora)
        y = y.astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


@functools.partial(jax.jit, static_argnames=("start", "stop", "fmt", "dtype"))
def _packed_rows(arrays: tuple[jax.Array, jax.Array, jax.Array | None], start: int, stop: int, fmt: PackedFormat,
                 dtype: jnp.dtype) -> jax.Array:
    cut = [None if a is None else jax.lax.slice_in_dim(a, start, stop) for a in arrays]
    return dequantize_rows(*cut, fmt, dtype)


class Embed(nnx.Module):
    """Token embedding table [vocab, embed]; `attend` reuses it as a tied output projection.

    With `packed`, the table is kept rows-first in that format (`weight_q`, `weight_scale`,
    `weight_offset`; layers/quant.py): a lookup dequantizes only the rows it reads, and `attend` the
    table inside its matmul. With `add_token_slots`, the rows of ids >= `added_start` come from each
    token's adapter slot."""

    def __init__(self, vocab: int, dim: int, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None = None,
                 packed: PackedFormat | None = None):
        self.dim, self.dtype, self.packed = dim, dtype, packed
        if packed is None:
            self.weight = nnx.Param(initial_weights(rngs, (vocab, dim), dtype), logical_axes=("vocab", "embed"))
        else:
            add_packed_params(self, "weight", packed, (vocab, dim), ("vocab", "embed"), rows_first=True)
        self.added_rows: LoraParam | None = nnx.data(None)
        self.added_start = vocab
        self.matmul: PackedMatmul | None = None  # the packed head's matmul (use_packed_matmul)

    @property
    def vocab(self) -> int:
        """Rows in the table now (it grows with `CausalLM.extend_vocabulary`)."""
        return (self.weight if self.packed is None else self.weight_q).shape[0]

    def table(self) -> jax.Array:
        """The whole table [vocab, embed] in the model's dtype (a packed one dequantized)."""
        if self.packed is None:
            return self.weight[...]
        return dequantize_rows(*packed_arrays(self, "weight", self.packed), self.packed, self.dtype)

    def lookup(self, ids: jax.Array) -> jax.Array:
        """The table's rows of `ids` [T] -> [T, embed]."""
        if self.packed is None:
            return jnp.take(self.weight[...], ids, axis=0)
        rows = [None if a is None else jnp.take(a, ids, axis=0) for a in packed_arrays(self, "weight", self.packed)]
        return dequantize_rows(*rows, self.packed, self.dtype)

    def rows(self, start: int, stop: int) -> jax.Array:
        """The table's rows start .. stop - 1 (static bounds: nothing is sent to the devices)."""
        if self.packed is None:
            return jax.lax.slice_in_dim(self.weight[...], start, stop)
        return _packed_rows(packed_arrays(self, "weight", self.packed), start, stop, self.packed, self.dtype)

    def add_token_slots(self, slots: int, start: int, zeros: ZerosFn) -> None:
        """Per-slot rows [slots, n, embed] for ids start .. vocab - 1, each a copy of the table's rows."""
        base = self.rows(start, self.vocab)
        axes = ("lora_slots", None, "embed")
        self.added_rows = LoraParam(zeros((slots, *base.shape), axes) + base[None], logical_axes=axes)
        self.added_start = start

    def __call__(self, ids: jax.Array, slots: jax.Array | None = None) -> jax.Array:
        base = self.lookup(ids)
        if slots is not None and self.added_rows is not None:
            return added_rows_lookup(base, self.added_rows[...], self.added_start, ids, slots)
        return base

    def attend(self, x: jax.Array, slots: jax.Array | None = None) -> jax.Array:
        if self.packed is None:
            logits = jnp.einsum("...e,ve->...v", x, self.weight[...], preferred_element_type=jnp.float32)
        elif self.matmul is not None:
            flat = self.matmul.rows_first(x.reshape(-1, self.dim), *packed_arrays(self, "weight", self.packed),
                                          self.packed)
            logits = flat.reshape(*x.shape[:-1], flat.shape[-1])
        else:  # the table's transpose is the [embed, vocab] kernel of a packed Linear
            logits = jnp.dot(x, self.table().T, preferred_element_type=jnp.float32)
        if slots is not None and self.added_rows is not None:
            logits = added_rows_logits(logits, x, self.added_rows[...], self.added_start, slots)
        return logits


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight (HF Llama semantics)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype = jnp.float32, axis_name: str = "embed"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)
