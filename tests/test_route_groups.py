"""The router's index against hybrid models' per-group KV events (vLLM 0.32's `group_idx` and
`kv_cache_spec_kind`): it follows the full-attention group, so a sliding-window group's removals
never drop blocks the full group holds, and predicts the hit the worker serves under every group's
rule; dense servers' events (no group) index as before."""

from __future__ import annotations

import json
import time
import urllib.request
from functools import partial

import msgspec
from cluster import Cluster, get_json, get_text, metric_sum

from agentkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from agentkv.route.index import BlockIndex, Match, TenantIndex

HITS = "agentkv_router_predicted_hit_blocks_total"


def _stored(hashes, g, kind, parent=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, group_idx=g, kv_cache_spec_kind=kind)


def test_window_group_removals_keep_the_full_groups_blocks():
    for idx in (TenantIndex(), BlockIndex()):
        a = [1, 2, 3, 4, 5, 6]
        idx.apply(0, _stored(a, 0, "full_attention"))
        idx.apply(0, _stored(a, 1, "sliding_window"))
        idx.apply(0, BlockRemoved(block_hashes=a[:4], group_idx=1))  # fell out of the window
        find = idx.find_matches if isinstance(idx, BlockIndex) else partial(idx.find_matches, "")
        assert find(a) == {0: Match(6)}
        idx.apply(0, BlockRemoved(block_hashes=a[3:], group_idx=0))  # the full group evicts: that counts
        held = idx.held(0) if isinstance(idx, TenantIndex) else idx._gpu[0]
        assert held == {1, 2, 3}
        assert find(a) == {0: Match(0)}  # but the window group holds none of blocks 1..3: nothing served
        assert idx.groups.skipped_stores == 6 and idx.groups.skipped_removals == 4


def test_state_group_first_then_mla_group_follows_the_attention_group():
    """Kimi-style layouts put Mamba groups before the attention group; DeepSeek-V4 reports MLA."""
    idx = TenantIndex()
    idx.apply(3, _stored([7], 0, "mamba"))
    idx.apply(3, _stored([7], 1, "mamba"))
    idx.apply(3, _stored([5, 6, 7], 2, "mla_attention"))
    idx.apply(3, _stored([5, 6, 7], 3, "sliding_window_mla"))
    idx.apply(3, BlockRemoved(block_hashes=[7], group_idx=0))
    idx.apply(3, BlockRemoved(block_hashes=[5, 6], group_idx=3))
    assert idx.held(3) == {5, 6, 7}  # the index is the MLA group's
    assert idx.find_matches("", [5, 6, 7]) == {3: Match(0)}  # but group 0 lost its state at block 3
    idx.apply(3, _stored([7], 0, "mamba"))
    assert idx.find_matches("", [5, 6, 7]) == {3: Match(3)}
    idx.apply(3, BlockRemoved(block_hashes=[6], group_idx=2))
    assert idx.held(3) == {5, 7} and idx.find_matches("", [5, 6, 7]) == {3: Match(0)}  # no state at 1


def test_dense_events_are_unchanged_and_a_restart_relearns_the_groups():
    idx = TenantIndex()
    # no group fields at all (older vLLM, SGLang): decoded as group 0; nil group: applied as is
    idx.apply(0, BlockStored(block_hashes=[1, 2, 3]))
    idx.apply(1, BlockStored(block_hashes=[1, 2], group_idx=None, kv_cache_spec_kind=None))
    idx.apply(0, BlockRemoved(block_hashes=[3]))
    idx.apply(1, BlockRemoved(block_hashes=[2], group_idx=None))
    assert idx.find_matches("", [1, 2, 3]) == {0: Match(2), 1: Match(1)}
    # a removal from group 0 of a worker whose stores the router never saw still applies
    idx.apply(2, BlockRemoved(block_hashes=[9], group_idx=0))
    assert idx.groups.skipped_removals == 0
    # a kind-less group other than 0 is not followed; after a restart the groups are learned anew
    idx.apply(0, _stored([1, 2], 1, None))
    assert idx.groups.skipped_stores == 2
    idx.apply(0, AllBlocksCleared())
    idx.apply(0, _stored([8], 1, "full_attention"))  # the layout changed: group 1 is full now
    assert idx.find_matches("", [8]) == {0: Match(1)}


