"""Claude Code session-log reader: call merging, timing, hash-id reuse, sub-agents, errors."""

from __future__ import annotations

import gzip
import logging
import math
import shutil
from pathlib import Path

import msgspec
import pytest

from agentkv.trace.formats import claude_code, detect, load, load_paths, read_bytes
from agentkv.trace.model import Trace, TraceError

FIX = Path(__file__).parent / "fixtures" / "claude_code" / "project"
SID = "5f0c1d2e-7a3b-4c1d-9e2f-0a1b2c3d4e5f"
MAIN = FIX / f"{SID}.jsonl"
AGENT = FIX / SID / "subagents" / "agent-a7f3.jsonl"

# (input + cache_creation + cache_read, cache_read, output) of the six calls in the fixture.
CALLS = [
    (17003, 12000, 85),
    (18507, 17003, 120),
    (18310, 18000, 400),
    (13005, 9000, 64),
    (13211, 13005, 50),
    (13719, 13211, 90),
]


@pytest.fixture(scope="module")
def trace() -> Trace:
    (tr,) = load(MAIN)
    return tr


def blocks(n: int) -> int:
    return math.ceil(n / 64)


def test_one_request_per_api_call(trace):
    reqs = trace.session.requests
    # 9 assistant lines (one call split over 3, one over 2) plus a synthetic API-error line: 6 calls
    assert len(reqs) == 6
    assert [r.input_tokens for r in reqs] == [c[0] for c in CALLS]
    assert [r.output_tokens for r in reqs] == [c[2] for c in CALLS]  # the largest, counted once
    assert sum(r.input_tokens for r in reqs) == 93755
    assert [r.stop for r in reqs] == ["tool_use", "tool_use", "end_turn", "end_turn", "tool_use", "end_turn"]
    assert reqs[0].output_types == ["text", "thinking", "tool_use"]  # blocks gathered over the lines
    assert [r.input_types for r in reqs] == [
        ["text"],
        ["tool_result"],
        ["tool_result"],
        ["text"],
        ["text"],
        ["tool_result"],
    ]
    assert {r.model for r in reqs} == {"claude-opus-4-5-20251101"}
    assert (trace.format, trace.block_size, trace.hash_id_scope, trace.id) == (
        "claude_code",
        64,
        "local",
        SID,
    )


def test_times_from_timestamps(trace):
    reqs = trace.session.requests
    # a call starts at the record that triggered it and ends at its last assistant line
    assert [r.t for r in reqs] == [0.0, 7.5, 12.0, 90.0, 120.0, 180.0]
    assert [r.api_time for r in reqs] == [5.0, 2.5, 8.0, 5.0, 5.0, 4.0]
    assert [r.think_time for r in reqs] == [0.0, 2.5, 2.0, 70.0, 25.0, 55.0]


def test_hash_ids_reuse_what_cache_read_reports(trace):
    reqs = trace.session.requests
    for r, (n_in, _, _) in zip(reqs, CALLS, strict=True):
        assert len(r.hash_ids) == blocks(n_in)
    seen: set[int] = set(reqs[0].hash_ids)
    assert reqs[0].hash_ids == list(range(1, 267))  # nothing before it in this trace: all fresh
    for i in (1, 2, 4, 5):  # calls that follow another call with no compaction between
        prev, cur, cache_read = reqs[i - 1].hash_ids, reqs[i].hash_ids, CALLS[i][1]
        reuse = min(blocks(cache_read), len(prev))
        assert cur[:reuse] == prev[:reuse]
        assert not seen & set(cur[reuse:]), "ids past the cached prefix must be new"
        seen |= set(cur)
    assert len(set(reqs[2].hash_ids) & set(reqs[1].hash_ids)) == blocks(18000)  # partial hit: 282 of 290


def test_compaction_restarts_the_prefix(trace):
    before = {h for r in trace.session.requests[:3] for h in r.hash_ids}
    after = trace.session.requests[3].hash_ids
    assert not before & set(after)  # cache_read is 9000 tokens, yet nothing is reused across the boundary
    assert after == list(range(296, 296 + blocks(13005)))


