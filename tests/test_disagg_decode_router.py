"""A decode pool routed by kv_aware prices its workers with --kv-weight and --kv-queue-weight, as the
prefill pool does, unless --decode-kv-weight or --decode-kv-queue-weight set its own (Dynamo's decode
stage: overlap weight 0); the run's summary records both pools' prices."""

import itertools
import json

import pytest

from agentkv.cli import main
from agentkv.engine.config import EngineConfig
from agentkv.placement.policy import RouteRequest
from agentkv.sim.cluster import SimConfig
from agentkv.sim.disagg import DisaggCluster
from agentkv.trace.formats import bundled_sample, load_paths

ENG = EngineConfig(max_model_len=200_000)
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def sample():
    return load_paths(bundled_sample())


def _hashes(n: int) -> list[int]:
    return [next(_ids) for _ in range(n)]


def _step(w) -> None:
    res = w.engine.step()
    w.engine.clock.advance_to(res.end)


def _primed(sample, **kw) -> tuple[DisaggCluster, RouteRequest]:
    """Two decode workers: the first caches the new request's 64-block prefix and runs another
    request (8 blocks held), the second is empty. The request shares that prefix plus 4 blocks."""
    cfg = SimConfig(engine=ENG, lanes=2, prefill_workers=1, decode_workers=2, decode_router="kv_aware", **kw)
    c = DisaggCluster(sample, cfg)
    warm, bs = c.decode_workers[0], c.ecfg.block_size
    prefix = _hashes(64)
    warm.add_request("warm", max_tokens=1, prompt_len=64 * bs, block_hashes=prefix)
    while warm.engine.has_work():
        _step(warm)
    warm.add_request("busy", max_tokens=1000, prompt_len=8 * bs, block_hashes=_hashes(8))
    _step(warm)  # its prompt in one chunk: it holds KV and decodes
    return c, RouteRequest(prefix + _hashes(4), 68 * bs, session="t", block_size=bs)


def test_decode_pool_prices_workers_with_the_given_weights(sample):
    """At the default weight the cached prefix outweighs the first worker's load; at --kv-weight 0
    only load counts and the empty worker wins: the decode pool reads the flag."""
    default, req = _primed(sample)
    warm, empty = default.decode_workers
    held = warm.active_blocks()
    assert held > 0 and empty.active_blocks() == 0
    assert default.decode_policy.costs(req, default.decode_workers) == [16.0 * 4 + held, 16.0 * 68]
    assert [default.decode_policy.choose(req, default.decode_workers) for _ in range(3)] == [0, 0, 0]
    zero, req = _primed(sample, kv_weight=0.0)
    assert zero.decode_policy.costs(req, zero.decode_workers) == [held, 0.0]
    assert [zero.decode_policy.choose(req, zero.decode_workers) for _ in range(3)] == [1, 1, 1]
    q, req = _primed(sample, kv_weight=2.0, kv_queue_weight=0.5)
    pending = _hashes(100)  # a prompt queued on the empty worker, not yet prefilled: its queue
    bs = q.ecfg.block_size
    q.decode_workers[1].add_request("queued", max_tokens=4, prompt_len=100 * bs, block_hashes=pending)
    # the queue counts at most half the request's 68 blocks (KV_QUEUE_CAP)
    assert q.decode_policy.costs(req, q.decode_workers) == [2.0 * 4 + held, 2.0 * (68 + 0.5 * 34)]
    assert all(w.track_prefill for w in q.decode_workers)


