"""Deployment what-if (docs/simulate.md): DeepSeek shapes on 8x H200, B200, B300, MI355X, GB300 and
Vera Rubin NVL72; agents/MW at an interactivity tier by a lanes search, beside AA-AgentPerf's figures.

Each row runs `agentkv simulate` (this checkout's) per lanes point with --cycle --warm-start and a
bisection on lanes; a rack is simulated as one 8-GPU slice priced at the rack's provisioned power per
GPU, or with --rack as the whole 72 GPUs. --quick runs one small row (for tests)."""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = "/work/shared/traces/claude-code"
MODELS = {
    "DeepSeek-V4-Pro": "deepseek-v4-pro",
    "DeepSeek-V4-Flash": "deepseek-v4-flash",
    "DeepSeek-V3": "deepseek-v3",
}
SYSTEMS = {
    "8x H200": "dgx-h200",
    "8x B200": "dgx-b200",
    "8x B300": "dgx-b300",
    "8x MI355X": "mi355x-8",
    "GB300 NVL72": "gb300-nvl72",
    "VR NVL72": "vr-nvl72",
}
MODES = {
    "agg": ["-tp", "8"],
    "disagg": ["--disagg", "prefill=1,decode=1", "-tp", "4", "--decode-router", "session"],
    # wide EP on a rack: 8 of the 72 DP ranks (tp 1) whose experts spread over all 72 GPUs
    "wide-ep": ["-tp", "1", "-dp", "72", "-ep", "--workers", "8"],
}
# --rack: the whole 72-GPU rack in one simulation (9 TP 8 engines; --rack-split TP 8 prefill and
# decode engines, 3p6d by default; or all 72 DP ranks of the wide-EP group)
RACK_MODES = {
    "agg": ["-tp", "8", "--workers", "9"],
    "disagg": ["--disagg", "{split}", "-tp", "8", "--decode-router", "session"],
    "wide-ep": ["-tp", "1", "-dp", "72", "-ep", "--workers", "72"],
    # --rack-split NpMd: N TP 8 prefill engines feeding a wide-EP decode group of the other M x 8 GPUs
    "disagg-wide-ep": [
        *("--disagg", "prefill={p},decode={ranks}", "--prefill-tensor-parallel-size", "8"),
        *("--decode-tensor-parallel-size", "1", "--decode-data-parallel-size", "{ranks}"),
        *("--decode-enable-expert-parallel", "--decode-router", "session"),
    ],
    # both pools wide-EP groups: N x 8 prefill ranks and M x 8 decode ranks (DeepSeek's own layout)
    "disagg-ep": [
        *("--disagg", "prefill={pranks},decode={ranks}", "-tp", "1", "--decode-router", "session"),
        *("--prefill-data-parallel-size", "{pranks}", "--prefill-enable-expert-parallel"),
        *("--decode-data-parallel-size", "{ranks}", "--decode-enable-expert-parallel"),
    ],
}
RACK_LABEL = {
    "agg": "9x TP8",
    "disagg": "{split} TP8",
    "wide-ep": "72 DP ranks",
    "disagg-wide-ep": "{p} TP8 prefill + {ranks} EP decode ranks",
    "disagg-ep": "{pranks} EP prefill ranks + {ranks} EP decode ranks",
}
# AA-AgentPerf, DeepSeek-V4-Pro, >= 20 tok/s per user, TTFT <= 10 s: agents per MW (per GPU)
# (B300 and MI355X: per MW only; no per-GPU figure published with them)
AA = {
    "dgx-h200": (2594, 1.4),
    "gb300-nvl72": (61354, 57.5),
    "dgx-b300": (21053, None),
    "mi355x-8": (3551, None),
}
DEFAULT_TIER, RELAXED_TIER = (20.0, 10.0), (5.0, 30.0)


@dataclass
class Row:
    model: str
    system: str
    mode: str
    quant: str
    offload: str = ""
    imbalance: float = 1.0  # --expert-imbalance (wide-ep rows)
    rack: bool = False  # the whole 72-GPU rack, not an 8-GPU slice
    split: str = "3p6d"  # --rack-split: a disaggregated rack's TP 8 prefill and decode engines
    cpu_s: float = 0.0  # CPU seconds of its simulate processes
    points: dict = field(default_factory=dict)  # lanes -> summary (or error string)
    error: str = ""


