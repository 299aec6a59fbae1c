"""A bench sweep's outputs: one row per point, the SLO knee, OUT/sweep.json, OUT/sweep.html (the
InferenceX-style curve of output throughput per GPU against interactivity) and the terminal table."""

from __future__ import annotations

import re
import sys
from html import escape
from pathlib import Path

import msgspec

from agentkv.bench.sweep import SCHEMA
from agentkv.metrics.report_sweep import tier_marks
from agentkv.metrics.summary import Summary, slo_fraction
from agentkv.metrics.svg import Chart, Series

_CSS = (
    "body{font:14px system-ui,sans-serif;margin:24px;color:#111827}table{border-collapse:collapse}"
    "td,th{padding:3px 10px;border-bottom:1px solid #e5e7eb;text-align:right}th{background:#f3f4f6}"
    "svg.chart{max-width:100%;height:auto}svg.chart text{font-size:11px;fill:#374151}"
    "svg.chart .title{font-size:13px;font-weight:600}svg.chart .label{font-size:12px}"
    "svg.chart .plot{fill:#fff;stroke:#d1d5db}svg.chart .grid{stroke:#eef0f3}.ok{color:#15803d}.no{color:#b91c1c}"
)


def gpus_of(s: Summary) -> int | None:
    """GPUs behind the target: NVML's devices, else the server's tp x dp (agentkv serve, SGLang)."""
    if s.gpu and s.gpu.get("devices"):
        return len(s.gpu["devices"])
    info = s.config.get("server") or {}
    tp = info.get("tp_size")
    return int(tp) * int(info.get("dp_size") or 1) if isinstance(tp, int) and tp > 0 else None


def point_row(k: int, key: str, value, result, slo: dict[str, float], attain: float) -> dict:
    """One sweep point's figures: throughput, interactivity, latencies and SLO compliance."""
    s: Summary = result.summary
    recs = [r for r in result.records if not r.warmup]
    tps = s.throughput.output_tokens_per_s if s.throughput else None
    gpus = gpus_of(s)
    good = s.goodput.fraction if s.goodput else None
    return {
        "k": k,
        key: value,
        "dir": f"point-{k}",
        "valid": s.valid and not result.interrupted,
        "invalid_reason": "interrupted" if result.interrupted else s.invalid_reason,
        "requests": s.requests,
        "failed": s.failed,
        "gpus": gpus,
        "output_tokens_per_s": tps,
        "output_tokens_per_s_per_gpu": tps / gpus if gpus and tps is not None else None,
        # what one user sees while decoding: 1 / median TPOT (InferenceX's tok/s/user)
        "interactivity_tokens_per_s_per_user": 1.0 / s.tpot.p50 if s.tpot.p50 else None,
        "ttft_p50": s.ttft.p50,
        "ttft_p90": s.ttft.p90,
        "tpot_p50": s.tpot.p50,
        "tpot_p90": s.tpot.p90,
        "slo_share": {name: slo_fraction(recs, {name: lim}) for name, lim in slo.items()},
        "goodput_fraction": good,
        "goodput_requests_per_s": s.goodput.requests_per_s if s.goodput else None,
        "meets_slo": bool(s.valid and not result.interrupted and good is not None and good >= attain)
        if slo
        else None,
        **tier_fields(s.interactivity),
    }


def tier_fields(i) -> dict:
    """A point against the interactivity tier: met, agents, per GPU and per MW (None: unknown)."""
    if i is None:
        return {"meets_tier": None, "agents": None, "agents_per_gpu": None, "agents_per_mw": None}
    return {
        "meets_tier": i.met,
        "agents": i.agents,
        "agents_per_gpu": i.agents_per_gpu,
        "agents_per_mw": i.agents_per_mw,
        "tier": [i.tier_tps, i.tier_ttft_p90],
        "power_basis": i.power_basis,
    }


