"""`agentkv security side-channel` (flags -> AttackConfig -> the attack -> a table or JSON) and
`agentkv security keys` (a CURVE key pair for the KV event plane)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

    from agentkv.security.sidechannel import AttackConfig, SideChannelReport


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The flags of `agentkv security side-channel`."""
    sec = sub.add_parser("security", help="attacks that test agentkv's isolation promises")
    ssub = sec.add_subparsers(dest="security_cmd", required=True, metavar="COMMAND")
    p = ssub.add_parser(
        "side-channel", help="prefix-cache timing attack: can one client see another's prefixes?"
    )
    p.add_argument(
        "--target", required=True, metavar="URL", help="agentkv serve, agentkv route, or any OpenAI server"
    )
    p.add_argument(
        "--via-router",
        action="store_true",
        help="the target is agentkv route: victim and attacker use different tenants' keys",
    )
    p.add_argument("--api-key", default=None, metavar="K", help="the victim's API key")
    p.add_argument(
        "--attacker-key", default=None, metavar="K2", help="the attacker's API key (another tenant)"
    )
    p.add_argument("--trials", type=int, default=100, metavar="N", help="victim/probe rounds (default 100)")
    p.add_argument(
        "--prefix-tokens", type=int, default=4096, metavar="N", help="secret prefix length (default 4096)"
    )
    p.add_argument(
        "--calibration",
        type=int,
        default=6,
        metavar="N",
        help="the attacker's own cold/warm prompt pairs that set its threshold (default 6)",
    )
    p.add_argument(
        "--confidence", type=float, default=0.95, help="confidence level of the intervals (default 0.95)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--model", default=None, help="model name in requests (default: the target's first)")
    p.add_argument(
        "--timeout", type=float, default=60.0, metavar="S", help="per-request time limit (default 60)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=side_channel_command)
    k = ssub.add_parser("keys", help="a ZMQ CURVE key pair for the KV event plane (serve and route)")
    k.add_argument("--out", required=True, metavar="DIR", help="folder to write NAME.key and NAME.key_secret")
    k.add_argument("--name", default="agentkv", help="file name stem (default agentkv)")
    k.set_defaults(func=keys_command)


def keys_command(args: argparse.Namespace) -> int:
    """Write a new CURVE key pair; print where, and the public key."""
    from agentkv.events.curve import load_public_key, write_keypair

    public, secret = write_keypair(args.out, args.name)
    print(
        f"wrote {public} (public key {load_public_key(public, '--out').decode()}: give it to the other side)"
    )
    print(f"wrote {secret} (secret key, mode 0600: keep it on this host)")
    return 0


def config_from_args(args: argparse.Namespace) -> AttackConfig:
    from agentkv.security.sidechannel import AttackConfig

    cfg = AttackConfig(
        target=args.target,
        via_router=args.via_router,
        victim_key=args.api_key,
        attacker_key=args.attacker_key,
        trials=args.trials,
        prefix_tokens=args.prefix_tokens,
        calibration=args.calibration,
        seed=args.seed,
        confidence=args.confidence,
        model=args.model,
        timeout=args.timeout,
    )
    cfg.check()
    return cfg


def report_table(r: SideChannelReport) -> Table:
    """One row per signal: AUC and accuracy with their intervals, the medians each class showed."""
    from rich.table import Table

    level = f"{r.confidence:.0%} CI"
    how = "via agentkv route, victim and attacker in different tenants" if r.via_router else "shared cache"
    t = Table(
        title=f"prefix-cache timing attack on {r.target} ({how}): {r.trials} trials, "
        f"{r.prefix_tokens}-token prefixes"
    )
    for col in ("signal", "ROC AUC", level, "accuracy", level, "victim prefix", "fresh prefix", "threshold"):
        t.add_column(col, justify="left" if col == "signal" else "right")
    for s in r.signals:
        unit = " ms" if s.signal == "ttft" else " tok"
        t.add_row(
            s.signal,
            f"{s.auc.value:.3f}",
            f"[{s.auc.low:.3f}, {s.auc.high:.3f}]",
            f"{s.accuracy.value:.1%}",
            f"[{s.accuracy.low:.1%}, {s.accuracy.high:.1%}]",
            f"{s.median_positive:,.1f}{unit}",
            f"{s.median_negative:,.1f}{unit}",
            f"{'<' if s.signal == 'ttft' else '>'} {s.threshold:,.1f}{unit}",
        )
    verdict = (
        "LEAKS: the attacker tells the victim's prefixes from fresh ones"
        if r.leaks
        else "no leak detected: every AUC interval holds 0.5 (chance)"
    )
    t.caption = (
        f"medians per class; attacker's own calibration: uncached {r.calibration_cold_ms:,.1f} ms, cached "
        f"{r.calibration_warm_ms:,.1f} ms TTFT; {verdict}; {r.wall_seconds:,.0f} s"
    )
    return t


def side_channel_command(args: argparse.Namespace) -> int:
    """Run the attack and print the report; exit 0 either way (the verdict is in the output)."""
    from rich.console import Console

    from agentkv.security.sidechannel import side_channel

    cfg = config_from_args(args)
    con = Console(stderr=True)
    if args.json:
        report = side_channel(cfg)
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    with con.status(f"attacking {cfg.target}...") as status:
        report = side_channel(cfg, lambda i, n: status.update(f"trial {i}/{n}"))
    Console().print(report_table(report))
    return 0