def command(row: Row, lanes: int, a: argparse.Namespace) -> list[str]:
    """The `agentkv simulate` command line of one point of `row`."""
    cmd = [sys.executable, "-m", "agentkv.cli", "simulate", a.traces, "--traces-limit", str(a.traces_limit)]
    cmd += ["--model", MODELS[row.model], "--system", SYSTEMS[row.system]]
    cmd += (
        [x.format(**split_fields(row.split)) for x in RACK_MODES[row.mode]] if row.rack else MODES[row.mode]
    )
    cmd += ["--cycle", "--warm-start", "--duration", a.duration, "--lanes", str(lanes), "-q", "--json"]
    cmd += ["--quantization", row.quant] if row.quant != "default" else []
    cmd += ["--cpu-offload", row.offload] if row.offload else []
    cmd += ["--expert-imbalance", str(row.imbalance)] if row.mode == "wide-ep" else []
    return cmd


def simulate(row: Row, lanes: int, a: argparse.Namespace) -> dict | str:
    """One `agentkv simulate` point as JSON, or its one-line error."""
    cmd = command(row, lanes, a)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    before = _children_cpu()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=a.point_timeout)
    row.cpu_s += _children_cpu() - before
    if p.returncode != 0:
        return (p.stderr.strip().splitlines() or ["failed"])[-1].removeprefix("agentkv: error: ")
    return json.loads(p.stdout)


def good_split(split: str) -> bool:
    """Whether `split` is NpMd with N, M >= 1 and N + M = 9 (the rack's nine 8-GPU groups)."""
    n, _, m = split.removesuffix("d").partition("p")
    return (
        split.endswith("d")
        and n.isdigit()
        and m.isdigit()
        and int(n) + int(m) == 9
        and min(int(n), int(m)) >= 1
    )


def split_fields(split: str) -> dict:
    """A rack split NpMd (N + M = 9 TP 8 engines) as the placeholders of RACK_MODES and RACK_LABEL:
    the split, N, N x 8 and M x 8 (the prefill and decode GPUs, as wide-EP ranks)."""
    p, _, d = split.removesuffix("d").partition("p")
    return {"split": split, "p": p, "pranks": int(p) * 8, "ranks": int(d) * 8}


def _children_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def meets(s: dict, tier: tuple[float, float]) -> bool:
    i = s["interactivity"]
    return (i["tps_per_user_p50"] or 0) >= tier[0] and (i["ttft_p90"] or 1e9) <= tier[1]


def point(row: Row, lanes: int, a) -> dict | str:
    if lanes not in row.points:
        before = row.cpu_s
        row.points[lanes] = simulate(row, lanes, a)
        if a.progress:
            rack = " rack" if row.rack else ""
            print(
                f"  {row.model} {row.system} {row.mode}{rack} {row.quant} lanes={lanes}: "
                f"{row.cpu_s - before:.0f} s CPU",
                file=sys.stderr,
                flush=True,
            )
    return row.points[lanes]


