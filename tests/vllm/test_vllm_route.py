"""`agentkv route` in front of two live vLLM workers: real KV events steer each session to its prefix.

Two routers run side by side over the same two workers: one in event mode (it consumes both
workers' ZMQ BlockStored/BlockRemoved events) and one with `--approximate` (it predicts the caches
from its own routing). Both keep a session they routed themselves on the worker holding its prefix.
Only event mode finds a prefix that reached a worker some other way (here: sent to the worker
directly, as another router or a client bypassing this one would).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cluster import free_ports
from vllm_server import BLOCK_SIZE, MODEL_NAME, VllmServer

pytestmark = pytest.mark.vllm


class Router:
    """An `agentkv route` subprocess over `workers` (slot i = workers[i])."""

    def __init__(self, workers: list[VllmServer], log: Path, approximate: bool = False):
        (self.port,) = free_ports(1)
        args = [
            sys.executable,
            "-m",
            "agentkv.cli",
            "route",
            "--port",
            str(self.port),
            "--policy",
            "kv_aware",
            "--block-size",
            str(BLOCK_SIZE),
            "--hash-algo",
            workers[0].spec.hash_algo,
            "--health-interval",
            "0.5",
            "--scrape-interval",
            "0",
            "--log-level",
            "warning",
        ]
        if workers[0].spec.python_hash_seed is not None:
            args += ["--hash-seed", workers[0].spec.python_hash_seed]
        for w in workers:
            args += ["--worker", f"{w.url}={w.events},{w.replay}"]
        if approximate:
            args.append("--approximate")
        self.log = log.open("ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while sum(self.metric("agentkv_router_worker_up").values()) < len(workers):
            assert self.proc.poll() is None, f"router exited:\n{log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the router did not take both workers in"
            time.sleep(0.2)

    def metric(self, name: str) -> dict[str, float]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        return {
            k: float(v)
            for k, v in (
                ln.rsplit(" ", 1) for ln in text.splitlines() if ln.startswith((name + "{", name + " "))
            )
        }

    def events(self) -> float:
        return sum(self.metric("agentkv_router_worker_events_total").values())

    def complete(self, prompt: list[int]) -> tuple[int, int]:
        """(worker slot, cached tokens) of one completion through the router."""
        return complete(f"http://127.0.0.1:{self.port}", prompt)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()


def complete(base: str, prompt: list[int]) -> tuple[int, int]:
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}).encode()
    req = urllib.request.Request(
        base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        slot = int(r.headers.get("x-agentkv-worker", "-1"))
        usage = json.loads(r.read())["usage"]
    return slot, usage["prompt_tokens_details"]["cached_tokens"]


def _sent(event: Router, send, *args) -> tuple[int, int]:
    """`send(*args)`, then wait until the event-mode router has applied the KV events it caused."""
    before = event.events()
    out = send(*args)
    deadline = time.monotonic() + 10
    while event.events() <= before:
        assert time.monotonic() < deadline, "no KV event reached the router"
        time.sleep(0.02)
    return out


def test_router_follows_real_events_and_beats_approximate(main_server, peer_server, tmp_path, figures):
    workers = [main_server, peer_server]
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 31000) for _ in range(n)]

    event = Router(workers, tmp_path / "route-event.log")
    approx = Router(workers, tmp_path / "route-approx.log", approximate=True)
    try:
        # 1. sessions routed by each router: every turn stays where its prefix is, and hits it
        for name, router in (("event", event), ("approximate", approx)):
            used = set()
            for _ in range(4):
                prompt = tokens(8 * BLOCK_SIZE)
                home, cached = _sent(event, router.complete, prompt)
                assert cached == 0
                used.add(home)
                for _turn in range(2):
                    prev, prompt = len(prompt), prompt + tokens(2 * BLOCK_SIZE)
                    assert _sent(event, router.complete, prompt) == (home, prev), name
            assert used == {0, 1}, f"{name}: new sessions should spread over both idle workers"
        indexed = event.metric("agentkv_router_worker_indexed_blocks")
        assert len(indexed) == 2 and all(v > 0 for v in indexed.values()), indexed

        # 2. prefixes the routers never saw: warmed on worker 1 directly, then continued via each router
        first = [tokens(8 * BLOCK_SIZE) for _ in range(4)]
        for p in first:
            assert _sent(event, complete, peer_server.url, p) == (-1, 0)
        got = {}
        for name, router in (("event", event), ("approximate", approx)):
            got[name] = [router.complete(p + tokens(2 * BLOCK_SIZE)) for p in first]
        assert got["event"] == [(1, len(p)) for p in first]  # every one to its prefix, fully hit
        on_holder = sum(slot == 1 for slot, _ in got["approximate"])
        assert on_holder < len(first), "approximate mode cannot know about prefixes it did not route"
        assert all(
            cached == (len(p) if slot == 1 else 0)
            for (slot, cached), p in zip(got["approximate"], first, strict=True)
        )
    finally:
        event.close()
        approx.close()

    hit = {k: sum(c for _, c in v) for k, v in got.items()}
    figures["router"] = (
        "own sessions: event and approximate mode both keep all 12 turns of 4 sessions on "
        "their first worker, each hitting its whole prefix; prefixes warmed "
        f"directly on worker 1: event mode 4/4 to it ({hit['event']:,} cached tokens), "
        f"approximate {on_holder}/4 ({hit['approximate']:,} cached tokens)"
    )
