"""`cache analyze` on models with hybrid KV groups: a cell is what the engine's `HybridPool` serves for
the same requests one at a time, a window-only model keeps hits a full-attention one loses, a state
model's ceiling is where states were saved, and Belady or a CPU tier is refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv.cache.analyze import analyze
from agentkv.cache.grid import make_grid
from agentkv.cli import main
from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.hardware import get_model
from agentkv.engine.models.layout import page_bytes
from agentkv.trace.accesses import arrivals, block_accesses
from agentkv.trace.ceiling import ceiling_tokens
from agentkv.trace.formats import load_paths
from agentkv.trace.formats.agentx import write_agentx
from agentkv.trace.model import Request, Session, Trace

OSS = "gpt-oss-120b"
MODELS = Path(__file__).resolve().parents[1] / "agentkv" / "data" / "models"


def _trace(tid: str, turns: list[tuple[float, int, list[int]]], out: int = 16) -> Trace:
    """A session of (arrival, prompt tokens, 16-token hash ids) turns, each answered in `out` tokens."""
    reqs = [
        Request(t=t, input_tokens=n, output_tokens=out, hash_ids=ids, api_time=0.5) for t, n, ids in turns
    ]
    return Trace(id=tid, block_size=16, session=Session(id=tid, requests=reqs))


def _agents() -> list[Trace]:
    """Three agents sharing a 2,000-token system prompt; each turn's prompt is the last one plus
    1,600 tokens, up to 10,000 (past the 8,192-token prefill chunk); their turns interleave."""
    out = []
    for s in range(3):
        ids, turns = list(range(125)), []
        for k in range(6):
            turns.append((s * 0.7 + 3.0 * k, 16 * len(ids), list(ids)))
            ids += range(10_000 * (s + 1) + 100 * k, 10_000 * (s + 1) + 100 * (k + 1))
        out.append(_trace(f"agent{s}", turns, out=200))
    return out


def _engine(model: str, block_size: int, pages: int, traces: list[Trace]) -> tuple[int, int, int]:
    """(hit tokens, requests that cannot run, evicted blocks) of the engine, one request at a time
    (decode bursts, as the simulator drives it) on `pages` of vLLM's pages."""
    cfg = EngineConfig(
        model=model, block_size=block_size, max_model_len=1 << 21, num_gpu_blocks_override=pages
    )
    e, hits, big = Engine(cfg), 0, 0
    for i, r in enumerate(block_accesses(arrivals(traces), block_size)):
        if r.input_tokens + r.output_tokens > e.max_seq_tokens:
            big += 1
            continue
        req = e.add_request(
            str(i), max_tokens=max(1, r.output_tokens), prompt_len=r.input_tokens, block_hashes=r.hashes
        )
        while e.has_work():
            burst = e.plan_burst()
            if burst is not None:
                e.commit_burst(burst, len(burst.ends))
            elif e.step() is None:  # it cannot run even alone
                e.abort(str(i))
                big += 1
                break
        else:
            hits += req.num_cached_tokens
    return hits, big, e.pool.stats.evicted


def _check_engine(model: str, block_size: int, pages: int, traces: list[Trace]):
    """The analysis of `traces` at the engine's capacity of `pages` (its null page left out): its
    one cell is the engine's figures, and the full-attention group's ceiling is `ceiling_tokens`."""
    unit = page_bytes(get_model(model), block_size)
    a = analyze(traces, make_grid(str((pages - 1) * unit), str(block_size), None, model))
    assert a.policies == ["lru"] and [g.rule for g in a.kv_groups][0] == "full"
    cell, ceiling = a.results[0], a.ceilings[0]
    assert (cell.hit_tokens, cell.too_big, cell.evicted) == _engine(model, block_size, pages, traces)
    full = ceiling_tokens(block_accesses(arrivals(traces), block_size), block_size)
    assert ceiling.groups[0].hit_tokens == full and ceiling.hit_tokens <= full
    assert all(g.hit_tokens >= cell.hit_tokens for g in cell.groups)  # a hit is what every group serves
    return a


@pytest.mark.parametrize("pages", [1100, 1600])
def test_gpt_oss_cells_are_what_the_engines_hybrid_pool_serves(pages):
    a = _check_engine(OSS, 16, pages, _agents())
    cell, ceiling = a.results[0], a.ceilings[0]
    assert cell.evicted > 0 and 0 < cell.hit_tokens < ceiling.hit_tokens  # eviction cost hits
    # a full-attention group needs every block, a window only its last ones: the window group alone
    # keeps more of its hits under eviction, and the ceilings agree (every window block was cached)
    assert cell.groups[1].hit_tokens > cell.groups[0].hit_tokens
    assert ceiling.hit_tokens == ceiling.groups[0].hit_tokens == ceiling.groups[1].hit_tokens


