"""The CLI's contract: a version, help, and one clear line (no traceback) for bad input."""

import subprocess
import sys

import pytest

from agentkv.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert "agentkv" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["agentkv.cli", "agentkv"])
def test_missing_file_is_one_line_error(module):
    """`python -m agentkv.cli` and `python -m agentkv` alike: one line naming the file, exit status 2."""
    p = subprocess.run(
        [sys.executable, "-m", module, "trace", "stats", "/nonexistent/x.json"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert "/nonexistent/x.json" in p.stderr


def test_format_choices_are_the_readers():
    from agentkv.trace.command import TRACE_FORMATS
    from agentkv.trace.formats import FORMATS

    assert ("auto", *FORMATS) == TRACE_FORMATS


def test_over_context_choices_are_the_policies():
    from agentkv.trace.command import OVER_CONTEXT
    from agentkv.trace.select import OVER_CONTEXT as POLICIES

    assert OVER_CONTEXT == POLICIES
