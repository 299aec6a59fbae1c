"""The event plane's flags: `agentkv security keys`, serve's loopback default, CURVE and token-id
flags, route's pinned worker keys; and one real `agentkv serve` + `agentkv route` pair over CURVE
with token ids off, watched by an anonymous subscriber that gets nothing.
"""

from __future__ import annotations

import json
import logging
import stat
import time
from pathlib import Path

import pytest
import zmq
from cluster import Procs, free_ports, get_json, post, wait_http

from agentkv.cli import build_parser, main
from agentkv.engine.config import EngineConfig
from agentkv.events.curve import CurveClient, load_keypair, load_public_key
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import BlockStored
from agentkv.route.command import config_from_args
from agentkv.serve.app import Server
from agentkv.serve.command import options_from_args


def keys(tmp: Path, name: str) -> tuple[Path, Path]:
    assert main(["security", "keys", "--out", str(tmp / name), "--name", name]) == 0
    return tmp / name / f"{name}.key", tmp / name / f"{name}.key_secret"


def serve_opts(*flags: str):
    return options_from_args(build_parser().parse_args(["serve", *flags]))


def route_cfg(*flags: str):
    return config_from_args(build_parser().parse_args(["route", *flags]))


def test_keys_command_writes_a_pair_and_never_overwrites(tmp_path, capsys):
    pub, sec = keys(tmp_path, "w0")
    public, secret = load_keypair(sec, "x")
    assert load_public_key(pub, "x") == public and zmq.curve_public(secret) == public
    assert stat.S_IMODE(sec.stat().st_mode) == 0o600 and b"secret" not in pub.read_bytes()
    assert public.decode() in capsys.readouterr().out
    assert main(["security", "keys", "--out", str(tmp_path / "w0"), "--name", "w0"]) == 2
    assert "exists" in capsys.readouterr().err


def test_serve_binds_a_wildcard_endpoint_on_loopback_unless_told(caplog):
    opts = serve_opts("--kv-events-endpoint", "tcp://*:*", "--kv-events-replay-endpoint", "tcp://*:*")
    assert opts.kv_events_host == "127.0.0.1" and opts.kv_events_curve is None and opts.kv_events_token_ids
    cfg = EngineConfig(max_model_len=2048)
    with caplog.at_level(logging.WARNING, "agentkv.events"):
        local = Server(cfg, opts)
        local.publisher.close()
        assert local.publisher.endpoint.startswith("tcp://127.0.0.1:") and not caplog.records
        opts.kv_events_host = "0.0.0.0"
        exposed = Server(cfg, opts)
        exposed.publisher.close()
    assert exposed.publisher.endpoint.startswith("tcp://0.0.0.0:")
    (warning,) = [r.getMessage() for r in caplog.records]
    print(f"\n{warning}")
    assert "without CURVE" in warning and "token ids" in warning and exposed.publisher.endpoint in warning


