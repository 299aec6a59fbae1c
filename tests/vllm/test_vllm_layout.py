"""The live server's process layout, read from its command line and environment (no server started)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_env import VllmEnv
from vllm_server import MAIN, ServerSpec, VllmServer

pytestmark = pytest.mark.vllm  # the suite's module, though it starts nothing

ENV = VllmEnv(Path("/venv/bin/python"), "0", Path("/model"), 0.0, False)


def _server(spec: ServerSpec = MAIN) -> VllmServer:
    return VllmServer(ENV, spec, Path("/logs"))


@pytest.mark.parametrize("value", [None, "0", "1"])
def test_layout_follows_the_variable(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("AGENTKV_VLLM_MULTIPROCESSING", raising=False)
    else:
        monkeypatch.setenv("AGENTKV_VLLM_MULTIPROCESSING", value)
    srv, mp = _server(), value == "1"
    assert srv.multiprocessing is mp
    assert ("uni" in srv.argv()) is not mp  # vLLM's CPU default with multiprocessing is "mp"
    assert srv.environ()["VLLM_ENABLE_V1_MULTIPROCESSING"] == ("1" if mp else "0")


def test_spec_overrides_the_variable(monkeypatch):
    monkeypatch.setenv("AGENTKV_VLLM_MULTIPROCESSING", "1")
    srv = _server(ServerSpec(multiprocessing=False))
    assert not srv.multiprocessing and "uni" in srv.argv()