def tier_knee(rows: list[dict]) -> tuple[int | None, str]:
    """(position, line): the highest load meeting the interactivity tier, with its agents per GPU
    and per MW (unknown when the GPUs or their power are)."""
    met = [i for i, r in enumerate(rows) if r.get("meets_tier")]
    if not met:
        return None, "tier: no point meets the interactivity tier"
    r = rows[met[-1]]
    tps, ttft = r["tier"]
    gpu = "unknown" if r["agents_per_gpu"] is None else f"{r['agents_per_gpu']:,.2f}"
    mw = "unknown" if r["agents_per_mw"] is None else f"{r['agents_per_mw']:,.0f}"
    top = "at least " if r is rows[-1] else ""
    return met[-1], (
        f"tier knee (tps>={tps:g}, TTFT p90<={ttft:g}s): {top}{r['agents']:,.1f} agents, {gpu} per GPU, "
        f"{mw} per MW ({r['power_basis']})"
    )


def knee(rows: list[dict]) -> tuple[dict | None, str]:
    """The highest load such that it and every lower point meet the SLO, and what that means."""
    if not rows or rows[0]["meets_slo"] is None:
        return None, "no --slo: no knee"
    best = None
    for r in rows:
        if not r["meets_slo"]:
            break
        best = r
    if best is None:
        return None, "the lowest load already misses the SLO: lower the load or relax the SLO"
    if best is rows[-1]:
        return best, "every point meets the SLO: the knee is at or above the highest load swept"
    return best, "the next point misses the SLO"


def write_sweep(out: Path, key: str, rows: list[dict], slo: dict[str, float], attain: float) -> dict:
    """OUT/sweep.json and OUT/sweep.html; returns the JSON document."""
    best, why = knee(rows)
    per = "gpu" if rows and all(r["gpus"] for r in rows) else "server"
    at, tier_line = tier_knee(rows)
    doc = {
        "schema": SCHEMA,
        "key": key,
        "slo": slo,
        "slo_attainment": attain,
        "throughput_per": per,
        "points": rows,
        "knee": None if best is None else rows.index(best),  # its position in points
        "knee_note": why,
        "tier_knee": at,  # the highest load meeting the interactivity tier (agents per MW)
        "tier_knee_note": tier_line,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2))
    (out / "sweep.html").write_text(_html(doc), encoding="utf-8")
    return doc


def _y(r: dict, per: str) -> float | None:
    return r["output_tokens_per_s_per_gpu"] if per == "gpu" else r["output_tokens_per_s"]


def curve(doc: dict) -> Chart:
    """Output throughput per GPU (or per server) against interactivity, one dot per load point."""
    key, per, rows = doc["key"], doc["throughput_per"], doc["points"]
    unit = "GPU" if per == "gpu" else "server"
    ch = Chart(
        f"throughput vs interactivity ({key} sweep)",
        "interactivity: output tok/s per user (1 / median TPOT)",
        f"output tok/s per {unit}",
    )
    xs = [r["interactivity_tokens_per_s_per_user"] for r in rows]
    ys = [_y(r, per) for r in rows]
    tips = [
        f"{key}={r[key]:g}: {_y(r, per) or 0:,.0f} tok/s/{unit}, "
        f"{r['interactivity_tokens_per_s_per_user'] or 0:,.1f} tok/s/user" + _slo_tip(r)
        for r in rows
    ]
    ch.add(Series("load points", xs, ys, kind="line", color="#9ca3af"))
    groups = (
        ("meets the SLO", True, "#16a34a"),
        ("misses the SLO", False, "#dc2626"),
        ("no SLO", None, "#2563eb"),
    )
    for name, flag, color in groups:
        idx = [i for i, r in enumerate(rows) if r["meets_slo"] is flag]
        if idx:
            pick = [xs[i] for i in idx], [ys[i] for i in idx], [tips[i] for i in idx]
            ch.add(Series(name, pick[0], pick[1], kind="dots", color=color, tips=pick[2]))
    if doc["knee"] is not None:
        i = doc["knee"]
        ch.add(Series(f"knee: {key}={rows[i][key]:g}", [xs[i]], [ys[i]], kind="dots", color="#000"))
    tier = next((r["tier"] for r in rows if r.get("tier")), None)
    for s in tier_marks(tier[0], xs, ys, [r.get("meets_tier") for r in rows]) if tier else []:
        ch.add(s)
    return ch


def labelled(svg: str, key: str) -> str:
    """The curve with each point's load written beside its dot (read back from the dots' tooltips)."""
    dots = re.findall(r'<circle cx="([-\d.]+)" cy="([-\d.]+)" r="[\d.]+"><title>' + key + r"=([^:<]+):", svg)
    text = "".join(f'<text x="{float(x) + 5:.1f}" y="{float(y) - 5:.1f}">{v}</text>' for x, y, v in dots)
    return svg.replace("</svg>", f"{text}</svg>")


