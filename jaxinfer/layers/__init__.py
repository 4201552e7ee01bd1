"""Building blocks of the decoder: linear maps, norms, RoPE and paged attention backends."""
