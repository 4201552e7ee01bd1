"""KV page bookkeeping on the host: reference-counted pages and the prefix cache (page 0 is null)."""

from jaxinfer.kv.prefix_cache import PrefixCachingPool, chain_keys

__all__ = ["PrefixCachingPool", "chain_keys"]
