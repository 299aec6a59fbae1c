"""Fuzzing every trace reader (agentx, mooncake, claude_code) and format detection with hypothesis:
arbitrary bytes, byte-level mutations and JSON-structure mutations of valid files. Each input must
give traces that are sound (finite, non-negative times and counts) or one TraceError; never
another exception, a hang (hypothesis' per-example timing is watched by a hard limit) or memory
that keeps growing.
"""

from __future__ import annotations

import gzip
import json
import math
import signal
import tracemalloc
from pathlib import Path

import pytest
from fuzzutil import byte_mutation, count, fuzz_settings, json_mutation, note, report, rss_bytes
from hypothesis import given
from hypothesis import strategies as st

from agentkv.trace.formats import FORMATS, _module, detect, limits, read_bytes
from agentkv.trace.model import Trace, TraceError

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "claude_code" / "project"
SESSION = FIXTURE / "5f0c1d2e-7a3b-4c1d-9e2f-0a1b2c3d4e5f.jsonl"
AGENT = FIXTURE / "5f0c1d2e-7a3b-4c1d-9e2f-0a1b2c3d4e5f" / "subagents" / "agent-a7f3.jsonl"
SLOW_S = 5  # one reader call on a few KB must end well within this

AGENTX_KEYS = [
    "t",
    "type",
    "model",
    "in",
    "out",
    "hash_ids",
    "input_types",
    "output_types",
    "stop",
    "api_time",
    "ttft",
    "think_time",
    "agent_id",
    "subagent_type",
    "duration_ms",
    "total_tokens",
    "tool_use_count",
    "status",
    "tool_tokens",
    "system_tokens",
    "requests",
    "id",
    "block_size",
    "hash_id_scope",
    "replay",
]
MOONCAKE_KEYS = ["timestamp", "input_length", "output_length", "hash_ids"]
CLAUDE_KEYS = [
    "type",
    "timestamp",
    "uuid",
    "parentUuid",
    "isSidechain",
    "agentId",
    "subtype",
    "requestId",
    "message",
    "id",
    "model",
    "content",
    "stop_reason",
    "usage",
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "toolUseResult",
    "agentType",
    "status",
    "totalTokens",
    "totalDurationMs",
]

AGENTX_DOC = {
    "id": "fz",
    "block_size": 64,
    "tool_tokens": 10,
    "system_tokens": 20,
    "requests": [
        {
            "t": 0.0,
            "type": "n",
            "model": "m",
            "in": 200,
            "out": 10,
            "hash_ids": [1, 2, 3, 4],
            "think_time": 0.0,
            "input_types": ["text"],
            "output_types": ["tool_use"],
            "stop": "tool_use",
            "api_time": 1.5,
            "ttft": 0.2,
        },
        {
            "t": 9.0,
            "type": "subagent",
            "agent_id": "a1",
            "subagent_type": "Explore",
            "duration_ms": 4000,
            "total_tokens": 500,
            "tool_use_count": 1,
            "status": "completed",
            "requests": [{"t": 0.0, "type": "n", "in": 130, "out": 5, "hash_ids": [1, 2, 9]}],
        },
        {"t": 12.0, "type": "s", "in": 300, "out": 20, "hash_ids": [1, 2, 3, 4, 5], "think_time": 2.5},
    ],
}
MOONCAKE_LINES = [
    {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 27, "input_length": 1500, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 50, "input_length": 600, "output_length": 80, "hash_ids": [5, 6]},
]


def _seeds() -> dict[str, list[bytes]]:
    bundled = gzip.decompress((ROOT / "agentkv" / "data" / "traces" / "trace_0266.json.gz").read_bytes())
    return {
        "agentx": [json.dumps(AGENTX_DOC).encode(), bundled],
        "mooncake": [b"\n".join(json.dumps(x).encode() for x in MOONCAKE_LINES)],
        "claude_code": [SESSION.read_bytes(), AGENT.read_bytes()],
    }


SEEDS = _seeds()
FUZZ_DIR: Path | None = None


@pytest.fixture(scope="module", autouse=True)
def _setup(request, tmp_path_factory):
    global FUZZ_DIR
    FUZZ_DIR = tmp_path_factory.mktemp("fuzz")  # no sub-agent folders beside the fuzzed files
    yield
    report(request.config, "trace ")


def _alarm(signum, frame):
    raise TimeoutError(f"a reader call took over {SLOW_S} s: a hang")


def _read(fmt: str, data: bytes, name: str = "fz") -> str:
    """Run one reader on `data`; the outcome ('traces'/'TraceError'), or fail on anything else."""
    suffix = ".jsonl" if fmt in ("mooncake", "claude_code") else ".json"
    path = FUZZ_DIR / f"{name}{suffix}"
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SLOW_S)
    try:
        traces = _module(fmt).read(path, data)
    except TraceError as e:
        assert str(path) in str(e)  # the error names the file
        return "TraceError"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    _check(traces)
    return "traces" if traces else "empty"


