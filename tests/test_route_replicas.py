"""Router replicas: two `agentkv route` processes over the same three `agentkv serve` workers, behind
a TCP round-robin balancer (each request on a new connection, so a session's turns alternate
between the replicas), place each session as one router would.

Both replicas subscribe to every worker's events and share `--router-secret-file` (so tenant
salts and the session tie-break agree). A slice of the shared Claude Code traces (the first
turns of a few sessions, blocks scaled 64 -> 16 tokens, two tenants) is replayed through a
single router and then, in a fresh hash space, through the replicas: >= 99% of each session's
requests reach one worker, and the hit rate is within 1 point of the single router's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from cluster import Cluster, get_text, metric_sum, write_keys

from agentkv.kv.events import BlockStored
from agentkv.placement.policy import RouteRequest
from agentkv.route.index import TenantIndex
from agentkv.route.replica import SessionTieKvAware, tie_key
from agentkv.trace.blocks import request_tokens
from agentkv.trace.formats import load_paths

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
SESSIONS, TURNS, BLOCK = 6, 8, 16


def sessions(shared: Path, run: str) -> list[tuple[str, str, list[list[int]]]]:
    """(session id, API key, prompts): each trace's first TURNS requests in the hash space `run`,
    every 64-token trace block as one 16-token engine block (the sharing kept, 4x fewer tokens)."""
    traces = load_paths(sorted((shared / "traces" / "claude-code").glob("*.json.gz"))[:SESSIONS])
    out = []
    for k, t in enumerate(traces):
        prompts = []
        for tr in t.timeline()[:TURNS]:
            r = tr.request
            n = min(r.input_tokens * BLOCK // t.block_size, 1 << 15)
            prompts.append(request_tokens(f"{run}/{t.id}", r.hash_ids, n, BLOCK).tolist())
        out.append((f"{run}-{t.id}", ("key-a", "key-b")[k % 2], prompts))
    return out


async def replay(url: str, work: list[tuple[str, str, list[list[int]]]]) -> list[tuple[str, str, int, int]]:
    """Sessions concurrently, turns in order, a new connection per request: (session, worker,
    prompt tokens, cached tokens) per request."""
    out: list[tuple[str, str, int, int]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:

        async def one(session: str, key: str, prompts: list[list[int]]) -> None:
            for ids in prompts:
                headers = {"Authorization": f"Bearer {key}", "x-session-id": session}
                body = {"prompt": ids, "max_tokens": 1}
                async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    usage = (await r.json())["usage"]
                    worker = r.headers["x-agentkv-worker"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                out.append((session, worker, usage["prompt_tokens"], cached))

        await asyncio.gather(*(one(*w) for w in work))
    return out


@contextlib.asynccontextmanager
async def round_robin(port: int, backends: list[int]):
    """A TCP balancer on 127.0.0.1:port: each connection to the next backend in turn, bytes piped."""
    turn = itertools.cycle(backends)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", next(turn))
        open_.update((writer, up_w))
        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        open_.difference_update((writer, up_w))

    open_: set[asyncio.StreamWriter] = set()
    server = await asyncio.start_server(accept, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for w in open_:
            w.close()
        await server.wait_closed()


def stickiness(records: list[tuple[str, str, int, int]]) -> float:
    """Requests on their session's most used worker, over all requests."""
    by: dict[str, Counter] = {}
    for session, worker, _, _ in records:
        by.setdefault(session, Counter())[worker] += 1
    return sum(c.most_common(1)[0][1] for c in by.values()) / len(records)


def hit_rate(records: list[tuple[str, str, int, int]]) -> float:
    return sum(r[3] for r in records) / sum(r[2] for r in records)


