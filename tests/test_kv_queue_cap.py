"""--kv-queue-cap: how much of a worker's active prefill kv_aware counts, on simulate (and its
sweeps) and route; 0 leaves queues unseen, none is Dynamo's uncapped sum, bad values are refused."""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

from agentkv.cli import build_parser, main
from agentkv.engine.config import EngineConfig
from agentkv.errors import UserError
from agentkv.placement.policy import KvAware
from agentkv.route.command import config_from_args
from agentkv.route.proxy import Router
from agentkv.sim.cluster import SimConfig, make_cluster, simulate
from agentkv.sim.sweep import apply
from agentkv.trace.synth import synthesize

ENG = EngineConfig(num_gpu_blocks_override=3000, max_model_len=200_000)


def _records(cfg: SimConfig) -> list[bytes]:
    run = simulate(synthesize(8, seed=1), cfg)
    return [msgspec.json.encode(r) for r in run.records]


def test_cap_zero_is_the_queue_unseen():
    base = SimConfig(engine=ENG, workers=2, lanes=8, max_requests=80)
    unseen = _records(dataclasses.replace(base, kv_queue_weight=0.0))
    assert _records(dataclasses.replace(base, kv_queue_cap=0.0)) == unseen
    capped = _records(base)
    assert capped != unseen  # on this case queues move requests at the default cap ...
    assert _records(dataclasses.replace(base, kv_queue_cap=float("inf"))) not in (
        capped,
        unseen,
    )  # ... and more uncapped


def test_uncapped_counts_the_whole_queue():
    cluster = make_cluster(synthesize(2, seed=1), SimConfig(engine=ENG, workers=2, kv_queue_cap=float("inf")))
    assert cluster.policy.queue_cap == float("inf")
    assert make_cluster(synthesize(2, seed=1), SimConfig(engine=ENG, workers=2)).policy.queue_cap == 0.5


def test_simulate_records_the_cap(tmp_path, capsys):
    argv = [
        "simulate",
        "--workers",
        "2",
        "--lanes",
        "2",
        "--max-requests",
        "6",
        "--num-gpu-blocks-override",
        "3000",
    ]
    for flag, want in (("0.25", 0.25), ("none", "none")):
        out = tmp_path / flag
        assert main([*argv, "--kv-queue-cap", flag, "-q", "--no-report", "--out", str(out)]) == 0
        assert json.loads((out / "summary.json").read_text())["config"]["kv_queue_cap"] == want
    out = tmp_path / "rr"
    assert main([*argv, "--router", "round_robin", "-q", "--no-report", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["config"].get("kv_queue_cap") is None


def test_sweep_sets_the_cap():
    assert apply(SimConfig(), {"kv_queue_cap": "none"}).kv_queue_cap == float("inf")
    assert apply(SimConfig(), {"kv_queue_cap": "0.25"}).kv_queue_cap == 0.25
    with pytest.raises(UserError, match="kv_queue_cap"):
        apply(SimConfig(), {"kv_queue_cap": "-1"})


@pytest.mark.parametrize("bad", ["-1", "nan", "half"])
@pytest.mark.parametrize("cmd", [["simulate"], ["route", "--worker", "http://127.0.0.1:9"]])
def test_bad_caps_are_refused(cmd, bad, capsys):
    """argparse's usage error (exit 2) naming the flag and the value, as for vLLM's flags."""
    with pytest.raises(SystemExit) as exit_:
        main([*cmd, f"--kv-queue-cap={bad}"])
    err = capsys.readouterr().err
    assert (
        exit_.value.code == 2
        and f"argument --kv-queue-cap: expected a number >= 0 or 'none', got '{bad}'" in err
    )
    assert "Traceback" not in err
    with pytest.raises(UserError, match="--kv-queue-cap"):
        SimConfig(kv_queue_cap=float(bad) if bad != "half" else -0.5)


def test_route_prices_with_the_cap():
    """The flags reach the router's policy, and a retry's policy keeps them."""
    argv = ["route", "--worker", "http://127.0.0.1:9", "--kv-queue-weight", "1", "--kv-queue-cap", "0.25"]
    router = Router(config_from_args(build_parser().parse_args(argv)))
    for policy in (router._make_policy(), router._make_policy(retry=True)):
        assert isinstance(policy, KvAware) and (policy.queue_weight, policy.queue_cap) == (1.0, 0.25)
    default = Router(config_from_args(build_parser().parse_args(argv[:3])))._make_policy()
    assert default.queue_cap == 0.5
