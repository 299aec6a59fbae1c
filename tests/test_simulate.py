"""The cluster simulator: exact decode bursts, routing quality, offload, determinism, the CLI."""

import json
import subprocess
import sys

import msgspec
import pytest

from agentkv.engine.config import EngineConfig
from agentkv.sim.cluster import SimConfig, make_cluster, simulate
from agentkv.trace.blocks import chain_keys
from agentkv.trace.formats import bundled_sample, load_paths
from agentkv.trace.synth import synthesize


@pytest.fixture(scope="module")
def sample():
    return load_paths(bundled_sample())


def _key(res):
    return [
        (r.id, r.worker, round(r.first_token, 9), round(r.end, 9), r.cached_tokens, r.output_tokens)
        for r in sorted(res.records, key=lambda r: r.id)
    ]


def test_bursts_are_exact(sample):
    """Decode bursts are an optimisation only: every record equals the step-by-step run's."""
    eng = EngineConfig(num_gpu_blocks_override=12_000, max_model_len=200_000)
    base = dict(engine=eng, workers=2, lanes=4, router="least_loaded", max_requests=60)
    fast = simulate(sample, SimConfig(**base, bursts=True))
    slow = simulate(sample, SimConfig(**base, bursts=False))
    assert _key(fast) == _key(slow)
    assert fast.summary.preemptions == slow.summary.preemptions


def test_bursts_are_exact_in_an_overloaded_round_robin_run():
    """Overload (round robin, a small pool: preemptions, retried lookups after evictions): the
    fast paths still give every record of the step-by-step run."""
    eng = EngineConfig(num_gpu_blocks_override=9000, max_model_len=200_000)
    base = dict(engine=eng, workers=2, lanes=12, router="round_robin", max_requests=300)
    fast = simulate(synthesize(12, seed=3), SimConfig(**base, bursts=True))
    slow = simulate(synthesize(12, seed=3), SimConfig(**base, bursts=False))
    assert fast.summary.preemptions == slow.summary.preemptions > 0

    def rounded(res):  # a burst sums its step times at once: equal to 9 digits, as `_key`
        rows = [msgspec.to_builtins(r) for r in res.records]
        return [{k: round(v, 9) if isinstance(v, float) else v for k, v in r.items()} for r in rows]

    assert rounded(fast) == rounded(slow)
    assert fast.summary.cache.reported == slow.summary.cache.reported


def test_deterministic(sample):
    cfg = SimConfig(engine=EngineConfig(max_model_len=200_000), workers=2, lanes=3, max_requests=40)
    assert _key(simulate(sample, cfg)) == _key(simulate(sample, cfg))


def test_kv_aware_beats_round_robin_on_hits():
    traces = synthesize(12, seed=3)
    eng = EngineConfig(num_gpu_blocks_override=6000, max_model_len=200_000)
    hits = {}
    for router in ("round_robin", "kv_aware"):
        res = simulate(traces, SimConfig(engine=eng, workers=4, lanes=8, router=router))
        hits[router] = res.summary.cache.reported
    assert hits["kv_aware"] > hits["round_robin"] + 0.05, hits


def test_kv_weight_prices_prefill_against_load():
    """--kv-weight 0 routes on load alone (hits fall toward least_loaded's); the weight is recorded."""
    traces = synthesize(12, seed=3)
    eng = EngineConfig(num_gpu_blocks_override=6000, max_model_len=200_000)
    runs = {
        w: simulate(traces, SimConfig(engine=eng, workers=4, lanes=8, kv_weight=w)).summary
        for w in (0.0, 16.0)
    }
    assert runs[16.0].cache.reported > runs[0.0].cache.reported + 0.05, {
        w: s.cache.reported for w, s in runs.items()
    }
    assert runs[0.0].config["kv_weight"] == 0.0 and runs[16.0].config["kv_weight"] == 16.0


