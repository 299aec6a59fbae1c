"""`calibrate --clock auto` (the default): resolved once from /server_info, against a real loopback
`agentkv serve` (engine clock) and a plain HTTP server without /server_info (client clock)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from agentkv.bench.client import BenchClient
from agentkv.calib.probes import resolve_clock
from tests.cluster import CLI, HOST, Procs, free_ports, wait_http
from tests.test_calib_floor import _Unstamped


async def _info(url: str) -> object:
    async with BenchClient(url, timeout=10.0) as client:
        return await client.get_json("/server_info")


def test_auto_is_the_engine_clock_on_agentkv_serve(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    procs = Procs(tmp_path / "logs")
    url = f"http://{HOST}:{port}"
    try:
        serve = ["serve", "--port", str(port), "--gpu", "h100", "--model", "qwen2.5-7b"]
        wait_http(f"{url}/health", proc=procs.start("serve", serve))
        info = asyncio.run(_info(url))
    finally:
        procs.stop_all()
    assert isinstance(info, dict) and info["engine"] == "agentkv"
    assert resolve_clock("auto", info) == "engine" and resolve_clock(None, info) == "engine"
    assert resolve_clock("client", info) == "client"  # a choice given is kept


def test_auto_is_the_client_clock_without_server_info(tmp_path: Path) -> None:
    """A server without /server_info (vLLM's kind): calibrate's default times on the client clock and
    never asks for engine stamps the target does not send."""
    target = _Unstamped("plain")
    url = f"http://{HOST}:{target.port}"
    out = tmp_path / "p.json"
    try:
        assert asyncio.run(_info(url)) is None
        cmd = [*CLI, "calibrate", "--target", url, "--out", str(out), "-q"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        target.close()
    doc = json.loads(out.read_text())
    assert doc["clock"] == "client" and "no engine times" not in run.stderr, run.stderr
    assert resolve_clock("auto", None) == "client" and resolve_clock("engine", None) == "engine"