def _slo_tip(r: dict) -> str:
    if r["goodput_fraction"] is None:
        return ""
    return f", {r['goodput_fraction']:.1%} meet the SLO"


def _cell(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _table_html(doc: dict) -> str:
    key, rows = doc["key"], doc["points"]
    names = list(doc["slo"])
    head = [key, "valid", "requests", "output tok/s", "per GPU", "tok/s/user", "TTFT p50 ms", "TPOT p50 ms"]
    head += [f"{n} met" for n in names] + (["all met", "meets"] if names else [])
    body = []
    for r in rows:
        cells = [
            f'<a href="{r["dir"]}/report.html">{r[key]:g}</a>',
            "yes" if r["valid"] else escape(r["invalid_reason"] or "no"),
            f"{r['requests']:,}",
            _cell(r["output_tokens_per_s"], ",.0f"),
            _cell(r["output_tokens_per_s_per_gpu"], ",.0f"),
            _cell(r["interactivity_tokens_per_s_per_user"], ",.1f"),
            _cell(None if r["ttft_p50"] is None else r["ttft_p50"] * 1e3, ",.1f"),
            _cell(None if r["tpot_p50"] is None else r["tpot_p50"] * 1e3, ",.2f"),
        ]
        cells += [_cell(r["slo_share"].get(n), ".1%") for n in names]
        if names:
            ok = r["meets_slo"]
            cells += [
                _cell(r["goodput_fraction"], ".1%"),
                f'<span class="{"ok" if ok else "no"}">{"yes" if ok else "no"}</span>',
            ]
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (
        "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>" + "".join(body) + "</table>"
    )


def _html(doc: dict) -> str:
    key = doc["key"]
    slo = ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in doc["slo"].items()) or "none"
    kn = doc["knee"]
    knee_line = (
        doc["knee_note"] if kn is None else f"knee: {key}={doc['points'][kn][key]:g} ({doc['knee_note']})"
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>agentkv bench sweep: {key}'
        f"</title><style>{_CSS}</style></head><body><h1>agentkv bench sweep over {escape(key)}</h1>"
        f"<p>SLO: {escape(slo)}; a point meets it when {doc['slo_attainment']:.0%} of its requests meet "
        f"every limit. {escape(knee_line)}.</p><p>{escape(doc['tier_knee_note'])}.</p>{labelled(curve(doc).svg(), key)}{_table_html(doc)}</body></html>"
    )


def print_table(doc: dict, as_json: bool) -> None:
    """The sweep on the terminal (or its JSON on stdout)."""
    if as_json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(doc), indent=2).decode() + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    key, names = doc["key"], list(doc["slo"])
    gpu = doc["throughput_per"] == "gpu"
    t = Table(title=f"bench sweep over {key}")
    heads = [key, "valid", f"out tok/s per {'GPU' if gpu else 'server'}", "tok/s per user", "TTFT p50 ms"]
    heads.append("TPOT p50 ms")
    for h in [*heads, *(f"{n} met" for n in names), *(["meets"] if names else [])]:
        t.add_column(h, justify="right")
    for r in doc["points"]:
        t.add_row(
            f"{r[key]:g}",
            "yes" if r["valid"] else "no",
            _cell(_y(r, doc["throughput_per"]), ",.0f"),
            _cell(r["interactivity_tokens_per_s_per_user"], ",.1f"),
            _cell(None if r["ttft_p50"] is None else r["ttft_p50"] * 1e3, ",.1f"),
            _cell(None if r["tpot_p50"] is None else r["tpot_p50"] * 1e3, ",.2f"),
            *[_cell(r["slo_share"].get(n), ".1%") for n in names],
            *([str(r["meets_slo"]).lower()] if names else []),
        )
    con = Console()
    con.print(t)
    kn = doc["knee"]
    line = doc["knee_note"] if kn is None else f"knee: {key}={doc['points'][kn][key]:g} ({doc['knee_note']})"
    con.print(line, markup=False)
    con.print(doc["tier_knee_note"], markup=False)
    con.print("[dim]wrote sweep.json, sweep.html and point-<k>/ folders[/dim]")
