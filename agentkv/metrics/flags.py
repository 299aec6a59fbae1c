"""The output flags bench and simulate share (`--percentiles`, `--no-report`); import-light, as
every command's parser is built at start-up."""

from __future__ import annotations

import argparse

from agentkv.errors import UserError


def percentiles_arg(text: str) -> tuple[float, ...]:
    """--percentiles as argparse reads it: a usage error (exit 2) at once, not after the run."""
    from agentkv.metrics.dist import parse_percentiles

    try:
        return parse_percentiles(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--percentiles: ")) from None


def add_output_flags(p) -> None:
    """--percentiles and --no-report."""
    p.add_argument(
        "--percentiles",
        default=None,
        type=percentiles_arg,
        metavar="P,P,...",
        help="latency percentiles in summary.json, vllm_result.json and the report "
        "(default 50,90,95,99,99.9; the terminal shows p50, p90 and p99)",
    )
    p.add_argument("--no-report", action="store_true", help="skip report.html")


def add_tier_arg(p) -> None:
    """--tier: the interactivity tier agents per GPU and per MW are counted at (bench and simulate)."""
    p.add_argument(
        "--tier",
        default="tps=20,ttft_p90=10s",
        metavar="tps=N,ttft_p90=T",
        help="interactivity tier for agents per GPU and per MW (default tps=20,ttft_p90=10s)",
    )