def _post(url: str, prompt: list[int], max_tokens: int = 1) -> tuple[str, int]:
    """(worker that answered, cached prompt tokens) for one completion."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        usage = json.loads(r.read())["usage"]
        return r.headers.get("x-agentkv-worker", ""), (usage.get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0
        )


def _settled(c: Cluster, w: int) -> tuple[dict, dict]:
    """The router's /debug/index entry for worker `w` and the worker's /debug/kv_blocks, once equal
    (or after 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        dbg = get_json(c.router_url() + "/debug/index")
        index = dbg["workers"].get(str(w), {"blocks": 0})
        cache = get_json(c.worker_url(w) + "/debug/kv_blocks")["GPU"]
        if index == cache or time.monotonic() > deadline:
            return dbg, cache
        time.sleep(0.1)


def test_router_follows_gpt_oss_full_attention_group(tmp_path):
    """Two real `agentkv serve --model gpt-oss-120b` (full + sliding-window groups) publishing over
    ZMQ to a real router: after the window group evicts other prompts' blocks, the index still
    equals the worker's full-attention cache, the prompt is routed back to that worker, and the hit
    the router predicted is the one the worker served (the cut at the prompt's replay boundary, where
    the window group cached the window before it)."""
    serve = ("--model", "gpt-oss-120b", "--num-gpu-blocks-override", "112", "--max-model-len", "768")
    with Cluster(tmp_path, 2, replay=False) as c:
        c.start_workers(time_scale=100, extra=serve)
        c.start_router(["--log-level", "warning", "--health-interval", "0.2", "--sliding-window", "128"])
        c.wait_ready()
        c.wait_taken_in()
        deadline = time.monotonic() + 60
        for w in range(2):  # until each worker's events reach the router (a SUB joins late)
            while (
                get_json(c.router_url() + "/debug/index")["workers"].get(str(w), {"blocks": 0})["blocks"] == 0
            ):
                assert time.monotonic() < deadline, f"worker {w}'s events never reached the router"
                _post(c.worker_url(w), [5 + w] * 32)
                time.sleep(0.1)
        prompt = [1000 + i for i in range(512)]  # 32 blocks; the window group caches the 8 before 31
        home, _ = _post(c.router_url(), prompt, 4)
        w = int(home)
        dbg, cache = _settled(c, w)
        assert dbg["workers"][home] == cache and cache["blocks"] == 34
        for k in range(12):  # other prompts straight at that worker, until its window group evicts
            _post(c.worker_url(w), [20000 + 1000 * k + i for i in range(256)])
            _post(c.worker_url(w), prompt)  # the prompt again: its blocks the most recently freed
            dbg, cache = _settled(c, w)
            assert dbg["workers"][home] == cache  # the index is the full group's cache, exactly
            if dbg["skipped_group_blocks"]["removed"]:
                break
        assert dbg["skipped_group_blocks"]["removed"] > 0, dbg
        hits = metric_sum(get_text(c.router_url() + "/metrics"), HITS)
        again, cached = _post(c.router_url(), prompt)
        predicted = metric_sum(get_text(c.router_url() + "/metrics"), HITS) - hits
        print(f"\nrouter index {dbg['workers'][home]} = worker cache {cache}; {dbg['skipped_group_blocks']}")
        print(
            f"prompt again: worker {again} (home {home}), predicted {predicted:g} blocks, cached {cached} tokens"
        )
        assert again == home and cached > 0
        assert predicted == cached // 16 == 31  # the window group's rule, not the full group's 32 blocks


def test_newer_vllm_fields_decode_and_removals_follow_the_group():
    """vLLM after 0.32 adds `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` to both events:
    unknown fields are ignored, and the group rule still applies to the decoded events."""
    extra = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128}
    base = {"parent_block_hash": None, "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU"}
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [1, 2],
            **base,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        },
        {"type": "BlockStored", "block_hashes": [1, 2], **base, "group_idx": 1, **extra},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1, **extra},
    ]
    batch = decode_batch(msgspec.msgpack.encode([1.0, events, 0]))
    idx = TenantIndex()
    for ev in batch.events:
        idx.apply(0, ev)
    assert idx.find_matches("", [1, 2]) == {0: Match(2)} and idx.groups.skipped_removals == 1