def test_subagent_is_a_child_session(trace):
    assert trace.num_subagents == 1 and trace.num_requests == 8
    (sub,) = trace.session.subagents
    assert sub.id == f"{SID}/a7f3"
    assert sub.t == 126.0  # spawned 2 min 6 s after the session's first record
    assert sub.agent_type == "Explore"  # from agent-a7f3.meta.json
    assert (sub.status, sub.total_tokens, sub.tool_use_count, sub.duration) == ("completed", 6858, 1, 44.0)
    assert [(r.t, r.input_tokens, r.output_tokens, r.think_time) for r in sub.requests] == [
        (0.0, 6006, 40, 0.0),
        (6.0, 6708, 150, 2.0),
    ]
    first, second = sub.requests
    parent_first = trace.session.requests[0].hash_ids
    assert first.hash_ids[:64] == parent_first[:64]  # cache_read 4096 = 64 blocks of the parent's prefix
    main_ids = {h for r in trace.session.requests for h in r.hash_ids}
    assert not main_ids & set(first.hash_ids[64:])  # the rest is fresh, from the shared counter
    assert second.hash_ids[:94] == first.hash_ids and len(second.hash_ids) == blocks(6708)
    times = [(round(x.time, 3), x.depth) for x in trace.timeline()]
    assert times == [(0.0, 0), (7.5, 0), (12.0, 0), (90.0, 0), (120.0, 0), (126.0, 1), (132.0, 1), (180.0, 0)]


def test_skipped_records_are_one_counted_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="agentkv.trace.formats.claude_code"):
        load(MAIN)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert lines[0] == (
        f"{MAIN}: skipped 1 record of unknown type 'mystery-event'; "
        "skipped 1 synthetic assistant record (no API call)"
    )


def _plain(tr: Trace) -> dict:
    d = msgspec.to_builtins(tr)
    d.pop("source")
    return d


def test_gzip_session_and_subagent(tmp_path, trace):
    shutil.copytree(FIX, tmp_path / "p")
    for f in (tmp_path / "p" / f"{SID}.jsonl", tmp_path / "p" / SID / "subagents" / "agent-a7f3.jsonl"):
        f.with_name(f.name + ".gz").write_bytes(gzip.compress(f.read_bytes()))
        f.unlink()
    (tr,) = load(tmp_path / "p" / f"{SID}.jsonl.gz")
    assert _plain(tr) == _plain(trace)


def test_directory_read_attaches_subagents(trace):
    traces = load_paths([FIX.parent])  # sessions-index.json and agent-*.meta.json are not traces
    assert len(traces) == 1
    assert _plain(traces[0]) == _plain(trace)


def test_subagent_file_alone_is_its_own_trace():
    (tr,) = load_paths([AGENT.parent])  # its session file is not being read: no parent to attach to
    assert tr.id == "agent-a7f3" and tr.num_subagents == 0
    assert [r.input_tokens for r in tr.session.requests] == [6006, 6708]
    assert tr.session.requests[0].hash_ids == list(range(1, 95))


def test_detected_by_content():
    assert detect(MAIN, read_bytes(MAIN)) == "claude_code"
    assert detect(Path("x.jsonl"), b'{"type":"file-history-snapshot","messageId":"m"}\n') == "claude_code"
    no_session = b'{"type":"user","uuid":"u","timestamp":"2026-01-10T10:00:00Z","message":{"content":"x"}}'
    assert detect(Path("x.jsonl"), no_session) == "claude_code"
    assert not claude_code.sniff(Path("m.jsonl"), b'{"timestamp": 0, "input_length": 5, "hash_ids": [1]}')


def _line(kind="assistant", uuid="x1", ts="2026-01-10T10:00:01Z", **kw) -> str:
    rec = {"type": kind, "uuid": uuid, "sessionId": "s", "timestamp": ts, **kw}
    return msgspec.json.encode(rec).decode()


def _call(mid, ts, cache_read=0, out=10, **kw) -> str:
    usage = {"input_tokens": 100, "cache_read_input_tokens": cache_read, "output_tokens": out}
    return _line(
        uuid=f"{mid}-{ts}",
        ts=ts,
        message={"id": mid, "model": "m", "content": [{"type": "text"}], "usage": usage},
        **kw,
    )


