"""The terminal contract of every command: each flag has help, tables never cut a number (at 80
columns and piped), and simulate, its sweep and cache analyze stop on the first Ctrl-C, write
what finished, say so and exit 130 without a traceback (real subprocesses sent SIGINT)."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys

from cliutil import interrupt
from rich.console import Console
from rich.table import Table

from agentkv.cli import build_parser, main
from agentkv.terminal import show

ENV = {**os.environ, "COLUMNS": "80"}


def _flags(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction | argparse._VersionAction):
            yield path, action


def test_every_flag_of_every_command_has_help():
    missing = [
        f"{path} {'/'.join(a.option_strings) or a.dest}"
        for path, a in _flags(build_parser(), "agentkv")
        if a.help != argparse.SUPPRESS and not (a.help or "").strip()
    ]
    assert not missing, f"flags without help: {missing}"


def test_show_keeps_every_number_whole_at_80_columns():
    t = Table(title="wide")
    t.add_column("a long label column that must give way")
    figures = [f"{n:,}" for n in (1_405_520, 98_765_432_101, 3_141_592, 2_718_281_828, 42, 7_777_777)]
    for i in range(len(figures)):
        t.add_column(f"figure number {i}", justify="right")
    t.add_row("request tokens per session with a long name", *figures)
    t.add_row("why", *["a reason that is long and wraps at spaces"] + figures[1:])
    out = io.StringIO()
    show(Console(file=out, width=80, force_terminal=False), t)
    text = out.getvalue()
    assert "…" not in text
    for f in figures:
        assert f in text


def test_simulate_summary_piped_at_80_columns(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "simulate", "--max-requests", "60", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert p.returncode == 0, p.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert f"{s['input_tokens']:,}" in p.stdout and "…" not in p.stdout
    assert max(len(line) for line in p.stdout.splitlines()) <= 80


def _interrupt(args: list[str], marker: str, delay: float = 0.3) -> tuple[subprocess.CompletedProcess, str]:
    """Start `agentkv ARGS`, wait for `marker` on its stderr, send one SIGINT; its result."""
    res, _ = interrupt(args, marker, delay, env=ENV)
    return res, res.stderr


def test_simulate_first_ctrl_c_keeps_what_finished(tmp_path):
    synth = tmp_path / "synth"
    assert main(["trace", "synth", "--sessions", "12", "--seed", "3", "-o", str(synth)]) == 0
    res, err = _interrupt(["simulate", str(synth), "--out", str(tmp_path / "out")], "simulating")
    assert res.returncode == 130 and "Traceback" not in err and "interrupted" in err
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert 0 < s["requests"] < 1085 and any("interrupted (Ctrl-C)" in n for n in s["notes"])
    lines = (tmp_path / "out" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == s["requests"]
    assert "interrupted (Ctrl-C)" in res.stdout  # the printed summary says so too


def test_sweep_first_ctrl_c_writes_finished_points(tmp_path):
    grid = "lanes=" + ",".join(str(n) for n in range(1, 13))
    res, err = _interrupt(["simulate", "--sweep", grid, "--out", str(tmp_path)], "points", delay=0.0)
    assert res.returncode == 130 and "Traceback" not in err, err
    assert "ETA" in err and "interrupted:" in err
    written = list(tmp_path.glob("summary-lanes=*.json"))
    assert 1 <= len(written) < 12
    assert "simulate sweep" in res.stdout


def test_cache_analyze_first_ctrl_c_shows_finished_replays():
    args = ["cache", "analyze", "--capacity", "1GB,2GB,4GB,8GB,16GB,32GB", "--block-size", "16,64", "-j", "2"]
    res, err = _interrupt(args, "analyzing", delay=1.5)
    assert res.returncode == 130 and "Traceback" not in err, err
    assert "replays done" in err and "'-' marks replays that did not run" in res.stdout
    # the ceiling row (its label wraps at 80 columns once finished cells widen the table)
    assert "unbounded" in res.stdout and "(ceiling)" in res.stdout
