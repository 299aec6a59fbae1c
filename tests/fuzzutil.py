"""Shared pieces of the fuzz suites: hypothesis settings, JSON value and mutation strategies,
example counters printed at the end of each module, and a resident-memory probe.

`AGENTKV_FUZZ_SCALE` (default 1) multiplies every example budget: `AGENTKV_FUZZ_SCALE=20 pytest
tests/test_fuzz_*.py` is the long run; the default keeps the suites to about a minute in all.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = float(os.environ.get("AGENTKV_FUZZ_SCALE", "1"))
COUNTS: Counter[str] = Counter()  # target -> examples run (printed by `report`)
OUTCOMES: Counter[str] = Counter()  # target:outcome -> examples
NOTES: dict[str, str] = {}  # target -> a one-line result of a loop that is not a hypothesis test


def fuzz_settings(examples: int) -> settings:
    """Hypothesis settings for a budget of `examples` (times the scale); no deadline on a busy machine."""
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        database=None,
    )


def count(target: str, outcome: str) -> None:
    COUNTS[target] += 1
    OUTCOMES[f"{target}: {outcome}"] += 1


def note(target: str, text: str) -> None:
    NOTES[target] = text


def report(config, prefix: str) -> None:
    """Print the examples run per target (and how each ended) on the terminal, captured or not."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    names = sorted(k for k in {*COUNTS, *NOTES} if k.startswith(prefix))
    if tr is None or not names:
        return
    cap = config.pluginmanager.get_plugin("capturemanager")
    with cap.global_and_fixture_disabled():
        tr.write_line("")
        for k in names:
            if k in NOTES:
                tr.write_line(f"fuzz {k}: {NOTES[k]}")
                continue
            ends = ", ".join(
                f"{o.split(': ', 1)[1]} {n}" for o, n in sorted(OUTCOMES.items()) if o.split(": ", 1)[0] == k
            )
            tr.write_line(f"fuzz {k}: {COUNTS[k]} examples ({ends})")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- JSON values and mutations ----------------------------------------------------------------------
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 70_000)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24)
    | st.sampled_from(
        [
            "",
            "GPU",
            "CPU",
            "n",
            "s",
            "subagent",
            "user",
            "assistant",
            "system",
            "2026-01-10T10:00:00Z",
            "0001-01-01T00:00:00",
            "9999-12-31T23:59:59+14:00",
        ]
    )
)
json_values = st.recursive(
    leaves,
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=10), c, max_size=5),
    max_leaves=16,
)
# raw JSON fragments that Python's json module will not write but a file may hold
FRAGMENTS = [
    b"1e999",
    b"-1e999",
    b"NaN",
    b"-0",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"null",
    b'"',
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"\\u0000",
    b"\\ud800",
    b"\xff\xfe",
    b"\x00",
    b"\n",
    b"\r\n",
    b"true",
    b"0.0000000000000000000000001",
    b"1" * 400,
    b"[" * 300,
    b'{"a":' * 200,
]


@st.composite
def json_mutation(draw, doc: Any, keys: list[str]) -> Any:
    """`doc` with one random node replaced, deleted, or given a new (often known) key."""
    doc = json.loads(json.dumps(doc))  # a private copy
    node, parent, key = doc, None, None
    while isinstance(node, dict | list) and node and draw(st.booleans()):
        k = (
            draw(st.sampled_from(sorted(node)))
            if isinstance(node, dict)
            else draw(st.integers(0, len(node) - 1))
        )
        parent, key, node = node, k, node[k]
    op = draw(st.sampled_from(["replace", "delete", "add", "add"]))
    if op == "replace" or parent is None and op == "delete":
        value = draw(json_values)
        if parent is None:
            return value
        parent[key] = value
    elif op == "delete":
        del parent[key]
    elif isinstance(node, dict):
        node[draw(st.sampled_from(keys) | st.text(max_size=8))] = draw(json_values)
    elif isinstance(node, list):
        node.insert(draw(st.integers(0, len(node))), draw(json_values))
    elif parent is not None:
        parent[key] = draw(json_values)
    return doc


@st.composite
def byte_mutation(draw, data: bytes) -> bytes:
    """`data` cut, flipped, spliced with raw fragments or random bytes, a few times over."""
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["cut", "flip", "fragment", "insert", "delete", "dup"]))
        if op == "cut":
            data = data[:i]
        elif op == "flip" and i < len(data):
            data = data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1 :]
        elif op == "fragment":
            data = data[:i] + draw(st.sampled_from(FRAGMENTS)) + data[i:]
        elif op == "insert":
            data = data[:i] + draw(st.binary(max_size=16)) + data[i:]
        elif op == "delete":
            data = data[:i] + data[i + draw(st.integers(1, 64)) :]
        elif op == "dup":
            j = draw(st.integers(i, min(len(data), i + 400)))
            data = data[:j] + data[i:j] + data[j:]
    return data
