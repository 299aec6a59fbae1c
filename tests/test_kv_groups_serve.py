"""agentkv serve emulating a hybrid model publishes each group's KV events, as vLLM does: BlockStored
with the group's `group_idx` and `kv_cache_spec_kind`, over real ZMQ on loopback."""

from __future__ import annotations

import asyncio

from serveutil import run, serving
from zmqutil import subscribed, until

from agentkv.engine.config import EngineConfig
from agentkv.kv.events import BlockStored


def test_gpt_oss_publishes_full_and_sliding_window_groups():
    cfg = EngineConfig(
        model="gpt-oss-120b", num_gpu_blocks_override=128, max_model_len=512, max_num_batched_tokens=512
    )
    prompt = list(range(100, 300))  # 12 full blocks of 16

    async def main():
        async with (
            subscribed() as (sub, got),
            serving(cfg, kv_events_endpoint=sub.endpoint) as (server, url, s),
        ):
            assert await asyncio.to_thread(server.publisher.wait_for_subscribers, 1, 5.0)
            async with s.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
            await until(lambda: len({e.group_idx for r in got for e in r.batch.events}) == 2)
            hashes = server.runner.engine.hasher.hashes(prompt, 16)
        stored = [e for r in got for e in r.batch.events if isinstance(e, BlockStored)]
        by_group = {}
        for e in stored:
            by_group.setdefault((e.group_idx, e.kv_cache_spec_kind), []).extend(e.block_hashes)
        # the window group caches only the window (128 tokens: 8 blocks) before the replay boundary
        assert by_group == {(0, "full_attention"): hashes, (1, "sliding_window"): hashes[4:]}

    run(main())
