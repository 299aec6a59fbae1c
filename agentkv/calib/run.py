"""The calibrate run: read the target, plan within the budget, probe with a progress bar, fit, write."""

from __future__ import annotations

import argparse
import sys
import time

from agentkv.bench.client import BenchClient
from agentkv.calib import fit as fitmod
from agentkv.calib.floor import FLOOR_SHARE, floor_first, floor_probes
from agentkv.calib.frontend import (
    CURVE_NEW,
    CURVE_OUT,
    CURVE_ROUNDS,
    CURVE_STREAMS,
    FrontEndCurve,
    curve_past,
    robust_front_end,
)
from agentkv.calib.identify import fit_all
from agentkv.calib.plan import DECODING, MIN_MODEL_LEN, Probe, make_plan, samples, within_budget
from agentkv.calib.probes import (
    LAG_PAIRS,
    PILOT_NEW,
    PILOT_OUT,
    FirstTokenLag,
    Prober,
    extra_pairs,
    named_extras,
    pilot,
    resolve_clock,
    run_plan,
)
from agentkv.calib.profile import profile_doc, write_profile
from agentkv.calib.split import SPLIT_OUT, SPLIT_ROUNDS, SplitLag, fit_split, split_lengths
from agentkv.errors import UserError
from agentkv.units import parse_duration

REQUEST_WALL_S = 0.02  # planning allowance per request for HTTP and scheduling
FAST_STEP_WALL_S = 0.002  # decode steps shorter than this (wall) show the server's own CPU time
ARRIVAL_WALL_S = 0.01  # how far apart (wall) concurrent streams may reach the engine, per stream
LAG_N = 2  # streams decoding beside each first-token delay request (bench's lanes overlap so)
CURVE_SHARE = 0.15  # of the budget, at most, kept apart for the front end's curve (`FrontEndCurve`)


def lag_wall_s(speed: tuple[float, float], time_scale: float, max_len: int | None = None) -> float:
    """Planning estimate of the first-token delay's wall seconds (`FirstTokenLag`) from the pilot's
    (TTFT, decode step) in engine seconds: the budget keeps this much for it apart from the probes."""
    beside = lag_beside(speed, time_scale, max_len)
    once = 2 * (beside.lead_s + beside.out * speed[1] / time_scale) + (1 + LAG_N) * 2 * REQUEST_WALL_S
    return LAG_PAIRS * once


def lag_beside(speed: tuple[float, float], time_scale: float, max_len: int | None = None) -> Probe:
    """The LAG_N streams (PILOT_NEW context) each first-token delay request is sent beside, from the
    pilot's (TTFT, step) in engine seconds: decoding when it is sent, still decoding when it ends.
    Their output stays within `max_len` (a slow pilot on a busy host once asked a 4,096-token server
    for 4,641 tokens, and calibrate failed)."""
    ttft, step = speed
    lead = (LAG_N * ttft + 4 * step) / time_scale + LAG_N * ARRIVAL_WALL_S
    out = 8 + 2 * PILOT_OUT + int((lead * time_scale + 2 * ttft) / max(step, 1e-9))
    if max_len is not None:
        out = max(1, min(out, max_len - PILOT_NEW))
    return Probe("loaded_ttft", new=PILOT_NEW, n=LAG_N, ctx=PILOT_NEW, out=out, lead_s=lead)


def curve_wall_s(speed: tuple[float, float], time_scale: float, past: int) -> float:
    """Planning estimate of the front end's curve's wall seconds (`FrontEndCurve`): each round warms
    a `past`-token prefix and sends each group of streams (one short prefill, CURVE_OUT tokens)."""
    group = speed[0] * CURVE_NEW / PILOT_NEW + (CURVE_OUT - 1) * speed[1]
    once = (speed[0] * past / PILOT_NEW + len(CURVE_STREAMS) * group) / time_scale
    return CURVE_ROUNDS * (once + (1 + sum(CURVE_STREAMS)) * REQUEST_WALL_S)


