"""The door's flags, shared by `agentkv serve` and `agentkv route` (uvicorn's names where it has one),
and the typed limits they become. Light imports: command.py files load this at start-up."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from agentkv.errors import UserError


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one HTTP server accepts from its clients (the table in docs/security.md)."""

    max_body_bytes: int = 32 << 20  # on the wire and inflated
    keep_alive: float = 5.0  # s: idle, or a request's headers incomplete (uvicorn's --timeout-keep-alive)
    body_timeout: float = 30.0  # s for a request's whole body to arrive
    max_connections: int = 0  # 0: from RLIMIT_NOFILE (gate.conn.default_max_connections)
    parse_processes: int = 1  # worker processes for large bodies (0: a thread)


def add_http_args(p, *, parse_processes: int) -> None:
    """--max-body-size, --timeout-keep-alive, --body-timeout, --limit-concurrency, --parse-processes."""
    p.add_argument(
        "--max-body-size",
        default="32MiB",
        metavar="SIZE",
        help="largest request body, both on the wire and once inflated (gzip, deflate); more is a 413 "
        "(default 32MiB)",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        metavar="S",
        help="close a connection idle this long, or whose request headers are not complete by then "
        "(default 5: uvicorn's flag and default, vLLM's default)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a request body must arrive within this many seconds: 408 and the connection closed "
        "(default 30)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=0,
        metavar="N",
        help="open connections at most; a new one closes the longest-idle, or gets a 503 when all "
        "are busy (default 0: from the file-descriptor limit)",
    )
    p.add_argument(
        "--parse-processes",
        type=int,
        default=parse_processes,
        metavar="N",
        help=f"worker processes that parse and tokenize bodies over 32KiB, off the event loop "
        f"(default {parse_processes}; 0: a thread)",
    )


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """HttpLimits from the flags; UserError naming the flag on a bad value."""
    from agentkv.units import parse_capacity

    max_body = parse_capacity(args.max_body_size, "--max-body-size")
    if max_body < 1024:
        raise UserError(f"--max-body-size must be at least 1KiB, got {args.max_body_size}")
    for flag, v in (("--timeout-keep-alive", args.timeout_keep_alive), ("--body-timeout", args.body_timeout)):
        if not (v > 0 and math.isfinite(v)):
            raise UserError(f"{flag} must be a finite number of seconds > 0, got {v}")
    if args.limit_concurrency < 0 or args.parse_processes < 0:
        raise UserError("--limit-concurrency and --parse-processes must be >= 0")
    return HttpLimits(
        int(max_body),
        args.timeout_keep_alive,
        args.body_timeout,
        args.limit_concurrency,
        args.parse_processes,
    )
