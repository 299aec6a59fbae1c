"""The KV-cache core: block hashing, the paged block pool, eviction policies, tiers and KV events.

It imports nothing of agentkv but `units` and `errors`. The hash algorithm names live here, not
in `hashing`, so the CLI can offer them without importing numpy.
"""

HASH_ALGOS = ("xxhash", "sha256", "sha256_cbor")  # kv.hashing.make_hasher's names
