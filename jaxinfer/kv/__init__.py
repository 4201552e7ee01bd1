"""KV page bookkeeping on the host: the pool of free pages (page 0 is the null page)."""

from jaxinfer.kv.pages import PagePool

__all__ = ["PagePool"]
