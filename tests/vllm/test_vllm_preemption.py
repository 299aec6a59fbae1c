"""Preemption: vLLM and agentkv serve, with the same blocks, count prefix-cache queries and hits alike.

vLLM 0.32 records a request's queries and hits once, when it is admitted, and a preempted
request's re-admission in separate `preempted_*` stats that `/metrics` does not export; usage's
`cached_tokens` is what its first admission found. A cached prefix, then six requests that extend
it and decode long enough that the 320-block cache cannot hold them all, goes to the live vLLM and
to `agentkv serve` with vLLM's block count and block size: both preempt, and the counters' deltas
and every request's `cached_tokens` are equal. (Before agentkv counted once per request, it counted
each re-admission again: tens of thousands more queries here.)
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from vllm_runs import HITS, QUERIES
from vllm_server import BLOCK_SIZE, EVICT_BLOCKS, MAX_MODEL_LEN, MODEL_NAME

from agentkv.bench.embedded import EmbeddedServer

pytestmark = pytest.mark.vllm
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX = [1000 + i for i in range(2048)]  # 64 blocks, cached by the first request
LONG = [PREFIX + [5000 + 1000 * k + i for i in range(1000)] for k in range(6)]
MAX_TOKENS = 1500  # 6 x (3,048 + 1,500) tokens: 64 shared + 6 x 79 blocks > 319


def complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def counters(url: str) -> dict[str, float]:
    """The prefix-cache and preemption counters of `/metrics`, summed over label sets."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    out = dict.fromkeys((QUERIES, HITS, PREEMPTIONS), 0.0)
    for line in lines:
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def replay(url: str) -> tuple[dict[str, float], list[int]]:
    """The prefix alone, then the four long requests at once: the counters' deltas and each
    request's usage `cached_tokens` (prefix first)."""
    before = counters(url)
    usages = [complete(url, PREFIX, 1)["usage"]]
    with ThreadPoolExecutor(len(LONG)) as pool:
        usages += [r["usage"] for r in pool.map(lambda p: complete(url, p, MAX_TOKENS), LONG)]
    after = counters(url)
    assert [u["completion_tokens"] for u in usages] == [1] + [MAX_TOKENS] * len(LONG)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    return {k: after[k] - before[k] for k in after}, cached


def test_preempted_requests_are_counted_once_as_vllm_does(evict_server, vllm_env, figures):
    evict_server.reset_prefix_cache()
    live, live_cached = replay(evict_server.url)
    args = [
        "--model",
        str(vllm_env.model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(EVICT_BLOCKS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]
    with EmbeddedServer(time_scale=100, extra_args=args) as srv:
        ours, our_cached = replay(srv.url)

    prompts = len(PREFIX) + sum(map(len, LONG))
    assert live[PREEMPTIONS] > 0 and ours[PREEMPTIONS] > 0, "the cache should be too small for all six"
    assert live[QUERIES] == prompts, "vLLM counts each request's prompt once, preempted or not"
    assert ours[QUERIES] == live[QUERIES] and ours[HITS] == live[HITS]
    assert our_cached == live_cached
    assert live_cached == [0] + [len(PREFIX)] * len(LONG)  # the first admission's hits

    figures["preemption (320 blocks)"] = (
        f"prefix + 6 long requests: live vLLM {live[PREEMPTIONS]:.0f} preemptions, queries "
        f"+{live[QUERIES]:,.0f}, hits +{live[HITS]:,.0f}; agentkv serve {ours[PREEMPTIONS]:.0f} "
        f"preemptions, queries +{ours[QUERIES]:,.0f}, hits +{ours[HITS]:,.0f}; cached_tokens {live_cached}"
    )
