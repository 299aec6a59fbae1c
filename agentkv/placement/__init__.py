"""Placement: which worker serves a request (kv_aware, session, least_loaded, round_robin).

Shared by the router (real workers) and the simulator (simulated engines). The names and
kv_aware's default weight live here, not in `policy`, so the CLI can offer them without
importing the policies.
"""

POLICIES = ("round_robin", "least_loaded", "session", "kv_aware")
KV_WEIGHT = 16.0  # kv_aware's default price of a block to prefill, in blocks of load (docs/route.md)


def add_kv_weight_arg(p) -> None:
    """kv_aware's price of one block still to prefill, in blocks of load (simulate and route)."""
    p.add_argument(
        "--kv-weight",
        type=float,
        default=KV_WEIGHT,
        metavar="W",
        help=f"kv_aware: cost = W x blocks to prefill + blocks of load (default {KV_WEIGHT:g}; "
        "Dynamo's overlap weight is 1)",
    )
