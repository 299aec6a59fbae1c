"""`cache analyze` on models with hybrid KV groups: a cell is what the engine's `HybridPool` serves for
the same requests one at a time, a window-only model keeps hits a full-attention one loses, a state
model's ceiling is where states were saved, a CPU tier and the other policies run as the engine
runs them, and Belady is refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv.cache.analyze import analyze
from agentkv.cache.grid import make_grid
from agentkv.cache.view import chart_series, write_plot
from agentkv.cli import main
from agentkv.engine.block_size import vllm_block_size
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


def _engine(
    model: str, block_size: int, pages: int, traces: list[Trace], cpu_gib: float = 0.0, policy: str = "lru"
) -> tuple[dict[str, int], int, int]:
    """(hit tokens by tier, requests that cannot run, evicted blocks) of the engine, one request at
    a time (decode bursts, as the simulator drives it) on `pages` of vLLM's pages, with a CPU tier
    of `cpu_gib` (--kv-offloading-size) and `policy`."""
    cfg = EngineConfig(
        model=model,
        block_size=block_size,
        max_model_len=1 << 21,
        num_gpu_blocks_override=pages,
        kv_offloading_size=cpu_gib,
        eviction_policy=policy,
    )
    e, hits, big = Engine(cfg), {"GPU": 0, **({"CPU": 0} if cpu_gib else {})}, 0
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
            hits["GPU"] += req.num_cached_tokens
            for tier, n in req.lower_tier_tokens.items():
                hits[tier] += n
    return hits, big, e.pool.stats.evicted


def _check_engine(
    model: str, block_size: int, pages: int, traces: list[Trace], cpu_gib: int = 0, policy: str | None = None
):
    """The analysis of `traces` at the engine's capacity of `pages` (its null page left out), with a
    CPU tier of `cpu_gib` and `policy` (default LRU): its one cell is the engine's figures, and the
    full-attention group's ceiling is `ceiling_tokens`."""
    block_size = vllm_block_size(model, block_size).size  # what both run (Qwen3-Next: its aligned page)
    unit = page_bytes(get_model(model), block_size)
    cpu = f"{cpu_gib}GiB" if cpu_gib else None
    a = analyze(traces, make_grid(str((pages - 1) * unit), str(block_size), policy, model, cpu=cpu))
    assert a.policies == [policy or "lru"] and [g.rule for g in a.kv_groups][0] == "full"
    cell, ceiling = a.results[0], a.ceilings[0]
    engine = _engine(model, block_size, pages, traces, cpu_gib, policy or "lru")
    assert (cell.tier_hit_tokens, cell.too_big, cell.evicted) == engine
    assert cell.hit_tokens == sum(cell.tier_hit_tokens.values())
    full = ceiling_tokens(block_accesses(arrivals(traces), block_size), block_size)
    assert ceiling.groups[0].hit_tokens == full and ceiling.hit_tokens <= full
    assert all(g.hit_tokens >= cell.hit_tokens for g in cell.groups)  # a hit is what every group serves
    return a


@pytest.mark.parametrize("pages", [1100, 1600])
def test_gpt_oss_cells_are_what_the_engines_hybrid_pool_serves(pages):
    a = _check_engine(OSS, 16, pages, _agents())
    cell, ceiling = a.results[0], a.ceilings[0]
    assert cell.evicted > 0 and 0 < cell.hit_tokens < ceiling.hit_tokens  # eviction cost hits
    # as vLLM 0.32, a window group caches only the window before each prompt's replay boundary, so it
    # is the group that binds: the cell's hits are its hits, under eviction and in the ceiling (a hit
    # away from an earlier prompt's end is the full group's alone)
    assert cell.hit_tokens == cell.groups[1].hit_tokens < cell.groups[0].hit_tokens
    assert ceiling.hit_tokens == ceiling.groups[1].hit_tokens < ceiling.groups[0].hit_tokens


@pytest.mark.shared
@pytest.mark.parametrize(("model", "pages"), [(OSS, 1000), (OSS, 3000), ("qwen3-next", 2000)])
def test_real_sessions_match_the_engine(shared_dir, model, pages):
    names = ("trace_0702", "trace_0076")
    traces = load_paths([shared_dir / "traces" / "claude-code" / f"{t}.json.gz" for t in names])
    a = _check_engine(model, 64, pages, traces)
    assert a.results[0].hit_tokens > 0
    if model == OSS:  # a full group and windows: the ceiling is the full-attention one
        assert a.ceilings[0].hit_tokens == a.ceilings[0].groups[0].hit_tokens


