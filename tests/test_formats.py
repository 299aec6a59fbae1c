"""Trace readers on real data (119 Claude Code traces, both Mooncake files) and on bad input.

Every bad input must give ONE line naming the file, the record and the field, through the CLI
too, never a traceback.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv.cli import main
from agentkv.trace.formats import bundled_sample, detect, load, load_paths, mooncake, read_bytes
from agentkv.trace.model import TraceError


@pytest.fixture(scope="module")
def shared_traces(shared_dir):
    return load_paths([shared_dir / "traces" / "claude-code"])


def _req(t=0.0, n_in=100, out=10, ids=(1, 2), **kw):
    return {"t": t, "type": "n", "model": "m", "in": n_in, "out": out, "hash_ids": list(ids), **kw}


def _agentx(tmp_path: Path, requests, name="x.json", **top) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps({"id": "x", "block_size": 64, **top, "requests": requests}))
    return p


def _jsonl(tmp_path: Path, lines, name="m.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def _line(ts=0, n_in=1000, out=5, ids=(0, 1)):
    return {"timestamp": ts, "input_length": n_in, "output_length": out, "hash_ids": list(ids)}


# ------------------------------------------------------------------------------------- real traces


def test_all_shared_claude_code_traces(shared_traces):
    assert len(shared_traces) == 119
    assert sum(t.num_requests for t in shared_traces) == 8078
    assert sum(t.num_subagents for t in shared_traces) == 9
    assert {t.format for t in shared_traces} == {"agentx"}
    assert {t.block_size for t in shared_traces} == {64}
    with_subs = {t.id: t.num_subagents for t in shared_traces if t.num_subagents}
    assert with_subs == {"trace_0014": 1, "trace_0020": 1, "trace_0254": 5, "trace_0291": 2}
    t14 = next(t for t in shared_traces if t.id == "trace_0014")
    sub = t14.session.subagents[0]
    assert (sub.id, sub.agent_type, sub.t, sub.duration, sub.tool_use_count) == (
        "trace_0014/agent_001",
        "Explore",
        961.349 - 10.509,
        10.509,
        5,
    )  # spawn = end - duration
    assert len(sub.requests) == 2 and sub.requests[0].model == "claude-haiku-4-5-20251001"


@pytest.mark.parametrize(
    ("name", "count", "last_ts"), [("conversation_trace", 12031, 3536999), ("synthetic_trace", 3993, 1022025)]
)
def test_mooncake_files(shared_dir, name, count, last_ts):
    path = shared_dir / "traces" / "mooncake" / f"{name}.jsonl.gz"
    [t] = load(path)
    assert (t.id, t.format, t.replay, t.hash_id_scope, t.block_size) == (
        name,
        "mooncake",
        "timestamp",
        "global",
        512,
    )
    assert t.num_requests == count and t.num_subagents == 0
    reqs = t.session.requests
    first = json.loads(gzip.decompress(path.read_bytes()).split(b"\n", 1)[0])
    assert (reqs[0].t, reqs[0].input_tokens, reqs[0].output_tokens, reqs[0].hash_ids) == (
        first["timestamp"] / 1000,
        first["input_length"],
        first["output_length"],
        first["hash_ids"],
    )
    assert reqs[-1].t == last_ts / 1000
    assert all(a.t <= b.t for a, b in zip(reqs, reqs[1:], strict=False))


def test_bundled_sample_ships_with_notice():
    paths = bundled_sample()
    assert [p.name for p in paths] == ["trace_0014.json.gz", "trace_0266.json.gz", "trace_0291.json.gz"]
    traces = load_paths(paths)
    assert sum(t.num_requests for t in traces) == 178
    assert sum(t.num_subagents for t in traces) == 3
    notice = (paths[0].parent / "NOTICE.md").read_text()
    assert "kv-cache-tester" in notice and "Apache License" in notice
    assert "Apache License" in (paths[0].parent / "LICENSE").read_text()


# ------------------------------------------------------------------------- gzip, directories, detect


def test_gzip_is_transparent(tmp_path):
    plain = _agentx(tmp_path, [_req(), _req(t=2.5, n_in=200, ids=(1, 2, 3, 4))])
    packed = tmp_path / "renamed.json"  # gzip found by magic number, not by name
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = load(plain)[0], load(packed)[0]
    assert a.session == b.session and a.num_requests == 2
    ml = _jsonl(tmp_path, [_line(), _line(ts=1500)])
    mz = tmp_path / "m.jsonl.gz"
    mz.write_bytes(gzip.compress(ml.read_bytes()))
    assert load(ml)[0].session == load(mz)[0].session


def test_directory_reading_is_recursive_sorted_and_skips_other_files(tmp_path):
    _agentx(tmp_path, [_req()], name="b.json", id="b")
    (tmp_path / "sub").mkdir()
    _agentx(tmp_path / "sub", [_req(), _req(t=1)], name="a.json", id="a")
    _jsonl(tmp_path, [_line(), _line(ts=10), _line(ts=20)], name="c.jsonl")
    (tmp_path / "README.txt").write_text("not a trace")
    traces = load_paths([tmp_path])
    assert [(t.id, t.format, t.num_requests) for t in traces] == [
        ("b", "agentx", 1),
        ("c", "mooncake", 3),
        ("a", "agentx", 2),
    ]


def test_detect_and_forced_format(tmp_path):
    ml = _jsonl(tmp_path, [_line()])
    ax = _agentx(tmp_path, [_req()])
    assert detect(ml, read_bytes(ml)) == "mooncake"
    assert detect(ax, read_bytes(ax)) == "agentx"
    with pytest.raises(TraceError, match="record 1, field 'timestamp': missing"):
        load(ax, "mooncake")


def test_mooncake_block_size_override(tmp_path, monkeypatch):
    p = _jsonl(tmp_path, [_line(n_in=100, ids=(0, 1))])
    with pytest.raises(TraceError, match="at most 1 blocks of 512"):
        load(p)
    assert mooncake.read(p, read_bytes(p), block_size=64)[0].block_size == 64
    monkeypatch.setattr(mooncake, "BLOCK_SIZE", 32)
    assert load(p)[0].block_size == 32


def test_mooncake_skips_blank_lines_and_keeps_line_numbers(tmp_path):
    p = _jsonl(tmp_path, [_line(), "", "   ", _line(ts=2000), _line(n_in=-1)])
    with pytest.raises(TraceError) as e:
        load(p)
    assert (e.value.record, e.value.field) == (5, "input_length")
    p = _jsonl(tmp_path, [_line(), "", _line(ts=2000)])
    assert [r.t for r in load(p)[0].session.requests] == [0.0, 2.0]


# ------------------------------------------------------------------------------------- bad input

_TRUNC = '{"id": "x", "block_size": 64, "requests": [{"t": 0, "type": "n", "in": 5'
_BAD = [
    # (name, content builder, extra CLI args, substrings the one error line must hold)
    ("truncated-json", lambda d: _write(d / "t.json", _TRUNC), [], ["t.json", "invalid JSON", "truncated"]),
    (
        "truncated-jsonl",
        lambda d: _jsonl(d, [_line(), '{"timestamp": 5, "input_len']),
        [],
        ["m.jsonl", "record 2", "invalid JSON"],
    ),
    (
        "wrong-type-in",
        lambda d: _agentx(d, [_req(), _req(n_in="12")]),
        [],
        ["x.json", "record requests[1]", "field 'in'", "got `str`"],
    ),
    (
        "wrong-type-nested",
        lambda d: _agentx(d, [_req(), {"t": 3, "type": "subagent", "requests": [_req(), _req(out=[1])]}]),
        [],
        ["record requests[1].requests[1]", "field 'out'", "got `array`"],
    ),
    (
        "wrong-type-mooncake",
        lambda d: _jsonl(d, [_line(), {**_line(), "input_length": "x"}]),
        [],
        ["m.jsonl", "record 2", "field 'input_length'", "got `str`"],
    ),
    (
        "negative-out",
        lambda d: _agentx(d, [_req(out=-5)]),
        [],
        ["x.json", "record requests[0]", "field 'out'", ">= 0"],
    ),
    (
        "negative-hash-id",
        lambda d: _agentx(d, [_req(ids=(1, -2))]),
        [],
        ["record requests[0]", "field 'hash_ids'", "hash_ids[1]"],
    ),
    (
        "negative-mooncake",
        lambda d: _jsonl(d, [_line(), _line(), _line(out=-1)]),
        [],
        ["m.jsonl", "record 3", "field 'output_length'", ">= 0"],
    ),
    (
        "hash-ids-too-long",
        lambda d: _agentx(d, [_req(n_in=64, ids=(1, 2))]),
        [],
        ["record requests[0]", "field 'hash_ids'", "2 blocks", "at most 1"],
    ),
    (
        "hash-ids-too-long-mooncake",
        lambda d: _jsonl(d, [_line(n_in=512, ids=(0, 1))]),
        [],
        ["m.jsonl", "record 1", "field 'hash_ids'", "at most 1 blocks of 512"],
    ),
    (
        "missing-field-mooncake",
        lambda d: _jsonl(d, [_line(), {"timestamp": 1, "input_length": 3, "output_length": 1}]),
        [],
        ["record 2", "field 'hash_ids'", "missing"],
    ),
    (
        "missing-t",
        lambda d: _agentx(d, [{"type": "n", "in": 1, "out": 1}]),
        [],
        ["record requests[0]", "field 't'", "missing"],
    ),
    (
        "unknown-type",
        lambda d: _agentx(d, [_req(), _req(type="x")]),
        [],
        ["record requests[1]", "field 'type'", "unknown request type 'x'"],
    ),
    (
        "bad-block-size",
        lambda d: _agentx(d, [_req()], block_size=0),
        [],
        ["record top level", "field 'block_size'"],
    ),
    ("empty-directory", lambda d: (d / "empty").mkdir() or d / "empty", [], ["empty", "no trace files"]),
    (
        "corrupt-gzip",
        lambda d: _write(d / "c.json.gz", gzip.compress(b'{"requests": []}' * 50)[:40]),
        [],
        ["c.json.gz", "corrupt gzip"],
    ),
    (
        "unknown-format",
        lambda d: _write(d / "u.json", '{"hello": 1}'),
        [],
        ["u.json", "unknown trace format"],
    ),
    (
        "empty-jsonl",
        lambda d: _write(d / "e.jsonl", "\n\n"),
        ["--format", "mooncake"],
        ["e.jsonl", "no requests"],
    ),
]


def _write(p: Path, content: str | bytes) -> Path:
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p


@pytest.mark.parametrize(("make", "extra", "expect"), [c[1:] for c in _BAD], ids=[c[0] for c in _BAD])
def test_bad_input_gives_one_clear_line(tmp_path, capsys, make, extra, expect):
    path = make(tmp_path)
    code = main(["trace", "convert", str(path), "-o", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("agentkv: error: "), err
    for s in expect:
        assert s in err, (s, err)
    assert not (tmp_path / "out").exists()


def test_bad_input_through_the_real_cli_prints_no_traceback(tmp_path):
    bad = _jsonl(tmp_path, [_line(), _line(n_in=-3)])
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "trace", "convert", str(bad), "-o", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        f"agentkv: error: {bad}: record 2, field 'input_length': expected `int` >= 0"
    ]