def split_wall_s(speed: tuple[float, float], time_scale: float, max_len: int) -> float:
    """Planning estimate of the split's wall seconds (`SplitLag`): each round each length's prefix
    warmed, then its prompt streamed (SPLIT_OUT tokens) between two scrapes of /metrics."""
    steps = speed[1] * SPLIT_OUT / time_scale
    once = sum(
        speed[0] * n / PILOT_NEW / time_scale + steps + 4 * REQUEST_WALL_S for n in split_lengths(max_len)
    )
    return SPLIT_ROUNDS * once


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


def slowdown(t: fitmod.Target, speed: tuple[float, float]) -> tuple[float, float]:
    """How much slower than the bundled model the pilot found the target: (prefill, decode) factors."""
    cm = t.cost()
    pre = fitmod.predict(cm, t, Probe("prefill_cold", new=PILOT_NEW))
    dec = fitmod.predict(cm, t, Probe("decode", n=1, ctx=PILOT_NEW, out=PILOT_OUT))
    return max(speed[0] / pre, 0.05), max(speed[1] / dec, 0.05)


def stretch_decodes(t: fitmod.Target, plan: list[Probe], slow: float = 1.0) -> None:
    """Longer decode streams where the streams' arrivals, spread in wall time, cost many decode steps
    (a fast model at a high time scale), so the first stream still decodes when the last one starts."""
    cm = t.cost()
    for p in plan:
        if p.family in DECODING:
            steps = p.n * ARRIVAL_WALL_S * t.time_scale / (fitmod.predict(cm, t, p) * slow)
            p.out += int(steps)


def shape_interference(t: fitmod.Target, plan: list[Probe], slow: tuple[float, float]) -> None:
    """Each interference and loaded_ttft probe's lead (wall seconds until its streams all decode) and
    stream length (they outlast twice the prefill), from the bundled model at the pilot's speed."""
    cm = t.cost()
    for p in plan:
        if p.family in ("interference", "loaded_ttft"):
            fill = fitmod.predict(cm, t, Probe("prefill_cold", new=p.n * p.ctx)) * slow[0]
            step = fitmod.predict(cm, t, Probe("decode", n=p.n, ctx=p.ctx, out=p.out)) * slow[1]
            pre = fitmod.predict(cm, t, Probe("prefill_cold", new=p.new)) * slow[0]
            p.lead_s = (fill + 8 * step) / t.time_scale + p.n * ARRIVAL_WALL_S
            p.out += int((p.lead_s * t.time_scale + 2 * pre) / step)


def decode_anchors(plan: list[Probe]) -> list[Probe]:
    """The one-stream decode probes at the plan's two shortest contexts: without two contexts the fit
    cannot tell a step's fixed time from its reading of the context (a 45 s budget on a slow host kept
    only 1,024-token decodes; the fit put the CPU build's per-step host time into the single-stream
    KV rate and predicted 21 ms a step at 4,096 tokens, where vLLM took 5-6 ms)."""
    ctxs = sorted({p.ctx for p in plan if p.family == "decode" and p.n == 1})[:2]
    return [p for p in plan if p.family == "decode" and p.n == 1 and p.ctx in ctxs]


def est_wall_s(t: fitmod.Target, p: Probe, repeats: int, slow: tuple[float, float] = (1.0, 1.0)) -> float:
    """Planning estimate of a probe's wall seconds: the bundled coefficients x the pilot's slowdown."""
    cm, once = t.cost(), 0.0
    if p.family in (*DECODING, "interference", "loaded_ttft"):
        fill = fitmod.predict(cm, t, Probe("prefill_cold", new=p.n * p.ctx + p.new))
        step = fitmod.predict(cm, t, Probe("decode", n=p.n, ctx=p.ctx, out=p.out))
        eng = fill * slow[0] + p.out * step * slow[1]
        reqs = p.n + (p.family not in DECODING)
    else:  # a cached prefix is warmed once per probe (`Prober.ttft`)
        eng, reqs = fitmod.predict(cm, t, p) * slow[0], 1
        if p.past:
            warm = fitmod.predict(cm, t, Probe("prefill_cold", new=p.past)) * slow[0]
            once = warm / t.time_scale + REQUEST_WALL_S
    return once + samples(p, repeats) * (eng / t.time_scale + reqs * REQUEST_WALL_S)


