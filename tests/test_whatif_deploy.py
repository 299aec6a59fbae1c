"""scripts/whatif_deploy.py prints the deployment what-if table (its --quick row) and rejects bad names."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "whatif_deploy.py"
TRACES = Path("/work/shared/traces/claude-code")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.skipif(not TRACES.is_dir(), reason="needs the shared Claude Code traces")
def test_quick_prints_a_row_with_the_ratio_to_aa_agentperf():
    p = _run("--quick")
    assert p.returncode == 0, p.stderr
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| DeepSeek-V4-Pro | 8x H200 | agg")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[4] == "8" and cells[5].startswith(("default:", "relaxed:", "none met"))
    if not cells[5].startswith("none"):
        agents_gpu, agents_mw = float(cells[6]), float(cells[7].replace(",", ""))
        # agents/MW is agents/GPU over the DGX H200's provisioned 1,275 W per GPU
        assert agents_mw == pytest.approx(agents_gpu / 1275 * 1e6, rel=0.01)
        assert "of 2,594/MW" in cells[8]


def test_unknown_system_is_a_one_line_error(tmp_path):
    p = _run("--systems", "dgx-h100", "--traces", str(tmp_path))
    assert p.returncode == 2 and "unknown dgx-h100" in p.stderr and "Traceback" not in p.stderr


def test_a_failing_point_is_reported_not_hidden(tmp_path):
    p = _run(
        "--models",
        "DeepSeek-V3",
        "--systems",
        "8x H200",
        "--rows",
        "agg",
        "--traces",
        str(tmp_path / "missing"),
    )
    assert p.returncode == 0
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| DeepSeek-V3")]
    assert len(rows) == 1 and "error:" in rows[0]
