"""The target and load flags of `agentkv bench` (argparse only: the CLI builds every parser).
What they mean is in agentkv/bench/load.py and docs/bench.md ("Load")."""

from __future__ import annotations

from agentkv.bench.agents import add_agents_args
from agentkv.errors import UserError
from agentkv.scaleout.raytasks import LOCAL, add_ray_arg, import_ray, reachable
from agentkv.trace.warmup import add_warmup_args


def add_load_args(p) -> None:
    """The target and load flags of `agentkv bench`."""
    p.add_argument(
        "--target",
        default=None,
        metavar="URL",
        help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 (default: start agentkv serve, "
        "a simulated H200 with Llama-3.1-8B, on a free loopback port)",
    )
    p.add_argument(
        "--lanes",
        type=int,
        default=None,
        metavar="N",
        help="session trees replayed at once, each starting the next trace when it drains (closed "
        "loop; default 16); with --session-rate a cap on trees at once (default: no cap)",
    )
    p.add_argument(
        "--duration",
        default="60s",
        help="stop releasing requests after this wall time, then let in-flight ones end; "
        "'none' runs the traces out (default 60s)",
    )
    p.add_argument(
        "--max-requests", type=int, default=None, metavar="N", help="stop after releasing N requests"
    )
    p.add_argument(
        "--clients",
        type=int,
        default=1,
        metavar="N",
        help="client processes, each replaying whole session trees with its share of the lanes; "
        "clocks reconciled, one requests.jsonl and summary (default 1: this process)",
    )
    add_ray_arg(p, "the --clients shards", "actors, one CPU each")
    _open_loop_args(p)
    add_agents_args(p)


def check_clients(args) -> None:
    """--clients and --ray, checked before traces load: a count >= 1; for --ray, Ray installed and
    something listening at a host:port address."""
    if args.clients < 1:
        raise UserError(f"--clients must be >= 1, got {args.clients}")
    if getattr(args, "ray", None) is not None:
        import_ray(args.ray)
        if args.ray != LOCAL:
            reachable(args.ray)


def _open_loop_args(p) -> None:
    """Session arrivals, warm-up, think scale and the sweep."""
    p.add_argument(
        "--session-rate",
        type=float,
        default=None,
        metavar="R",
        help="open loop: R new session trees per second (each then replays its turns as usual), "
        "like vllm bench serve --request-rate for sessions",
    )
    p.add_argument(
        "--arrivals",
        choices=["poisson", "constant"],
        default="poisson",
        help="spacing of --session-rate arrivals: poisson (exponential gaps, seeded by --seed) "
        "or constant (default poisson)",
    )
    add_warmup_args(p)
    p.add_argument(
        "--sweep",
        default=None,
        metavar="KEY=V1,V2,...",
        help="one run per value, lowest load first (KEY: lanes, session_rate or think_scale), each "
        "in OUT/point-<k>/, then OUT/sweep.json and sweep.html: throughput per GPU against "
        "interactivity, and with --slo the knee (highest load meeting it)",
    )
    p.add_argument(
        "--slo-attainment",
        default="90%",
        metavar="RATE",
        help="--sweep with --slo: a point meets the SLO when this share of its requests meets every "
        "--slo limit (default 90%%)",
    )
    p.add_argument(
        "--slo-search",
        type=int,
        default=0,
        metavar="N",
        help="--sweep with --slo: then run up to N more points, each halfway between the knee and "
        "the next point, to close in on the highest load meeting the SLO (default 0)",
    )
