"""The KV cache: the block pool, the cache policies, prefix matching and block hashing."""
