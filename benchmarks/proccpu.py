"""CPU time and syscall counts of a router process, for benchmarks/router.py: by process tree, by
thread (/proc), and syscalls and context switches per request by thread (`perf stat`)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

# the syscalls --syscalls counts (perf's tracepoints; the rest are summed as "other")
SYSCALLS = (
    "epoll_wait",
    "epoll_pwait",
    "epoll_ctl",
    "read",
    "write",
    "recvfrom",
    "sendto",
    "readv",
    "writev",
    "recvmsg",
    "sendmsg",
    "futex",
    "getpid",
    "poll",
    "ppoll",
    "ioctl",
    "timerfd_settime",
    "nanosleep",
)


def cpu_seconds(pid: int, stat: str = "") -> float:
    """User + system CPU time of a process (or of a thread, given its /proc stat path) so far."""
    fields = Path(stat or f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> Counter[str]:
    """CPU time of one router process by thread kind: its event loop (the main thread), ZMQ's own
    I/O threads, and the other threads (the KV-event poller, asyncio's to_thread pool)."""
    out: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            kind = "loop" if task.name == str(pid) else "zmq" if comm.startswith("ZMQbg") else "other"
            out[kind] += cpu_seconds(pid, str(task / "stat"))
        except (OSError, IndexError, ValueError):
            continue
    return out


def tree_cpu_seconds(pid: int) -> float:
    """`cpu_seconds` of `pid` and its live descendants (`--processes` children, parser processes)."""
    from cluster import descendants  # tests/cluster.py (benchmarks/router.py puts tests/ on sys.path)

    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            total += cpu_seconds(p)
        except (OSError, IndexError, ValueError):
            continue
    return total


class SyscallCount:
    """`perf stat` on one process's threads over a run (tracepoints: counts, not samples, so the
    figures do not depend on the load): syscalls and context switches per request, by thread kind."""

    def __init__(self, pid: int, names: dict[int, str] | None = None) -> None:
        """`names`: a kind for some thread ids (the rest: loop, zmq or their comm)."""
        events = [
            "raw_syscalls:sys_enter",
            "context-switches",
            *(f"syscalls:sys_enter_{n}" for n in SYSCALLS),
        ]
        cmd = ["perf", "stat", "-x,", "--per-thread", "-e", ",".join(events), "-p", str(pid)]
        self.pid, self.names = pid, {str(t): k for t, k in (names or {}).items()}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def report(self, n: int, unit: str = "request") -> None:
        """Stop counting and print the counts per `unit` (`n` of them: requests answered)."""
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=30)
        by: dict[str, Counter[str]] = {}
        for line in err.splitlines():
            f = line.split(",")
            if len(f) < 4 or not f[1].isdigit():
                continue
            comm, _, tid = f[0].rpartition("-")
            kind = self.names.get(tid) or (
                "loop" if tid == str(self.pid) else "zmq" if comm.startswith("ZMQbg") else comm or "other"
            )
            by.setdefault(kind, Counter())[f[3].removeprefix("syscalls:sys_enter_")] += int(f[1])
        if not by:
            print(f"  syscalls: perf stat gave nothing ({err.strip()[:200]})")
            return
        n = max(1, n)
        for kind, c in sorted(by.items(), key=lambda kv: -kv[1]["raw_syscalls:sys_enter"]):
            total = c.pop("raw_syscalls:sys_enter", 0)
            if total < n // 100:
                continue
            cs = c.pop("context-switches", 0)
            top = ", ".join(f"{k} {v / n:.2f}" for k, v in c.most_common() if v >= n // 100)
            print(f"  syscalls per {unit}, {kind}: {total / n:.2f} ({top}); context switches {cs / n:.2f}")
