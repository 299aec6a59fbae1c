"""A disaggregated decode on a model with a `state` group (DeepSeek-V4's compressor states): the
state at the arrived KV's last block boundary comes with the KV, so the decode engine caches the
boundary an aggregated engine holding the same prompt would, and a session's next turn hits there."""

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.kv_move import kv_transfer_bytes
from agentkv.engine.models import get_model
from agentkv.sim.cluster import SimConfig, simulate
from agentkv.trace.model import Request, Session, Trace

V4 = EngineConfig(model="deepseek-v4-pro", gpu="gb300", tensor_parallel_size=4, max_model_len=8192)


def _state_group(e: Engine) -> int:
    return next(g for g, s in enumerate(e.pool.specs) if s.rule == "state")


def _turns(e: Engine, prompt: int, arrived: bool) -> tuple[Engine, int]:
    """Serve a `prompt`-token turn (its KV but the last token arrived, or computed here), then a
    second turn extending it; returns the engine and the second turn's cached tokens."""
    toks = list(range(1, prompt + 1))
    ext = prompt - 1 if arrived else 0
    e.add_request("t0", max_tokens=4, token_ids=toks, session_id="s", external_tokens=ext)
    while e.has_work() and e.step() is not None:
        e.pool.check_invariants()
    nxt = e.add_request("t1", max_tokens=1, token_ids=toks + list(range(90_000, 90_300)), session_id="s")
    while e.has_work() and e.step() is not None:
        e.pool.check_invariants()
    return e, nxt.num_cached_tokens


@pytest.mark.parametrize(
    "prompt",
    [
        1100,  # not block-aligned: the arrived state is the decode's only one (V4's 256-token blocks:
        # 1000 would hit 0 on the decode, whose window skips the block before 768 as vLLM's does)
        1025,  # the arrived KV (1,024 tokens) ends on a boundary
        1024,  # block-aligned: the decode's own last token saves the state at the prompt's end
        10,  # shorter than a block: nothing to cache, nothing to hit
    ],
)
def test_decode_caches_the_state_boundary_an_aggregated_engine_would(prompt):
    dec, hit_dec = _turns(Engine(V4), prompt, arrived=True)
    agg, hit_agg = _turns(Engine(V4), prompt, arrived=False)
    bs = dec.config.block_size
    assert hit_dec == hit_agg == prompt // bs * bs
    assert dec.stats.prompt_tokens < agg.stats.prompt_tokens  # the decode computed 1 token of turn 1
    g = _state_group(dec)
    hashes = dec.hasher.hashes(list(range(1, prompt + 1)), bs)
    k = prompt // bs
    for e in (dec, agg):  # both hold the state at the prompt's last boundary
        assert k == 0 or hashes[k - 1] in e.pool.cached_maps[g]


def test_no_arrived_state_past_what_the_local_hit_already_holds():
    """A decode whose own cache covers the arrived KV saves nothing twice; the pool stays consistent."""
    e, _ = _turns(Engine(V4), 1000, arrived=True)
    before = len(e.pool.cached_maps[_state_group(e)])
    toks = list(range(1, 1001))
    e.add_request("again", max_tokens=2, token_ids=toks, session_id="s", external_tokens=999)
    while e.has_work() and e.step() is not None:
        e.pool.check_invariants()
    assert len(e.pool.cached_maps[_state_group(e)]) == before


def _sessions(n: int, turns: int, first: int, grow: int) -> list[Trace]:
    """`n` sessions whose every turn's prompt extends the previous one (not block-aligned)."""
    out = []
    for i in range(n):
        reqs, ids = [], []
        for t in range(turns):
            size = first + t * grow
            ids = ids + [(i + 1) * 100_000 + j for j in range(len(ids), size // 16)]
            reqs.append(Request(t=0.0, input_tokens=size, output_tokens=8, hash_ids=list(ids)))
        out.append(Trace(id=f"s{i}", block_size=16, session=Session(id=f"s{i}", requests=reqs)))
    return out


def test_a_v4_disaggregated_decode_pool_hits_from_the_second_turn():
    """1p1d on DeepSeek-V4-Pro with the session decode router: each session's later turns find its
    earlier prompt on the decode engine, and only the new part of each prompt moves."""
    eng = EngineConfig(model="deepseek-v4-pro", tensor_parallel_size=4, max_model_len=32_000)
    cfg = SimConfig(
        engine=eng,
        lanes=2,
        prefill_workers=1,
        decode_workers=1,
        decode_router="session",
        system="gb300-nvl72",
    )
    traces = _sessions(2, 3, 3100, 1000)  # prompts 3,100 / 4,100 / 5,100 tokens
    s = simulate(traces, cfg).summary
    assert s.succeeded == 6 and s.failed == 0
    # turns 2 and 3 hit their previous prompt's last 256-token boundary (3,100 -> 3,072; 4,100 -> 4,096):
    # the arrived window holds the block before it (a prompt ending 128+ tokens past one would not)
    want = (3072 + 4096) / (3100 + 4100 + 5100)
    assert s.disagg.decode_hit_rate == pytest.approx(want, rel=1e-9)
    assert s.disagg.prefill_hit_rate == pytest.approx(want, rel=1e-9)
    # the KV moved: each turn's prompt but its last token, less what the decode caches, by group
    m = get_model("deepseek-v4-pro")
    rank = sum(
        kv_transfer_bytes(m, a, b, 256, eng.kv_dtype, 4) for a, b in ((0, 3099), (3072, 4099), (4096, 5099))
    )
    assert s.disagg.kv_transferred_gb == pytest.approx(2 * 4 * rank / 1e9, rel=1e-9)


def test_arrived_kv_takes_only_the_windows_tail_blocks():
    """vLLM takes no block for arrived tokens a window has moved past (the null block pads them): a
    1,100-token arrival holds 2 of V4's 256-token blocks in its 128-token window group, not 5, and
    caches the full one; an aggregated engine computing the prompt caches all 4 full ones."""
    dec, agg = Engine(V4), Engine(V4)
    for e, ext in ((dec, 1099), (agg, 0)):
        e.add_request("a", max_tokens=3, token_ids=list(range(1, 1101)), external_tokens=ext)
        while e.has_work() and e.step() is not None:
            e.pool.check_invariants()
    g = next(g for g, s in enumerate(dec.pool.specs) if s.rule == "sliding")
    assert len(dec.pool.cached_maps[g]) == 1 and len(agg.pool.cached_maps[g]) == 4
    assert len(dec.pool.cached_maps[0]) == len(agg.pool.cached_maps[0]) == 4
