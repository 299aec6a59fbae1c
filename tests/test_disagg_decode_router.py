"""A decode pool routed by kv_aware prices its workers with --kv-weight and --kv-queue-weight, as the
prefill pool does (Dynamo has no per-pool weights); the run's summary records them."""

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
    assert q.decode_policy.costs(req, q.decode_workers) == [2.0 * 4 + held, 2.0 * (68 + 0.5 * 100)]
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


@pytest.mark.parametrize("flag", ["--kv-weight=-1", "--kv-queue-weight=nan", "--kv-weight=inf"])
def test_bad_decode_weights_are_one_line_errors(flag, capsys):
    argv = ["simulate", "-q", "--max-requests", "5", "--disagg", "1p1d", "--decode-router", "kv_aware"]
    assert main([*argv, flag]) == 2
    err = capsys.readouterr().err
    assert flag.split("=")[0] in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
