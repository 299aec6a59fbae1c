"""Red team for the trace readers: hostile files and paths (tests/hostile_traces.py builds them).

Every input, through the library and the real CLI (`trace stats`, `simulate --max-requests 5`), must
end in one `agentkv: error:` line and exit code 2, naming the file, the record and the field where
there is one: never a traceback, a hang, or a read of a FIFO, a device or more than the size cap.
Values at the bounds must still be read and usable. Prints how many inputs were tried and rejected.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from hostile_traces import AGENTX, CLAUDE, Case, number_cases, path_cases

from agentkv.cli import main
from agentkv.errors import UserError
from agentkv.trace.formats import limits, load_paths
from agentkv.trace.model import TraceError

ROOT = Path(__file__).resolve().parents[1]
CALL_S = 20  # one in-process call must end well within this: longer is a hang
PROC_S = 60  # the same for one CLI subprocess (start-up included)
FIGURES: Counter[str] = Counter()


@pytest.fixture(scope="module")
def cases(request, tmp_path_factory) -> Iterator[list[Case]]:
    d = tmp_path_factory.mktemp("hostile")
    sock_dir = Path(tempfile.mkdtemp(prefix="akv", dir="/tmp"))  # a socket's path must be short
    (d / "numbers").mkdir()
    (d / "paths").mkdir()
    try:
        yield number_cases(d / "numbers") + path_cases(d / "paths", sock_dir)
    finally:
        shutil.rmtree(sock_dir)
        _report(request.config)


def _report(config) -> None:
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or not FIGURES:
        return
    with config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        tr.write_line("")
        for k in sorted(FIGURES):
            if not k.endswith(" rejected"):
                tr.write_line(
                    f"hostile {k}: {FIGURES[k]} inputs, {FIGURES[k + ' rejected']} rejected cleanly"
                )


@contextmanager
def _guard(env: dict[str, str], seconds: int = CALL_S):
    """`env` set, and a hang turned into a failure (SIGALRM also interrupts a blocking open)."""

    def alarm(signum, frame):
        raise TimeoutError(f"a call took over {seconds} s: a hang")

    saved = {k: os.environ.get(k) for k in env}
    old = signal.signal(signal.SIGALRM, alarm)
    os.environ.update(env)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _shown(p: Path) -> str:
    return str(p) if str(p).isprintable() else repr(str(p))


def _kind(c: Case) -> str:
    return c.label.split("-")[0] if c.label.split("-")[0] in ("agentx", "mooncake", "claude") else "paths"


def test_the_library_rejects_each_input_naming_file_record_and_field(cases):
    for c in cases:
        FIGURES[f"library {_kind(c)}"] += 1
        with _guard(c.env):
            try:
                load_paths([c.path], c.fmt)
                pytest.fail(f"{c.label}: read without an error")
            except UserError as e:
                err = e
        msg = str(err)
        assert "\n" not in msg, (c.label, msg)
        assert (c.names or _shown(c.path)) in msg, (c.label, msg)
        assert c.words in msg, (c.label, c.words, msg)
        if c.record is not None:
            assert f"record {c.record}" in msg, (c.label, msg)
        if c.key is not None:
            assert isinstance(err, TraceError) and c.key in (err.field or ""), (c.label, msg)
        FIGURES[f"library {_kind(c)} rejected"] += 1


def _one_line_exit_2(code: int, err: str) -> bool:
    return (
        code == 2 and err.count("\n") == 1 and err.startswith("agentkv: error: ") and "Traceback" not in err
    )


def test_the_cli_in_process_gives_one_line_and_exit_2_for_each(cases, capsys):
    for c in cases:
        for argv in (["trace", "stats", *c.args()], ["simulate", *c.args(), "--max-requests", "5"]):
            name = f"cli in-process {_command(argv)}"
            FIGURES[name] += 1
            with _guard(c.env):
                code = main(argv)
            err = capsys.readouterr().err
            assert _one_line_exit_2(code, err), (c.label, argv[0], code, err)
            FIGURES[f"{name} rejected"] += 1


def _command(argv: list[str]) -> str:
    return " ".join(argv[:2]) if argv[0] == "trace" else argv[0]


def _subset(cases: list[Case]) -> list[Case]:
    """Every path case, and per (format, field) one bad number, the value rotating across fields."""
    groups: dict[str, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.label.rsplit("-", 1)[0] if _kind(c) != "paths" else c.label, []).append(c)
    return [members[i % len(members)] for i, members in enumerate(groups.values())]


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    cmd = [sys.executable, "-m", "agentkv.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=PROC_S, env=full, cwd=ROOT)


def test_the_real_cli_gives_one_line_and_exit_2(cases):
    """Subprocesses, two at a time: `trace stats` on the subset, `simulate` on every fifth of it,
    and one `trace stats` given a good file then many bad ones (the first bad one is named)."""
    subset = _subset(cases)
    runs = [(c, ["trace", "stats", *c.args()]) for c in subset]
    runs += [(c, ["simulate", *c.args(), "--max-requests", "5"]) for c in subset[::5]]
    good = cases[0].path.with_name("good.json")
    good.write_text(json.dumps(AGENTX))
    many = [c for c in cases if c.fmt == "agentx"][:50]
    runs.append((many[0], ["trace", "stats", "--format", "agentx", str(good), *(str(c.path) for c in many)]))
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda r: (r[0], r[1], _cli(r[1], r[0].env)), runs))
    for c, args, p in done:
        FIGURES[f"cli subprocess {_command(args)}"] += 1
        assert _one_line_exit_2(p.returncode, p.stderr), (c.label, args[:2], p.returncode, p.stderr[-2000:])
        assert c.words in p.stderr and (c.names or _shown(c.path)) in p.stderr, (c.label, p.stderr)
        FIGURES[f"cli subprocess {_command(args)} rejected"] += 1


def _at_the_bounds(d: Path) -> list[Path]:
    """Files whose every number sits at its bound (or one tick inside): all must be accepted."""
    T, H, S = limits.MAX_TOKENS, limits.MAX_HASH_ID, limits.MAX_SECONDS
    req = {"t": S, "type": "n", "in": T, "out": T, "hash_ids": [H, 0, H], "api_time": S, "ttft": S}
    req["think_time"] = S
    doc = copy.deepcopy(AGENTX)
    doc.update(id=H, block_size=limits.MAX_BLOCK_SIZE, tool_tokens=T, system_tokens=T)
    sub = doc["requests"][1]
    sub.update(t=S, duration_ms=limits.MAX_MILLIS, total_tokens=limits.MAX_TOTAL_TOKENS, requests=[req])
    sub.update(tool_use_count=limits.MAX_COUNT, tool_tokens=T, system_tokens=T)
    doc["requests"][0] = req
    line = {"timestamp": limits.MAX_MILLIS, "input_length": T, "output_length": T, "hash_ids": [H, 0]}
    lines = copy.deepcopy(CLAUDE)
    lines[1]["message"]["usage"].update(input_tokens=T - 2, cache_read_input_tokens=1, output_tokens=T)
    lines[1]["message"]["usage"]["cache_creation_input_tokens"] = 1  # the three sum to the bound
    lines[2]["toolUseResult"].update(totalTokens=limits.MAX_TOTAL_TOKENS, totalDurationMs=limits.MAX_MILLIS)
    files = {"edge.json": json.dumps(doc), "edge.jsonl": json.dumps(line), "cc-edge.jsonl": ""}
    files["cc-edge.jsonl"] = "\n".join(json.dumps(x) for x in lines)
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "cc-edge" / "subagents").mkdir(parents=True)
    (d / "cc-edge" / "subagents" / "agent-a7.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:2]))
    os.mkfifo(d / "cc-edge" / "subagents" / "agent-a7.meta.json")  # optional: passed over, never opened
    return [d / name for name in files]


def test_values_at_the_bounds_are_read_and_usable(tmp_path, capsys):
    """The bounds keep what follows safe: stats and a simulation run on them without a traceback."""
    files = _at_the_bounds(tmp_path)
    with _guard({}):
        traces = load_paths(files)
        assert main(["trace", "stats", *map(str, files)]) == 0, capsys.readouterr().err
    assert [t.format for t in traces] == ["agentx", "mooncake", "claude_code"]
    assert traces[0].session.requests[0].hash_ids[0] == limits.MAX_HASH_ID
    assert traces[2].session.subagents[0].total_tokens == limits.MAX_TOTAL_TOKENS
    for f in files:
        p = _cli(["simulate", str(f), "--max-requests", "5"], {})
        ok = p.returncode == 0 or (p.returncode == 3 and "agentkv: invalid run:" in p.stderr)  # 3: said why
        assert ok and "Traceback" not in p.stderr, (f.name, p.stderr[-2000:])
