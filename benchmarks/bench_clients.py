"""Client capacity of `agentkv bench --clients N`: the same sessions against the instant server
(benchmarks/client_overhead.py's, each answer written at once so the client's cost sets the pace),
driven by one client process and then by N (bench/shards.py), alternating rounds.

Prints output tokens/s over the run's span (first due -> last end, so process start-up is left
out), client CPU seconds (driver and shards, their start-up included), the ratio to one client,
and the host's load average:
a ratio near N needs N free cores beside the server's.

    .venv/bin/python benchmarks/bench_clients.py [--streams 400] [--turns 4] [--tokens 200]
        [--clients 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from client_overhead import _traces, start_server  # noqa: E402
from proccpu import cpu_seconds  # noqa: E402


def _cpu() -> float:
    """CPU seconds of this process and its joined children (the shards)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def run(url: str, clients: int, a: argparse.Namespace) -> dict:
    """One run with `clients` processes (1: the ordinary in-process BenchRun)."""
    from agentkv.bench.live import run_loop
    from agentkv.bench.runner import BenchConfig, BenchRun
    from agentkv.bench.shards import ShardedRun

    cfg = BenchConfig(
        target=url, lanes=a.streams, duration=None, idle_gap_cap=None, monitor_gpu=False, sample_every=1.0
    )
    traces = _traces(a.streams, a.turns, a.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        r = ShardedRun(cfg, traces, clients, out=out) if clients > 1 else BenchRun(cfg, traces, out=out)
        c0, t0 = _cpu(), time.perf_counter()
        res = run_loop(r.run(), "auto")
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
    s = res.summary
    return {
        "tok_s": s.output_tokens / s.duration_s,
        "tokens": s.output_tokens,
        "requests": s.requests,
        "failed": s.failed,
        "span": s.duration_s,
        "wall": wall,
        "cpu": cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=400, help="concurrent session trees (lanes)")
    ap.add_argument("--turns", type=int, default=4, help="requests per session")
    ap.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    ap.add_argument("--clients", type=int, default=2, help="client processes to compare with one")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of 1 and N clients")
    a = ap.parse_args()
    srv, port = start_server(None, burst=True)
    url = f"http://127.0.0.1:{port}"
    print(
        f"instant server (burst), {a.streams} sessions x {a.turns} requests x {a.tokens} tokens; "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} before"
    )
    best: dict[int, float] = {}
    try:
        for _ in range(a.rounds):
            for n in (1, a.clients):
                s0 = cpu_seconds(srv.pid)
                r = run(url, n, a)
                best[n] = max(best.get(n, 0.0), r["tok_s"])
                print(
                    f"--clients {n}: {r['tok_s']:,.0f} output tokens/s over {r['span']:.2f} s "
                    f"({r['tokens']:,} tokens, {r['requests']:,} requests, {r['failed']} failed; "
                    f"{r['wall']:.1f} s with start-up), clients {r['cpu']:.2f} CPU s (start-up included), server "
                    f"{(cpu_seconds(srv.pid) - s0) / r['span']:.2f} cores, load average {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    finally:
        srv.terminate()
        srv.join(5)
    print(f"best --clients {a.clients} / best --clients 1: {best[a.clients] / best[1]:.2f}x")


if __name__ == "__main__":
    main()
