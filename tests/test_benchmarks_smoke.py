"""The benchmark scripts still start: every one answers `--help` with its usage (nothing runs them
otherwise; sweep_ray.py was broken for sessions unnoticed), and three cheap ones run for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _scripts() -> list[Path]:
    """The runnable scripts: a `__main__` block (the rest are modules the scripts import)."""
    return [p for p in sorted(BENCH.glob("*.py")) if 'if __name__ == "__main__":' in p.read_text()]


def _run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV
    )


# `--help` of every script in one interpreter (their shared imports load once): {name: [exit, stdout, stderr]}
HELP_ALL = """import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[1])
out = {}
for path in sys.argv[2:]:
    o, e, code = io.StringIO(), io.StringIO(), None
    sys.argv = [path, "--help"]
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as x:
            code = x.code
        except BaseException as x:
            code = f"{type(x).__name__}: {x}"
    out[path.rsplit("/", 1)[1]] = [code, o.getvalue(), e.getvalue()[-500:]]
print(json.dumps(out))
"""


def test_every_benchmark_answers_help_with_its_usage():
    scripts = _scripts()
    assert len(scripts) >= 20 and BENCH / "sweep_ray.py" in scripts, scripts
    r = _run(["-c", HELP_ALL, str(BENCH), *map(str, scripts)], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    done = json.loads(r.stdout)
    assert sorted(done) == [p.name for p in scripts]
    for name, (code, out, err) in done.items():
        assert code == 0, (name, code, err)  # None: it ran instead of printing its usage
        assert out.startswith(f"usage: {name}") and "-h, --help" in out, (name, out[:300])


def test_a_bad_flag_is_a_usage_error_not_a_run():
    r = _run([str(BENCH / "sweep_ray.py"), "--pairs", "x"])
    assert r.returncode == 2 and "invalid int value: 'x'" in r.stderr, r.stderr
    assert r.stdout == "", r.stdout  # nothing started: no cluster, no grid


def test_three_cheap_benchmarks_run_and_print_their_figures():
    runs = {
        "kv_tiers.py": [],
        "zmq_events.py": [],
        "kv_hashmap.py": ["--blocks", "2000", "--batch", "50", "--rounds", "2", "--repeat", "1"],
    }
    with ThreadPoolExecutor(3) as pool:
        out = dict(
            zip(runs, pool.map(lambda kv: _run([str(BENCH / kv[0]), *kv[1]], 120), runs.items()), strict=True)
        )
    for name, r in out.items():
        assert r.returncode == 0, (name, r.stderr[-2000:])
    assert "TierStack.match, one CPU tier:" in out["kv_tiers.py"].stdout
    zmq = out["zmq_events.py"].stdout
    assert "delivered 20,000/20,000 batches" in zmq and "lost 0" in zmq, zmq
    rows = [line for line in out["kv_hashmap.py"].stdout.splitlines() if "ns/block" in line]
    assert len(rows) == 6 and all(line.endswith("same map") for line in rows), rows  # U64Map's too