def test_pressure_evicts_and_offload_restores_hits(sample):
    eng = dict(num_gpu_blocks_override=9000, max_model_len=200_000)
    run = dict(lanes=3, max_requests=60)
    tight = simulate(sample, SimConfig(engine=EngineConfig(**eng), **run)).summary
    roomy = simulate(
        sample, SimConfig(engine=EngineConfig(num_gpu_blocks_override=60_000, max_model_len=200_000), **run)
    ).summary
    offload = simulate(sample, SimConfig(engine=EngineConfig(**eng, kv_offloading_size=64), **run)).summary
    assert tight.cache.reported < roomy.cache.reported - 0.05
    assert offload.cache.by_tier.get("CPU", 0) > 0.05
    assert offload.cache.reported > tight.cache.reported + 0.05
    assert tight.preemptions >= 0 and tight.failed == 0


def test_context_overflow_is_a_counted_failure(sample):
    res = simulate(sample, SimConfig(engine=EngineConfig(max_model_len=32_768), lanes=3))
    s = res.summary
    assert s.errors.get("context_overflow", 0) == s.failed > 0
    assert not s.valid and "context overflow" in s.invalid_reason


def test_cli_json_and_out(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentkv.cli",
            "simulate",
            "--lanes",
            "2",
            "--max-requests",
            "20",
            "--json",
            "--out",
            str(out),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary["schema"].startswith("agentkv.summary/") and summary["requests"] == 20
    assert (out / "summary.json").exists()
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 20 and msgspec.json.decode(lines[0])["trace"]


def test_cli_bad_input_is_one_line():
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "simulate", "--gpu", "h999", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr and "h999" in p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "simulate", "--sweep", "bogus=1,2", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "bogus" in p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "simulate", "--kv-weight", "-1", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "--kv-weight" in p.stderr and "Traceback" not in p.stderr


def test_sweep_prints_one_row_per_point():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentkv.cli",
            "simulate",
            "--lanes",
            "2",
            "--max-requests",
            "15",
            "--sweep",
            "router=round_robin,kv_aware",
            "--workers",
            "2",
            "--json",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert [r["overrides"]["router"] for r in rows] == ["round_robin", "kv_aware"]


def test_an_invalid_simulated_run_exits_3_and_says_why(capsys) -> None:
    """Every request longer than the context window: outputs still come, exit 3 as bench does."""
    from agentkv.cli import main

    assert main(["simulate", "--max-requests", "20", "-q", "--max-model-len", "4096", "--json"]) == 3
    err = capsys.readouterr().err
    assert "agentkv: invalid run:" in err and "context overflow" in err
    assert main(["simulate", "--max-requests", "20", "-q", "--json"]) == 0


def test_a_request_longer_than_the_kv_cache_fails_and_the_run_goes_on(sample):
    """A request needing more KV than one engine holds can never be scheduled: it fails as
    kv_cache_too_small (said once in the notes) and every other request still runs."""
    from agentkv.sim.limits import _max_len_for

    longest = _max_len_for(sample)
    blocks = int(longest * 0.6) // 16  # the longest requests cannot fit, the rest can
    eng = EngineConfig(num_gpu_blocks_override=blocks, max_model_len=longest)
    res = simulate(sample, SimConfig(engine=eng, workers=1, lanes=3))
    total = sum(len(s.requests) for t in sample for s in t.sessions())
    too_big = [r for r in res.records if r.error == "kv_cache_too_small"]
    assert len(res.records) == total  # nothing is left waiting when the run ends
    assert too_big and all(r.input_tokens + r.expected_output_tokens > blocks * 16 - 16 for r in too_big)
    assert all(r.ok for r in res.records if r.error != "kv_cache_too_small")
    assert sum(n.startswith("kv_cache_too_small") for n in res.summary.notes) == 1


@pytest.mark.parametrize(
    "model, kw",
    [
        ("Llama-3.1-8B", dict(num_gpu_blocks_override=9000)),
        ("gpt-oss-120b", dict(num_gpu_blocks_override=12000)),
        (
            "DeepSeek-V4-Flash",
            dict(tensor_parallel_size=2, kv_cache_dtype="fp8", num_gpu_blocks_override=600),
        ),
    ],
)
def test_deferred_decodes_are_exact(model, kw):
    """Steps where one prefill runs beside quiet decoders skip the decoders (their updates wait, the
    allocations of those reaching a block boundary run in order): with them every record equals the
    run without them to the bit, and the step-by-step run's as decode bursts do (9 digits); the
    preemptions, hit rate and every token gap too, on dense and hybrid pools; and such steps ran."""
    eng = EngineConfig(gpu="h200", model=model, max_model_len=200_000, max_num_batched_tokens=2048, **kw)
    base = dict(engine=eng, workers=1, lanes=10, router="round_robin", max_requests=150)
    traces = synthesize(10, seed=5)
    runs = []
    for bursts, defer in ((True, True), (True, False), (False, False)):
        c = make_cluster(traces, SimConfig(**base, bursts=bursts))
        for w in c.workers:
            w.engine.defer_decodes = defer
        runs.append((c, c.run()))
    (fast, a), (bursts_only, b), (slow, c) = runs
    rows = [[msgspec.to_builtins(r) for r in res.records] for res in (a, b, c)]
    assert rows[0] == rows[1]
    assert _rounded(rows[0]) == _rounded(rows[2])
    assert a.summary.preemptions == b.summary.preemptions == c.summary.preemptions > 0
    assert a.summary.cache.reported == c.summary.cache.reported
    assert sorted(fast.itl) == sorted(bursts_only.itl)  # every token gap (appended later, in another order)
    assert sum(w.engine.deferred_steps for w in fast.workers) > 0
    assert sum(w.engine.deferred_steps for w in bursts_only.workers) == 0


def _rounded(rows):
    """Records with floats to 9 digits (a decode burst sums its step times at once)."""
    return [{k: round(v, 9) if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def test_a_turns_key_list_reuses_its_sessions_previous_list_and_equals_a_fresh_one(shared_dir):
    """Each request's block keys as Python ints (what routers and engines read) equal the keys
    computed afresh, although a session's later turns resume its previous turn's chain and take the
    prefix they share from that turn's list (real Claude Code traces, sub-agents included); a
    session's entry is gone once its last request is dispatched."""
    from pathlib import Path

    files = sorted(Path(shared_dir, "traces", "claude-code").glob("*.json*"), key=lambda p: p.stat().st_size)
    traces = load_paths(files[:6])
    cluster = make_cluster(traces, SimConfig(engine=EngineConfig(), workers=2, lanes=8))
    made, reused = cluster._key_list, []

    def checked(item, chain):
        last = cluster._turn_keys.get(item.session_key)
        out = made(item, chain)
        assert out == chain.keys.tolist() and type(out) is list
        r = item.request  # (the chain resumed from the previous turn's: the keys computed afresh)
        assert (
            out
            == chain_keys(
                item.hash_space, r.hash_ids, item.trace.block_size, cluster.ecfg.block_size, r.input_tokens
            ).tolist()
        )
        if last is not None and len(out) and len(last[1]) and out[0] is last[1][0]:
            reused.append(len(out))  # (the same int objects: taken from the previous list)
        return out

    cluster._key_list = checked
    res = cluster.run()
    turns = sum(len(s.requests) - 1 for t in traces for s in t.sessions())
    assert len(res.records) == sum(t.num_requests for t in traces)
    assert len(reused) > turns // 2  # most later turns extend their session's context
    assert cluster._turn_keys == {}


def test_a_sessions_kept_keys_go_with_its_last_request_even_when_refused(shared_dir):
    """A session whose last request no engine can take (longer than max_model_len) still drops the
    keys kept for its next turn; the refused requests are failed records."""
    from pathlib import Path

    files = sorted(Path(shared_dir, "traces", "claude-code").glob("*.json*"), key=lambda p: p.stat().st_size)
    traces = load_paths(files[:6])
    cluster = make_cluster(traces, SimConfig(engine=EngineConfig(max_model_len=20_000), workers=2, lanes=8))
    res = cluster.run()
    assert sum(not r.ok for r in res.records) > 0
    assert cluster._turn_keys == {}
