"""Coefficient recovery: `agentkv calibrate` against `agentkv serve` started with known coefficients.

Run: .venv/bin/python benchmarks/calib_recovery.py [--gpu h100 --model qwen2.5-7b --time-scale 1]
     [--budget 60s] [--runs 3] [--keep DIR] [--predict] [--clock engine]
     (or --profiles P.json ... [--refit])

Each run starts serve (a subprocess) with the coefficients below, calibrates it (a subprocess),
and prints each fitted coefficient against the truth with its standard error, the fit's MAPE per
family, and per probe the measured time, the engine time of the model serve ran (`true`), what
the host added (measured - true: HTTP, parsing, the event loop) and the fitted model's time.
With --predict each run then benches the six trimmed Claude Code sessions of tests/test_predict.py
against the same serve and predicts that run with the fitted profile and with the true coefficients
(serve -> calibrate -> bench -> predict, the issue's "predicts its bench" chain).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path

from agentkv.calib import fit as F
from agentkv.calib.identify import fit_all
from agentkv.calib.plan import Probe
from agentkv.engine.cost import CostCoefficients, load_coefficients

CLI = [sys.executable, "-m", "agentkv.cli"]
# unlike the bundled H200 fit, as tests/test_calibrate.py starts serve
TRUTH = dict(gemm_eff=0.7, overlap_k=1.6, attn_self_eff=0.6, attn_past_eff=0.3, stream_gbps=80.0)
TRUTH |= dict(past_setup_s=50e-6, launch_floor_s=60e-6, floor_k=2.5)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not answer in {timeout:.0f} s")


def calibrate_once(args: argparse.Namespace, tmp: Path, i: int) -> dict:
    """Start serve with TRUTH, calibrate it into tmp/profile-<i>.json, stop serve; the profile."""
    truth = tmp / "true.json"
    truth.write_text(json.dumps({"name": "true", "coefficients": true_coeffs().to_dict()}))
    port = _port()
    shape = ["--gpu", args.gpu, "--model", args.model, "-tp", str(args.tp)]
    serve = [*CLI, "serve", "--port", str(port), "--time-scale", str(args.time_scale), *shape]
    with open(tmp / f"serve-{i}.log", "w") as log:
        proc = subprocess.Popen([*serve, "--profile", str(truth)], stdout=log, stderr=subprocess.STDOUT)
    out = tmp / f"profile-{i}.json"
    try:
        _wait(f"http://127.0.0.1:{port}/health", proc)
        t0 = time.monotonic()
        cmd = [*CLI, "calibrate", "--target", f"http://127.0.0.1:{port}", "--out", str(out), "-q"]
        cmd += ["--budget", args.budget, "--repeats", str(args.repeats), "--clock", args.clock]
        res = subprocess.run(cmd, text=True)
        took = time.monotonic() - t0
        print(f"run {i}: calibrate exit {res.returncode} in {took:.0f} s, load {_load()}")
        if args.predict:
            bench_predict(f"http://127.0.0.1:{port}", tmp, i, out)
    finally:
        proc.terminate()
        proc.wait(15)
    return json.loads(out.read_text())


def _traces(tmp: Path) -> Path:
    """tests/test_predict.py's workload: six Claude Code sessions, 10 turns, lengths / 8, think <= 1 s."""
    from agentkv.trace.formats import load_paths
    from agentkv.trace.formats.agentx import write_agentx
    from tests.conftest import CLAUDE_TRACES
    from tests.test_predict import SOURCES, trimmed  # the test's workload, not a copy of it

    folder = tmp / "traces"
    folder.mkdir(exist_ok=True)
    for n in SOURCES:
        write_agentx(trimmed(load_paths([CLAUDE_TRACES / f"{n}.json.gz"])[0]), folder / f"{n}.json")
    return folder


