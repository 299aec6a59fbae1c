"""The calibrate run: read the target, plan within the budget, probe with a progress bar, fit, write."""

from __future__ import annotations

import argparse
import sys

from agentkv.bench.client import BenchClient
from agentkv.calib import fit as fitmod
from agentkv.calib.plan import MIN_MODEL_LEN, Probe, make_plan, within_budget
from agentkv.calib.probes import SHORT_PREFILL, Prober, run_plan
from agentkv.calib.profile import profile_doc, write_profile
from agentkv.errors import UserError
from agentkv.units import parse_duration

REQUEST_WALL_S = 0.02  # planning allowance per request for HTTP and scheduling
FAST_STEP_WALL_S = 0.002  # decode steps shorter than this (wall) show the server's own CPU time
ARRIVAL_WALL_S = 0.01  # how far apart (wall) concurrent streams may reach the engine, per stream


def target_of(args: argparse.Namespace, card: dict, info: dict) -> tuple[fitmod.Target, int, int, int | None]:
    """(modelled target, max model len, block size, KV tokens or None) from flags, /v1/models, /server_info."""
    max_len = card.get("max_model_len") or args.max_model_len
    if not max_len:
        raise UserError("the target's /v1/models has no max_model_len; pass --max-model-len")
    if max_len < MIN_MODEL_LEN:
        raise UserError(f"max model length {max_len} is too small to calibrate (need >= {MIN_MODEL_LEN})")
    t = fitmod.Target(
        gpu=args.gpu or info.get("gpu") or "h200",
        model=args.model or card.get("root") or card.get("id"),
        tp=args.tensor_parallel_size or info.get("tp_size") or 1,
        kv_dtype=args.kv_cache_dtype or "bf16",
        chunk=args.max_num_batched_tokens or info.get("chunked_prefill_size") or 8192,
        time_scale=args.time_scale or info.get("time_scale") or 1.0,
    )
    t.cost()  # unknown GPU or model: UserError naming the choices
    return t, int(max_len), args.block_size or info.get("page_size") or 16, info.get("max_total_num_tokens")


def stretch_decodes(t: fitmod.Target, plan: list[Probe]) -> None:
    """Longer decode streams where the streams' arrivals, spread in wall time, cost many decode steps
    (a fast model at a high time scale), so the first stream still decodes when the last one starts."""
    cm = t.cost()
    for p in plan:
        if p.family == "decode":
            steps = p.n * ARRIVAL_WALL_S * t.time_scale / fitmod.predict(cm, t, p)
            p.out += int(steps)


def est_wall_s(t: fitmod.Target, p: Probe, repeats: int) -> float:
    """Planning estimate of a probe's wall seconds with the bundled coefficients."""
    cm = t.cost()
    if p.family == "decode":
        fill = fitmod.predict(cm, t, Probe("prefill_cold", new=p.n * p.ctx))
        eng = fill + p.out * fitmod.predict(cm, t, p)
        reqs = p.n
    else:
        eng = fitmod.predict(cm, t, p) + (
            fitmod.predict(cm, t, Probe("prefill_cold", new=p.past)) if p.past else 0
        )
        reqs = 2 if p.past else 1
    if p.family != "decode" and p.new <= SHORT_PREFILL:
        repeats *= 2
    return repeats * (eng / t.time_scale + reqs * REQUEST_WALL_S)


async def calibrate(args: argparse.Namespace) -> int:
    """Probe, fit and write the profile; a failure mid-run still writes the finished probes, then errors."""
    budget = parse_duration(args.budget, "--budget")
    async with BenchClient(args.target, timeout=max(budget, 60.0)) as client:
        ids = await client.models()
        if not ids:
            raise UserError(f"target {client.base}: /v1/models lists no model")
        models = await client.get_json("/v1/models") or {}
        card = next((m for m in models.get("data", []) if m.get("id") == ids[0]), {"id": ids[0]})
        info = await client.get_json("/server_info") or {}
        t, max_len, bs, kv_tokens = target_of(args, card, info)
        plan = make_plan(max_len, bs, t.chunk, kv_tokens)
        stretch_decodes(t, plan)
        plan = within_budget(plan, [est_wall_s(t, p, args.repeats) for p in plan], budget)
        if not plan:
            raise UserError(f"--budget {args.budget} is too short for any probe")
        prober = Prober(client, ids[0], bs, t.time_scale)
        error = await _run_with_bar(prober, plan, args)
    return _finish(args, client.base, ids[0], t, {"model": card, "server_info": info}, plan, error)


async def _run_with_bar(prober: Prober, plan: list[Probe], args: argparse.Namespace) -> str | None:
    if args.quiet or not sys.stderr.isatty():
        return await run_plan(prober, plan, args.repeats, lambda p: None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (
        TextColumn("calibrating {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*cols, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(plan[0].label(), total=len(plan))
        labels = iter([p.label() for p in plan[1:]] + ["done"])
        return await run_plan(
            prober, plan, args.repeats, lambda p: bar.update(task, advance=1, description=next(labels))
        )


def _finish(args, base: str, model_id: str, t, server: dict, plan: list[Probe], error: str | None) -> int:
    done = [p for p in plan if p.measured_s is not None]
    fitted = None
    if len(done) >= 3:
        f = fitmod.fit(t, done)
        fitted = {
            "coefficients": f.coeffs.to_dict(),
            "overhead": {"request_s": f.overhead[0], "prompt_token_s": f.overhead[1]},
            "mape_pct": fitmod.errors(t, done, f.coeffs, f.overhead),
            "stderr_pct": f.stderr_pct,
        }
    doc = profile_doc(f"{model_id}@{base}", base, t, server, plan, fitted, error)
    write_profile(args.out, doc)
    fast = [p.measured_s / t.time_scale for p in done if p.family == "decode"]
    if fast and min(fast) < FAST_STEP_WALL_S:
        print(
            f"agentkv: warning: decode steps of {min(fast) * 1e3:.2f} ms wall time at time scale "
            f"{t.time_scale:g}: the server's own CPU time is in the measurements; use a lower time scale",
            file=sys.stderr,
        )
    if fitted:
        fams = ", ".join(f"{k} {v:.1f}%" for k, v in fitted["mape_pct"].items())
        print(f"calibrated {model_id} as {t.gpu}/{t.model} tp={t.tp}: {len(done)} probes, MAPE {fams}")
        print(f"wrote {args.out}")
    if error:
        raise UserError(f"{error} ({len(done)} finished probes written to {args.out})")
    return 0
