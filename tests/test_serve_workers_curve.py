"""`agentkv serve --workers N` with a folder of CURVE key pairs: each worker publishes under its own
key (real processes, real ZMQ), so a router pinning worker I's key hears worker I and no other."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from cluster import Procs, free_port_range, post, wait_http

from agentkv.cli import main
from agentkv.events.curve import CurveClient, load_keypair, load_public_key
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import BlockStored


def _keys(folder: Path, *names: str) -> None:
    for name in names:
        assert main(["security", "keys", "--out", str(folder), "--name", name]) == 0


def _serve(http: int, events: int, keys: Path, allow: Path) -> list[str]:
    return [
        "serve", "--workers", "2", "--port", str(http), "--time-scale", "100", "--max-model-len", "4096",
        "--kv-events-endpoint", f"tcp://*:{events}",
        "--kv-events-curve-secret-key", str(keys), "--kv-events-curve-allow", str(allow),
    ]  # fmt: skip


def _stored(sub: ZmqEventSubscriber, url: str, seed: int) -> int:
    """BlockStored events `sub` receives while `url` serves one 512-token prompt."""
    prompt = [(seed * 7919 + i * 104729) % 30000 + 1000 for i in range(512)]
    status, body = post(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 200, body
    return sum(isinstance(e, BlockStored) for r in sub.recv_batches(3.0) for e in r.batch.events)


@pytest.mark.slow
def test_each_worker_publishes_under_its_own_key(tmp_path, capsys):
    _keys(tmp_path / "workers", "worker-0", "worker-1")
    _keys(tmp_path / "routers", "router")
    capsys.readouterr()
    router = load_keypair(tmp_path / "routers" / "router.key_secret", "x")
    pinned = [load_public_key(tmp_path / "workers" / f"worker-{i}.key", "x") for i in range(2)]
    base = free_port_range(4)  # HTTP base, base + 1; events base + 2, base + 3
    procs = Procs(tmp_path / "logs")
    subs: list[ZmqEventSubscriber] = []
    try:
        proc = procs.start("serve", _serve(base, base + 2, tmp_path / "workers", tmp_path / "routers"))
        urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
        for url in urls:
            wait_http(f"{url}/health", 90, proc)
        ep = [f"tcp://127.0.0.1:{base + 2 + i}" for i in range(2)]
        # the router's subscriber: each worker pinned to its own key, and worker 1 pinned to worker 0's
        subs = [ZmqEventSubscriber(ep[i], curve=CurveClient(*router, pinned[i])) for i in range(2)]
        subs.append(ZmqEventSubscriber(ep[1], curve=CurveClient(*router, pinned[0])))
        time.sleep(1.0)  # subscriptions settle
        got = [_stored(subs[0], urls[0], 0), _stored(subs[1], urls[1], 1)]
        impostor = sum(len(r.batch.events) for r in subs[2].recv_batches(1.0))
        handshake_failures = subs[2].stats.handshake_failures
        ready = procs.output("serve")
    finally:
        for s in subs:
            s.close()
        procs.stop_all()
    print(f"\nBlockStored per worker {got}; worker 1 pinned to worker 0's key: {impostor} events")
    keys = dict(re.findall(r"worker (\d): .*curve-public-key=(\S+)", ready))
    assert keys == {str(i): pinned[i].decode() for i in range(2)}, ready
    assert all(n > 0 for n in got) and impostor == 0 and handshake_failures > 0
    assert "share one CURVE key" not in ready


def test_a_folder_without_a_pair_for_every_worker_is_one_line(tmp_path, capsys):
    _keys(tmp_path / "workers", "worker-0")
    _keys(tmp_path / "routers", "router")
    flags = ["serve", "--workers", "2", "--port", "1", "--kv-events-endpoint", "tcp://*:5557"]
    flags += ["--kv-events-curve-secret-key", str(tmp_path / "workers")]
    flags += ["--kv-events-curve-allow", str(tmp_path / "routers")]
    capsys.readouterr()
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no worker-1.key_secret for worker 1" in err, err
    pair = tmp_path / "workers" / "worker-0.key_secret"
    (tmp_path / "workers" / "worker-1.key_secret").write_bytes(pair.read_bytes())
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the same key pair" in err, err


def test_one_file_for_every_worker_still_works_and_warns(tmp_path, caplog):
    from agentkv.cli import build_parser
    from agentkv.serve.command import _curve_from_args, options_from_args
    from agentkv.serve.launch import worker_options

    _keys(tmp_path / "workers", "worker-0")
    _keys(tmp_path / "routers", "router")
    args = build_parser().parse_args(
        ["serve", "--workers", "3", "--port", "9000", "--kv-events-endpoint", "tcp://*:5557"]
        + ["--kv-events-curve-secret-key", str(tmp_path / "workers" / "worker-0.key_secret")]
        + ["--kv-events-curve-allow", str(tmp_path / "routers")]
    )
    opts = worker_options(options_from_args(args), 3, _curve_from_args(args))
    assert len({o.kv_events_curve.public for o in opts}) == 1
    assert "share one CURVE key" in caplog.text