def bench_predict(url: str, tmp: Path, i: int, profile: Path) -> None:
    """Bench the test's workload on 6 lanes against serve at `url`, then predict the run with the
    fitted `profile` and with the true coefficients; print MAPE (bias) per figure, throughput, hit rate."""
    traces, run = _traces(tmp), tmp / f"run-{i}"
    bench = [*CLI, "bench", str(traces), "--target", url, "--lanes", "6", "--duration", "none"]
    n0, s0, c0 = _wakes(url)
    res = subprocess.run([*bench, "--out", str(run), "-q", "--no-report", "--json"], capture_output=True)
    if res.returncode:
        raise SystemExit(f"bench failed: {res.stderr.decode()[-500:]}")
    n1, s1, c1 = _wakes(url)
    wake = f"{(s1 - s0) / (n1 - n0) * 1e3:.2f} ms, mean of {n1 - n0:.0f}" if n1 > n0 else "no idle wake-up"
    print(
        f"run {i}: bench load {_load()}; serve's loop woke {wake} after an idle engine's first arrival; "
        f"catch-up {(c1 - c0) * 1e3:.1f} ms"
    )
    prof = json.loads(profile.read_text())
    true = tmp / f"true-profile-{i}.json"
    true.write_text(json.dumps(prof | {"coefficients": true_coeffs().to_dict()}))
    for name, pf in (("fitted", profile), ("true", true)):
        out = tmp / f"pred-{i}-{name}"
        cmd = [*CLI, "predict", str(run), "--profile", str(pf), "--traces", str(traces), "--out", str(out)]
        if subprocess.run(cmd, capture_output=True).returncode:
            raise SystemExit(f"predict failed on {run}")
        doc = json.loads((out / "prediction.json").read_text())
        o, thr, hit = doc["overall"], doc["throughput"]["diff_pct"], doc["hit_rate"]["diff_points"]
        figs = ", ".join(
            f"{f} {o[f]['mape_pct']:.1f}% ({o[f]['bias_pct']:+.1f}%)" for f in ("ttft", "tpot", "e2e")
        )
        print(
            f"run {i} predict ({name} coefficients): {figs}; throughput {thr:+.2f}%, hit rate {hit:+.2f} points"
        )
        print(f"  TTFT |error| by arrival: {ttft_split(run, out)}")


