"""`agentkv route --processes N`: N real router processes share one loopback port (SO_REUSEPORT),
both serve, and they stop with their parent: SIGTERM to the parent ends every child and every
parser process by pid; a child killed from outside stops the rest and the parent's exit status
says so. Without --host the port is bound on 127.0.0.1 only."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from cluster import Cluster, descendants, get_text, metric_sum, post

pytestmark = pytest.mark.slow


def _listeners(port: int) -> list[tuple[str, int]]:
    """(local address in /proc/net/tcp's hex, socket inode) of every TCP socket listening on `port`."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        addr, p = f[1].split(":")
        if int(p, 16) == port and f[3] == "0A":  # 0A: LISTEN
            out.append((addr, int(f[9])))
    return out


def _socket_owners(pids: list[int]) -> dict[int, int]:
    """socket inode -> pid, for the sockets `pids` hold open."""
    owners = {}
    for pid in pids:
        with_fds = Path(f"/proc/{pid}/fd")
        for fd in with_fds.iterdir() if with_fds.exists() else ():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                owners[int(target[8:-1])] = pid
    return owners


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _alive(pids: list[int]) -> list[str]:
    """The command lines of those still running (for a failure message)."""
    out = []
    for p in pids:
        with_cmd = Path(f"/proc/{p}/cmdline")
        if with_cmd.exists() and _state(p) != "Z":
            out.append(f"{p} {_state(p)} " + with_cmd.read_bytes().replace(b"\0", b" ").decode()[:150])
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def _wait_serving(c: Cluster, j: int, parent, n: int, timeout: float = 60.0) -> list[int]:
    """The router processes (children of the parent that hold a listener on router port j), once all
    n do."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert parent.poll() is None, c.procs.output(f"router{j}")
        owners = _socket_owners(descendants(parent.pid))
        held = [owners[inode] for _, inode in _listeners(c.router_ports[j]) if inode in owners]
        if len(held) == n:
            return held
        time.sleep(0.2)
    raise TimeoutError(f"{n} router processes did not come up: {c.procs.output(f'router{j}')}")


def _start_two(c: Cluster, j: int):
    """`route --processes 2` on router port j (one parser process each): the parent and the two
    router processes, once both listen (the worker answers already: see `worker`)."""
    flags = ["--processes", "2", "--parse-processes", "1", "--health-interval", "0.5"]
    parent = c.start_router(flags, j=j, name=f"router{j}")
    return parent, _wait_serving(c, j, parent, 2)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """One `agentkv serve` worker, answering before any router starts (a router's first health
    check, 0.5 s in, would otherwise race a slow start, such as a cold numba cache's compile, take
    it out of rotation and answer 503 until its next check), and two router ports; every process
    stopped at the end."""
    with Cluster(tmp_path_factory.mktemp("processes"), 1, routers=2, events=False, replay=False) as c:
        c.start_workers(time_scale=100, log_level="error")
        c.wait_workers()
        yield c


def test_processes_share_the_port_on_loopback_and_stop_with_the_parent(worker):
    c = worker
    parent, routers = _start_two(c, 0)
    assert len(set(routers)) == 2  # two processes, each its own listener
    assert {addr for addr, _ in _listeners(c.router_ports[0])} == {"0100007F"}  # 127.0.0.1 only
    for k in range(24):  # a new connection each: the kernel spreads them over the two
        status, _ = post(c.router_url(0) + "/v1/completions", {"prompt": [1, 2, 3, k], "max_tokens": 1})
        assert status == 200
    time.sleep(1.5)  # each process leaves its /metrics page for the others every second
    page = get_text(c.router_url(0) + "/metrics")
    per = [metric_sum(page, f'agentkv_router_requests_total{{process="{k}"}}') for k in "01"]
    assert sum(per) == 24 and min(per) > 0, per  # one scrape shows both; both served (all on one: p = 2^-23)
    family = descendants(parent.pid)  # routers and their parser processes
    assert len(family) >= 2 + 2  # two routers, a parser process each
    os.kill(parent.pid, signal.SIGTERM)
    assert parent.wait(30) == 0, c.procs.output("router0")
    assert _gone(family, 10), _alive(family)


def test_a_child_that_dies_stops_the_others_and_fails_the_parent(worker):
    c = worker
    parent, routers = _start_two(c, 1)
    family = descendants(parent.pid)
    os.kill(routers[0], signal.SIGKILL)
    assert parent.wait(30) != 0
    assert "exited with -9; stopping the others" in c.procs.output("router1")
    assert _gone(family, 10), _alive(family)
    with pytest.raises(OSError):
        urllib.request.urlopen(c.router_url(1) + "/health", timeout=2)


def test_bad_processes_flags_are_one_line_errors(capsys):
    """Refused before any child starts: a taken port (even one a listener shares by SO_REUSEPORT),
    --port 0, and a count out of range."""
    import socket

    from agentkv.cli import main

    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        base = ["route", "--worker", "http://127.0.0.1:9"]
        for extra, said in (
            (
                ["--port", str(port), "--processes", "2"],
                f"cannot listen on 127.0.0.1:{port}: Address already in use",
            ),
            (["--port", "0", "--processes", "2"], "--processes over 1 needs a fixed --port"),
            (["--processes", "0"], "--processes must be 1 to 256, got 0"),
        ):
            assert main([*base, *extra]) == 2
            err = capsys.readouterr().err
            assert said in err and len(err.strip().splitlines()) == 1, err
    finally:
        taken.close()
