"""The deployment flags of `agentkv simulate`: system, prefill/decode disaggregation, the KV link,
the interactivity tier. Import-light (argparse only), like command.py."""

from __future__ import annotations

import argparse

from agentkv.metrics.flags import add_tier_arg
from agentkv.placement import POLICIES


def add_deploy_args(p: argparse.ArgumentParser) -> None:
    """--system, --disagg, per-pool TP, DP and EP (vLLM's flag names per pool), --decode-router and
    its kv_aware weights, --kv-link-gbps, --tier."""
    g = p.add_argument_group("deployment (docs/simulate.md)")
    g.add_argument(
        "--system",
        default=None,
        metavar="NAME",
        help="a node or rack from the catalogue (dgx-h200, dgx-b200, dgx-b300, mi355x-8, gb300-nvl72, "
        "vr-nvl72): sets the GPU (over --gpu), the NVLink domain, the NIC and the provisioned power per MW",
    )
    g.add_argument(
        "--disagg",
        default=None,
        metavar="prefill=N,decode=M",
        help="disaggregate prefill and decode into pools of N and M engines (replaces --workers); "
        "NpMd (vLLM's xPyD) says the same, e.g. 2p6d",
    )
    for pool in ("prefill", "decode"):
        g.add_argument(
            f"--{pool}-tensor-parallel-size",
            type=int,
            default=None,
            help=f"--disagg: the {pool} pool's TP (default --tensor-parallel-size)",
        )
        g.add_argument(
            f"--{pool}-data-parallel-size",
            type=int,
            default=None,
            help=f"--disagg: DP ranks of the {pool} pool's expert group, each {pool} engine one rank "
            "(default --data-parallel-size)",
        )
        g.add_argument(
            f"--{pool}-enable-expert-parallel",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"--disagg: the {pool} pool splits experts by expert over its tp x dp GPUs, with "
            "all-to-all (default --enable-expert-parallel)",
        )
    _add_decode_router_args(g)
    g.add_argument(
        "--kv-link-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="--disagg: GB/s per GPU of both KV links (default: the system's NVLink and NIC; inf: free)",
    )
    g.add_argument(
        "--cycle",
        action="store_true",
        help="refill the trace queue so every lane stays busy (with --duration): steady load for agents per MW",
    )
    add_tier_arg(g)


def _add_decode_router_args(g) -> None:
    """--decode-router and the decode pool's own kv_aware prices (default: the shared ones)."""
    g.add_argument(
        "--decode-router",
        default="least_loaded",
        choices=POLICIES,
        help="--disagg: how a decode worker is picked (default least_loaded; session keeps a tree's KV; "
        "kv_aware prices with --decode-kv-weight and --decode-kv-queue-weight)",
    )
    for flag, shared in (("kv-weight", "W"), ("kv-queue-weight", "Q")):
        g.add_argument(
            f"--decode-{flag}",
            type=float,
            default=None,
            metavar=shared,
            help=f"--decode-router kv_aware: the decode pool's --{flag} (default --{flag}, shared "
            "with the prefill pool; Dynamo's decode stage: overlap weight 0, no prefill tracking)",
        )


def disagg_fields(value: str) -> dict[str, int]:
    """A `--sweep disagg=NpMd` value as the SimConfig fields it sets."""
    from agentkv.engine.kv_move import parse_disagg

    prefill, decode = parse_disagg(value, "--sweep disagg")
    return {"prefill_workers": prefill, "decode_workers": decode}


def deploy_settings(args: argparse.Namespace) -> dict:
    """The SimConfig fields the deployment flags set."""
    from agentkv.engine.kv_move import parse_disagg
    from agentkv.metrics.tier import parse_tier

    prefill, decode = parse_disagg(args.disagg)
    tps, ttft = parse_tier(args.tier)
    return {
        "system": args.system,
        "prefill_workers": prefill,
        "decode_workers": decode,
        "prefill_tensor_parallel_size": args.prefill_tensor_parallel_size,
        "decode_tensor_parallel_size": args.decode_tensor_parallel_size,
        "prefill_data_parallel_size": args.prefill_data_parallel_size,
        "decode_data_parallel_size": args.decode_data_parallel_size,
        "prefill_enable_expert_parallel": args.prefill_enable_expert_parallel,
        "decode_enable_expert_parallel": args.decode_enable_expert_parallel,
        "decode_router": args.decode_router,
        "decode_kv_weight": args.decode_kv_weight,
        "decode_kv_queue_weight": args.decode_kv_queue_weight,
        "kv_link_gbps": args.kv_link_gbps,
        "tier_tps": tps,
        "tier_ttft_p90": ttft,
        "cycle": args.cycle,
    }
