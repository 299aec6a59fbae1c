"""`agentkv calibrate --target URL --out profile.json`: probe a running engine, fit the cost model, save;
`agentkv predict RUN_DIR --profile profile.json --traces TRACE...`: simulate a bench run with it, beside what it measured.

Import-light at module level (the CLI builds every parser); the client and scipy load when it runs."""

from __future__ import annotations

import argparse

from agentkv.calib.bench_predict import add_predict_flag
from agentkv.errors import UserError
from agentkv.trace.command import TRACE_FORMATS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The flags of `agentkv calibrate`."""
    p = sub.add_parser("calibrate", help="probe a running OpenAI-compatible engine and fit the cost model")
    p.add_argument("--target", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--budget", default="10m", help="wall time for the probes (default 10m)")
    p.add_argument("--repeats", type=int, default=3, help="samples per probe, the least kept (default 3)")
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
    p.add_argument(
        "--clock",
        choices=("auto", "client", "engine"),
        default="auto",
        help="auto (default): engine when /server_info names agentkv serve, else client; client: this "
        "machine's clock, host delays included; engine: the target's own stamps (agentkv serve), the "
        "engine's steps alone, as bench reads that clock",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=calibrate_command)
    _add_predict(sub)
    add_predict_flag(sub)  # `agentkv bench --predict`: the CLI registers bench before calib


def _add_predict(sub: argparse._SubParsersAction) -> None:
    """The `agentkv predict` subcommand."""
    p = sub.add_parser(
        "predict",
        help="simulate a bench run with a calibrate profile: predicted TTFT/TPOT/E2E beside the measured",
    )
    add_predict_args(p)
    p.set_defaults(func=predict_command)


def predict_args(run_dir: str, profile: str) -> argparse.Namespace:
    """`agentkv predict RUN_DIR --profile PROFILE` with every other flag at its default, parsed by
    predict's own flags (what `bench --predict` runs, so a new predict flag cannot be missed there)."""
    p = argparse.ArgumentParser(prog="agentkv predict", add_help=False)
    add_predict_args(p)
    return p.parse_args([f"--profile={profile}", "--", run_dir])  # names may start with -


def add_predict_args(p: argparse.ArgumentParser) -> None:
    """The flags of `agentkv predict`."""
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out folder of an `agentkv bench` run")
    p.add_argument("--profile", required=True, help="profile JSON written by `agentkv calibrate`")
    p.add_argument(
        "--traces",
        nargs="+",
        default=None,
        metavar="TRACE",
        help="the trace files or folders the run replayed, as bench was given them (default: bundled sample)",
    )
    p.add_argument(
        "--format", default="auto", choices=TRACE_FORMATS, help="trace format (default: detect from file)"
    )
    p.add_argument(
        "--out", default=None, help="where predictions.jsonl and prediction.json go (default RUN_DIR)"
    )
    g = p.add_argument_group("the engine (default: what the profile's /server_info and /v1/models said)")
    g.add_argument("--block-size", type=int, default=None, help="the target's KV block size (default 16)")
    g.add_argument(
        "--max-model-len", type=int, default=None, help="the target's context limit (default: the run's)"
    )
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="the target's KV cache blocks")
    g.add_argument("--max-num-seqs", type=int, default=None, help="(default 256)")
    p.add_argument(
        "--no-overhead",
        action="store_true",
        help="leave out the profile's host overheads: per request, per prompt token, per other request in "
        "flight, and the first-token delay of a continuing stream",
    )
    p.add_argument("--json", action="store_true", help="print prediction.json instead of the table")


def calibrate_command(args: argparse.Namespace) -> int:
    """Entry point: run the probes, fit, write the profile; exit 2 with the probes kept on a failure."""
    import asyncio

    from agentkv.calib.run import calibrate

    if args.repeats < 1:
        raise UserError("--repeats must be >= 1")
    return asyncio.run(calibrate(args))


def predict_command(args: argparse.Namespace) -> int:
    """Entry point of `agentkv predict`."""
    from agentkv.calib.predict import predict_run, print_prediction
    from agentkv.trace.formats import bundled_sample, load_paths

    traces = load_paths(args.traces or bundled_sample(), args.format)
    doc = predict_run(args, traces)
    if args.json:
        import json

        print(json.dumps(doc, indent=1))
    else:
        print_prediction(doc)
    return 0
