"""Per-request token gaps (#21): bench records each request's inter-token gaps (`itls`, seconds)
and vllm_result.json carries them per request as `vllm bench serve --save-result` does."""

from __future__ import annotations

import asyncio
import csv
import json

import numpy as np
import pytest

from agentkv.bench.runner import BenchConfig, BenchRun
from agentkv.bench.testserver import Behaviour, StreamTestServer
from agentkv.metrics.export import write_outputs
from agentkv.metrics.records import read_records
from agentkv.trace.model import Request, Session, Trace

ITL = 0.02


def _trace(tid: str, outs: list[int]) -> Trace:
    reqs = [
        Request(t=i * 0.001, input_tokens=64, output_tokens=o, hash_ids=list(range(4)), think_time=0.0)
        for i, o in enumerate(outs)
    ]
    return Trace(id=tid, block_size=16, session=Session(id=tid, requests=reqs))


def _behave(body: dict, n: int) -> Behaviour:
    if body["max_tokens"] == 7:
        return Behaviour(itl=ITL, reset_after=3)  # a stream cut after three tokens
    return Behaviour(itl=ITL)


def test_bench_records_and_exports_each_requests_token_gaps(tmp_path):
    cfg = BenchConfig(target="", duration=None, idle_gap_cap=None, sample_every=0.05)

    async def go():
        async with StreamTestServer(behave=_behave) as srv:
            cfg.target = srv.url
            return await BenchRun(cfg, [_trace("a", [5, 1, 7]), _trace("b", [3, 4])], out=tmp_path).run()

    res = asyncio.run(go())
    write_outputs(tmp_path, res.summary, res.records, report=False)
    recs = read_records(tmp_path / "requests.jsonl")  # what the run wrote, read back
    assert len(recs) == 5
    for r in recs:
        if r.ok:
            assert len(r.itls) == r.output_tokens - 1  # one gap between each two tokens
        # paced by the server, in seconds: on a busy host two tokens can arrive in one read (a gap
        # near 0), so the gaps' sum carries the pacing
        assert all(0 <= g < ITL * 20 for g in r.itls), r.itls
        assert not r.itls or sum(r.itls) > ITL * 0.5 * len(r.itls), r.itls
        if r.itls:
            assert max(r.itls) == pytest.approx(r.itl_max, abs=1e-6)
            assert r.tpot == pytest.approx(np.mean(r.itls), abs=1e-5)
    assert [r.itls for r in recs if r.output_tokens == 1] == [[]]
    cut = next(r for r in recs if not r.ok)
    assert cut.error == "reset" and len(cut.itls) == 2  # the gaps it did see, as vLLM keeps them
    # the summary's ITL is over the same gaps, pooled (successful requests only)
    pooled = [g for r in recs if r.ok for g in r.itls]
    assert res.summary.itl.mean == pytest.approx(np.mean(pooled), abs=1e-5)

    v = json.loads((tmp_path / "vllm_result.json").read_text())
    assert v["itls"] == [r.itls for r in recs]  # one list per request, in requests.jsonl order
    assert len(v["itls"]) == len(v["ttfts"]) == v["num_prompts"]
    assert v["mean_itl_ms"] == pytest.approx(1000 * np.mean(pooled), rel=1e-3)
    with open(tmp_path / "records.csv", newline="") as f:
        header = next(csv.reader(f))
    assert "itls" not in header and "itl_max" in header  # a list per row stays in requests.jsonl
