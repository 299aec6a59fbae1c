"""`agentkv bench` reports agents per MW (#16): the run against the interactivity tier (--tier, as
simulate) on the target's GPUs and power (--gpus, --system, else what the server or NVML says);
figures it cannot know are unknown, not numbers."""

from __future__ import annotations

import json
import re

import pytest

from agentkv.cli import main
from agentkv.engine.hardware import get_system
from tests.serveutil import stream_server_process


@pytest.fixture(scope="module")
def server():
    with stream_server_process("--itl", "0.0005") as url:  # fast: meets any sane tier
        yield url


def _flat(out: str) -> str:
    """The terminal's summary table as one line of words (its cells wrap)."""
    return " ".join(re.sub("[│┃]", " ", out).split())


def _bench(url: str, out, *flags: str) -> dict:
    argv = ["bench", "--target", url, "--max-requests", "6", "--duration", "none", "--lanes", "3"]
    argv += ["--think-scale", "0", "--quiet", "--no-report", "--out", str(out), *flags]
    assert main(argv) == 0
    return json.loads((out / "summary.json").read_text())["interactivity"]


def test_gpus_and_system_give_agents_per_gpu_and_per_mw(server, tmp_path, capsys):
    i = _bench(server, tmp_path / "a", "--gpus", "2", "--system", "dgx-h200", "--tier", "tps=50,ttft_p90=5s")
    share = get_system("dgx-h200").power_w_per_gpu
    assert i["met"] and (i["tier_tps"], i["tier_ttft_p90"]) == (50.0, 5.0) and i["sessions"] == 3
    assert 0 < i["agents"] <= 3 and i["agents"] == pytest.approx(i["mean_trees"])
    assert i["agents_per_gpu"] == pytest.approx(i["agents"] / 2)
    assert i["agents_per_mw"] == pytest.approx(i["agents"] / (2 * share / 1e6))
    assert "DGX H200 provisioned" in i["power_basis"]
    out = _flat(capsys.readouterr().out)
    assert "interactivity (tier >= 50 tok/s, TTFT p90 <= 5 s) met:" in out
    assert f"agents at the tier {i['agents']:,.1f} agents, {i['agents_per_gpu']:,.2f} per GPU, " in out
    assert f"{i['agents_per_mw']:,.0f} per MW power per GPU DGX H200 provisioned" in out


def test_unknown_gpus_and_power_stay_unknown(server, tmp_path, capsys):
    i = _bench(server, tmp_path / "b")  # the test server reports neither its GPUs nor their kind
    assert i["met"] and i["agents"] > 0
    assert i["agents_per_gpu"] is None and i["agents_per_mw"] is None
    assert i["power_basis"].startswith("power unknown")
    assert "agents, unknown per GPU, unknown per MW power per GPU power unknown" in _flat(
        capsys.readouterr().out
    )
    strict = _bench(server, tmp_path / "c", "--tier", "tps=100000")  # no server streams that per user
    assert not strict["met"] and strict["agents"] is None and strict["agents_per_mw"] is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tier", "tps=fast"], "--tier tps: expected a number"),
        (["--tier", "ttft_p90=0s"], "--tier ttft_p90"),
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--system", "nvl-nothing"], "unknown system 'nvl-nothing'"),
    ],
)
def test_bad_tier_gpus_or_system_fail_before_any_server_starts(flags, message, capsys, tmp_path):
    assert main(["bench", "--quiet", "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agentkv: error:") and message in err and "\n" not in err
    assert not (tmp_path / "o").exists()
