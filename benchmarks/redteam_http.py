"""The red team's gzip bomb, measured: one tenant sends parallel gzip bodies (text that inflates a
thousandfold: 30 MB prompts and 100 MB bombs) while another tenant's small requests and /health
are timed, through `agentkv route` and straight at `agentkv serve`. Prints each phase's victim
latency (idle baseline, then under attack), the attack's answers, and every process's resident
memory (with its parse processes) at start, peak and end.

The processes run whatever `agentkv` is on PYTHONPATH, so the same script measures an older tree:
PYTHONPATH=../main .venv/bin/python benchmarks/redteam_http.py  (then without, for this one).

Run: .venv/bin/python benchmarks/redteam_http.py [--seconds 8] [--parallel 4] [--text-mb 30]
     [--target router] [--max-parses-per-tenant 1]   (also prints each door's CPU and the load average)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # cluster.py, redteam.py
from cluster import Cluster, descendants, tenant_flags
from redteam import bomb_under_load, gzip_text_body

KEYS = {"key-attacker": "attacker", "key-victim": "victim"}
VICTIM = {"prompt": list(range(1000, 1064)), "max_tokens": 2}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) `pid` has used, all its threads, not its children (0 once gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_split(pid: int) -> tuple[float, float]:
    """(CPU s of `pid` itself, of its live descendants: the parse processes)."""
    return cpu_s(pid), sum(cpu_s(c) for c in descendants(pid))


def report(name: str, run, cpu: list[float]) -> None:
    """Print one door's figures: victim latency per phase, the attack's answers, CPU and memory."""
    print(f"\n{name}:")
    print(f"  idle:   {run.idle.line()}")
    print(f"  attack: {run.attack.line()}")
    print(
        f"  attack answers: {dict(run.attack.attack_status)} of {run.attack.attack_sent} sent; "
        f"victim statuses {dict(run.attack.victim_status)}"
    )
    print(
        f"  CPU (both phases): the door's process {cpu[0]:.2f} s (event loop and its threads), "
        f"its parse processes {cpu[1]:.2f} s; load average {os.getloadavg()[0]:.1f}"
    )
    for k, (a, peak, end) in run.rss.items():
        print(f"  RSS {k}: {a:.0f} MiB at start, {peak:.0f} MiB peak, {end:.0f} MiB at the end")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each phase (idle, attack)")
    ap.add_argument("--parallel", type=int, default=4, help="attacker connections")
    ap.add_argument("--text-mb", type=float, default=30.0, help="inflated prompt text per body")
    ap.add_argument("--bomb-mb", type=float, default=100.0, help="inflated size of the larger bomb")
    ap.add_argument(
        "--target", choices=("both", "router", "serve"), default="both", help="measure through which door"
    )
    ap.add_argument("--max-parses-per-tenant", type=int, default=2, help="the router's flag (default 2)")
    args = ap.parse_args()
    bombs = [gzip_text_body(args.text_mb), gzip_text_body(args.bomb_mb)]
    print(
        f"bodies: {len(bombs[0]) / 1e3:.0f} KB -> {args.text_mb:g} MB, {len(bombs[1]) / 1e3:.0f} KB -> "
        f"{args.bomb_mb:g} MB of text; {args.parallel} attacker connections, {args.seconds:g} s a phase"
    )
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp), 1, replay=False) as c:
        c.start_workers(time_scale=100, extra=("--max-model-len", "8192"))
        c.start_router(
            tenant_flags(Path(tmp), KEYS, "--max-parses-per-tenant", str(args.max_parses_per_tenant))
        )
        c.wait_ready()
        pids = {"router": c.procs.procs["router"].pid, "serve": c.worker(0).pid}
        for name, url, keys in (
            ("through the router", c.router_url(), ("key-attacker", "key-victim")),
            ("straight at serve", c.worker_url(0), (None, None)),
        ):
            if args.target != "both" and not name.endswith(args.target):
                continue
            door = pids["router" if name.endswith("router") else "serve"]
            cpu0 = cpu_split(door)
            run = asyncio.run(
                bomb_under_load(
                    url,
                    VICTIM,
                    bombs,
                    pids,
                    seconds=args.seconds,
                    parallel=args.parallel,
                    attacker_key=keys[0],
                    victim_key=keys[1],
                )
            )
            report(name, run, [b - a for a, b in zip(cpu0, cpu_split(door), strict=True)])


if __name__ == "__main__":
    main()
