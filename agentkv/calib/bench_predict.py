"""`agentkv bench ... --predict PROFILE`: the bench run, then `agentkv predict` on its folder with
the traces and selection the run used, in one command.

Bench (layer 5) cannot import calib, so calib adds the flag to bench's parser and wraps its entry
point. The profile is checked before the run starts; a failed, invalid or interrupted run is not
predicted (stderr says so, the exit status is the run's)."""

from __future__ import annotations

import argparse
import sys


def add_predict_flag(sub: argparse._SubParsersAction) -> None:
    """Add `--predict PROFILE` to the `agentkv bench` parser already in `sub`."""
    bench = sub.choices["bench"]
    bench.add_argument(
        "--predict",
        default=None,
        metavar="PROFILE.json",
        help="after a successful run, simulate it with this `agentkv calibrate` profile (as "
        "`agentkv predict OUT --profile PROFILE.json` with the same traces): prediction.json and "
        "predictions.jsonl in --out, the errors in report.html and `agentkv compare`",
    )
    bench.set_defaults(func=bench_then_predict)


def bench_then_predict(args: argparse.Namespace) -> int:
    """Entry point of `agentkv bench`: the run, then its prediction when --predict names a profile."""
    from agentkv.bench.command import bench_command, default_out

    if args.predict is None:
        return bench_command(args)
    from agentkv.calib.predict import read_profile
    from agentkv.errors import UserError

    if args.sweep or args.slo_search:
        raise UserError("--predict simulates one run; predict each point of a sweep with `agentkv predict`")
    read_profile(args.predict)  # a missing or bad profile fails before the run
    if args.out is None:  # bench's own default, fixed now so the prediction knows the folder
        args.out = default_out()
    rc = bench_command(args)
    if rc != 0:
        why = {130: "was interrupted", 3: "is invalid"}.get(rc, "failed")
        print(f"agentkv: no prediction: the run {why} (exit {rc})", file=sys.stderr)
        return rc
    predict_bench_run(args)
    return 0


def predict_bench_run(args: argparse.Namespace) -> dict:
    """`agentkv predict` on the finished run in `args.out`, with the traces bench selected (the
    same files, selection and context window) and the engine the profile and run describe."""
    from agentkv.bench.command import load_traces, request_options
    from agentkv.calib.command import predict_args
    from agentkv.calib.predict import predict_run, print_prediction

    traces = load_traces(args, [], request_options(args))
    pargs = predict_args(str(args.out), args.predict)
    doc = predict_run(pargs, traces)
    if args.json:  # stdout holds the run's summary JSON: the table would break it
        print(f"wrote predictions.jsonl and prediction.json to {doc['out']}", file=sys.stderr)
    else:
        print_prediction(doc)
    return doc
