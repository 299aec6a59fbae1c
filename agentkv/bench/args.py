"""The flags of `agentkv bench` (kept apart from the command so building the CLI stays light)."""

from __future__ import annotations

import argparse

from agentkv.cli import TRACE_FORMATS

DEFAULT_EMBEDDED_TIME_SCALE = 10.0


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The flags of `agentkv bench`."""
    p.add_argument(
        "paths", nargs="*", metavar="TRACE", help="trace files or directories (default: bundled sample)"
    )
    p.add_argument("--format", default="auto", choices=TRACE_FORMATS)
    p.add_argument(
        "--target",
        default=None,
        metavar="URL",
        help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 (default: start agentkv serve, "
        "a simulated H200 with Llama-3.1-8B, on a free loopback port)",
    )
    p.add_argument("--lanes", type=int, default=16, help="concurrent session lanes (default 16)")
    p.add_argument(
        "--duration",
        default="60s",
        help="stop releasing requests after this wall time, then let in-flight ones end; "
        "'none' runs the traces out (default 60s)",
    )
    p.add_argument(
        "--max-requests", type=int, default=None, metavar="N", help="stop after releasing N requests"
    )
    p.add_argument("--api", default="completions", choices=["completions", "chat"])
    p.add_argument(
        "--prompt-mode",
        default=None,
        choices=["token-ids", "text"],
        help="token ids (exact lengths; completions only) or text (default: token-ids, text for chat)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="text mode: tokenizer.json or a HF folder to render blocks with (default: built-in)",
    )
    p.add_argument(
        "--model", default=None, metavar="NAME", help="model name in requests (default: the target's first)"
    )
    p.add_argument("--slo", default=None, metavar="SPEC", help="goodput SLOs, e.g. ttft=2s,tpot=50ms")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default out/bench-<time>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warm-start", action="store_true", help="start each lane's first trace at a random point"
    )
    p.add_argument(
        "--idle-gap-cap", default="10s", help="longest gap while nothing is in flight (default 10s)"
    )
    p.add_argument(
        "--tenant-salts",
        action="store_true",
        help="send each session tree's own cache_salt (tenants never share cache)",
    )
    p.add_argument(
        "--cache-bust",
        action="store_true",
        help="mark this run's prompts so nothing cached by an earlier run is reused",
    )
    p.add_argument("--timeout", default="300s", help="per-request time limit (default 300s)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        metavar="X",
        help="target seconds per wall second: the embedded server runs X times faster, gaps shrink "
        f"X times and results are reported in target seconds (default {DEFAULT_EMBEDDED_TIME_SCALE:g} "
        "for the embedded server, 1 with --target)",
    )
    p.add_argument(
        "--serve-args",
        default=None,
        metavar="ARGS",
        help="extra flags for the embedded agentkv serve, e.g. '--gpu h100 --cpu-offload 256GB'",
    )
    p.add_argument("--sample-every", default="1s", help="time-series sampling period (default 1s)")
    p.add_argument(
        "--max-connections",
        type=int,
        default=0,
        metavar="N",
        help="cap on open connections (default 0: one per concurrent request)",
    )
    p.add_argument(
        "--loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="event loop (default auto: uvloop when installed)",
    )
    p.add_argument("--no-report", action="store_true", help="skip report.html")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", "-q", action="store_true", help="no live progress display")