def plan_for(
    t: fitmod.Target,
    plan: list[Probe],
    speed: tuple[float, float],
    args,
    budget_s: float,
    max_len: int | None = None,
) -> list[Probe]:
    """The probes that fit `budget_s` at the pilot's speed, cheapest first (a budget cut short by a
    slower target than estimated drops the dearest ones of every family); loaded_ttft ones are chosen
    before the rest, within a third of the budget (the only probes that see host time under traffic:
    a cheapest-first choice left them out of a 45 s budget on a slow host), then `decode_anchors`,
    then the floor rungs within `FLOOR_SHARE` of it (`calib.floor`)."""
    slow = slowdown(t, speed)
    stretch_decodes(t, plan, slow[1])
    shape_interference(t, plan, slow)
    for p in plan if max_len else ():  # a stream longer than the model allows is refused (HTTP 400)
        p.out = max(1, min(p.out, max_len - p.past - p.ctx))
    est = {id(p): est_wall_s(t, p, args.repeats, slow) for p in plan}
    loaded = [p for p in plan if p.family == "loaded_ttft"]
    first = within_budget(loaded, [est[id(p)] for p in loaded], budget_s / 3)
    anchors = decode_anchors(plan)
    left = budget_s - sum(est[id(p)] for p in first)
    first += within_budget(anchors, [est[id(p)] for p in anchors], left)
    rungs = floor_first(plan)
    left = min(budget_s - sum(est[id(p)] for p in first), budget_s * FLOOR_SHARE)
    first += within_budget(rungs, [est[id(p)] for p in rungs], left)
    rest = [p for p in plan if all(p is not q for q in first)]
    left = budget_s - sum(est[id(p)] for p in first)
    plan = first + within_budget(rest, [est[id(p)] for p in rest], left)
    if not plan:
        raise UserError(f"--budget {args.budget} is too short for any probe")
    return sorted(plan, key=lambda p: est[id(p)])


