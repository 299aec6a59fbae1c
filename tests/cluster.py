"""Real `agentkv serve` workers and `agentkv route` routers as subprocesses on free loopback ports:
started, waited for on /health, their output captured to one log file each, stopped by pid.

The one home of this scaffolding for the integration, security and fault tests, and for
benchmarks/router.py and benchmarks/routing_quality.py (which put tests/ on sys.path), so it
needs nothing beyond the standard library.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path

CLI = [sys.executable, "-m", "agentkv.cli"]
HOST = "127.0.0.1"
ADMIN_KEY = "admin-key"  # every keys file write_keys makes opens the router's /metrics to this key


def free_ports(n: int) -> list[int]:
    """`n` distinct free TCP ports on 127.0.0.1."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_range(n: int) -> int:
    """A base port p with p .. p + n - 1 all free on every interface (serve binds its ZMQ events on `*`),
    as `serve --workers` needs; drawn below the usual ephemeral range, where no client socket lands."""
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(20000, 32768 - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports")


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200 (the machine may be busy: start-up takes seconds); fail early
    when `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before {url} came up")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up")


def _signal(p: subprocess.Popen, sig: int, group: bool) -> None:
    if p.poll() is None:  # never signal a pid already reaped (it may belong to another process now)
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if group else os.kill)(p.pid, sig)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children, theirs, ...), from /proc (ppid: field 4 of stat)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def stop_processes(procs: Iterable[subprocess.Popen], grace: float = 15.0, *, group: bool = False) -> None:
    """SIGTERM each by pid (after a SIGCONT, so a stalled one can act on it), wait up to `grace` seconds
    for all, then SIGKILL what is left. `group`: signal each one's process group (it leads its session)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal(p, signal.SIGCONT, group)
        _signal(p, signal.SIGTERM, group)
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL, group)
            p.wait(5)


def stop_process(p: subprocess.Popen, grace: float = 15.0, *, group: bool = False) -> int:
    """`stop_processes` for one; its exit status (negative: the signal that ended it)."""
    stop_processes([p], grace, group=group)
    return p.wait()


class Procs:
    """Subprocesses of one test or benchmark run, each logging stdout and stderr to `logs/<prefix><name>.log`
    (a restart under the same name appends); `stop_all` ends them all by pid.

    `new_session`: each leads its own session, out of reach of the terminal's Ctrl-C, and is stopped
    with its whole process group.
    """

    def __init__(self, logs: Path, *, prefix: str = "", new_session: bool = False) -> None:
        self.logs, self.prefix, self.new_session = Path(logs), prefix, new_session
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self._started: set[str] = set()

    def log_path(self, name: str) -> Path:
        return self.logs / f"{self.prefix}{name}.log"

    def start(
        self, name: str, args: Sequence[str], *, env: dict | None = None, exe: Sequence[str] = CLI
    ) -> subprocess.Popen:
        """Run `exe + args` (by default an agentkv sub-command) under `name`."""
        with self.log_path(name).open("a" if name in self._started else "w") as log:
            p = subprocess.Popen(
                [*exe, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=self.new_session,
            )
        self._started.add(name)
        self.procs[name] = p
        return p

    def output(self, name: str) -> str:
        """Everything the named process wrote so far (stdout and stderr)."""
        path = self.log_path(name)
        return path.read_text("utf-8", "replace") if path.exists() else ""

    def stop(self, name: str, grace: float = 15.0) -> int:
        return stop_process(self.procs[name], grace, group=self.new_session)

    def stop_all(self, grace: float = 15.0) -> None:
        stop_processes(self.procs.values(), grace, group=self.new_session)


def serve_args(
    port: int,
    *,
    time_scale: float = 1.0,
    events: int | None = None,
    replay: int | None = None,
    workers: int | None = None,
    log_level: str = "warning",
    extra: Sequence[str] = (),
) -> list[str]:
    """`agentkv serve` arguments; events and replay bind on `*` (ports go up by one per worker)."""
    args = ["serve", "--port", str(port), "--time-scale", str(time_scale), "--log-level", log_level]
    if workers is not None:
        args += ["--workers", str(workers)]
    if events is not None:
        args += ["--kv-events-endpoint", f"tcp://*:{events}"]
    if replay is not None:
        args += ["--kv-events-replay-endpoint", f"tcp://*:{replay}"]
    return [*args, *extra]


class Cluster:
    """N `agentkv serve` workers on loopback and routers in front of them; every port drawn up front.

    Worker i serves HTTP on `http[i]`, publishes KV events on `events[i]` and replays them on
    `replay[i]`. `one_process`: the workers are one `serve --workers N` (consecutive ports), named
    "serve"; otherwise one process each, "worker<i>", so a test can kill and restart one.
    `spare` ports are left for the caller (a relay, say). `with Cluster(...) as c:` stops them all.
    """

    def __init__(
        self,
        logs: Path,
        workers: int,
        *,
        routers: int = 1,
        events: bool = True,
        replay: bool = True,
        spare: int = 0,
        one_process: bool = False,
        prefix: str = "",
        new_session: bool = False,
    ) -> None:
        n, k = workers, workers * (1 + events + replay)
        total = k + routers + spare
        ports = list(range(b := free_port_range(total), b + total)) if one_process else free_ports(total)
        self.n, self.one_process = n, one_process
        self.http = ports[:n]
        self.events = ports[n : 2 * n] if events else []
        self.replay = ports[k - n : k] if replay else []
        self.router_ports, self.spare = ports[k : k + routers], ports[k + routers :]
        self.procs = Procs(logs, prefix=prefix, new_session=new_session)
        self._routers: list[tuple[str, int]] = []

    def worker_url(self, i: int) -> str:
        return f"http://{HOST}:{self.http[i]}"

    @property
    def urls(self) -> list[str]:
        return [self.worker_url(i) for i in range(self.n)]

    def router_url(self, j: int = 0) -> str:
        return f"http://{HOST}:{self.router_ports[j]}"

    def worker(self, i: int) -> subprocess.Popen:
        return self.procs.procs["serve" if self.one_process else f"worker{i}"]

    def start_worker(self, i: int, **serve) -> subprocess.Popen:
        """(Re)start worker i (not with `one_process`); `serve`: `serve_args` keywords."""
        return self.procs.start(
            f"worker{i}",
            serve_args(
                self.http[i],
                events=self.events[i] if self.events else None,
                replay=self.replay[i] if self.replay else None,
                **serve,
            ),
        )

    def start_workers(self, **serve) -> None:
        if self.one_process:
            self.procs.start(
                "serve",
                serve_args(
                    self.http[0],
                    workers=self.n,
                    events=self.events[0] if self.events else None,
                    replay=self.replay[0] if self.replay else None,
                    **serve,
                ),
            )
        else:
            for i in range(self.n):
                self.start_worker(i, **serve)

    def worker_flags(self, events: Sequence[str] | None = None) -> list[str]:
        """The router's `--worker URL[=EVENTS[,REPLAY]]` flags; `events` overrides the event endpoints."""
        if events is None and self.events:
            events = [f"tcp://{HOST}:{p}" for p in self.events]
        flags = []
        for i in range(self.n):
            spec = self.worker_url(i)
            if events:
                spec += f"={events[i]}" + (f",tcp://{HOST}:{self.replay[i]}" if self.replay else "")
            flags += ["--worker", spec]
        return flags

    def start_router(
        self,
        extra: Sequence[str] = (),
        *,
        j: int = 0,
        name: str = "router",
        events: Sequence[str] | None = None,
        exe: Sequence[str] = CLI,
    ) -> subprocess.Popen:
        """`agentkv route` on router port j in front of every worker, with the flags in `extra`."""
        self._routers.append((name, j))
        return self.procs.start(
            name, ["route", "--port", str(self.router_ports[j]), *self.worker_flags(events), *extra], exe=exe
        )

    def wait_workers(self, timeout: float = 60.0) -> None:
        for i in range(self.n):
            wait_http(self.worker_url(i) + "/health", timeout, self.worker(i))

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Every worker's /health, then every started router's."""
        self.wait_workers(timeout)
        for name, j in self._routers:
            wait_http(self.router_url(j) + "/health", timeout, self.procs.procs[name])

    def wait_taken_in(self, j: int = 0, timeout: float = 20.0) -> None:
        """Until router j counts every worker up (`agentkv_router_worker_up`), that is in rotation."""
        deadline = time.monotonic() + timeout
        while (
            up := metric_sum(get_text(self.router_url(j) + "/metrics"), "agentkv_router_worker_up")
        ) < self.n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router took {up:g} of {self.n} workers in")
            time.sleep(0.1)

    def close(self) -> None:
        self.procs.stop_all()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_keys(tmp: Path, keys: dict[str, str]) -> Path:
    """An `--api-keys` file: {key: tenant}, plus ADMIN_KEY as the admin (`@admin`)."""
    path = tmp / "keys.json"
    path.write_text(json.dumps({**keys, ADMIN_KEY: "@admin"}))
    return path


def tenant_flags(
    tmp: Path,
    keys: dict[str, str],
    *extra: str,
    secret: Sequence[str] = ("--router-secret", "s"),
    log_level: str = "warning",
) -> list[str]:
    """`agentkv route` flags for a router with tenants: an --api-keys file of `keys` (and the admin),
    a shared secret, the builtin tokenizer, a log level, then `extra`."""
    return [
        "--api-keys",
        str(write_keys(tmp, keys)),
        *secret,
        "--tokenizer",
        "builtin",
        "--log-level",
        log_level,
        *extra,
    ]


def post(url: str, body: dict | bytes, key: str | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
    """(status, body) of a POST; HTTP errors are returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get_text(url: str, timeout: float = 10.0, key: str | None = ADMIN_KEY) -> str:
    """GET `url` as text, with `key` as the bearer (by default the admin key: routers with --api-keys
    serve /metrics and /debug/index to it alone; other servers ignore it)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return r.read().decode()


def get_json(url: str, timeout: float = 10.0):
    return json.loads(get_text(url, timeout))


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_sum(text: str, name: str) -> float:
    """Sum of a Prometheus series; `name` may carry labels to match, e.g. `x{worker="0"`, in any
    order (an exposition writes them in its own order: prometheus_client sorts them)."""
    base, _, sel = name.partition("{")
    want = set(_LABEL.findall(sel))
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        metric, _, labels = head.partition("{")
        if metric == base and want <= set(_LABEL.findall(labels)):
            total += float(value)
    return total
