"""`agentkv predict`: simulate a recorded bench run with a profile's coefficients and compare.

Writes predictions.jsonl (one line per succeeded request, measured beside predicted) and
prediction.json (the errors, docs/cost-model.md), prints a table, and re-renders the run's
report.html with the errors when they are written into the run folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec

from agentkv.calib.accuracy import FIGURES, accuracy, row
from agentkv.calib.frontend import front_end_reads
from agentkv.calib.replay import clock_offsets, load_run, replay, trace_requests
from agentkv.engine.config import EngineConfig
from agentkv.errors import UserError


def read_profile(path: str) -> dict:
    """A profile `agentkv calibrate` wrote, checked: its `coefficients` load and its `modelled_as`
    names a catalogue GPU and model (UserError: one line naming the file and the field)."""
    from agentkv.calib.fit import Target
    from agentkv.engine.cost import CostCoefficients

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read the profile ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or "coefficients" not in doc or "modelled_as" not in doc:
        raise UserError(f"{path}: not an `agentkv calibrate` profile (no 'coefficients' or 'modelled_as')")
    for key in ("coefficients", "modelled_as"):
        if not isinstance(doc[key], dict):
            raise UserError(f"{path}: '{key}' must be an object, got {type(doc[key]).__name__}")
    for key, check in (("coefficients", CostCoefficients), ("modelled_as", lambda **t: Target(**t).cost())):
        try:
            check(**doc[key])
        except (TypeError, ValueError, UserError) as e:
            raise UserError(f"{path}: '{key}': {e}") from None
    return doc


def engine_config(args: argparse.Namespace, prof: dict, run_cfg: dict) -> EngineConfig:
    """The engine the profile models, its cache sized as the profile's or the run's /server_info
    reported it, flags first."""
    t = prof["modelled_as"]
    server = prof.get("server") or {}
    info = server.get("server_info") or run_cfg.get("server") or {}
    card = server.get("model") or {}
    bs = args.block_size or info.get("page_size") or 16
    blocks = args.num_gpu_blocks_override
    if blocks is None and info.get("max_total_num_tokens"):
        blocks = int(info["max_total_num_tokens"]) // bs
    return EngineConfig(
        gpu=t["gpu"],
        model=t["model"],
        tensor_parallel_size=t.get("tp", 1),
        kv_cache_dtype=t.get("kv_dtype", "bf16"),
        max_num_batched_tokens=t.get("chunk", 8192),
        block_size=bs,
        max_model_len=args.max_model_len or card.get("max_model_len") or info.get("context_length"),
        max_num_seqs=args.max_num_seqs or info.get("max_running_requests") or 256,
        num_gpu_blocks_override=blocks,
        cost_profile=args.profile,
        cost_profile_name=prof.get("name"),
    )


def predict_run(args: argparse.Namespace, traces) -> dict:
    """Replay the run on the profile's engine; write predictions.jsonl and prediction.json; the doc."""
    run = load_run(args.run_dir)
    prof = read_profile(args.profile)
    ecfg = engine_config(args, prof, run.config)
    scale = float(run.config.get("time_scale") or 1.0)
    ov = ((prof.get("fit") or {}).get("overhead")) or {}
    keys = ("request_s", "prompt_token_s", "per_other_request_s", "first_token_s")  # absent (older): 0
    req_s, tok_s, other_s, lag = (0.0 if args.no_overhead else ov.get(k, 0.0) * scale for k in keys)
    front = None if args.no_overhead or "front_end_token_s" not in ov else ov["front_end_token_s"] * scale
    share = ov.get("front_end_before_engine", 0.0) if front is not None else 0.0
    # host time per prompt token is read after the engine's first token, not before the engine: the
    # live vLLM runs' one-token answers trail vLLM's TTFT by it while 16-token streams end on time;
    # a profile with the front end's curve queues its share before the engine, the rest after
    delay = (req_s, share * front if front else 0.0, other_s)  # target seconds before the engine
    items = trace_requests(run, traces)
    clocks = clock_offsets(run.records, one_server=bool(run.config.get("server")))
    pred = replay(ecfg, items, delay, bool(run.config.get("tenant_salts")), clocks)
    after = _after_first_token(items, pred, tok_s, None if front is None else (1 - share) * front)
    rows = [row(r, pred[r.id], pred[r.id].arrival - r.sent, lag, after[r.id]) for r, _, _ in items]
    rows.sort(key=lambda x: x["id"])
    out = Path(args.out or run.path)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w") as f:
        for x in rows:
            f.write(json.dumps(x) + "\n")
    doc = {
        "about": "agentkv predict: the bench run simulated with the profile's coefficients, each "
        "request arriving when bench sent it (docs/cost-model.md)",
        "run": str(run.path),
        "profile": args.profile,
        "profile_name": prof.get("name"),
        "engine": msgspec.to_builtins(ecfg),
        "overhead_s": {"request": req_s, "prompt_token": tok_s, "per_other_request": other_s}
        | {
            "first_token": lag,
            "prompt_token_after_first_token": True,
            "front_end_token": front,
            "front_end_before_engine": share,
        },
        "failed_requests_skipped": run.failed,
        "cache_bust": run.config.get("cache_bust"),
        "arrivals": clocks.note,
    } | accuracy(rows)
    (out / "prediction.json").write_text(json.dumps(doc, indent=1) + "\n")
    extra = {"out": str(out)}
    if out.resolve() == Path(run.path).resolve() and (out / "report.html").is_file():
        from agentkv.metrics.report_prediction import rerender_report

        extra["report"] = str(rerender_report(out, doc))  # the run's report gains the errors' panel
    return doc | extra


