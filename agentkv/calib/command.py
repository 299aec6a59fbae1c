"""`agentkv calibrate --target URL --out profile.json`: probe a running engine, fit the cost model, save.

Import-light at module level (the CLI builds every parser); the client and scipy load when it runs."""

from __future__ import annotations

import argparse

from agentkv.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The flags of `agentkv calibrate`."""
    p = sub.add_parser("calibrate", help="probe a running OpenAI-compatible engine and fit the cost model")
    p.add_argument("--target", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--budget", default="10m", help="wall time for the probes (default 10m)")
    p.add_argument("--repeats", type=int, default=2, help="samples per probe, the least kept (default 2)")
    g = p.add_argument_group("what the target runs (default: read from /v1/models and /server_info)")
    g.add_argument("--gpu", default=None, help="catalogue GPU (server_info 'gpu', else h200)")
    g.add_argument("--model", default=None, help="catalogue model (the served model's root/id)")
    g.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=None, help="GPUs per engine (default 1)"
    )
    g.add_argument("--kv-cache-dtype", default=None, help="bf16 or fp8 (default bf16)")
    g.add_argument("--max-model-len", type=int, default=None, help="when /v1/models has none")
    g.add_argument("--block-size", type=int, default=None, help="prefix cache block (server_info page_size)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="prefill chunk (default 8192)")
    g.add_argument("--time-scale", type=float, default=None, help="engine s per wall s (server_info, else 1)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=calibrate_command)


def calibrate_command(args: argparse.Namespace) -> int:
    """Entry point: run the probes, fit, write the profile; exit 2 with the probes kept on a failure."""
    import asyncio

    from agentkv.calib.run import calibrate

    if args.repeats < 1:
        raise UserError("--repeats must be >= 1")
    return asyncio.run(calibrate(args))
