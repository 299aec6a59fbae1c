"""Placement: which worker serves a request (kv_aware, session, least_loaded, round_robin).

Shared by the router (real workers) and the simulator (simulated engines). The names and
kv_aware's default weight live here, not in `policy`, so the CLI can offer them without
importing the policies.
"""

POLICIES = ("round_robin", "least_loaded", "session", "kv_aware")
KV_WEIGHT = 16.0  # kv_aware's default price of a block to prefill, in blocks of load (docs/route.md)
