"""The router needs only block hashes: routing a trimmed shared Claude Code trace with and without
token ids in BlockStored gives the same decisions and the same hits.

Three real engines (in process, virtual clock) publish their KV events over real ZMQ sockets on
127.0.0.1; the router's tenant index is built from what its subscribers receive, and the router's
kv_aware policy picks a worker for each request from that index, one request at a time (so load
is zero and only the index decides). The same replay runs with `token_ids` on and off.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.events.publisher import ZmqEventPublisher
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import BlockStored, EventBatch
from agentkv.placement.policy import RouteRequest, make_policy
from agentkv.route.index import Match, TenantIndex
from agentkv.route.workers import Worker, WorkerSpec
from agentkv.trace.blocks import request_tokens
from agentkv.trace.formats import load_paths

pytestmark = pytest.mark.shared
WORKERS, TRACES, TURNS, BLOCK = 3, 6, 4, 16
T = 10.0


def trimmed(shared: Path) -> list[tuple[str, list[int], int]]:
    """(session, prompt token ids, output tokens): the first TURNS requests of TRACES traces,
    interleaved turn by turn so sessions compete for workers."""
    traces = load_paths([shared / "traces" / "claude-code"])[:TRACES]
    out = []
    for turn in range(TURNS):
        for t in traces:
            r = t.timeline()[turn].request
            ids = request_tokens(t.hash_space(t.id), r.hash_ids, r.input_tokens, t.block_size)
            out.append((t.id, ids.tolist(), max(1, min(r.output_tokens, 64))))
    return out


class Lane:
    """One engine, its publisher and the router's subscriber to it."""

    def __init__(self, slot: int, token_ids: bool) -> None:
        self.events: list = []
        self.engine = Engine(
            EngineConfig(block_size=BLOCK, max_model_len=1 << 18), on_event=self.events.append
        )
        self.pub = ZmqEventPublisher("tcp://127.0.0.1:*", token_ids=token_ids)
        self.sub = ZmqEventSubscriber(self.pub.endpoint, start_seq=0)
        self.worker = Worker(slot, WorkerSpec(f"http://w{slot}", self.pub.endpoint), BLOCK, False)
        self.bytes = self.token_ids = 0
        assert self.pub.wait_for_subscribers(timeout=T)

    def run(self, rid: str, ids: list[int], out: int, index: TenantIndex) -> int:
        """Run one request to its end, publishing each step's events; apply them to `index` as the
        router does; the request's cached prompt tokens."""
        eng = self.engine
        req = eng.add_request(rid, max_tokens=out, token_ids=ids)
        last = None
        while eng.has_work():
            res = eng.step()
            assert res is not None
            eng.clock.advance_to(res.end)
            if self.events:
                last = self.pub.publish(EventBatch(time.time(), self.events[:]))
                self.events.clear()
        while last is not None:
            r = self.sub.recv(T)
            assert r is not None, "an event batch did not arrive"
            self.bytes += len(r.payload)
            for ev in r.batch.events:
                index.apply(self.worker.slot, ev)
                if isinstance(ev, BlockStored):
                    self.token_ids += len(ev.token_ids)
            if r.seq == last:
                break
        return req.num_cached_tokens

    def close(self) -> None:
        self.sub.close()
        self.pub.close()


def route_all(requests, token_ids: bool) -> dict:
    lanes = [Lane(i, token_ids) for i in range(WORKERS)]
    try:
        index, policy = TenantIndex(), make_policy("kv_aware")
        hasher = lanes[0].engine.hasher
        picks, cached, prompt = [], 0, 0
        for n, (session, ids, out) in enumerate(requests):
            hashes = hasher.hashes(ids, BLOCK)
            matches = index.find_matches("", hashes)
            for lane in lanes:
                lane.worker.match = matches.get(lane.worker.slot, Match(0))
            i = policy.choose(RouteRequest(hashes, len(ids), session, BLOCK), [x.worker for x in lanes])
            picks.append(i)
            cached += lanes[i].run(f"r{n}", ids, out, index)
            prompt += len(ids)
        return {
            "picks": picks,
            "hit rate": cached / prompt,
            "event bytes": sum(x.bytes for x in lanes),
            "token ids sent": sum(x.token_ids for x in lanes),
        }
    finally:
        for lane in lanes:
            lane.close()


def test_same_routing_with_and_without_token_ids(shared_dir):
    requests = trimmed(shared_dir)
    on, off = route_all(requests, True), route_all(requests, False)
    tokens = sum(len(ids) for _, ids, _ in requests)
    print(
        f"\n{len(requests)} requests, {tokens:,} prompt tokens, {WORKERS} workers: picks {on['picks']}\n"
        f"token ids on:  hit rate {on['hit rate']:.3f}, {on['event bytes']:,} event bytes, "
        f"{on['token ids sent']:,} token ids sent\n"
        f"token ids off: hit rate {off['hit rate']:.3f}, {off['event bytes']:,} event bytes, "
        f"{off['token ids sent']:,} token ids sent"
    )
    assert on["picks"] == off["picks"] and on["hit rate"] == off["hit rate"]
    assert on["token ids sent"] > 0 and off["token ids sent"] == 0
    assert on["hit rate"] > 0.5  # later turns found their sessions' prefixes: the index worked
    assert len(set(on["picks"])) == WORKERS  # and the sessions were spread over the workers
    homes: dict[str, set[int]] = {}
    for (session, _, _), pick in zip(requests, on["picks"], strict=True):
        homes.setdefault(session, set()).add(pick)
    assert all(len(h) == 1 for h in homes.values())  # each session's later turns found its worker
