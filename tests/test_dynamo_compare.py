"""benchmarks/dynamo_compare.py: the Claude Code -> Mooncake conversion that Dynamo's replay reads
keeps what the cache sees (arrival order, lengths, shared prefixes), and where the Dynamo venv
exists, both tools replay the converted file to the same hit rate in each router mode."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from dynamo_compare import MODES, run_agentkv, run_peer, write_mooncake  # noqa: E402
from dynamo_peer import DYNAMO_VENV, perf_table  # noqa: E402

from agentkv.engine.config import EngineConfig  # noqa: E402
from agentkv.engine.engine import Engine  # noqa: E402
from agentkv.trace.accesses import arrivals, block_accesses  # noqa: E402
from agentkv.trace.ceiling import ceiling_tokens  # noqa: E402
from agentkv.trace.formats import load_paths  # noqa: E402
from agentkv.trace.model import Request, Session, Trace  # noqa: E402


def _agent(tid: str, start: float, turns: int = 5) -> Trace:
    """A session whose prompt grows by 1,000 tokens a turn (not block-aligned), on a shared
    6,400-token system prompt (hash ids 0-99 in every trace's own space)."""
    ids, reqs = list(range(100)), []
    for k in range(turns):
        n = 64 * len(ids) + 37
        reqs.append(
            Request(t=start + 30.0 * k, input_tokens=n, output_tokens=50, hash_ids=list(ids), api_time=2)
        )
        ids += range(1000 * (k + 1), 1000 * (k + 1) + 16)
    return Trace(id=tid, block_size=64, session=Session(id=tid, requests=reqs))


def _traces() -> list[Trace]:
    return [_agent("a", 0.0), _agent("b", 7.0), _agent("c", 12.5, turns=3)]


def test_the_mooncake_file_keeps_order_lengths_and_prefix_sharing(tmp_path):
    path = tmp_path / "cc.jsonl"
    assert write_mooncake(_traces(), path) == 13
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    assert rows[1]["timestamp"] == 7000 and rows[0]["input_length"] == 6437
    # Dynamo refuses a request whose hash ids cover fewer tokens than its input: the partial tail
    # block is listed too, with an id no other request has
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 64) for r in rows)
    tails = [r["hash_ids"][-1] for r in rows]
    assert len(set(tails)) == len(tails)
    # the traces' hash spaces are local: their equal ids are one prefix per trace, so trace b's
    # first request shares nothing with a's; a's second request (the 4th row) extends its first
    assert not set(rows[1]["hash_ids"]) & set(rows[0]["hash_ids"])
    assert rows[3]["hash_ids"][:100] == rows[0]["hash_ids"][:100]
    # read back by agentkv as Mooncake: the same unbounded-cache hits as the traces themselves
    back = load_paths([path], block_size=64)
    before = ceiling_tokens(block_accesses(arrivals(_traces()), 16), 16)
    after = ceiling_tokens(block_accesses(arrivals(back), 16), 16)
    assert before == after > 0


def _dynamo_python() -> str | None:
    """DYNAMO_PYTHON, else the venv benchmarks/simulate.py makes; None when neither exists."""
    for py in (os.environ.get("DYNAMO_PYTHON"), DYNAMO_VENV / "bin" / "python"):
        if py and Path(py).exists():
            return str(py)
    return None


@pytest.mark.skipif(_dynamo_python() is None, reason="no ai-dynamo venv (benchmarks/simulate.py creates it)")
@pytest.mark.parametrize("router", list(MODES))
def test_dynamo_replays_the_converted_file_to_the_same_hit_rate(tmp_path, router):
    path, npz = tmp_path / "cc.jsonl", tmp_path / "perf.npz"
    write_mooncake(_traces(), path)
    ecfg = EngineConfig(gpu="h200", model="llama3-8b")
    perf_table(Engine(ecfg), npz)
    a = run_agentkv(path, ecfg, router, 64)
    d = run_peer(_dynamo_python(), path, npz, Engine(ecfg), router, 64)
    assert a.requests == d.requests == 13
    assert a.hit > 0.1 and abs(a.hit - d.hit) < 0.01, (a.hit, d.hit)
