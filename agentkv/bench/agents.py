"""Agents per MW of a bench run: the run against the interactivity tier (metrics/tier.py) on the
target's GPU count and power. GPUs: --gpus, else NVML's devices or the server's tp x dp; power:
--system's provisioned share, else the GPU's board power when the server or NVML names a catalogue
GPU. What is not known stays unknown (None), never a guessed number."""

from __future__ import annotations

import argparse

from agentkv.errors import UserError
from agentkv.metrics.flags import add_tier_arg


def add_agents_args(p) -> None:
    """--tier (as simulate), --gpus and --system: what agents per GPU and per MW divide by."""
    add_tier_arg(p)
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="GPUs serving the target, for per-GPU and per-MW figures (default: NVML's devices when "
        "the target is on this host, else the server's tp x dp when it reports them; else unknown)",
    )
    p.add_argument(
        "--system",
        default=None,
        metavar="NAME",
        help="the target's node or rack from the catalogue (dgx-h200, dgx-b200, gb300-nvl72, ...): "
        "per-MW figures use its provisioned power per GPU (default: the GPU's board power when "
        "known, else unknown)",
    )


def check_agents_args(args: argparse.Namespace) -> None:
    """One-line errors for --tier, --gpus and --system, before any server starts."""
    from agentkv.engine.hardware import get_system
    from agentkv.metrics.tier import parse_tier

    parse_tier(args.tier)
    if args.gpus is not None and args.gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {args.gpus}")
    if args.system is not None:
        get_system(args.system)


def target_power(s, system: str | None) -> tuple[float | None, str]:
    """(watts per GPU, basis): --system's share, else the board power of the GPU the server (its
    /server_info `gpu`) or NVML names, when it is in the catalogue."""
    from agentkv.engine.hardware import provisioned_power

    if system is not None:
        return provisioned_power(system, None)
    devices = (s.gpu or {}).get("devices") or []
    name = (s.config.get("server") or {}).get("gpu") or (devices[0]["name"] if devices else None)
    if not name:
        return provisioned_power(None, None)
    for n in (str(name), str(name).removeprefix("NVIDIA ")):
        try:
            return provisioned_power(None, n)
        except UserError:
            continue
    return None, f"power unknown: GPU {name!r} is not in the catalogue; name the system with --system"


def bench_interactivity(s, records, args: argparse.Namespace):
    """The run's Interactivity: agents are the session trees in progress on average (the measured
    records' span), at most --lanes; per GPU and per MW only when GPUs and power are known."""
    from agentkv.bench.sweep_view import gpus_of
    from agentkv.metrics.tier import interactivity, parse_tier, trees_in_progress
    from agentkv.trace.warmup import measured

    gpus = getattr(args, "gpus", None) or gpus_of(s)
    watts, basis = target_power(s, getattr(args, "system", None))
    tier = parse_tier(getattr(args, "tier", None) or "")
    trees = trees_in_progress(measured(records))
    return interactivity(s, s.config.get("lanes"), gpus, watts, tier, basis, mean_trees=trees)