def _bracket(text: str) -> float:
    """--bracket's value: a finite factor above 1 (anything else is argparse's one-line error)."""
    try:
        f = float(text)
    except ValueError:
        f = math.nan
    if not (math.isfinite(f) and f > 1.0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 1, got {text!r}")
    return f


def knee(row: Row, tier, lo: int, hi: int, a) -> int | None:
    """The most lanes meeting `tier` (bisection, as simulate --sweep; None when `lo` misses it)."""
    s = point(row, lo, a)
    if isinstance(s, str):
        row.error = s
        return None
    if not meets(s, tier):
        return None
    top = point(row, hi, a)
    if isinstance(top, dict) and meets(top, tier):
        return hi
    while hi > lo * a.bracket and hi - lo > 1:
        mid = max(lo + 1, round((lo * hi) ** 0.5))
        m = point(row, mid, a)
        lo, hi = (mid, hi) if isinstance(m, dict) and meets(m, tier) else (lo, mid)
    for n in range(lo + 1, hi) if a.exact else ():  # up from the knee, one point at a time, to a miss
        m = point(row, n, a)
        if not (isinstance(m, dict) and meets(m, tier)):
            break
        lo = n
    return lo


def figures(s: dict) -> dict:
    """Agents per GPU and per MW, M tok/s per MW, per-user tok/s and TTFT p90 of one point."""
    c, i = s["config"], s["interactivity"]
    gpus, w = c["gpus"], c["power_w_per_gpu"]
    return {
        "agents_gpu": i["mean_trees"] / gpus,
        "agents_mw": i["mean_trees"] / gpus / w * 1e6,
        "mtok_mw": s["throughput"]["million_total_tokens_per_s_per_mw"],
        "tps": i["tps_per_user_p50"] or 0.0,
        "ttft": i["ttft_p90"] or 0.0,
        "gpus": gpus,
        "mix": mix(s),
    }


def mix(s: dict) -> str:
    """Which traces a point replayed, `37 (138K)`: distinct traces and mean prompt tokens. Lanes take
    traces in path order, so a point with few lanes replays only the first few of --traces-limit, and
    tokens/s per MW follows that mix's prompt length (docs/simulate.md, whole racks)."""
    traces = len({x["trace"] for x in s.get("sessions") or []})
    prompt = s["input_tokens"] / s["succeeded"] if s.get("succeeded") else 0.0
    return f"{traces} ({prompt / 1e3:.0f}K)"


def ratio(row: Row, f: dict) -> str:
    ref = AA.get(SYSTEMS[row.system]) if row.model == "DeepSeek-V4-Pro" else None
    if not ref:
        return "-"

    def out(x: float) -> str:
        return "" if 0.5 <= x <= 2.0 else " (outside 0.5-2x)"

    r = f["agents_mw"] / ref[0]
    text = f"{r:.2f}x of {ref[0]:,}/MW{out(r)}"
    if ref[1] is None:
        return text
    g = f["agents_gpu"] / ref[1]
    return f"{text}; {g:.2f}x of {ref[1]}/GPU{out(g)}"


def run_row(row: Row, a) -> str:
    """One table line: the default tier's knee, else the relaxed tier's, else the 1-lane figures."""
    lo = a.min_lanes or (9 if row.rack else 1)  # a rack: one lane per TP 8 engine at least
    tier_name, k = "default", knee(row, DEFAULT_TIER, lo, a.max_lanes, a)
    if k is None and not row.error:
        tier_name, k = "relaxed", knee(row, RELAXED_TIER, lo, a.max_lanes, a)
    mode = f"{row.mode} (imbalance {row.imbalance:g})" if row.mode == "wide-ep" else row.mode
    mode += f" ({RACK_LABEL[row.mode].format(**split_fields(row.split))}, whole rack)" if row.rack else ""
    label = (
        f"| {row.model} | {row.system} | {mode} | {row.quant}{' +CPU ' + row.offload if row.offload else ''}"
    )
    cpu = f" {row.cpu_s:,.0f} s ({len(row.points)}) |"
    if row.error:
        return f"{label} | - | error: {row.error} | | | | | | | |{cpu}"
    if k is None:
        f, tier_name = figures(row.points[lo]), f"none met ({lo} lanes)"
        return (
            f"{label} | {f['gpus']} | {tier_name} | - | - | - | {f['mtok_mw']:.2f} | {f['tps']:.1f} "
            f"| {f['ttft']:.1f} s | {f['mix']} |{cpu}"
        )
    f = figures(row.points[k])
    above = [n for n in row.points if n > k]  # every point tried above the knee missed
    at = f"{k}{'+' if k == a.max_lanes else ''} lanes" + (f" ({min(above)} missed)" if above else "")
    return (
        f"{label} | {f['gpus']} | {tier_name}: {at} | {f['agents_gpu']:.2f} | {f['agents_mw']:,.0f} | "
        f"{ratio(row, f)} | {f['mtok_mw']:.2f} | {f['tps']:.1f} | {f['ttft']:.1f} s | {f['mix']} |{cpu}"
    )


def rows(a) -> list[Row]:
    if a.quick:
        return [Row("DeepSeek-V4-Pro", "8x H200", "agg", "default")]
    out = []
    if a.rack:
        racks = [s for s in a.systems.split(",") if "NVL72" in s]
        kinds = [k for k in a.rows.split(",") if k in RACK_MODES]
        extra = dict(offload=a.rack_offload or "", split=a.rack_split)
        return [
            Row(m, s, k, "default", imbalance=a.expert_imbalance or 1.0, rack=True, **extra)
            for m in a.models.split(",")
            for s in racks
            for k in kinds
        ]
    if a.wide_ep:
        racks = [s for s in a.systems.split(",") if "NVL72" in s]
        return [
            Row(m, s, "wide-ep", "default", imbalance=x)
            for m in a.models.split(",")
            for s in racks
            for x in ((a.expert_imbalance,) if a.expert_imbalance else (1.0, 1.5))
        ]
    for m in a.models.split(","):
        for s in a.systems.split(","):
            out.append(Row(m, s, "agg", "default"))
            out.append(Row(m, s, "agg", "nvfp4"))
            out.append(Row(m, s, "disagg", "default"))
            out.append(Row(m, s, "agg", "default", offload="512GB"))  # with a CPU tier (V4: per group)
    kinds = a.rows.split(",")
    return [r for r in out if ("cpu" if r.offload else r.mode if r.quant == "default" else "fp4") in kinds]


def parser() -> argparse.ArgumentParser:
    """The script's flags (main validates the names and runs the rows)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one small row (V4-Pro on 8x H200, 3 traces, 1 minute, lanes 1..2)",
    )
    ap.add_argument("--traces", default=TRACES)
    ap.add_argument("--traces-limit", type=int, default=12)
    ap.add_argument("--duration", default="10m", help="simulated time per point (default 10m)")
    ap.add_argument("--max-lanes", type=int, default=96)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rows", default="agg,fp4,disagg,cpu", help="which rows per model and system")
    ap.add_argument("--wide-ep", action="store_true", help="only wide-EP rows (racks; imbalance 1.0 and 1.5)")
    ap.add_argument(
        "--rack",
        action="store_true",
        help="simulate the NVL72 systems' whole 72 GPUs (rows agg: 9x TP8, disagg: 3p6d TP8, wide-ep: "
        "72 DP ranks, disagg-wide-ep: 3 TP8 prefill + 48 EP decode ranks, disagg-ep: 24 EP prefill "
        "ranks + 48 EP decode ranks) with lanes searched from 9 to --max-lanes",
    )
    ap.add_argument(
        "--rack-split",
        default="3p6d",
        help="--rack disagg rows: NpMd TP 8 prefill and decode engines, N + M = 9 (default 3p6d; "
        "disagg-wide-ep, disagg-ep: the N x 8 / M x 8 GPUs are wide-EP groups)",
    )
    ap.add_argument(
        "--rack-offload",
        default=None,
        metavar="SIZE",
        help="--rack rows: a CPU tier of SIZE per engine (--cpu-offload; a wide-EP rank is an engine)",
    )
    ap.add_argument(
        "--min-lanes", type=int, default=None, help="bottom of the lanes search (default 1; racks 9)"
    )
    ap.add_argument("--point-timeout", type=float, default=3600.0, help="seconds per simulate point")
    ap.add_argument(
        "--bracket",
        type=_bracket,
        default=1.25,
        help="the bisection stops once its missed point is within this factor of its knee (default "
        "1.25; 1.05 resolves a knee to 5%% in about two more points)",
    )
    ap.add_argument(
        "--exact",
        action="store_true",
        help="after the bisection (a --bracket bracket), run each lanes point above its knee until one misses",
    )
    ap.add_argument(
        "--expert-imbalance",
        type=float,
        default=None,
        help="wide-ep rows: the hottest expert GPU's load over the mean (default: 1.0 on --rack, "
        "1.0 and 1.5 with --wide-ep)",
    )
    ap.add_argument("--progress", action="store_true", help="print each point to stderr")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    x = a.expert_imbalance
    if x is not None and not (math.isfinite(x) and x >= 1.0):
        ap.error(f"--expert-imbalance: must be a finite number >= 1.0, got {x:g}")
    if a.quick:
        a.traces_limit, a.duration, a.max_lanes = 3, "1m", 2
    bad = [x for x in a.models.split(",") if x not in MODELS] + [
        x for x in a.systems.split(",") if x not in SYSTEMS
    ]
    if not good_split(a.rack_split):
        ap.error(f"--rack-split: expected NpMd with N + M = 9 TP 8 engines (e.g. 6p3d), got {a.rack_split!r}")
    if bad:
        ap.error(f"unknown {', '.join(bad)}; models: {', '.join(MODELS)}; systems: {', '.join(SYSTEMS)}")
    print(f"# {a.traces} first {a.traces_limit} traces, --cycle --warm-start --duration {a.duration}")
    print(
        f"# tiers: default tps>={DEFAULT_TIER[0]:g}, ttft_p90<={DEFAULT_TIER[1]:g}s; relaxed tps>=5, ttft_p90<=30s"
    )
    print(
        "| model | system | mode | weights | GPUs sim'd | knee | agents/GPU | agents/MW | vs AA-AgentPerf "
        "| M tok/s per MW | tok/s/user p50 | TTFT p90 | traces (mean prompt) | CPU (points) |"
    )
    print("|---|---|---|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows(a):
        print(run_row(r, a), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