def test_inline_sidechain_records_become_a_subagent(tmp_path):
    lines = [
        _line("user", "u1", "2026-01-10T10:00:00Z", message={"content": "go"}),
        _call("m1", "2026-01-10T10:00:02Z"),
        _line("user", "s1", "2026-01-10T10:00:03Z", isSidechain=True, message={"content": "task"}),
        _call("s-m1", "2026-01-10T10:00:04Z", isSidechain=True, parentUuid="s1"),
        _call("m2", "2026-01-10T10:00:09Z", cache_read=64),
    ]
    f = tmp_path / "sess.jsonl"
    f.write_text("\n".join(lines) + "\n")
    (tr,) = load(f)
    assert [r.t for r in tr.session.requests] == [0.0, 9.0]
    assert tr.session.requests[1].hash_ids[:1] == tr.session.requests[0].hash_ids[:1]
    (sub,) = tr.session.subagents
    assert sub.t == 3.0 and [r.t for r in sub.requests] == [0.0]


def test_repeated_records_and_empty_sessions(tmp_path, caplog):
    f = tmp_path / "dup.jsonl"
    call = _call("m1", "2026-01-10T10:00:02Z", out=7)
    f.write_text("\n".join([call, call, _call("m2", "2026-01-10T10:00:05Z")]) + "\n")
    (tr,) = load(f)
    assert [r.output_tokens for r in tr.session.requests] == [7, 10]
    empty = tmp_path / "only-summary.jsonl"
    empty.write_text('{"type":"summary","summary":"s","leafUuid":"x"}\n')
    with caplog.at_level(logging.WARNING, logger="agentkv.trace.formats.claude_code"):
        assert load(empty, "claude_code") == []
    assert "no API calls" in caplog.text


BAD = [
    ("{not json\n", 1, None, "invalid JSON"),
    ("[1, 2]\n", 1, None, "expected a JSON object"),
    ('{"uuid": "x"}\n', 1, "type", "missing"),
    (
        _call("m", "2026-01-10T10:00:00Z").replace('"output_tokens":10', '"output_tokens":"ten"'),
        1,
        "message.usage.output_tokens",
        "expected `int`, got `str`",
    ),
    (
        _call("m", "2026-01-10T10:00:00Z").replace('"output_tokens":10', '"output_tokens":-1'),
        1,
        "message.usage.output_tokens",
        ">= 0",
    ),
    (
        _line("user", message={"content": "a"}) + "\n" + _line(uuid="x2", ts="yesterday", message={}),
        2,
        "timestamp",
        "ISO 8601",
    ),
    (_line(isSidechain="yes"), 1, "isSidechain", "expected `bool`"),
    (_line(message=None), 1, "message", "missing"),
]


@pytest.mark.parametrize(("text", "line", "field", "words"), BAD)
def test_bad_line_is_one_clear_error(tmp_path, text, line, field, words):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"type":"summary","summary":"ok"}\n' + text)
    with pytest.raises(TraceError) as e:
        load(f, "claude_code")
    assert (e.value.path, e.value.record, e.value.field) == (str(f), f"line {line + 1}", field)
    assert words in e.value.message
    assert str(e.value).startswith(f"{f}: record line {line + 1}")


def test_bad_subagent_file_is_named(tmp_path):
    shutil.copytree(FIX, tmp_path / "p")
    agent = tmp_path / "p" / SID / "subagents" / "agent-a7f3.jsonl"
    agent.write_text(agent.read_text() + "oops\n")
    with pytest.raises(TraceError) as e:
        load(tmp_path / "p" / f"{SID}.jsonl")
    assert (e.value.path, e.value.record) == (str(agent), "line 6")


def test_roundtrip_through_agentx(tmp_path, trace):
    agentx = pytest.importorskip("agentkv.trace.formats.agentx")
    if not hasattr(agentx, "write_agentx"):
        pytest.skip("write_agentx not available")
    (back,) = load(agentx.write_agentx(trace, tmp_path / "t.json.gz"))
    assert back.format == "agentx"
    assert msgspec.to_builtins(back.session) == msgspec.to_builtins(trace.session)


def test_cli_stats_reports_a_bad_line_in_one_line(tmp_path, capsys):
    pytest.importorskip("agentkv.trace.stats")
    from agentkv.cli import main

    f = tmp_path / "bad.jsonl"
    f.write_text(
        _line("user", "u", message={"content": "x"})
        + "\n"
        + _call("m", "2026-01-10T10:00:02Z").replace('"input_tokens":100', '"input_tokens":"100"')
        + "\n"
    )
    assert main(["trace", "stats", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"agentkv: error: {f}: record line 2, field 'message.usage.input_tokens': expected `int`, got `str`"
    )
