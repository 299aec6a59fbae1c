"""The KV-cache core: block hashing, the paged block pool, eviction policies, tiers and KV events."""