@pytest.mark.shared
@pytest.mark.parametrize(("model", "pages"), [(OSS, 1000), (OSS, 3000), ("qwen3-next", 2000)])
def test_real_sessions_match_the_engine(shared_dir, model, pages):
    names = ("trace_0702", "trace_0076")
    traces = load_paths([shared_dir / "traces" / "claude-code" / f"{t}.json.gz" for t in names])
    a = _check_engine(model, 64, pages, traces)
    assert a.results[0].hit_tokens > 0
    if model == OSS:  # a full group and windows: the ceiling is the full-attention one
        assert a.ceilings[0].hit_tokens == a.ceilings[0].groups[0].hit_tokens


def _model(tmp_path: Path, layer: str) -> Path:
    """gpt-oss-120b's config with every layer `layer`, windows of 32 tokens."""
    cfg = json.loads((MODELS / "gpt_oss.json").read_text())
    cfg["layer_types"] = [layer] * cfg["num_hidden_layers"]
    cfg["sliding_window"] = 32
    path = tmp_path / f"{layer}.json"
    path.write_text(json.dumps(cfg))
    return path


def _analyze(capsys, *argv: str) -> dict:
    assert main(["cache", "analyze", *argv, "--block-size", "16", "--json", "-q"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_window_only_model_keeps_the_hit_a_full_attention_model_loses(tmp_path, capsys):
    # A (160 tokens), B (unrelated, 128), then C = A's prompt + 40 tokens, in a 14-block pool.
    # Full attention: A's 10 blocks are freed tail first and B evicts 5 of them from the tail: C hits
    # the 5 left at the head, 80 tokens. A 32-token window: A freed its 8 blocks before the window
    # as it decoded, B evicts 5 of those, and C finds the 2 blocks before its cut: 160 tokens.
    a_ids, trace_dir = list(range(1, 11)), tmp_path / "traces"
    turns = [(0.0, 160, a_ids), (1.0, 128, list(range(100, 108))), (2.0, 200, [*a_ids, 20, 21, 22])]
    trace_dir.mkdir()
    write_agentx(_trace("abc", turns), trace_dir / "abc.json")
    block = 16 * get_model(str(_model(tmp_path, "full_attention"))).kv_bytes_per_token("bf16")
    flags = [str(trace_dir), "--capacity", str(int(14 * block))]
    window = _analyze(capsys, *flags, "--model", str(_model(tmp_path, "sliding_attention")))
    full = _analyze(capsys, *flags, "--model", str(_model(tmp_path, "full_attention")))
    assert full["kv_groups"] == [] and len(full["policies"]) > 1  # one table: every policy
    assert [(g["rule"], g["window"]) for g in window["kv_groups"]] == [("sliding", 32)]
    assert window["policies"] == ["lru"] and window["results"][0]["num_blocks"] == 14
    lru = next(r for r in full["results"] if r["policy"] == "lru")
    assert (lru["hit_tokens"], window["results"][0]["hit_tokens"]) == (80, 160)
    assert window["ceilings"][0]["hit_tokens"] == full["ceilings"][0]["hit_tokens"] == 160
    assert lru["query_tokens"] == window["results"][0]["query_tokens"] == 160 + 128 + 200


def test_a_state_models_ceiling_is_where_states_were_saved(tmp_path, capsys):
    # B shares A's first 5 blocks; a state is saved only where a prefill chunk ended (A's 10th block),
    # so the full-attention group alone would serve B 80 tokens and the model none. C extends A.
    a_ids, trace_dir = list(range(1, 11)), tmp_path / "traces"
    turns = [(0.0, 160, a_ids), (1.0, 160, [*a_ids[:5], *range(50, 55)]), (2.0, 200, [*a_ids, 20, 21, 22])]
    trace_dir.mkdir()
    write_agentx(_trace("abc", turns), trace_dir / "abc.json")
    a = _analyze(capsys, str(trace_dir), "--model", "qwen3-next", "--capacity", "10GB")
    ceiling = a["ceilings"][0]
    assert [g["rule"] for g in a["kv_groups"]] == ["full", "state"]
    assert ceiling["hit_tokens"] == 160  # C: A's saved state at its 10th block
    assert [g["hit_tokens"] for g in ceiling["groups"]] == [80 + 160, 160]
    assert a["results"][0]["hit_tokens"] == 160  # 10GB holds it all


def test_the_table_shows_each_groups_own_figure(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert (
        main(["cache", "analyze", "--model", OSS, "--capacity", "4GB,24GB", "--block-size", "64", "-q"]) == 0
    )
    out = capsys.readouterr().out
    assert "full_attention 2,359,296, sliding_window 128 2,359,296 bytes a 64-token block" in out
    assert "sliding_window 128 alone" in out and "pages" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policy", "belady"], "--policy belady: gpt-oss-120b has hybrid KV groups"),
        (["--policy", "lru,arc"], "--policy arc: gpt-oss-120b has hybrid KV groups"),
        (["--cpu", "100GB"], "--cpu: gpt-oss-120b has hybrid KV groups"),
        (["--capacity", "1MB"], "--capacity: 1MB holds no block of 16 tokens of gpt-oss-120b"),
        (["--model", "llama-4-scout", "--block-size", "192"], "--block-size: 192 does not divide"),
    ],
)
def test_what_a_hybrid_pool_cannot_do_is_one_line(flags, message, capsys):
    assert main(["cache", "analyze", "--model", OSS, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err
