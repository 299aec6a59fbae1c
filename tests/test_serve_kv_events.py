"""agentkv serve's KV events over real HTTP on loopback: stored then removed, wildcard binds, replay."""

from __future__ import annotations

import asyncio

from serveutil import run, serving
from zmqutil import subscribed, until

from agentkv.engine.config import EngineConfig
from agentkv.events.subscriber import AsyncZmqEventSubscriber
from agentkv.kv.events import BlockRemoved, BlockStored


def test_kv_events_stored_then_removed_under_memory_pressure():
    """9 GPU blocks, 8 usable beside vLLM's null block: a second prompt that needs all 8 evicts the
    first one's cached blocks."""
    cfg = EngineConfig(num_gpu_blocks_override=9, max_model_len=128, max_num_batched_tokens=128)
    first, second = list(range(100, 164)), list(range(300, 364))

    async def main():
        async with (
            subscribed() as (sub, got),  # the subscriber binds; the server connects
            serving(cfg, kv_events_endpoint=sub.endpoint) as (server, url, s),
        ):
            assert await asyncio.to_thread(server.publisher.wait_for_subscribers, 1, 5.0)
            for prompt, n in ((first, 1), (second, 60)):
                async with s.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n}) as r:
                    assert r.status == 200, await r.text()
            await until(lambda: any(isinstance(e, BlockRemoved) for r in got for e in r.batch.events))
            hashes = server.runner.engine.hasher.hashes(first, 16)
        events = [(r.seq, e) for r in got for e in r.batch.events]
        assert [r.seq for r in got] == list(range(len(got)))
        stored = [
            seq for seq, e in events if isinstance(e, BlockStored) and set(hashes) <= set(e.block_hashes)
        ]
        removed = [
            seq for seq, e in events if isinstance(e, BlockRemoved) and set(e.block_hashes) & set(hashes)
        ]
        assert stored and removed and stored[0] < removed[0]
        assert all(e.medium == "GPU" for _, e in events)

    run(main())


def test_kv_events_bind_on_wildcard_and_replay():
    async def main():
        async with serving(
            kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*"
        ) as (server, url, s):
            pub = server.publisher
            assert not pub.endpoint.endswith("*") and not pub.replay_endpoint.endswith("*")
            async with s.post(
                url + "/v1/completions", json={"prompt": list(range(64)), "max_tokens": 2}
            ) as r:
                assert r.status == 200
            for _ in range(100):
                if pub.stats.sent:
                    break
                await asyncio.sleep(0.01)
            sub = AsyncZmqEventSubscriber(pub.endpoint, pub.replay_endpoint)
            try:
                replayed = await sub.replay(0, timeout=2.0)
            finally:
                sub.close()
        assert replayed and replayed[0].seq == 0
        assert isinstance(replayed[0].batch.events[0], BlockStored)
        assert replayed[0].batch.data_parallel_rank == 0

    run(main())
