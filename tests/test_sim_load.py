"""`agentkv simulate --think-scale F` and `--warmup N|DURATION` (#21): bench's flags, on the virtual
clock. Think scale shortens the gaps between turns but not the simulated latencies; warm-up requests
are simulated (they warm the cache) but left out of every figure."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from agentkv.cli import main
from agentkv.metrics.records import read_records
from agentkv.sim.cluster import SimConfig, simulate
from agentkv.trace.model import Request, Session, Trace


def _traces(n: int = 3, turns: int = 4, think: float = 8.0) -> list[Trace]:
    """`n` sessions of `turns` growing turns, `think` seconds of think time between them."""
    reqs = lambda i: [  # noqa: E731
        Request(
            t=0.0,
            input_tokens=256 * (k + 1),
            output_tokens=6 + i,
            hash_ids=[i * 1000 + j for j in range(16 * (k + 1))],
            think_time=think if k else 0.0,
        )
        for k in range(turns)
    ]
    return [Trace(id=f"s{i}", block_size=16, session=Session(id=f"s{i}", requests=reqs(i))) for i in range(n)]


def _run(**kw):
    return simulate(_traces(), SimConfig(lanes=1, idle_gap_cap=None, **kw))


def _gaps(records) -> list[float]:
    """Due time of each turn minus the end of the turn before it, in one session."""
    by = sorted(records, key=lambda r: (r.session, r.index))
    return [b.scheduled - a.end for a, b in zip(by, by[1:], strict=False) if a.session == b.session]


def test_think_scale_halves_the_gaps_not_the_latencies():
    full, half = _run(), _run(think_scale=0.5)
    g1, g2 = _gaps(full.records), _gaps(half.records)
    assert len(g1) == 9 and g1 == pytest.approx([8.0] * 9)
    assert g2 == pytest.approx([0.5 * g for g in g1])
    for a, b in zip(
        sorted(full.records, key=lambda r: r.id), sorted(half.records, key=lambda r: r.id), strict=True
    ):
        assert (a.ttft, a.tpot, a.e2e) == pytest.approx((b.ttft, b.tpot, b.e2e))  # not scaled
    assert half.records[-1].end < full.records[-1].end - 30  # the run is shorter by the gaps
    assert half.summary.config["think_scale"] == 0.5
    assert any(n.startswith("think scale 0.5") for n in half.summary.notes)


def test_warmup_requests_are_simulated_marked_and_left_out():
    plain, warm = _run(), _run(warmup_requests=5)
    assert sorted(r.id for r in warm.records if r.warmup) == [0, 1, 2, 3, 4]
    # the warm-up is simulated as usual: every record is the same, only marked
    key = lambda r: r.id  # noqa: E731
    for a, b in zip(sorted(plain.records, key=key), sorted(warm.records, key=key), strict=True):
        assert (a.ttft, a.e2e, a.cached_tokens) == (b.ttft, b.e2e, b.cached_tokens)
    kept = [r for r in warm.records if not r.warmup]
    s = warm.summary
    assert (s.requests, s.warmup_requests, s.config["warmup"]) == (7, 5, "5 requests")
    assert s.output_tokens == sum(r.output_tokens for r in kept)
    assert s.ttft.count == 7 and s.ttft.max == max(r.ttft for r in kept)
    assert s.itl.count == sum(r.output_tokens - 1 for r in kept)  # warm-up token gaps left out too
    assert plain.summary.itl.count == sum(r.output_tokens - 1 for r in plain.records)
    assert s.preemptions == 0 and s.cache.metrics is None  # the engines' counters include the warm-up
    assert any(n.startswith("warm-up: 5 requests simulated and left out") for n in s.notes)


def test_warmup_duration_leaves_out_what_was_due_in_it():
    res = _run(warmup_s=20.0)
    warm = [r for r in res.records if r.warmup]
    assert warm and all(r.scheduled < 20.0 for r in warm)
    assert all(r.scheduled >= 20.0 for r in res.records if not r.warmup)
    assert res.summary.requests == 12 - len(warm) and res.summary.config["warmup"] == "20s"


def test_cli_writes_warmup_marked_and_measured_outputs(tmp_path, capsys):
    out = tmp_path / "o"
    args = ["simulate", "--max-requests", "40", "-q", "--warmup", "10", "--think-scale", "0.5"]
    assert main([*args, "--out", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    recs = read_records(out / "requests.jsonl")
    assert len(recs) == 40 and sorted(r.id for r in recs if r.warmup) == list(range(10))
    assert s["warmup_requests"] == 10 and s["requests"] == 30 and s["config"]["think_scale"] == 0.5
    rows = list(csv.DictReader((out / "records.csv").read_text().splitlines()))
    assert len(rows) == 40 and sum(r["warmup"] == "True" for r in rows) == 10
    vllm = json.loads((out / "vllm_result.json").read_text())
    assert len(vllm["input_lens"]) == 30 and vllm["num_prompts"] == 30
    assert np.isfinite(s["ttft"]["p50"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--think-scale", "-0.5"], "--think-scale must be >= 0"),
        (["--think-scale", "nan"], "--think-scale must be >= 0"),
        (["--think-scale", "abc"], "--think-scale: expected a number >= 0"),
        (["--warmup", "abc"], "--warmup: expected a request count"),
        (["--warmup=-5"], "--warmup: expected a request count"),
        (["--warmup", "0s"], "--warmup must be > 0"),
        (["--warmup", "2.5"], "--warmup: expected"),
        (["--sweep", "think_scale=1,x"], "--sweep think_scale: expected a number"),
        (["--sweep", "think_scale=-1"], "--think-scale must be >= 0"),
    ],
)
def test_bad_values_are_one_line_errors(flags, message, capsys):
    assert main(["simulate", "--max-requests", "5", "-q", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and "\n" not in err


def test_sweep_over_think_scale(capsys):
    args = ["simulate", "--max-requests", "30", "-q", "--lanes", "2", "--json"]
    assert main([*args, "--sweep", "think_scale=0.25,1"]) == 0
    points = json.loads(capsys.readouterr().out)
    assert [p["overrides"] for p in points] == [{"think_scale": "0.25"}, {"think_scale": "1"}]
    dur = [p["summary"]["duration_s"] for p in points]
    assert [p["summary"]["config"]["think_scale"] for p in points] == [0.25, 1.0]
    assert dur[0] < dur[1]  # shorter gaps: the same requests in less simulated time