def _check(traces: list) -> None:
    """What a reader hands on must be usable downstream: finite, non-negative, bounded numbers."""
    assert isinstance(traces, list)
    for t in traces:
        assert isinstance(t, Trace) and 0 < t.block_size <= limits.MAX_BLOCK_SIZE
        for s in t.sessions():
            assert math.isfinite(s.t) and s.t >= 0, ("session t", s.t)
            assert 0 <= s.system_tokens <= limits.MAX_TOKENS and 0 <= s.tool_tokens <= limits.MAX_TOKENS
            for r in s.requests:
                assert math.isfinite(r.t) and r.t >= 0, ("t", r.t)
                assert math.isfinite(r.think_time) and r.think_time >= 0, ("think_time", r.think_time)
                assert 0 <= r.input_tokens <= limits.MAX_TOKENS and 0 <= r.output_tokens <= limits.MAX_TOKENS
                assert all(isinstance(h, int) and 0 <= h <= limits.MAX_HASH_ID for h in r.hash_ids)
        t.timeline()  # the replay plan's first step


def test_seeds_are_valid():
    for fmt, seeds in SEEDS.items():
        for data in seeds:
            assert _read(fmt, data) == "traces", fmt


@pytest.mark.parametrize("fmt", FORMATS)
@given(data=st.binary(max_size=3000))
@fuzz_settings(100)
def test_arbitrary_bytes(fmt, data):
    count(f"trace {fmt} bytes", _read(fmt, data))


@pytest.mark.parametrize("fmt", FORMATS)
@given(st.data())
@fuzz_settings(120)
def test_byte_mutations_of_valid_files(fmt, data):
    seed = data.draw(st.sampled_from(SEEDS[fmt]))
    count(f"trace {fmt} byte-mutations", _read(fmt, data.draw(byte_mutation(seed))))


def _json_mutant(fmt: str, data) -> bytes:
    seed = data.draw(st.sampled_from(SEEDS[fmt]))
    if fmt == "agentx":
        return json.dumps(data.draw(json_mutation(json.loads(seed), AGENTX_KEYS))).encode()
    lines = [json.loads(x) for x in seed.splitlines() if x.strip()]
    keys = MOONCAKE_KEYS if fmt == "mooncake" else CLAUDE_KEYS
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        lines[i] = data.draw(json_mutation(lines[i], keys))
    return b"\n".join(json.dumps(x).encode() for x in lines)


@pytest.mark.parametrize("fmt", FORMATS)
@given(st.data())
@fuzz_settings(150)
def test_json_mutations_of_valid_files(fmt, data):
    count(f"trace {fmt} json-mutations", _read(fmt, _json_mutant(fmt, data)))


@given(st.data())
@fuzz_settings(150)
def test_detection_and_gzip(data):
    """`detect` and `read_bytes` (gzip by magic number) on mutants of every format."""
    fmt = data.draw(st.sampled_from(FORMATS))
    raw = data.draw(byte_mutation(data.draw(st.sampled_from(SEEDS[fmt]))))
    if data.draw(st.booleans()):
        raw = data.draw(byte_mutation(gzip.compress(raw)))
    path = FUZZ_DIR / "detect.json"
    path.write_bytes(raw)
    try:
        found = detect(path, read_bytes(path))
    except TraceError:
        count("trace detect+gzip", "TraceError")
        return
    assert found in FORMATS
    count("trace detect+gzip", _read(found, read_bytes(path), "detect"))


def test_deep_nesting_is_an_error_not_a_crash():
    """Sub-agents nested 50,000 deep (a few hundred KB) must not overflow the stack."""
    inner = {"t": 0.0, "type": "n", "in": 10, "out": 1, "hash_ids": []}
    depth = 50_000
    doc = (
        '{"block_size": 64, "requests": '
        + '[{"t": 1, "type": "subagent", "requests": ' * depth
        + json.dumps([inner])
        + "}]" * depth
        + "}"
    ).encode()
    assert _read("agentx", doc) in ("traces", "TraceError")
    deep_line = b'{"type": "user", "message": ' + b'{"content": ' * depth + b"1" + b"}" * depth + b"}"
    assert _read("claude_code", deep_line) in ("traces", "TraceError", "empty")
    deep_ids = (
        b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ' + b"[" * depth + b"]" * depth
    )
    assert _read("mooncake", deep_ids + b"}") == "TraceError"
    for d in (150, 900):  # deep enough to hurt recursive walks, shallow enough for the JSON decoder
        doc = (
            '{"block_size": 64, "requests": '
            + '[{"t": 1, "type": "subagent", "requests": ' * d
            + json.dumps([inner])
            + "}]" * d
            + "}"
        ).encode()
        assert _read("agentx", doc) == "TraceError"


def test_memory_stays_bounded_over_many_reads():
    """Reading the same mutant files again and again must not keep memory (no caches that grow)."""
    import random

    rng = random.Random(7)
    inputs = []
    for fmt, seeds in SEEDS.items():
        for s in seeds:
            for _ in range(20):
                b = bytearray(s)
                for _ in range(3):
                    i = rng.randrange(len(b))
                    b[i] = rng.randrange(256)
                inputs.append((fmt, bytes(b)))
    for fmt, b in inputs:  # warm up: module caches, interned strings
        _read(fmt, b)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(5):
            for fmt, b in inputs:
                _read(fmt, b)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    note("trace memory-loop", f"{5 * len(inputs)} reads, {grown / 1024:.0f} KiB kept")
    assert grown < 1 << 20, f"{grown} bytes kept after {5 * len(inputs)} reads"
    assert rss_bytes() < 2 << 30
