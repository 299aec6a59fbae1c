"""Where a simulate run's memory goes: runs `agentkv simulate ARGS` under tracemalloc and prints the
top allocation sites (by file, then by line) while the cluster is still alive, and the max RSS.

Run: PYTHONPATH=. .venv/bin/python scripts/sim_memprof.py simulate TRACES [simulate flags...]
tracemalloc roughly quadruples RSS and doubles CPU: profile a short point, not a headline one.
"""

from __future__ import annotations

import resource
import sys
import tracemalloc


def _print_top(snap: tracemalloc.Snapshot, key: str, n: int = 18) -> None:
    stats = snap.statistics(key)
    print(f"== by {key}: total {sum(s.size for s in stats) / 2**20:.0f} MiB", file=sys.stderr)
    for s in stats[:n]:
        frame = s.traceback[0]
        where = frame.filename.split("agentkv/")[-1] + (f":{frame.lineno}" if key == "lineno" else "")
        print(f"{s.size / 2**20:8.1f} MiB {s.count:>10} {where}", file=sys.stderr)


def main() -> None:
    tracemalloc.start(1)
    import agentkv.sim.cluster as cluster
    from agentkv.cli import main as cli_main

    run = cluster.Cluster.run

    def profiled(self):
        res = run(self)
        snap = tracemalloc.take_snapshot()
        _print_top(snap, "filename")
        _print_top(snap, "lineno")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"max RSS {rss:.0f} MiB (with tracemalloc)", file=sys.stderr)
        return res

    cluster.Cluster.run = profiled
    sys.argv = ["agentkv", *sys.argv[1:]]
    sys.exit(cli_main())


if __name__ == "__main__":
    main()