def _after_first_token(items, pred: dict, tok_s: float, front: float | None) -> dict[int, float]:
    """Record id -> host time between the engine's first token and the client's reading of it: the
    profile's per-prompt-token time, each request alone (a profile without `front_end_token_s`), or
    through one front end's queue at that rate (`frontend.front_end_reads`: first tokens made
    together wait for each other); 0 on agentkv serve's engine clock, whose stamps are the engine's."""
    client = [r for r, _, _ in items if r.clock != "engine"]
    if front is None:
        return {r.id: tok_s * r.input_tokens for r, _, _ in items}
    reads = front_end_reads([(r.id, pred[r.id].first_token, r.input_tokens) for r in client], front)
    return {r.id: reads[r.id] - pred[r.id].first_token if r.id in reads else 0.0 for r, _, _ in items}


def print_prediction(doc: dict) -> None:
    """The terminal table: each figure's errors overall and per input-length bucket, hits, throughput."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"predicted vs measured: {doc['requests']} requests ({doc['profile_name']})")
    for c in ("figure", "requests", "n", "MAPE %", "bias %", "|err| p50 %", "|err| p90 %", "|err| max %"):
        t.add_column(c, justify="left" if c in ("figure", "requests") else "right")
    groups = [("all", doc["overall"], doc["requests"])]
    for by in ("by_input_len", "by_position", "by_overlap", "by_delivery"):
        groups += [(k, {f: v[f] for f in FIGURES}, v["requests"]) for k, v in doc.get(by, {}).items()]
    for name, figs, n in groups:
        for f in FIGURES:
            e = figs[f]
            if e is None:
                continue
            vals = (e["mape_pct"], e["bias_pct"], e["abs_p50_pct"], e["abs_p90_pct"], e["abs_max_pct"])
            t.add_row(
                f.upper(),
                f"{name} ({n})",
                str(e["n"]),
                *(f"{v:+.1f}" if i == 1 else f"{v:.1f}" for i, v in enumerate(vals)),
            )
    con = Console()
    con.print(t)
    h, tp = doc["hit_rate"], doc["throughput"]
    meas = "-" if h["measured"] is None else f"{h['measured']:.1%}"
    diff = "" if h["diff_points"] is None else f" ({h['diff_points']:+.2f} points)"
    con.print(f"prefix-cache hit rate: measured {meas}, predicted {h['predicted']:.1%}{diff}")
    con.print(
        f"output throughput: measured {tp['output_tokens_per_s']:,.1f} tok/s, predicted "
        f"{tp['output_tokens_per_s_pred']:,.1f} tok/s ({tp['diff_pct']:+.2f}%)"
    )
    con.print(doc["arrivals"], markup=False, highlight=False)
    con.print(f"[dim]wrote predictions.jsonl and prediction.json to {doc['out']}[/dim]")
    if doc.get("report"):
        con.print(f"[dim]added the prediction errors to {doc['report']}[/dim]")
