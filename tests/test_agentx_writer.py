"""The AgentX writer and `agentkv trace convert`: read(write(trace)) == trace, files like the originals."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.cli import main
from agentkv.trace.formats import bundled_sample, load, load_paths
from agentkv.trace.formats.agentx import to_agentx, write_agentx
from agentkv.trace.model import Request, Session, Trace, TraceError

ROUND_TRIP = ["trace_0001", "trace_0014", "trace_0020", "trace_0254", "trace_0291", "trace_0449"]


def _spawns(s: Session) -> list[float]:
    return [s.t] + [t for sub in s.subagents for t in _spawns(sub)]


def _zero_spawns(s: Session) -> Session:
    return msgspec.structs.replace(s, t=0.0, subagents=[_zero_spawns(x) for x in s.subagents])


def _same(a: Trace, b: Trace) -> bool:
    """Equal apart from provenance (`source`, `format`), which names the file actually read, and
    sub-agent spawn offsets, which travel as end times rounded to microseconds (so within 1e-6)."""
    b = msgspec.structs.replace(b, source=a.source, format=a.format)
    close = all(
        abs(x - y) <= 1e-6 * max(1.0, abs(x))
        for x, y in zip(_spawns(a.session), _spawns(b.session), strict=True)
    )
    return close and (
        msgspec.structs.replace(b, session=_zero_spawns(b.session))
        == msgspec.structs.replace(a, session=_zero_spawns(a.session))
    )


def _with_default_think_time(x):
    """The originals sometimes omit `think_time`; the model (and so the writer) makes it 0.0."""
    if isinstance(x, dict):
        if x.get("type") in ("n", "s"):
            x = {**x, "think_time": x.get("think_time", 0.0)}
        return {k: _with_default_think_time(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_with_default_think_time(v) for v in x]
    return x


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_real_traces_round_trip_and_match_the_original_file(shared_dir, tmp_path, name):
    src = shared_dir / "traces" / "claude-code" / f"{name}.json.gz"
    [t] = load(src)
    out = write_agentx(t, tmp_path / f"{name}.json.gz")
    assert out.read_bytes()[:2] == b"\x1f\x8b"
    assert _same(t, load(out)[0])
    original = _with_default_think_time(json.loads(gzip.decompress(src.read_bytes())))
    mine = json.loads(gzip.decompress(out.read_bytes()))
    assert json.dumps(mine) == json.dumps(original)  # same fields, values and key order, totals included


def test_mooncake_round_trip(shared_dir, tmp_path):
    [t] = load(shared_dir / "traces" / "mooncake" / "synthetic_trace.jsonl.gz")
    out = write_agentx(t, tmp_path / "synthetic.json")
    back = load(out)[0]
    assert back.format == "agentx" and back.replay == "timestamp" and back.hash_id_scope == "global"
    assert _same(t, back)
    doc = json.loads(out.read_bytes())
    assert doc["block_size"] == 512 and doc["totals"]["subagent_count"] == 0
    assert doc["totals"]["parent_tokens"]["input"] == sum(r.input_tokens for r in t.session.requests)


def _tree() -> Trace:
    def r(t, **kw):
        return Request(
            t=t, input_tokens=100, output_tokens=5, hash_ids=[1, 2], model=kw.pop("model", "big"), **kw
        )

    inner = Session(id="root/a1/b1", t=0.5, requests=[r(0.0, model="tiny")], agent_type="Plan", duration=0.25)
    a1 = Session(
        id="root/a1",
        t=2.0,
        requests=[r(0.0, model="small"), r(1.0, model="small")],
        subagents=[inner],
        agent_type="Explore",
        status="completed",
        duration=12.5,
        total_tokens=7,
        tool_use_count=2,
    )
    a2 = Session(id="root/a2", t=10.0, requests=[r(0.0, model="small")])
    root = Session(
        id="root",
        requests=[r(0.0), r(2.0, kind="s"), r(5.0, api_time=1.5, ttft=0.2), r(12.0)],
        subagents=[a1, a2],
        tool_tokens=11,
        system_tokens=3,
    )
    return Trace(id="root", block_size=64, session=root)


def test_claude_code_log_round_trips(tmp_path):
    fixture = Path(__file__).parent / "fixtures" / "claude_code" / "project"
    [t] = load_paths([fixture])
    assert t.format == "claude_code" and t.num_subagents == 1
    assert _same(t, load(write_agentx(t, tmp_path / "cc.json"))[0])


def test_subagents_nested_inline_at_their_spawn_time(tmp_path):
    t = _tree()
    doc = to_agentx(t)
    # a sub-agent is written at its end (spawn + duration), as kv-cache-tester stamps it
    assert [(x["type"], x["t"]) for x in doc["requests"]] == [
        ("n", 0.0),
        ("s", 2.0),
        ("n", 5.0),
        ("subagent", 10.0),
        ("n", 12.0),
        ("subagent", 14.5),
    ]
    a1 = doc["requests"][5]
    assert (a1["agent_id"], a1["subagent_type"], a1["duration_ms"], a1["models"]) == (
        "a1",
        "Explore",
        12500,
        ["small"],
    )
    assert [x["type"] for x in a1["requests"]] == ["n", "subagent", "n"]
    assert a1["requests"][1]["agent_id"] == "b1"
    assert doc["totals"] == {
        "parent_tokens": {"input": 400, "output": 20},
        "subagent_tokens": {"input": 400, "output": 20},
        "combined_tokens": {"input": 800, "output": 40},
        "subagent_count": 3,
    }
    assert doc["models"] == ["big"] and "replay" not in doc
    assert _same(t, load(write_agentx(t, tmp_path / "tree.json"))[0])


def test_writer_refuses_a_request_kind_agentx_cannot_hold(tmp_path):
    t = _tree()
    t.session.subagents[0].requests[1].kind = "x"
    with pytest.raises(TraceError, match="session root/a1 request 1, field 'kind'"):
        write_agentx(t, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


_secs = st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False)
_ms_secs = st.integers(0, 10**10).map(lambda ms: ms / 1000)  # AgentX stamps sub-agents in ms


@st.composite
def _requests(draw, bs):
    out = []
    for _ in range(draw(st.integers(0, 4))):
        n_in = draw(st.integers(0, 5000))
        ids = draw(st.lists(st.integers(0, 2**63 - 1), max_size=-(-n_in // bs)))
        out.append(
            Request(
                t=draw(_secs),
                input_tokens=n_in,
                output_tokens=draw(st.integers(0, 10**6)),
                hash_ids=ids,
                think_time=draw(_secs),
                model=draw(st.text(max_size=8)),
                kind=draw(st.sampled_from("ns")),
                stop=draw(st.text(max_size=5)),
                api_time=draw(st.none() | _secs),
                ttft=draw(st.none() | _secs),
                input_types=draw(st.lists(st.text(max_size=4), max_size=2)),
            )
        )
    return out


@st.composite
def _session(draw, sid, bs, depth):
    subs = []
    if depth < 2:
        for i in range(draw(st.integers(0, 2))):
            agent = draw(st.text(min_size=1, max_size=6)) + f"#{i}"
            sub = draw(_session(f"{sid}/{agent}", bs, depth + 1))
            subs.append(
                msgspec.structs.replace(
                    sub,
                    t=draw(_ms_secs),
                    agent_type=draw(st.text(max_size=6)),
                    status=draw(st.text(max_size=6)),
                    duration=draw(st.none() | _ms_secs),  # recorded in ms
                    total_tokens=draw(st.none() | st.integers(0, 10**9)),
                    tool_use_count=draw(st.none() | st.integers(0, 100)),
                )
            )
    subs.sort(key=lambda x: (x.t, x.t + (x.duration or 0.0)))  # the model's order: spawn, then end
    return Session(
        id=sid,
        requests=draw(_requests(bs)),
        subagents=subs,
        tool_tokens=draw(st.integers(0, 10**5)),
        system_tokens=draw(st.integers(0, 10**5)),
    )


@st.composite
def _traces(draw):
    bs = draw(st.sampled_from([16, 64, 512]))
    tid = draw(st.text(min_size=1, max_size=10))
    return Trace(
        id=tid,
        block_size=bs,
        session=draw(_session(tid, bs, 0)),
        hash_id_scope=draw(st.sampled_from(["local", "global"])),
        replay=draw(st.sampled_from(["session", "timestamp"])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=_traces(), packed=st.booleans())
def test_any_trace_round_trips(tmp_path, trace, packed):
    path = write_agentx(trace, tmp_path / ("t.json.gz" if packed else "t.json"))
    assert _same(trace, load(path, "agentx")[0])


# ------------------------------------------------------------------------------------------- convert


def test_convert_many_into_a_directory(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["trace", "convert", *map(str, bundled_sample()), "-o", str(out), "--gzip"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and "trace_0014.json.gz  (123 requests, 1 sub-agents, from agentx)" in printed[0]
    written = sorted(out.iterdir())
    assert [p.name for p in written] == ["trace_0014.json.gz", "trace_0266.json.gz", "trace_0291.json.gz"]
    for a, b in zip(load_paths(bundled_sample()), load_paths([out]), strict=True):
        assert _same(a, b)


def test_convert_one_to_a_file_and_keeps_distinct_names(tmp_path, capsys):
    src = bundled_sample()[0]
    assert main(["trace", "convert", str(src), "-o", str(tmp_path / "deep" / "one.json")]) == 0
    assert _same(load(src)[0], load(tmp_path / "deep" / "one.json")[0])
    assert main(["trace", "convert", str(src), str(src), "-o", str(tmp_path / "twice")]) == 0
    assert sorted(p.name for p in (tmp_path / "twice").iterdir()) == ["trace_0014-2.json", "trace_0014.json"]
    capsys.readouterr()


def test_convert_refuses_many_traces_into_one_file_and_overwriting_an_input(tmp_path, capsys):
    assert main(["trace", "convert", *map(str, bundled_sample()), "-o", str(tmp_path / "all.json")]) == 2
    assert "3 traces need a directory" in capsys.readouterr().err
    src = tmp_path / "a.json"
    write_agentx(load(bundled_sample()[1])[0], src)
    assert main(["trace", "convert", str(src), "-o", str(src)]) == 2
    assert "is one of the inputs" in capsys.readouterr().err
