"""`agentkv trace stats`: exact figures on a hand-made trace, and the prefix-cache hit ceiling checked
against an independent computation from the raw gzip JSON of every shared trace."""

from __future__ import annotations

import gzip
import itertools
import json

import msgspec
import numpy as np
import pytest
from real_traces import claude_report, claude_traces

from agentkv.cli import main
from agentkv.trace.ceiling import cache_hits
from agentkv.trace.formats import bundled_sample
from agentkv.trace.formats.agentx import write_agentx
from agentkv.trace.model import Request, Session, Trace
from agentkv.trace.stats import StatsReport, ceiling, compute


def _r(t, n_in, ids, out=1, think=0.0, api=1.0, kind="n"):
    return Request(
        t=t,
        input_tokens=n_in,
        output_tokens=out,
        hash_ids=list(ids),
        think_time=think,
        api_time=api,
        kind=kind,
    )


def tiny() -> Trace:
    """Block size 4; a sub-agent spawned at t=6 runs between the root's requests.

    timeline  request     ids         leading run seen before      hit (capped at input)
    0   root r0   in 10   [1,2,3]     -                            0
    5   root r1   in 14   [1,2,5,6]   1,2                          8
    6   sub  s0   in 9    [1,7,8]     1                            4
    8   root r2   in 16   [1,7,8,10]  1,7,8 (7,8 from the sub-agent) 12
    9   sub  s1   in 12   [1,7,8]     1,7,8                        12
    20  root r3   in 7    [1,2]       1,2 -> 8 tokens, capped      7
    hits 43 of 68 input tokens.
    """
    sub = Session(
        id="t/a1",
        t=6.0,
        duration=4.5,
        requests=[_r(0.0, 9, [1, 7, 8], out=2), _r(3.0, 12, [1, 7, 8], out=4, think=2.0)],
    )
    root = Session(
        id="t",
        subagents=[sub],
        requests=[
            _r(0.0, 10, [1, 2, 3], out=3),
            _r(5.0, 14, [1, 2, 5, 6], out=2, think=4.0),
            _r(8.0, 16, [1, 7, 8, 10], out=1, think=2.0, api=2.0, kind="s"),
            _r(20.0, 7, [1, 2], out=5, think=10.0, api=0.5),
        ],
    )
    return Trace(id="t", block_size=4, session=root, format="agentx")


def test_tiny_trace_exact_figures():
    r = compute([tiny()])
    [s] = r.traces
    assert (s.requests, s.sessions, s.subagents, s.root_requests) == (6, 2, 1, 4)
    assert (s.side_calls, s.compactions, s.first_input) == (1, 1, 10)  # 7 < 0.7 * 16: a compaction
    assert (s.input_tokens, s.output_tokens, s.hit_tokens) == (68, 17, 43)
    assert s.ceiling == 43 / 68
    assert s.duration == 20.5  # r3 arrives at 20 and takes 0.5 s
    assert (s.input.p50, s.input.max, s.input.mean) == (11.0, 16.0, 68 / 6)
    assert (s.growth.count, s.growth.p50, s.growth.max, s.growth.mean) == (4, 2.5, 4.0, 0.0)  # 4, 2, -9; 3
    assert (s.gap.count, s.gap.p50, s.gap.max) == (4, 3.0, 10.0)  # 4, 2, 10; 2
    assert r.total.ceiling == s.ceiling and r.total.hit_tokens == 43


def test_hits_follow_time_order_not_file_order():
    t = tiny()
    in_file_order = [r for s in t.sessions() for r in s.requests]
    assert cache_hits(in_file_order, 4).tolist() == [0, 8, 4, 7, 9, 12]  # r2 sees only id 1 then
    assert cache_hits([x.request for x in t.timeline()], 4).tolist() == [0, 8, 4, 12, 12, 7]


@pytest.mark.parametrize("base", [1 << 60, (1 << 64) - 10_000])
def test_sparse_and_huge_ids_give_the_same_hits(base):
    t = tiny()
    for s in t.sessions():
        for r in s.requests:
            r.hash_ids = [base + 977 * h for h in r.hash_ids]
    assert compute([t]).traces[0].hit_tokens == 43


def _flat(tid, scope, source, reqs):
    return Trace(
        id=tid,
        block_size=4,
        hash_id_scope=scope,
        source=source,
        session=Session(id=tid, requests=reqs),
        replay="timestamp",
    )


def test_global_ids_are_shared_across_one_files_traces_in_time_order():
    def pair(scope, src_b):
        a = _flat("a", scope, "f", [_r(0.0, 8, [1, 2]), _r(10.0, 12, [1, 2, 3])])
        b = _flat("b", scope, src_b, [_r(5.0, 12, [1, 2, 9])])
        return compute([a, b]).traces

    a, b = pair("global", "f")
    assert (a.hit_tokens, b.hit_tokens) == (8, 8)  # b at t=5 reuses a's first request
    a, b = pair("global", "g")  # another file: another cache
    assert (a.hit_tokens, b.hit_tokens) == (8, 0)
    a, b = pair("local", "f")
    assert (a.hit_tokens, b.hit_tokens) == (8, 0)
    assert (a.growth.count, a.gap.count) == (0, 0)  # timestamp replay: no session order to measure


