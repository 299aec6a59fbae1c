"""Fidelity per model kind: `agentkv simulate` predicts live vLLM's hit rate on other architectures too.

Each kind of `vllm_env.TINY_KINDS` (a Gemma 3 with a 512-token sliding window on one of its two
layers, a Qwen3-MoE, a DeepSeek-V2 with MLA, a Qwen3-Next with one Gated DeltaNet layer) is served
by the CPU build with dummy weights and a cache small enough to evict, replays the trimmed trace like
the dense fidelity test, and is simulated from the same `config.json` with the block count and block
size vLLM reports. The hit rates must be equal (the hybrid's: its page lifecycle in vLLM's 'align'
mode, a state saved where a chunk ends on a 96-token block boundary and cached only at a prompt's
replay boundary or a shared prefix's junction, two state pages per running request). Where vLLM
cannot serve a kind, or serves it without prefix caching, the test
skips with vLLM's own log line saying so.
"""

from __future__ import annotations

import re

import pytest
from vllm_runs import live_and_simulated
from vllm_server import KIND_SERVERS, VllmServer

from agentkv.trace.formats.agentx import write_agentx
from agentkv.trace.model import Request, Session, Trace

pytestmark = pytest.mark.vllm

# vLLM's reason, as it logs it: the exception that stopped it, or its notice that prefix caching is off
CRASH = re.compile(r"\b\w+(Error|Exception): .*")
NO_CACHING = re.compile(r"[^\]]*prefix caching to be disabled.*")


def vllm_reason(log: str, pattern: re.Pattern = CRASH) -> str:
    """vLLM's own line saying why: the last match of `pattern` outside its warnings, not its "see
    root cause above" wrapper, without the log prefix."""
    lines = [ln for ln in log.splitlines() if " WARNING " not in ln]
    found = [m.group(0).strip() for m in map(pattern.search, lines) if m]
    causes = [x for x in found if "root cause above" not in x]
    return (causes or found or log.strip().splitlines() or ["(empty log)"])[-1]


@pytest.fixture
def kind_server(vllm_pool, request) -> VllmServer:
    """The server of one model kind, or a skip with vLLM's reason when it cannot start."""
    name = request.param
    try:
        srv = vllm_pool.get(name)
    except (RuntimeError, TimeoutError):
        vllm_pool.release(name)
        log = (vllm_pool.log_dir / f"{name}.log").read_text(errors="replace")
        pytest.skip(f"vLLM cannot serve the tiny {name} model on CPU: {vllm_reason(log)}")
    yield srv
    vllm_pool.release(name)


@pytest.mark.parametrize("kind_server", list(KIND_SERVERS), indirect=True)
def test_simulated_hit_rate_matches_live_vllm_per_kind(kind_server, trimmed_trace, tmp_path, figures):
    cfg = kind_server.cache_config()
    if cfg.get("enable_prefix_caching") != "True":
        log = (kind_server.log_dir / f"{kind_server.name}.log").read_text(errors="replace")
        pytest.skip(f"vLLM serves {kind_server.name} without prefix caching: {vllm_reason(log, NO_CACHING)}")
    live, sim = live_and_simulated(kind_server, trimmed_trace, tmp_path / "bench")
    sim_rate, live_rate = sim["cache"]["reported"], live.hit_rate
    ceiling = live.summary["cache"]["ceiling"]
    assert ceiling - live_rate > 0.02, "the small cache should evict: no eviction, no fidelity test"
    assert sim_rate == live_rate, (sim_rate, live_rate)

    figures[f"fidelity ({kind_server.name})"] = (
        f"{len(live.records)} requests, {cfg['num_gpu_blocks']} blocks of {cfg['block_size']}: live vLLM "
        f"hit rate {live_rate:.4%}, agentkv simulate {sim_rate:.4%} "
        f"(diff {100 * (sim_rate - live_rate):+.2f} pt); unbounded ceiling {ceiling:.2%}"
    )