def _wakes(url: str) -> tuple[float, float, float]:
    """serve's /metrics so far: idle wake-ups, the wall seconds summed from an idle engine's first
    arrival to its loop waking, and the engine seconds skipped catching up (idle time predict lacks)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    names = ("engine_wake_seconds_count", "engine_wake_seconds_sum", "engine_catchup_seconds_total")
    return tuple(got.get(f"agentkv:{k}", 0.0) for k in names)


def ttft_split(run: Path, pred: Path) -> str:
    """Which requests carry the TTFT error: those reaching an idle engine (first of a burst: another
    arrived before its first token) and those reaching a busy one; each group's count, how many are
    off by over 1%, and its share of the summed |error|."""
    recs = {r["id"]: r for r in map(json.loads, (run / "requests.jsonl").open())}
    rows = [json.loads(x) for x in (pred / "predictions.jsonl").open()]
    arrived = [recs[x["id"]]["engine_arrival"] for x in rows]
    err, busy_until, total = {}, float("-inf"), 0.0
    for x in sorted(rows, key=lambda x: recs[x["id"]]["engine_arrival"]):
        a = recs[x["id"]]["engine_arrival"]
        burst = any(0 < b - a < x["ttft"] for b in arrived)
        kind = "busy" if a < busy_until else "idle, first of a burst" if burst else "idle, alone"
        busy_until = max(busy_until, a + x["e2e"])
        e = abs(x["ttft_pred"] / x["ttft"] - 1)
        err.setdefault(kind, []).append(e)
        total += e
    return "; ".join(
        f"{k} {len(v)} ({sum(e > 0.01 for e in v)} off >1%, {100 * sum(v) / max(total, 1e-12):.0f}% of it)"
        for k, v in sorted(err.items())
    )


def true_coeffs() -> CostCoefficients:
    return replace(load_coefficients(), **TRUTH)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def report(doc: dict) -> dict[str, float]:
    """Print one profile's recovery and per-probe table; the coefficients' signed errors (%)."""
    fitted = CostCoefficients(**doc["coefficients"])
    se, unpinned = doc["fit"]["stderr_pct"], doc["fit"].get("not_identifiable", {})
    errs = {}
    print(f"{'coefficient':16s} {'true':>10s} {'fitted':>10s} {'error':>8s} {'stderr%':>8s}")
    for name, v in TRUTH.items():
        got = getattr(fitted, name)
        errs[name] = (got / v - 1) * 100
        s = "-" if se.get(name) is None else f"{se[name]:.1f}"
        flag = "  not identifiable" if name in unpinned else ""
        print(f"{name:16s} {v:10.4g} {got:10.4g} {errs[name]:+7.1f}% {s:>8s}{flag}")
    for name, why in unpinned.items():
        print(f"  {name}: {why}")
    for label, why in doc.get("skipped_probes", {}).items():
        print(f"  skipped {label}: {why}")
    ov = doc["fit"]["overhead"]
    print(
        f"overhead: {ov['request_s'] * 1e3:.2f} ms per request, {ov['prompt_token_s'] * 1e6:.3f} us per token"
    )
    print("fit MAPE %:", ", ".join(f"{k} {v:.1f}" for k, v in doc["fit"]["mape_pct"].items()))
    low = doc["fit"].get("weights", {})
    print(f"weighed less ({len(low)}):", ", ".join(f"{k} {v:.2f}" for k, v in low.items()) or "none")
    t = F.Target(**doc["modelled_as"])
    true_cm, fit_cm = t.cost(true_coeffs()), t.cost(fitted)
    oh = (ov["request_s"], ov["prompt_token_s"])
    print(f"{'probe':44s} {'measured':>9s} {'true':>9s} {'host':>8s} {'fitted':>9s}  (ms)")
    off: dict[str, list[float]] = {}  # the fitted engine against the true one, no overheads
    for p in [Probe(**x) for x in doc["probes"]]:
        m, tr = p.measured_s * 1e3, F.predict(true_cm, t, p) * 1e3
        print(f"{p.label():44s} {m:9.2f} {tr:9.2f} {m - tr:+8.2f} {F.predict(fit_cm, t, p, oh) * 1e3:9.2f}")
        off.setdefault(p.family, []).append(abs(F.predict(fit_cm, t, p) * 1e3 / tr - 1) * 100)
    print(
        "fitted vs true engine, mean |error| %:",
        ", ".join(f"{k} {sum(v) / len(v):.1f}" for k, v in off.items()),
    )
    return errs


def refit(doc: dict) -> dict:
    """`doc` with its probes measured and fitted again by this tree's code (the least or median of
    the stored samples, fit, identifiability), to compare fits without re-running serve."""
    t = F.Target(**doc["modelled_as"])
    probes = [Probe(**x) for x in doc["probes"]]
    for p in probes:
        p.settle()
    f = fit_all(t, probes, engine_clock=doc.get("clock") == "engine")
    ov = {"request_s": f.overhead[0], "prompt_token_s": f.overhead[1]}
    fit = {"overhead": ov, "mape_pct": F.errors(t, probes, f.coeffs, f.overhead)}
    fit |= {"stderr_pct": f.stderr_pct, "not_identifiable": f.not_identifiable, "weights": F.weights(probes)}
    return doc | {"coefficients": f.coeffs.to_dict(), "probes": [asdict(p) for p in probes], "fit": fit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--budget", default="60s")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--clock", default="client", choices=("client", "engine"), help="calibrate's --clock")
    ap.add_argument(
        "--keep", default=None, help="folder for the profiles and serve logs (default: a temp one)"
    )
    ap.add_argument("--profiles", nargs="*", default=None, help="report these profiles instead of running")
    ap.add_argument("--refit", action="store_true", help="with --profiles: fit their probes again first")
    ap.add_argument("--predict", action="store_true", help="bench and predict each calibrated serve")
    args = ap.parse_args()
    docs = [json.loads(Path(p).read_text()) for p in args.profiles] if args.profiles else []
    docs = [refit(d) for d in docs] if args.refit else docs
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="calib-recovery-"))
    tmp.mkdir(parents=True, exist_ok=True)
    for i in range(0 if docs else args.runs):
        docs.append(calibrate_once(args, tmp, i))
    all_errs = [report(d) for d in docs]
    if len(all_errs) > 1:
        print("signed error % per run:")
        for name in TRUTH:
            print(f"{name:16s} " + " ".join(f"{e[name]:+7.1f}" for e in all_errs))
    print(f"profiles in {tmp}")


if __name__ == "__main__":
    main()