def test_empty_input():
    r = compute([])
    assert (r.total.traces, r.total.ceiling, r.total.input.count) == (0, 0.0, 0)
    assert ceiling([]) == 0.0


# ------------------------------------------------------------------ independent check on real traces


def _independent_hits(doc: dict) -> list[int]:
    """Per-request hits from the raw AgentX JSON, by another method: each id's first request index."""
    rows = []  # (absolute time, file order, request)

    def walk(reqs, offset):
        for q in reqs:
            if q.get("type") == "subagent":
                walk(q["requests"], offset + q["t"])
            else:
                rows.append((offset + q["t"], len(rows), q))

    walk(doc["requests"], 0.0)
    rows.sort(key=lambda x: (x[0], x[1]))
    lens = np.array([len(q["hash_ids"]) for _, _, q in rows], dtype=np.int64)
    ids = np.fromiter(itertools.chain.from_iterable(q["hash_ids"] for _, _, q in rows), np.int64, lens.sum())
    req = np.repeat(np.arange(len(rows)), lens)
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    before = req[first][inverse] < req  # the id appeared in an earlier request
    misses = np.flatnonzero(~before)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    nxt = np.searchsorted(misses, starts)
    first_miss = np.where(nxt < misses.size, misses[np.minimum(nxt, misses.size - 1)], ids.size)
    run = np.minimum(first_miss, starts + lens) - starts
    return [min(int(n) * doc["block_size"], q["in"]) for n, (_, _, q) in zip(run, rows, strict=True)]


def test_ceiling_matches_independent_computation_on_all_shared_traces(shared_dir):
    files = sorted((shared_dir / "traces" / "claude-code").glob("*.json.gz"))
    assert len(files) == 119
    expected, total_in = {}, 0
    for f in files:
        doc = json.loads(gzip.decompress(f.read_bytes()))
        expected[doc["id"]] = sum(_independent_hits(doc))
        stack = list(doc["requests"])
        while stack:
            q = stack.pop()
            if q.get("type") == "subagent":
                stack.extend(q["requests"])
            else:
                total_in += q["in"]
    report = claude_report(shared_dir)
    assert {t.id: t.hit_tokens for t in report.traces} == expected
    assert report.total.input_tokens == total_in == 1_018_926_127
    assert report.total.ceiling == sum(expected.values()) / total_in
    assert report.total.ceiling == pytest.approx(0.96559, abs=5e-6)
    assert ceiling(claude_traces(shared_dir)) == report.total.ceiling


def test_mooncake_ceiling_matches_a_plain_set_walk(shared_dir):
    from agentkv.trace.formats import load

    path = shared_dir / "traces" / "mooncake" / "synthetic_trace.jsonl.gz"
    seen: set[int] = set()
    hit = total = 0
    for line in gzip.decompress(path.read_bytes()).splitlines():
        q = json.loads(line)
        n = 0
        while n < len(q["hash_ids"]) and q["hash_ids"][n] in seen:
            n += 1
        hit += min(n * 512, q["input_length"])
        total += q["input_length"]
        seen.update(q["hash_ids"])
    assert compute(load(path)).total.ceiling == hit / total


# ------------------------------------------------------------------------------------------- CLI


def test_cli_json_parses_into_the_report(tmp_path, capsys):
    write_agentx(tiny(), tmp_path / "tiny.json")
    assert main(["trace", "stats", str(tmp_path / "tiny.json"), "--json"]) == 0
    report = msgspec.json.decode(capsys.readouterr().out, type=StatsReport)
    assert report.total.hit_tokens == 43 and report.traces[0].id == "t"


def test_cli_tables_name_the_trace_and_the_ceiling(tmp_path, capsys):
    write_agentx(tiny(), tmp_path / "tiny.json")
    assert main(["trace", "stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "t " in out and f"{43 / 68:.4f}" in out and "Totals" in out


def test_cli_defaults_to_the_bundled_sample(capsys):
    assert main(["trace", "stats", "--json"]) == 0
    report = msgspec.json.decode(capsys.readouterr().out, type=StatsReport)
    assert sorted(t.source for t in report.traces) == sorted(str(p) for p in bundled_sample())
    assert 0.5 < report.total.ceiling < 1.0


@pytest.mark.parametrize(
    "content, args, needle",
    [
        (
            '{"id": "x", "block_size": 64, "requests": [{"t": 0, "type": "n", "in": "many", "out": 1}]}',
            [],
            "'in'",
        ),
        ("{not json", ["--format", "agentx"], "bad.json"),
        ("", ["--top", "0"], "--top"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, args, needle):
    p = tmp_path / "bad.json"
    p.write_text(content or json.dumps({"id": "x", "block_size": 64, "requests": []}))
    assert main(["trace", "stats", str(p), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("agentkv: error:") and needle in err
    assert "Traceback" not in err