@pytest.mark.slow
@pytest.mark.shared
def test_two_replicas_place_sessions_as_one_router(tmp_path, shared_dir):
    secret = tmp_path / "secret"
    secret.write_text("replica-test-secret\n")
    flags = ["--api-keys", str(write_keys(tmp_path, KEYS)), "--router-secret-file", str(secret)]
    flags += ["--health-interval", "2", "--scrape-interval", "0.5", "--log-level", "warning"]
    with Cluster(tmp_path, 3, routers=3, spare=1, one_process=True) as c:
        c.start_workers(time_scale=200, log_level="error")
        c.start_router(flags, j=0, name="router0")  # the single router: the default tie-break
        for j in (1, 2):
            c.start_router([*flags, "--tie-break", "session"], j=j, name=f"router{j}")
        c.wait_ready(timeout=60)
        for j in range(3):
            c.wait_taken_in(j)

        async def main():
            single = await replay(c.router_url(0), sessions(shared_dir, "single"))
            async with round_robin(c.spare[0], c.router_ports[1:]) as lb:
                replicas = await replay(lb, sessions(shared_dir, "replicas"))
            return single, replicas

        single, replicas = asyncio.run(main())
        served = [
            metric_sum(get_text(c.router_url(j) + "/metrics"), "agentkv_router_requests_total")
            for j in (1, 2)
        ]
    n = sum(len(p) for _, _, p in sessions(shared_dir, "count"))
    assert len(single) == len(replicas) == n
    assert min(served) >= 0.3 * n, served  # the balancer spread the turns over both replicas
    figures = {
        "stickiness": (stickiness(single), stickiness(replicas)),
        "hit rate": (hit_rate(single), hit_rate(replicas)),
    }
    print(json.dumps(figures))
    assert stickiness(replicas) >= 0.99, figures
    assert abs(hit_rate(replicas) - hit_rate(single)) <= 0.01, figures


class _Idle:
    """A worker with no load and nothing cached for the request: every one costs the same."""

    def active_requests(self) -> int:
        return 0

    def active_blocks(self) -> int:
        return 0

    def active_prefill_blocks(self) -> float:
        return 0.0

    def cached_prefix(self, block_hashes) -> tuple[int, int]:
        return 0, 0


def test_replicas_break_ties_alike_whatever_each_routed_before():
    """Two replicas with different histories (counters, homes) send a session's tied request to one
    worker; another secret, or another session, may point elsewhere."""
    workers = [_Idle() for _ in range(4)]
    key = tie_key("shared")
    a, b = SessionTieKvAware(key, affinity=8.0), SessionTieKvAware(key, affinity=8.0)
    for k in range(7):  # replica a has routed other traffic: its rotation stands elsewhere
        a.choose(RouteRequest([k], 16), workers)
    picks = {}
    for s in range(64):
        req = RouteRequest([s], 16, session=f"s{s}")
        picks[s] = a.choose(req, workers)
        assert b.choose(req, workers) == picks[s]
        assert a.choose(req, workers) == picks[s]  # and again next turn
    assert len(set(picks.values())) == 4  # sessions spread over the idle workers
    other = SessionTieKvAware(tie_key("another"))
    assert [other.choose(RouteRequest([s], 16, session=f"s{s}"), workers) for s in range(64)] != list(
        picks.values()
    )


def test_a_run_another_replica_routed_is_found_by_its_tenant_only():
    """agentkv serve's events carry no salt: a run this replica did not route (no root registered) is
    unattributed, yet the tenant whose salted hashes it holds finds it; another tenant does not."""
    idx = TenantIndex(salts={"salt-a": "tenant-a", "salt-b": "tenant-b"})
    idx.index("tenant-a")
    idx.index("tenant-b")
    hashes_a = [101, 102, 103, 104]  # tenant-a's salted chain, routed by the other replica
    idx.apply(2, BlockStored(block_hashes=hashes_a, parent_block_hash=None, token_ids=[], block_size=16))
    assert idx.find_matches("tenant-a", hashes_a)[2].gpu == 4
    assert idx.find_matches("tenant-b", [201, 202]) == {}  # tenant-b's own hashes differ: nothing
    idx.expect("tenant-b", [301, 302])  # a run this replica routed for tenant-b stays tenant-b's
    idx.apply(0, BlockStored(block_hashes=[301, 302], parent_block_hash=None, token_ids=[], block_size=16))
    assert 0 not in idx.find_matches("tenant-a", [301, 302])
    assert idx.find_matches("tenant-b", [301, 302])[0].gpu == 2