async def calibrate(args: argparse.Namespace) -> int:
    """Probe, fit and write the profile; a failure mid-run still writes the finished probes, then errors."""
    budget = parse_duration(args.budget, "--budget")
    deadline = time.monotonic() + budget
    async with BenchClient(args.target, timeout=max(budget, 60.0)) as client:
        ids = await client.models()
        if not ids:
            raise UserError(f"target {client.base}: /v1/models lists no model")
        models = await client.get_json("/v1/models") or {}
        card = next((m for m in models.get("data", []) if m.get("id") == ids[0]), {"id": ids[0]})
        info = await client.get_json("/server_info") or {}
        t, max_len, bs, kv_tokens = target_of(args, card, info)
        args.clock = resolve_clock(getattr(args, "clock", None), info)  # once: every later read agrees
        prober = Prober(client, ids[0], bs, t.time_scale, engine_clock=_clock(args) == "engine")
        plan: list[Probe] = []
        floor, skipped = floor_probes(max_len, kv_tokens)
        lag: tuple = (0.0, {}, None, None)  # delay, its samples, the front end's curve, its split
        try:
            speed = await pilot(prober)
        except UserError as e:
            error = f"warm-up: {e}"
        else:
            curve = FrontEndCurve(curve_past(max_len, bs))
            # the first-token delay's and the front end's time, apart; the curve's at most CURVE_SHARE
            # of the budget (a slow pilot at load 27-44 estimated it past the whole budget: no probe)
            # the split needs the server's own TTFT (/metrics) beside the client's: not on the engine clock
            split = None if _clock(args) == "engine" else SplitLag(max_len)
            keep = curve_wall_s(speed, t.time_scale, curve.past) + (
                split_wall_s(speed, t.time_scale, max_len) if split else 0
            )
            keep = min(keep, CURVE_SHARE * budget)
            reserve = lag_wall_s(speed, t.time_scale, max_len) + keep
            end = deadline - min(reserve, budget / 2)  # both: half at most
            full = make_plan(max_len, bs, t.chunk, kv_tokens) + floor
            plan = plan_for(t, full, speed, args, end - time.monotonic(), max_len)
            if not args.quiet:
                slow = slowdown(t, speed)
                est = sum(est_wall_s(t, p, args.repeats, slow) for p in plan)
                print(f"plan: {len(plan)} of {len(full)} probes, about {est:.0f} s", file=sys.stderr)
            # a pair (a round) after each round of the probes, the rest after
            delay = FirstTokenLag(beside=lag_beside(speed, t.time_scale, max_len))
            extras = (curve,) if split is None else (curve, split)
            error = await _run_with_bar(prober, plan, args, end, delay, extras)
            error = error or await extra_pairs(prober, named_extras(delay, extras), deadline)
            lag = (*delay.result(), curve.result(), split.result() if split else None)
    server = {"model": card, "server_info": info}
    return _finish(args, client.base, ids[0], t, server, plan, error, lag, skipped)


