"""Placement: which worker serves a request (kv_aware, session, least_loaded, round_robin).

Shared by the router (real workers) and the simulator (simulated engines). The names and
kv_aware's default weight live here, not in `policy`, so the CLI can offer them without
importing the policies.
"""

import argparse

from agentkv.errors import UserError

POLICIES = ("round_robin", "least_loaded", "session", "kv_aware")
KV_WEIGHT = 16.0  # kv_aware's default price of a block to prefill, in blocks of load (docs/route.md)
# kv_aware's price of a block of a worker's active prefill (requests routed there whose first token
# has not come), relative to a block of this request's own; 1 as in Dynamo (simulate's default),
# 0 leaves queues unseen (route's default: docs/route.md, "Policy")
KV_QUEUE_WEIGHT = 1.0
# kv_aware counts a worker's active prefill up to this many times the request's own blocks: deeper
# queues all look alike (busy), so queues place new work but never outweigh a prefix of over half
# the prompt (inf: Dynamo's uncapped sum; docs/simulate.md, "Beside Dynamo in each router mode")
KV_QUEUE_CAP = 0.5


def check_kv_weights(
    kv_weight: float, kv_queue_weight: float, pool: str = "", queue_cap: float = 0.0
) -> None:
    """Refuse a kv_aware price that is negative, infinite or NaN, naming its flag (`pool`: the
    flags' prefix, "decode-" for simulate's --decode-kv-weight and --decode-kv-queue-weight), and a
    queue cap that is negative or NaN (inf: uncapped)."""
    for flag, v in ((f"--{pool}kv-weight", kv_weight), (f"--{pool}kv-queue-weight", kv_queue_weight)):
        if not 0 <= v < float("inf"):
            raise UserError(f"{flag} must be a finite number >= 0, got {v}")
    if not queue_cap >= 0:
        raise UserError(f"--kv-queue-cap must be a number >= 0 or 'none', got {queue_cap}")


def queue_cap_arg(text: str) -> float:
    """--kv-queue-cap's value: a number >= 0, or none/inf for Dynamo's uncapped sum."""
    if str(text).strip().lower() in ("none", "inf", "uncapped"):
        return float("inf")
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'none', got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'none', got {text!r}")
    return v


def add_kv_weight_arg(p, queue_weight: float = KV_QUEUE_WEIGHT) -> None:
    """kv_aware's prices of a block to prefill and of a worker's active prefill (simulate and route)."""
    p.add_argument(
        "--kv-weight",
        type=float,
        default=KV_WEIGHT,
        metavar="W",
        help=f"kv_aware: cost = W x blocks to prefill + blocks of load (default {KV_WEIGHT:g}; "
        "Dynamo's overlap weight is 1)",
    )
    p.add_argument(
        "--kv-queue-weight",
        type=float,
        default=queue_weight,
        metavar="Q",
        help="kv_aware: a worker's active prefill (uncached prompt blocks of requests routed there "
        f"that have no first token yet) costs Q x W per block (default {queue_weight:g}; Dynamo's is "
        f"{KV_QUEUE_WEIGHT:g}; 0: queues unseen)",
    )
    p.add_argument(
        "--kv-queue-cap",
        type=queue_cap_arg,
        default=KV_QUEUE_CAP,
        metavar="F",
        help=f"kv_aware: a worker's active prefill counts at most F x this request's blocks (default "
        f"{KV_QUEUE_CAP:g}: queues never outweigh a prefix of over half the prompt; none: Dynamo's "
        "uncapped sum)",
    )
