"""The format of one stored KV page: the model identity it must match (`ModelIdentity`), and its kvstore
value (a magic line, a JSON header with shape, dtype, size, blake2b checksum and creation time, then the raw
K and V bytes), encoded here and checked when read back.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass

import numpy as np

MAGIC = b"jaxinfer-kv-page/1\n"
HEADER_BYTES = 1024  # a header line is far shorter; byte-range reads of this size find it


@dataclass(frozen=True)
class ModelIdentity:
    """What must match for a stored page to be usable: the checkpoint and the KV layout."""

    checkpoint: str  # the checkpoint's content fingerprint (weights/fingerprint.py)
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def digest(self) -> str:
        return hashlib.blake2b(json.dumps(asdict(self), sort_keys=True).encode(), digest_size=12).hexdigest()

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """A stored page: [layers, 2 (k, v), kv_heads, page_size, head_dim]."""
        return (self.num_layers, 2, self.num_kv_heads, self.page_size, self.head_dim)

    def fits(self, page: np.ndarray) -> bool:
        """Whether `page` has this model's page shape and KV dtype (a header can claim anything)."""
        return page.shape == self.page_shape and page.dtype.name == self.dtype


def encode_value(page: np.ndarray, created: float) -> tuple[bytes, int]:
    """A page's kvstore value, and the size of its raw bytes (the header's `nbytes`)."""
    data = np.ascontiguousarray(page).tobytes()
    header = {"shape": list(page.shape), "dtype": str(page.dtype), "nbytes": len(data),
              "blake2b": hashlib.blake2b(data, digest_size=16).hexdigest(), "created": created}
    return MAGIC + json.dumps(header).encode() + b"\n" + data, len(data)


def read_header(value: bytes) -> dict | None:
    end = value.find(b"\n", len(MAGIC))
    if not value.startswith(MAGIC) or end < 0:
        return None
    try:
        header = json.loads(value[len(MAGIC) : end])
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    nbytes, created = header.get("nbytes"), header.get("created")
    sizes_fine = isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 0
    time_fine = isinstance(created, int | float) and not isinstance(created, bool) and math.isfinite(created)
    return header if sizes_fine and time_fine else None



def parse_value(value: bytes) -> tuple[dict, np.ndarray] | None:
    header = read_header(value)
    if header is None:
        return None
    data = value[value.find(b"\n", len(MAGIC)) + 1 :]
    try:
        if len(data) != header["nbytes"]:
            return None
        if hashlib.blake2b(data, digest_size=16).hexdigest() != header["blake2b"]:
            return None
        return header, np.frombuffer(data, dtype=np.dtype(header["dtype"])).reshape(header["shape"])
    except (ValueError, KeyError, TypeError):
        return None