async def _run_with_bar(
    prober: Prober,
    plan: list[Probe],
    args: argparse.Namespace,
    deadline: float,
    lag: FirstTokenLag,
    extras: tuple,
) -> str | None:
    """`run_plan`, with a progress bar of the samples on a terminal (not with -q)."""
    if args.quiet or not sys.stderr.isatty():
        return await run_plan(prober, plan, args.repeats, lambda *_: None, deadline, lag, extras)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (
        TextColumn("calibrating {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*cols, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(plan[0].label(), total=None)
        return await run_plan(
            prober,
            plan,
            args.repeats,
            lambda label, done, total: bar.update(task, completed=done, total=total, description=label),
            deadline,
            lag,
            extras,
        )


def _finish(
    args,
    base: str,
    model_id: str,
    t,
    server: dict,
    plan: list[Probe],
    error: str | None,
    lag: tuple,
    skipped: dict[str, str] | None = None,
) -> int:
    done = [p for p in plan if p.measured_s is not None]
    fitted, front = _fitted(args, t, done, lag) if len(done) >= 3 else (None, None)
    doc = profile_doc(f"{model_id}@{base}", base, t, server, plan, fitted, error, skipped) | {
        "clock": _clock(args)
    }
    write_profile(args.out, doc)
    fast = [p.measured_s / t.time_scale for p in done if p.family == "decode"]
    if fast and min(fast) < FAST_STEP_WALL_S:
        print(
            f"agentkv: warning: decode steps of {min(fast) * 1e3:.2f} ms wall time at time scale "
            f"{t.time_scale:g}: the server's own CPU time is in the measurements; use a lower time scale",
            file=sys.stderr,
        )
    if len(done) < len(plan) and not error:
        print(
            f"agentkv: note: the budget ran out before {len(plan) - len(done)} of {len(plan)} probes",
            file=sys.stderr,
        )
    if fitted:
        fams = ", ".join(f"{k} {v:.1f}%" for k, v in fitted["mape_pct"].items())
        print(f"calibrated {model_id} as {t.gpu}/{t.model} tp={t.tp}: {len(done)} probes, MAPE {fams}")
        print(f"first token of a continuing stream: {lag[0] * 1e3:.1f} ms later than of a one-token one")
        if lag[2]:
            print(front_line(lag[2], front))
        for name, why in fitted["not_identifiable"].items():
            print(f"not identifiable on this target: {name}: {why}")
        for label, why in (skipped or {}).items():
            print(f"skipped {label}: {why}")
        print(f"wrote {args.out}")
    if error:
        raise UserError(f"{error} ({len(done)} finished probes written to {args.out})")
    return 0


def _fitted(args, t, done: list[Probe], lag: tuple) -> tuple[dict, dict | None]:
    """The profile's fit of the finished probes (coefficients, overheads, errors, what is not
    identifiable) and the front end's fit as the profile keeps it (`fit.front_end`) or None."""
    f = fit_all(t, done, engine_clock=_clock(args) == "engine")
    ov = (*f.overhead, fitmod.fit_loaded(t, done, f.coeffs, f.overhead))
    front = _front(t, f.coeffs, lag[2], ov[0], ov[1])
    split = fit_split(lag[3], ov[1]) if lag[3] else None
    if split is not None:  # the split's rate, all after the engine; the curve's fit kept beside it
        front = (front or {}) | split
    overhead = {
        "request_s": ov[0],
        "prompt_token_s": ov[1],
        "per_other_request_s": ov[2],
        "first_token_s": lag[0],
    }
    if front is not None:
        overhead |= {"front_end_token_s": front["token_s"], "front_end_before_engine": front["before_engine"]}
    return {
        "coefficients": f.coeffs.to_dict(),
        "overhead": overhead,
        "first_token_ttft_s": lag[1],
        "front_end_ttft_s": lag[2] or {},
        "front_end": front or {},
        "front_end_split": lag[3] or {},
        "mape_pct": fitmod.errors(t, done, f.coeffs, ov),
        "stderr_pct": f.stderr_pct,
        "not_identifiable": f.not_identifiable,
        "weights": fitmod.weights(done),
    }, front


def _clock(args) -> str:
    """Which clock the probes read (`--clock`, resolved by `resolve_clock`): client or engine."""
    return resolve_clock(getattr(args, "clock", None), {})


def _front(t: fitmod.Target, coeffs, curve: dict | None, request_s: float, token_s: float) -> dict | None:
    """`fit_front_end` of the curve with the fitted engine: `n` of its prompts prefilled in one step,
    then decoded together to the stream's end."""
    if not curve:
        return None
    cm, ctx = t.cost(coeffs), curve["past"] + CURVE_NEW

    def engine_s(n: int) -> tuple[float, float]:
        first = cm.step_time([(CURVE_NEW, curve["past"])] * n, [])
        out = curve.get("out", CURVE_OUT)
        return first, first + (out - 1) * cm.step_time([], [ctx + out // 2] * n)

    return robust_front_end(curve, engine_s, request_s, t.time_scale, token_s)


def front_line(curve: dict, front: dict | None) -> str:
    """calibrate's line on the front end: the fitted queue time, the split's or the curve's slope
    it came from, and the curve's TTFTs."""
    tt = " / ".join(f"{sum(v) / len(v) * 1e3:.1f}" if v else "-" for v in curve["ttft_s"].values())
    fitted = "not fitted (no round)"
    if front is not None:
        which = "split" if "split_token_s" in front else "curve"
        fitted = (
            f"{front['token_s'] * 1e6:.2f} us a prompt token, {front['before_engine']:.0%} of it before "
            f"the engine, from {front['source']}; the {which}'s slope {_us(front.get(which + '_token_s'))} +- "
            f"{_us(front.get(which + '_stderr_s'))} us ({front.get(which + '_points')} points)"
        )
    return (
        f"front end under concurrency: {fitted} ({'/'.join(curve['ttft_s'])} streams together: TTFT {tt} ms)"
    )


def _us(x: float | None) -> str:
    """Seconds as microseconds to 2 decimals, '-' for None."""
    return "-" if x is None else f"{x * 1e6:.2f}"
