"""The one `agentkv` entry point: it only wires the commands; each package's `command.py` owns
its flags and its run (and keeps its imports light, so `agentkv --help` stays quick)."""

from __future__ import annotations

import argparse
import importlib
import sys

from agentkv import __version__
from agentkv.errors import UserError

COMMANDS = (  # in the order `agentkv --help` lists them
    "agentkv.trace.command",  # trace stats | convert | synth
    "agentkv.cache.command",  # cache analyze
    "agentkv.sim.command",  # simulate
    "agentkv.route.command",  # route
    "agentkv.serve.command",  # serve
    "agentkv.bench.command",  # bench, compare
    "agentkv.calib.command",  # calibrate
    "agentkv.security.command",  # security side-channel
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv",
        description="Replay, simulate and route agentic LLM inference; the KV cache at the centre.",
    )
    parser.add_argument("--version", action="version", version=f"agentkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"agentkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
