"""The live-vLLM suite's fixtures: provisioning (or a skip with its reason), servers, the trimmed trace.

Every test module here is marked `vllm` (deselect with `-m "not vllm"`). Three servers of the
tiny Llama are used, plus one per other model kind (`kind-*`, test_vllm_kinds.py), at most two
alive at once: `main` and `peer` (sha256, PYTHONHASHSEED unset, vLLM binds its event socket, a cache too big to evict) and `evict` (sha256_cbor, PYTHONHASHSEED set, 320 blocks, the
subscriber binds). Tests run in the order that waits least for start-ups: those on `peer` first,
those on `evict` last, so `evict` starts while the middle ones run on `main`. The run ends with a
summary saying whether the suite ran, on which vLLM, how long provisioning and start-ups took,
and the figures the tests measured.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from vllm_env import Unavailable, VllmEnv, provision
from vllm_pool import ServerPool
from vllm_server import EVICT, KIND_SERVERS, MAIN, VllmServer
from vllm_trace import write_trimmed

HERE = Path(__file__).resolve().parent


class _State:
    env: VllmEnv | None = None
    skipped: str | None = None
    pool: ServerPool | None = None
    uses: list[list[str]] = []
    t0: float = 0.0
    figures: dict[str, str] = {}


STATE = _State()


SERVERS = {"main": MAIN, "peer": MAIN, "evict": EVICT} | KIND_SERVERS


def _servers(item) -> list[str]:
    names = getattr(item, "fixturenames", ())
    params = getattr(getattr(item, "callspec", None), "params", {})
    picked = params.get("server") or params.get("kind_server")
    return [n for n in SERVERS if f"{n}_server" in names or n == picked]


def _ours(item) -> bool:
    return Path(str(item.fspath)).resolve().is_relative_to(HERE)


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    mine = [i for i in items if _ours(i)]
    if mine:  # peer-only tests first, evict tests last (a stable sort keeps file order otherwise)
        order = sorted(mine, key=lambda i: 0 if "peer" in _servers(i) else 2 if "evict" in _servers(i) else 1)
        at = items.index(mine[0])
        rest = [i for i in items if not _ours(i)]
        items[:] = rest[:at] + order + rest[at:]


def pytest_collection_finish(session):
    STATE.uses = [_servers(i) for i in session.items if _ours(i)]


@pytest.fixture(scope="session")
def vllm_env(request) -> VllmEnv:
    """The provisioned environment, or a skip naming why it cannot be had here."""
    if STATE.skipped:
        pytest.skip(STATE.skipped)
    if STATE.env is None:
        if os.environ.get("AGENTKV_SKIP_VLLM"):
            STATE.skipped = "AGENTKV_SKIP_VLLM is set"
            pytest.skip(STATE.skipped)
        STATE.t0 = time.monotonic()
        try:
            tr = request.config.pluginmanager.get_plugin("terminalreporter")
            STATE.env = provision(log=lambda msg: tr.write_line(f"[vllm] {msg}") if tr else None)
        except Unavailable as e:
            STATE.skipped = f"vLLM environment unavailable: {e}"
            pytest.skip(STATE.skipped)
    return STATE.env


@pytest.fixture(scope="session")
def vllm_pool(vllm_env, tmp_path_factory) -> ServerPool:
    STATE.pool = ServerPool(vllm_env, tmp_path_factory.mktemp("vllm-logs"), SERVERS, limit=2)
    STATE.pool.plan(STATE.uses)
    yield STATE.pool
    STATE.pool.close()


def _server(pool: ServerPool, name: str):
    srv = pool.get(name)
    yield srv
    pool.release(name)


@pytest.fixture
def main_server(vllm_pool) -> VllmServer:
    yield from _server(vllm_pool, "main")


@pytest.fixture
def peer_server(vllm_pool) -> VllmServer:
    yield from _server(vllm_pool, "peer")


@pytest.fixture
def evict_server(vllm_pool) -> VllmServer:
    yield from _server(vllm_pool, "evict")


@pytest.fixture
def server(vllm_pool, request) -> VllmServer:
    """The server named by the test's (indirect) parameter."""
    yield from _server(vllm_pool, request.param)


@pytest.fixture(scope="session")
def trimmed_trace(shared_dir, tmp_path_factory) -> Path:
    """Two Claude Code sessions, scaled x1/8 and taking turns, as one AgentX file."""
    return write_trimmed(shared_dir, tmp_path_factory.mktemp("vllm-trace"))


@pytest.fixture
def figures() -> dict[str, str]:
    """Figures a test measured, printed in the suite's summary (name -> text)."""
    return STATE.figures


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    if STATE.env is None and not STATE.skipped:
        return
    tr.section("live vLLM suite")
    if STATE.env is None:
        tr.write_line(f"vLLM suite SKIPPED: {STATE.skipped}")
        return
    env = STATE.env
    how = "installed now" if env.installed_now else "reused"
    tr.write_line(
        f"vLLM suite RAN against vLLM {env.version} (CPU build, {env.python.parent.parent}, {how}; "
        f"provisioning {env.provision_s:.0f} s)"
    )
    if STATE.pool is not None and STATE.pool.started:
        starts = ", ".join(f"{n} {s:.0f} s" for n, s in STATE.pool.started)
        tr.write_line(f"servers started: {starts}; suite wall time {time.monotonic() - STATE.t0:.0f} s")
    for name, text in STATE.figures.items():
        tr.write_line(f"  {name}: {text}")