def test_decode_weights_are_recorded_and_not_given_to_other_policies(sample, capsys):
    """A run whose only kv_aware pool is the decode pool records the weights it priced with; a
    session decode pool ignores them (its policy has no prices, its workers no queue lookup)."""
    argv = ["simulate", "-q", "--json", "--max-requests", "12", "--lanes", "3", "--disagg", "1p2d"]
    argv += ["--router", "least_loaded", "--decode-router", "kv_aware", "--kv-weight", "4"]
    assert main([*argv, "--kv-queue-weight", "0.5"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["kv_weight"], config["kv_queue_weight"], config["decode_router"]) == (4.0, 0.5, "kv_aware")
    c = DisaggCluster(sample, SimConfig(engine=ENG, prefill_workers=1, decode_workers=2, kv_weight=0.0))
    assert c.decode_policy.name == "least_loaded" and not any(w.track_prefill for w in c.decode_workers)


def test_decode_weight_zero_changes_only_the_decode_pools_prices(sample):
    """--decode-kv-weight 0 beside the default --kv-weight: the decode pool routes on load alone
    (the empty worker wins over the cached prefix) while the prefill pool keeps pricing its cached
    prefix at 16 per block, exactly as without the flag."""
    zero, req = _primed(sample, decode_kv_weight=0.0)
    default, dreq = _primed(sample)
    held = zero.decode_workers[0].active_blocks()
    assert zero.decode_policy.costs(req, zero.decode_workers) == [held, 0.0]
    assert zero.decode_policy.choose(req, zero.decode_workers) == 1
    assert default.decode_policy.choose(dreq, default.decode_workers) == 0
    assert (zero.policy.weight, zero.policy.queue_weight) == (16.0, 1.0)
    p, dp = zero.workers[:1], default.workers[:1]
    assert zero.policy.costs(req, p) == default.policy.costs(dreq, dp) == [16.0 * 68]
    assert not any(w.track_prefill for w in zero.decode_workers)  # weight 0: no queue lookups
    q, req = _primed(sample, kv_queue_weight=0.0, decode_kv_queue_weight=0.5)
    assert (q.policy.queue_weight, q.decode_policy.queue_weight) == (0.0, 0.5)


def test_decode_weight_zero_moves_decodes_not_prefills(sample):
    """On a run of the sample, --decode-kv-weight 0 sends turns to other decode workers (lower
    decode-pool hit rate) while every request keeps its prefill worker and the prefill pool's hits."""
    runs = []
    for kw in ({}, {"decode_kv_weight": 0.0}):
        pools = dict(prefill_workers=2, decode_workers=2, decode_router="kv_aware")
        cfg = SimConfig(engine=ENG, lanes=4, max_requests=24, **pools, **kw)
        runs.append(DisaggCluster(sample, cfg).run())
    (a, b), split = runs, [[r.worker.split("/") for r in run.records] for run in runs]
    assert [p for p, _ in split[0]] == [p for p, _ in split[1]]
    assert [d for _, d in split[0]] != [d for _, d in split[1]]
    assert a.summary.disagg.prefill_hit_rate == b.summary.disagg.prefill_hit_rate
    assert b.summary.disagg.decode_hit_rate < a.summary.disagg.decode_hit_rate


def _decode_run(capsys, *flags: str) -> dict:
    """A small 2p2d run with a kv_aware decode pool: its summary's config."""
    argv = ["simulate", "-q", "--json", "--max-requests", "16", "--lanes", "4", "--disagg", "2p2d"]
    assert main([*argv, "--decode-router", "kv_aware", *flags]) == 0
    return json.loads(capsys.readouterr().out)["config"]


def test_decode_weights_are_recorded_per_pool(capsys):
    """The summary records the shared weights and the decode pool's own; a decode pool that is
    not kv_aware records none, whatever the flags say."""
    config = _decode_run(capsys, "--decode-kv-weight", "0")
    assert (config["kv_weight"], config["kv_queue_weight"]) == (16.0, 1.0)
    assert (config["decode_kv_weight"], config["decode_kv_queue_weight"]) == (0.0, 1.0)
    config = _decode_run(capsys, "--kv-weight", "4", "--decode-kv-queue-weight", "0.25")
    assert (config["decode_kv_weight"], config["decode_kv_queue_weight"]) == (4.0, 0.25)
    argv = ["simulate", "-q", "--json", "--max-requests", "5", "--disagg", "1p1d", "--decode-kv-weight", "0"]
    assert main(argv) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["decode_router"] == "least_loaded" and config["decode_kv_weight"] is None


@pytest.mark.parametrize(
    "flag",
    [
        "--kv-weight=-1",
        "--kv-queue-weight=nan",
        "--kv-weight=inf",
        "--decode-kv-weight=-1",
        "--decode-kv-queue-weight=nan",
        "--decode-kv-weight=inf",
    ],
)
def test_bad_decode_weights_are_one_line_errors(flag, capsys):
    argv = ["simulate", "-q", "--max-requests", "5", "--disagg", "1p1d", "--decode-router", "kv_aware"]
    assert main([*argv, flag]) == 2
    err = capsys.readouterr().err
    assert flag.split("=")[0] in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
