"""--expert-imbalance: the hottest EP rank's load prices expert GEMMs, expert reads and all-to-all."""

import subprocess
import sys

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.cost import CostModel
from agentkv.errors import UserError


def _cm(imb: float, **kw) -> CostModel:
    kw = {"tp": 1, "dp": 8, "ep": True, **kw}
    return CostModel("h200", "deepseek-v3", expert_imbalance=imb, **kw)


def test_balanced_is_the_default_step_time():
    steps = [((), [4096] * 32), (((2048, 0),), [8192] * 8), (((8192, 60000),), ())]
    base, one = CostModel("h200", "deepseek-v3", tp=1, dp=8, ep=True), _cm(1.0)
    for pre, dec in steps:
        assert one.step_time(pre, dec) == base.step_time(pre, dec)


@pytest.mark.parametrize("dec", [[2048] * 1, [2048] * 64, [2048] * 256])
def test_step_time_grows_with_imbalance(dec):
    times = [_cm(x).step_time((), dec) for x in (1.0, 1.5, 2.0, 4.0)]
    assert times == sorted(times) and times[-1] > times[0]


def test_imbalance_scales_gemm_and_all_to_all_bytes():
    t1, t2 = _cm(1.0).terms(), _cm(2.0).terms()
    assert t2.moe.flop_tok == pytest.approx(2.0 * t1.moe.flop_tok)
    assert t2.a2a_tok == pytest.approx(2.0 * t1.a2a_tok)
    assert t2.a2a_lat == t1.a2a_lat
    # a hot rank touches more of its experts at small batches, never more than all of them
    assert t1.moe.weights_s(4) < t2.moe.weights_s(4) <= t1.moe.weights_s(10**6) * 1.000001


def test_without_expert_parallel_imbalance_changes_nothing():
    tp8 = CostModel("h200", "deepseek-v3", tp=8)
    hot = CostModel("h200", "deepseek-v3", tp=8, expert_imbalance=3.0)
    assert hot.step_time((), [4096] * 16) == tp8.step_time((), [4096] * 16)


@pytest.mark.parametrize("bad", [0.5, float("nan"), float("inf"), -1.0])
def test_bad_imbalance_is_a_one_line_error(bad):
    with pytest.raises(UserError, match="--expert-imbalance"):
        EngineConfig(model="deepseek-v3", expert_imbalance=bad)
    with pytest.raises(UserError, match="--expert-imbalance"):
        _cm(bad)


def test_cli_flag_reaches_the_engine_and_rejects_bad_values():
    base = [sys.executable, "-m", "agentkv.cli", "simulate", "--model", "deepseek-v3", "-q", "--json"]
    bad = subprocess.run([*base, "--expert-imbalance", "0.2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--expert-imbalance" in bad.stderr and "Traceback" not in bad.stderr