def constructed(server: VllmServer, prompts: list[tuple[int, int, int]], name: str, tmp_path):
    """Replay prompts given as (blocks shared by all, own blocks, extra tokens) of the server's block
    size, all at t=0 in one session, live and simulated: (live run, simulate summary, block size)."""
    bs = int(server.cache_config()["block_size"])
    reqs = []
    for i, (shared, own, extra) in enumerate(prompts):
        ids = [*range(1, shared + 1), *range(1000 * (i + 1), 1000 * (i + 1) + own)]
        reqs.append(Request(t=0.0, input_tokens=len(ids) * bs + extra, output_tokens=4, hash_ids=ids))
    trace = write_agentx(
        Trace(id=name, block_size=bs, session=Session(id=name, requests=reqs), format="agentx"),
        tmp_path / f"{name}.json",
    )
    live, sim = live_and_simulated(server, trace, tmp_path / "bench")
    return live, sim, bs


@pytest.mark.parametrize("kind_server", ["kind-sliding-window"], indirect=True)
def test_a_window_caches_its_tail_where_a_shared_prefix_ends(kind_server, tmp_path, figures):
    """Three prompts share 40 blocks (32 tokens each) and diverge after them. The first caches its
    window only before its own end; the second finds the 40 blocks in the full-attention group but
    not the window before them, so it hits nothing, and vLLM 0.32 keeps its window tail at that
    junction (`shared_prefix_boundary`); the third hits all 40. agentkv simulates the same."""
    live, sim, bs = constructed(kind_server, [(40, 10, 0)] * 3, "junction", tmp_path)
    assert [r.cached_tokens for r in live.records] == [0, 0, 40 * bs]
    assert sim["cache"]["reported"] == live.hit_rate
    figures["window junction (kind-sliding-window)"] = (
        f"3 prompts sharing 40 blocks of {bs}: live cached {[r.cached_tokens for r in live.records]}, "
        f"hit rate {live.hit_rate:.4%}; agentkv simulate {sim['cache']['reported']:.4%}"
    )


# (prompts as (shared blocks, own blocks, extra tokens), the cached tokens live vLLM 0.32 gives, in blocks)
STATE_CASES = {
    # three prompts sharing 30 of 50 blocks: the second finds them in the full-attention group but no
    # state there, so it hits nothing and saves the state at that junction; the third hits it
    "junction": ([(30, 20, 0), (30, 20, 0), (30, 20, 0)], [0, 0, 30]),
    # a block-aligned prompt keeps the state at its replay boundary, a block short of its end: a longer
    # prompt extending it, and the same prompt again, hit all but its last block
    "aligned, then extended": ([(30, 0, 0), (40, 0, 0)], [0, 29]),
    "aligned, resent": ([(30, 0, 0), (30, 0, 0)], [0, 29]),
}


@pytest.mark.parametrize("case", list(STATE_CASES))
@pytest.mark.parametrize("kind_server", ["kind-hybrid"], indirect=True)
def test_a_state_is_cached_only_where_a_later_prompt_resumes(kind_server, case, tmp_path, figures):
    """vLLM 0.32 (`prefix_cache_retention_interval` 0) caches a Gated DeltaNet state only at a prompt's
    replay boundary and at a shared prefix's junction, where its scheduler also ends a prefill chunk;
    the states saved at other chunk ends are freed uncached. agentkv simulates the same."""
    prompts, want = STATE_CASES[case]
    live, sim, bs = constructed(kind_server, prompts, case.replace(" ", "-").replace(",", ""), tmp_path)
    assert [r.cached_tokens for r in live.records] == [n * bs for n in want]
    assert sim["cache"]["reported"] == live.hit_rate
    figures[f"state retention, {case} (kind-hybrid)"] = (
        f"live cached {[r.cached_tokens for r in live.records]}, hit rate {live.hit_rate:.4%}; "
        f"agentkv simulate {sim['cache']['reported']:.4%}"
    )