def _small_state_model(tmp_path: Path) -> str:
    """Qwen3-Next with one small linear-attention head (a 9,344-byte state per layer, under a 16-token
    attention page), so vLLM keeps 16-token blocks for it: block-level cases stay small."""
    cfg = json.loads((MODELS / "qwen3_next.json").read_text())
    cfg.update(
        linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=64, linear_value_head_dim=64
    )
    path = tmp_path / "small_state.json"
    path.write_text(json.dumps(cfg))
    assert vllm_block_size(str(path), 16).size == 16
    return str(path)


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
    # the 5 left at the head, 80 tokens. A 32-token window: A caches only the 2 blocks before its
    # replay boundary (159 // 16 = 9 blocks: vLLM 0.32's sparse retention), B leaves them, and C
    # finds them before the cut at 9: 144 tokens.
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
    assert (lru["hit_tokens"], window["results"][0]["hit_tokens"]) == (80, 144)
    assert (window["ceilings"][0]["hit_tokens"], full["ceilings"][0]["hit_tokens"]) == (144, 160)
    assert lru["query_tokens"] == window["results"][0]["query_tokens"] == 160 + 128 + 200


def test_a_state_models_ceiling_is_where_states_were_saved(tmp_path, capsys):
    # B shares A's first 5 blocks. A state is cached only at a prompt's replay boundary (A is block-
    # aligned: its 9th block, a block short of its end) or a junction, so the full-attention group
    # alone would serve B 80 tokens and the model none; B saves its junction's state. C extends A.
    a_ids, trace_dir = list(range(1, 11)), tmp_path / "traces"
    turns = [(0.0, 160, a_ids), (1.0, 160, [*a_ids[:5], *range(50, 55)]), (2.0, 200, [*a_ids, 20, 21, 22])]
    trace_dir.mkdir()
    write_agentx(_trace("abc", turns), trace_dir / "abc.json")
    a = _analyze(capsys, str(trace_dir), "--model", _small_state_model(tmp_path), "--capacity", "10GB")
    ceiling = a["ceilings"][0]
    assert [g["rule"] for g in a["kv_groups"]] == ["full", "state"]
    assert ceiling["hit_tokens"] == 144  # C: A's state at its 9th block
    assert [g["hit_tokens"] for g in ceiling["groups"]] == [80 + 160, 144]
    assert a["results"][0]["hit_tokens"] == 144  # 10GB holds it all


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
        (["--policy", "lru,belady"], "use lru, lfu, radix, arc, session (the ceiling is the unbounded"),
        (["--cpu", "500KB"], "--cpu: 500KB holds no block of 16 tokens (589,824 bytes)"),
        (["--capacity", "1MB"], "--capacity: 1MB holds no block of 16 tokens of gpt-oss-120b"),
        (["--model", "llama-4-scout", "--block-size", "192"], "--block-size: 192 does not divide"),
    ],
)
def test_what_a_hybrid_pool_cannot_do_is_one_line(flags, message, capsys):
    assert main(["cache", "analyze", "--model", OSS, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize(("cpu_gib", "policy"), [(1, None), (1, "lfu"), (0, "arc")])
def test_a_cpu_tier_and_other_policies_are_what_the_engine_serves(cpu_gib, policy):
    # the cell's pool is the engine's (`engine.pools.hybrid_pool`): a CPU tier keeps each group's
    # evicted blocks and serves the hit every group finds on the GPU or below, as the engine does
    a = _check_engine(OSS, 16, 1100, _agents(), cpu_gib, policy)
    cell, ceiling = a.results[0], a.ceilings[0].hit_tokens
    assert cell.evicted > 0 and cell.tier_hit_tokens["GPU"] < ceiling
    if cpu_gib:  # 1 GiB (1,820 blocks of a group) holds what the GPU evicts between turns: every hit
        assert cell.tier_hit_tokens["CPU"] > 0 and cell.hit_tokens == ceiling


def test_lfu_keeps_a_prompt_read_three_times_where_lru_lets_it_go(tmp_path, capsys):
    # A three times, then B and C (unrelated, as large), then A again, in 32 blocks of a group's
    # bytes; each request holds 18 (9 in each group). LRU evicts A's blocks, the least recently
    # freed, for B and C: A misses. LFU evicts B's, read once, and keeps A's: A hits its 7 blocks.
    a, trace_dir = list(range(1, 9)), tmp_path / "traces"
    turns = [(float(t), 128, ids) for t, ids in enumerate([a, a, a, range(100, 108), range(200, 208), a])]
    trace_dir.mkdir()
    write_agentx(_trace("abc", [(t, n, list(ids)) for t, n, ids in turns]), trace_dir / "abc.json")
    block = 16 * get_model(OSS).kv_bytes_per_token("bf16") // 2  # one group's block
    out = _analyze(
        capsys, str(trace_dir), "--model", OSS, "--capacity", str(32 * block), "--policy", "lru,lfu"
    )
    hits = {r["policy"]: r["hit_tokens"] for r in out["results"]}
    assert hits == {"lru": 2 * 112, "lfu": 3 * 112}
    assert out["ceilings"][0]["hit_tokens"] == hits["lfu"]  # A's three repeats


@pytest.mark.shared
def test_a_cpu_tier_raises_the_hit_rate_on_real_sessions(shared_dir):
    # 3 GB evicts (both policies lose hits), a 20 GB tier below keeps what the GPU lets go
    names = ("trace_0702", "trace_0076")
    traces = load_paths([shared_dir / "traces" / "claude-code" / f"{t}.json.gz" for t in names])
    runs = [analyze(traces, make_grid("3GB", "64", "lru,lfu", OSS, cpu=cpu)) for cpu in (None, "20GB")]
    for gpu_only, tiered in zip(runs[0].results, runs[1].results, strict=True):
        assert tiered.tier_hit_tokens["GPU"] > 0 and tiered.tier_hit_tokens["CPU"] > 0
        assert gpu_only.hit_tokens < tiered.hit_tokens <= runs[1].ceilings[0].hit_tokens
        assert tiered.hit_tokens == sum(tiered.tier_hit_tokens.values())


def test_the_plot_draws_each_groups_own_line(tmp_path):
    # gpt-oss at two capacities that evict: the full-attention group alone keeps more hits than the
    # model (its line is drawn, dashed, at its own figures); the window group, which caches only the
    # window before each prompt's replay boundary, binds
    unit = page_bytes(get_model(OSS), 16)
    a = analyze(_agents(), make_grid(f"{1099 * unit},{1599 * unit}", "16", None, OSS))
    series = {s.name: s for s in chart_series(a, 16)}
    cells = sorted(a.results, key=lambda r: r.capacity_bytes)
    full = series["lru: full_attention alone"]
    assert full.dash and full.ys == [100 * r.groups[0].hit_rate for r in cells]
    assert full.ys > series["lru"].ys == [100 * r.hit_rate for r in cells]
    for name, g in (("lru: sliding_window 128 alone", 1),):  # drawn only where it differs from the model's
        differs = any(abs(r.groups[g].hit_rate - r.hit_rate) >= 5e-4 for r in cells)
        assert (name in series) == differs
    # unbounded, the window's retention loses a few hits the full-attention group would serve: both drawn
    assert [n for n in series if n.startswith("unbounded")] == [
        "unbounded",
        "unbounded: full_attention alone",
    ]
    write_plot(a, tmp_path / "chart.svg")
    assert "lru: full_attention alone" in (tmp_path / "chart.svg").read_text()


def test_the_plot_draws_a_state_models_full_group_ceiling(tmp_path):
    # a Qwen3-Next: the full-attention group alone would serve 240 tokens unbounded, the model 144 (the
    # state at A's replay boundary, its 9th block): a dashed ceiling line at 240 / 520; a dense model draws none
    a_ids = list(range(1, 11))
    turns = [(0.0, 160, a_ids), (1.0, 160, [*a_ids[:5], *range(50, 55)]), (2.0, 200, [*a_ids, 20, 21, 22])]
    a = analyze([_trace("abc", turns)], make_grid("10GB,20GB", "16", None, _small_state_model(tmp_path)))
    series = {s.name: s for s in chart_series(a, 16)}
    assert series["unbounded"].ys == [100 * 144 / 520] * 2
    assert series["unbounded: full_attention alone"].ys == [100 * 240 / 520] * 2
    dense = analyze([_trace("abc", turns)], make_grid("10GB,20GB", "16", "lru", "llama3-8b"))
    assert [s.name for s in chart_series(dense, 16)] == ["lru", "unbounded"]
