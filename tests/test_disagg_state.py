"""A disaggregated decode's prefix cache. On a model with a Mamba-style `state` group (Qwen3-Next's
Gated DeltaNet) the state at the arrived KV's last block boundary comes with the KV, so the decode
engine caches the boundary an aggregated engine holding the same prompt would. On DeepSeek-V4, whose
compressor buffers vLLM keeps as 8- and 128-token sliding windows, the arrived KV fills only each
window's tail, so the decode caches no boundary a later turn can hit (vLLM pads the rest with its
null block)."""

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.kv_move import kv_transfer_bytes
from agentkv.engine.models import get_model
from agentkv.sim.cluster import SimConfig, simulate
from agentkv.trace.model import Request, Session, Trace

V4 = EngineConfig(model="deepseek-v4-pro", gpu="gb300", tensor_parallel_size=4, max_model_len=8192)
QWEN_NEXT = EngineConfig(model="qwen3-next-80b-a3b", tensor_parallel_size=4, max_model_len=16384)


def _state_group(e: Engine) -> int:
    return next(g for g, s in enumerate(e.pool.specs) if s.rule == "state")


def _window_group(e: Engine, window: int) -> int:
    return next(g for g, s in enumerate(e.pool.specs) if s.rule == "sliding" and s.window == window)


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
    "extra",
    [
        76,  # not block-aligned: the arrived state is the decode's only one
        1,  # the arrived KV ends on a boundary
        0,  # block-aligned: the replay boundary is a block short of the prompt's end (vLLM 0.32)
        -262,  # shorter than a block: nothing to cache, nothing to hit
    ],
)
def test_decode_caches_the_state_boundary_an_aggregated_engine_would(extra):
    bs = Engine(QWEN_NEXT).config.block_size
    prompt = 4 * bs + extra if extra > -bs else 10
    dec, hit_dec = _turns(Engine(QWEN_NEXT), prompt, arrived=True)
    agg, hit_agg = _turns(Engine(QWEN_NEXT), prompt, arrived=False)
    assert hit_dec == hit_agg == (prompt - 1) // bs * bs
    assert dec.stats.prompt_tokens < agg.stats.prompt_tokens  # the decode computed 1 token of turn 1
    g = _state_group(dec)
    hashes = dec.hasher.hashes(list(range(1, prompt + 1)), bs)
    k = (prompt - 1) // bs
    for e in (dec, agg):  # both hold the state at the prompt's replay boundary
        assert k == 0 or hashes[k - 1] in e.pool.cached_maps[g]


def test_no_arrived_state_past_what_the_local_hit_already_holds():
    """A decode whose own cache covers the arrived KV saves nothing twice; the pool stays consistent."""
    bs = Engine(QWEN_NEXT).config.block_size
    prompt = 4 * bs - 24
    e, _ = _turns(Engine(QWEN_NEXT), prompt, arrived=True)
    before = len(e.pool.cached_maps[_state_group(e)])
    toks = list(range(1, prompt + 1))
    e.add_request("again", max_tokens=2, token_ids=toks, session_id="s", external_tokens=prompt - 1)
    while e.has_work() and e.step() is not None:
        e.pool.check_invariants()
    assert len(e.pool.cached_maps[_state_group(e)]) == before


@pytest.mark.parametrize(
    ("prompt", "want"),
    [
        (1100, 0),  # the arrived 8-token compressor window (4-token blocks) starts at 1,092: past 1,016
        (1024, 0),  # the arrival ends at 1,023: its last cut is 768, long out of every window
        (1028, 0),  # arrival 1,027: the window's blocks start at 1,020, one past what a hit at 1,024 needs
        (1027, 1024),  # arrival 1,026: they start at 1,016 (and the 128-token windows' at 896): a hit
        (1025, 1024),
    ],
)
def test_a_v4_decode_caches_a_boundary_only_where_its_windows_own_blocks_hold_it(prompt, want):
    """V4's windows run on 4-, 8- and 64-token blocks in vLLM: the arrived KV fills only the blocks of
    each window's tail, so the decode's next turn hits only a boundary a few tokens before the arrival's
    end, where an aggregated engine hits the window it kept before the prompt's replay boundary
    ((prompt - 1) // 256 blocks: vLLM 0.32's sparse retention)."""
    _, hit_dec = _turns(Engine(V4), prompt, arrived=True)
    agg, hit_agg = _turns(Engine(V4), prompt, arrived=False)
    assert not agg.pool.has_state  # vLLM's V4 has no Mamba group: no block-aligned prefill chunks
    assert (hit_dec, hit_agg) == (want, (prompt - 1) // 256 * 256)


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


def test_a_v4_disaggregated_decode_pool_moves_every_turns_whole_prompt():
    """1p1d on DeepSeek-V4-Pro with the session decode router: the prefill engine hits each session's
    earlier prompt, the decode engine none (its compressor windows hold only the arrived tails), so
    each turn's whole prompt moves."""
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
    # turns 2 and 3 hit their previous prompt's replay boundary on the prefill engine (3,099 -> 3,072;
    # 4,099 -> 4,096)
    assert s.disagg.prefill_hit_rate == pytest.approx((3072 + 4096) / (3100 + 4100 + 5100), rel=1e-9)
    assert s.disagg.decode_hit_rate == 0
    # the KV moved: each turn's prompt but its last token, by group
    m = get_model("deepseek-v4-pro")
    rank = sum(kv_transfer_bytes(m, 0, b, 256, eng.kv_dtype, 4) for b in (3099, 4099, 5099))
    assert s.disagg.kv_transferred_gb == pytest.approx(2 * 4 * rank / 1e9, rel=1e-9)


def test_arrived_kv_takes_only_the_windows_tail_blocks():
    """vLLM takes no block for arrived tokens a window has moved past (the null block pads them): a
    1,100-token arrival holds 2 of V4's 256-token blocks in its 128-token window group, not 5, and
    the 8-token compressor window only the partial last block. Neither caches a block: in vLLM's own
    blocks (64- and 8-token) the arrived window starts at 960 and 968, past the 896 a hit at 1,024
    needs. An aggregated engine caches, in each window group, the block before the replay boundary."""
    dec, agg = Engine(V4), Engine(V4)
    for e, ext in ((dec, 1099), (agg, 0)):
        e.add_request("a", max_tokens=3, token_ids=list(range(1, 1101)), external_tokens=ext)
        while e.has_work() and e.step() is not None:
            if e is dec and e.pool.tables.get("a"):
                held = [int((t >= 0).sum()) for t in e.pool.tables["a"]]
            e.pool.check_invariants()
    w128, w8 = _window_group(dec, 128), _window_group(dec, 8)
    assert (held[w128], held[w8], held[0]) == (2, 1, 5)
    hashes = dec.hasher.hashes(list(range(1, 1101)), 256)
    assert list(dec.pool.cached_maps[w128]) == list(dec.pool.cached_maps[w8]) == []
    assert list(agg.pool.cached_maps[w128]) == list(agg.pool.cached_maps[w8]) == [hashes[3]]
    assert len(dec.pool.cached_maps[0]) == len(agg.pool.cached_maps[0]) == 4