def test_serve_curve_and_token_id_flags(tmp_path):
    _, w_sec = keys(tmp_path, "w")
    r_pub, _ = keys(tmp_path, "r")
    keys(tmp_path / "r", "r2")  # a second router key in the same folder
    opts = serve_opts(
        "--kv-events-curve-secret-key",
        str(w_sec),
        "--kv-events-curve-allow",
        str(tmp_path / "r"),
        "--kv-events-token-ids",
        "off",
    )
    assert (
        opts.kv_events_curve.public == load_keypair(w_sec, "x")[0] and len(opts.kv_events_curve.allowed) == 1
    )
    assert not opts.kv_events_token_ids
    assert (
        len(
            serve_opts(
                "--kv-events-curve-secret-key", str(w_sec), "--kv-events-curve-allow", str(r_pub)
            ).kv_events_curve.allowed
        )
        == 1
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-events-curve-secret-key", "{w_sec}"], "go together"),
        (["--kv-events-curve-allow", "{r_pub}"], "go together"),
        (["--kv-events-curve-secret-key", "{r_pub}", "--kv-events-curve-allow", "{r_pub}"], "no secret key"),
        (["--kv-events-curve-secret-key", "{w_sec}", "--kv-events-curve-allow", "{empty}"], "no *.key files"),
        (
            ["--kv-events-curve-secret-key", "{junk}", "--kv-events-curve-allow", "{r_pub}"],
            "no valid CURVE public key",
        ),
    ],
)
def test_serve_curve_flag_errors_are_one_line(tmp_path, capsys, flags, message):
    _, w_sec = keys(tmp_path, "w")
    r_pub, _ = keys(tmp_path, "r")
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").write_text('curve\n    public-key = "short"\n    secret-key = "short"\n')
    paths = {"w_sec": w_sec, "r_pub": r_pub, "empty": tmp_path / "empty", "junk": tmp_path / "junk"}
    assert main(["serve", "--port", "1", *(f.format(**paths) for f in flags)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_route_pins_each_worker_key(tmp_path, capsys):
    w0, _ = keys(tmp_path, "w0")
    w1, _ = keys(tmp_path, "w1")
    _, r_sec = keys(tmp_path, "r")
    workers = [
        "--worker",
        "http://h:1=tcp://h:5557",
        "--worker",
        "http://h:2=tcp://h:5558",
        "--worker",
        "http://h:3",
    ]
    cfg = route_cfg(
        *workers,
        "--kv-events-curve-secret-key",
        str(r_sec),
        "--kv-events-curve-server-key",
        str(w0),
        "--kv-events-curve-server-key",
        f"http://h:2={w1}",
    )
    c0, c1, c2 = (s.curve for s in cfg.workers)
    assert c0.server == load_public_key(w0, "x") and c1.server == load_public_key(w1, "x") and c2 is None
    assert c0.public == c1.public == load_keypair(r_sec, "x")[0]
    for flags, message in [
        (["--kv-events-curve-secret-key", str(r_sec)], "go together"),
        (["--kv-events-curve-server-key", str(w0)], "go together"),
        (
            ["--kv-events-curve-secret-key", str(r_sec), "--kv-events-curve-server-key", f"http://h:3={w0}"],
            "events endpoint",
        ),
    ]:
        assert main(["route", *workers, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1000 for i in range(n)]


def _commands(tmp: Path, w_pub: Path, w_sec: Path, r_sec: Path, ports) -> tuple[list[str], list[str]]:
    """`agentkv serve` (CURVE, token ids off) and `agentkv route` (pinning its key) arguments."""
    http, events, replay, rport = ports
    serve = [
        "serve", "--port", str(http), "--time-scale", "100", "--max-model-len", "4096", "--log-level", "info",
        "--kv-events-endpoint", f"tcp://*:{events}", "--kv-events-replay-endpoint", f"tcp://*:{replay}",
        "--kv-events-curve-secret-key", str(w_sec), "--kv-events-curve-allow", str(tmp / "router"),
        "--kv-events-token-ids", "off",
    ]  # fmt: skip
    route = [
        "route", "--port", str(rport), "--log-level", "info", "--health-interval", "5",
        "--worker", f"http://127.0.0.1:{http}=tcp://127.0.0.1:{events},tcp://127.0.0.1:{replay}",
        "--kv-events-curve-secret-key", str(r_sec), "--kv-events-curve-server-key", str(w_pub),
    ]  # fmt: skip
    return serve, route


@pytest.mark.slow
def test_serve_and_route_over_curve_with_token_ids_off(tmp_path):
    """A real worker and router over CURVE: the router's index matches the worker's cache; an
    anonymous subscriber on the worker's (loopback) endpoints receives nothing; an admitted one
    sees BlockStored without token ids."""
    w_pub, w_sec = keys(tmp_path, "worker")
    _, r_sec = keys(tmp_path, "router")
    http, events, replay, rport = free_ports(4)
    procs = Procs(tmp_path / "logs")
    serve, route = _commands(tmp_path, w_pub, w_sec, r_sec, (http, events, replay, rport))
    ep = f"tcp://127.0.0.1:{events}"
    ctx = zmq.Context()
    try:
        procs.start("serve", serve)
        wait_http(f"http://127.0.0.1:{http}/health", 60, procs.procs["serve"])
        procs.start("route", route)
        wait_http(f"http://127.0.0.1:{rport}/health", 60, procs.procs["route"])
        anon = ctx.socket(zmq.SUB)
        anon.setsockopt(zmq.SUBSCRIBE, b"")
        anon.connect(ep)
        admitted = ZmqEventSubscriber(
            ep, curve=CurveClient(*load_keypair(r_sec, "x"), load_public_key(w_pub, "x"))
        )
        time.sleep(1.0)  # subscriptions settle
        for i in range(4):
            status, body = post(
                f"http://127.0.0.1:{rport}/v1/completions", {"prompt": _prompt(i, 512), "max_tokens": 2}
            )
            assert status == 200, body
        stored = [e for r in admitted.recv_batches(5.0) for e in r.batch.events if isinstance(e, BlockStored)]
        admitted.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            index = get_json(f"http://127.0.0.1:{rport}/debug/index")["workers"]["0"]
            cache = get_json(f"http://127.0.0.1:{http}/debug/kv_blocks")["GPU"]
            if index == cache:
                break
            time.sleep(0.2)
        anon_n = 0
        while anon.poll(200):
            anon.recv_multipart()
            anon_n += 1
        ready = procs.output("serve")
        logs = ready + procs.output("route")
    finally:
        procs.stop_all()
        ctx.destroy(linger=0)
    print(
        f"\nrouter index {json.dumps(index)} = worker cache {json.dumps(cache)}; anonymous SUB got "
        f"{anon_n} messages; admitted SUB saw {len(stored)} BlockStored, token ids in none"
    )
    assert index == cache and index["blocks"] > 0 and anon_n == 0
    assert stored and all(e.token_ids == [] for e in stored)
    assert f"kv-events={ep}" in ready and "curve=on" in ready and "without CURVE" not in logs
