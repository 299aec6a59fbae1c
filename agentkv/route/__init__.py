"""Routing agentic traffic: policies (shared with the simulator), the block index, the proxy, tenants.

The policy names and kv_aware's default weight live here, not in `policy`, so the CLI can offer
them without importing the policies.
"""

POLICIES = ("round_robin", "least_loaded", "session", "kv_aware")
KV_WEIGHT = 16.0  # kv_aware's default price of a block to prefill, in blocks of load (docs/route.md)
