"""benchmarks/simulate.py's block-work line: the KV blocks a run's pools allocated and evicted per
simulated request, which tells simulated churn (a pool too small for its sessions) from pool cost."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.sim.cluster import SimConfig, make_cluster
from agentkv.trace.synth import synthesize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from simulate import block_work  # noqa: E402

SHARED = Path(os.environ.get("AGENTKV_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def _run(blocks: int, model: str = "Llama-3.1-8B"):
    eng = EngineConfig(model=model, num_gpu_blocks_override=blocks, max_model_len=200_000)
    cluster = make_cluster(
        synthesize(6, seed=3), SimConfig(engine=eng, workers=2, lanes=6, router="round_robin")
    )
    res = cluster.run()
    return cluster, len(res.records)


def _figures(line: str) -> tuple[float, float, float]:
    m = re.fullmatch(
        r"blocks per request: ([\d,]+) allocated, ([\d,]+) evicted; ([\d.]+) us CPU per allocated block", line
    )
    assert m, line
    return tuple(float(x.replace(",", "")) for x in m.groups())


def test_block_work_sums_every_replica_pool_and_shows_a_small_pool_churning():
    big, n_big = _run(60_000)
    small, n_small = _run(20_000)
    assert n_big == n_small > 0
    alloc = sum(w.engine.pool.stats.allocated for w in small.workers)
    evicted = sum(w.engine.pool.stats.evicted for w in small.workers)
    a, e, us = _figures(block_work(small, n_small, 2.0))
    assert round(a) == round(alloc / n_small) and round(e) == round(evicted / n_small)
    assert us == round(2.0 / alloc * 1e6, 2)
    a_big, e_big, _ = _figures(block_work(big, n_big, 2.0))
    assert e_big < e  # the same traces evict more, and recompute more, in a pool too small for them
    assert a_big <= a


def test_block_work_reads_a_hybrid_pool_per_group_blocks():
    cluster, n = _run(8_000, model="gpt-oss-120b")  # full attention and a sliding window: two groups
    assert cluster.workers[0].engine.hybrid
    a, e, _ = _figures(block_work(cluster, n, 1.0))
    alloc = sum(w.engine.pool.stats.allocated for w in cluster.workers)
    assert a == round(alloc / n) > 0 and e >= 0


def _bench(*args: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, str(root / "benchmarks" / "simulate.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )


def test_the_claude_code_runs_repeat_in_rounds_and_keep_their_least_cpu():
    """`--only claude --repeat 2`: each of the three runs twice, one each a round, its least CPU in the
    table and the two ratios printed (overload's own cost first, with its round-by-round spread);
    `--repeat 0` is refused."""
    if not (SHARED / "traces" / "claude-code").is_dir():
        pytest.skip(f"{SHARED / 'traces' / 'claude-code'} not found")
    out = _bench("--only", "claude", "--traces", "2", "--repeat", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rounds = [ln.strip() for ln in lines if "runs, one a round" in ln]
    assert [r.split(":")[0] for r in rounds] == ["kv_aware x8", "round_robin x8", "round_robin x32"]
    table = {ln.split("  ")[0]: ln for ln in lines if ln.startswith("agentkv, claude-code")}
    least = []
    for r in rounds:
        cpus = [float(x) for x in re.findall(r"[\d.]+", r.rsplit(":", 1)[1].split("(")[0])]
        assert len(cpus) == 2
        least.append(min(cpus))
    # the table's CPU column (after requests and wall s) holds each run's least
    assert sorted(float(ln[40:].split()[2]) for ln in table.values()) == sorted(least)
    assert sum("(a) " in ln and "load average before" in ln for ln in lines) == 6 and len(table) == 3
    over = [ln for ln in lines if ln.strip().startswith("round_robin on 8 (overloaded) / on 32 replicas")]
    assert len(over) == 1
    lo, hi, med = (
        float(x)
        for x in re.search(r"round by round ([\d.]+)x to ([\d.]+)x, median ([\d.]+)x", over[0]).groups()
    )
    assert lo <= med <= hi  # each round's own ratio: the spread the host's noise gives
    assert any(ln.strip().startswith("round_robin / kv_aware on 8 replicas") for ln in lines)
    bad = _bench("--only", "claude", "--repeat", "0")
    assert bad.returncode == 2 and "--repeat: 0 must be >= 1" in bad.stderr
