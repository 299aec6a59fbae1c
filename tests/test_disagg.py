"""Prefill/decode disaggregation in the simulator: hit rates against an aggregated run, the KV link
model, decode waiting for its KV, and the deployment flags' errors."""

import math

import pytest

from agentkv.cli import main
from agentkv.engine.config import EngineConfig
from agentkv.errors import UserError
from agentkv.kv.transfer import fabric_link
from agentkv.sim.cluster import SimConfig, simulate
from agentkv.sim.disagg import DisaggCluster
from agentkv.trace.formats import bundled_sample, load_paths

ENG = EngineConfig(max_model_len=200_000)


@pytest.fixture(scope="module")
def sample():
    return load_paths(bundled_sample())


def _disagg(**kw) -> SimConfig:
    base = dict(engine=ENG, lanes=6, max_requests=120, prefill_workers=1, decode_workers=1)
    return SimConfig(**{**base, **kw})


def test_free_transfer_matches_the_aggregated_hit_rate(sample):
    """Free KV moves: the prefill pool's cache sees the same prompts as one aggregated engine of the
    same capacity, so per-request hits and the pool's hit rate match; no request fails."""
    agg = simulate(sample, SimConfig(engine=ENG, lanes=6, max_requests=120)).summary
    dis = simulate(sample, _disagg(kv_link_gbps=math.inf)).summary
    assert dis.succeeded == agg.succeeded == 120 and dis.failed == 0
    assert dis.cache.reported == pytest.approx(agg.cache.reported, abs=1e-12)
    assert dis.disagg.prefill_hit_rate == pytest.approx(agg.cache.metrics, abs=1e-12)
    assert dis.disagg.decode_hit_rate is not None and dis.disagg.kv_transfer_s.max == 0.0
    assert dis.config["gpus"] == 2 and agg.config["gpus"] == 1
    ignored = simulate(sample, _disagg(workers=4, max_requests=5)).summary
    assert any("--workers 4 is not used" in n for n in ignored.notes)


def test_link_model_grows_with_bytes_and_falls_with_speed():
    """fabric_link: time = setup + copies x max(floor, chunk / bandwidth)."""
    fast, slow = fabric_link(900, 0.5e-6, 10e-6), fabric_link(50, 0.5e-6, 30e-6)
    mb = 1 << 20
    assert slow.seconds(64 * mb, mb) == pytest.approx(30e-6 + 64 * mb / 50e9)
    assert slow.seconds(128 * mb, mb) > slow.seconds(64 * mb, mb) > fast.seconds(64 * mb, mb)
    # small chunks pay the per-copy floor: 4 KiB copies at 900 GB/s take 0.5 us each, not 4.6 ns
    assert fast.seconds(64 * mb, 4096) == pytest.approx(10e-6 + (64 * mb // 4096) * 0.5e-6)
    assert fabric_link(math.inf, 1, 1).seconds(1 << 30, 4096) == 0.0
    with pytest.raises(UserError):
        fabric_link(0, 0, 0)


class _Watched(DisaggCluster):
    """Records, for every finished decode, (KV arrival, transfer start, its decode-side request)."""

    def _deliver(self, w, res, now):
        if w.index >= self.cfg.prefill_workers:
            for out in res.outputs:
                if out.finished:
                    fl = self.flights[out.request.request_id]
                    self.seen.append((fl.kv_at, fl.kv_sent, fl.prefill, out.request))
        super()._deliver(w, res, now)


def _watched(traces, cfg):
    c = _Watched(traces, cfg)
    c.seen = []
    res = c.run()
    return c, res


def test_decode_never_starts_before_its_kv_arrives(sample):
    """On a slow link the decode worker admits a request only once its KV is there, and the wait is
    at least the link model's time for the bytes it did not already cache."""
    c, res = _watched(sample, _disagg(kv_link_gbps=2.0, prefill_workers=2, decode_workers=2))
    assert len(c.seen) == res.summary.succeeded == 120
    for kv_at, sent, pre, dec in c.seen:
        assert kv_at >= sent >= pre.finished_at
        assert dec.first_scheduled >= kv_at and dec.first_token > kv_at
        assert dec.arrival == kv_at and dec.num_output == dec.max_tokens
    waits = [kv_at - sent for kv_at, sent, *_ in c.seen]
    assert max(waits) > 0.05  # 2 GB/s: long prompts take visible time
    rec = {r.id: r for r in res.records}
    assert all(r.ttft > 0 and r.worker.startswith("p") for r in rec.values())


def test_slower_link_means_longer_transfers_and_ttft(sample):
    fast = simulate(sample, _disagg(kv_link_gbps=400.0)).summary
    slow = simulate(sample, _disagg(kv_link_gbps=1.0)).summary
    assert slow.disagg.kv_transfer_s.mean > 50 * fast.disagg.kv_transfer_s.mean
    assert slow.ttft.p50 > fast.ttft.p50
    assert slow.disagg.kv_transferred_gb == pytest.approx(fast.disagg.kv_transferred_gb, rel=0.2)


def test_rdma_between_nodes_nvlink_within(sample):
    """Two 8-GPU DGX H200 pools (tp 8 each) sit in two NVLink domains: every move crosses RDMA;
    on one GB300 NVL72 rack the same deployment stays on NVLink. With 128-token blocks a copy (one
    layer's block on one rank: 64 KiB) is bandwidth-bound, so the 50 GB/s NIC is the slower path."""
    eng = EngineConfig(max_model_len=200_000, block_size=128)
    kw = dict(engine=eng, max_requests=30, lanes=3)
    kw.update(prefill_tensor_parallel_size=8, decode_tensor_parallel_size=8)
    hgx = simulate(sample, _disagg(system="dgx-h200", **kw)).summary.disagg
    rack = simulate(sample, _disagg(system="gb300-nvl72", **kw)).summary.disagg
    assert hgx.transfers_rdma == 30 and hgx.transfers_nvlink == 0
    assert rack.transfers_nvlink == 30 and rack.transfers_rdma == 0
    per_gb = [d.kv_transfer_s.mean * d.kv_transfer_s.count / d.kv_transferred_gb for d in (hgx, rack)]
    assert per_gb[0] > 2 * per_gb[1]


def test_pools_take_their_own_tp(sample):
    """Llama-3.1-70B does not fit one H200; pools at TP 4 run although --tensor-parallel-size is 1."""
    eng = EngineConfig(model="llama3-70b", max_model_len=200_000)
    kw = dict(engine=eng, max_requests=10, lanes=2, system="dgx-h200")
    s = simulate(sample, _disagg(prefill_tensor_parallel_size=4, decode_tensor_parallel_size=2, **kw)).summary
    assert s.succeeded == 10 and s.config["gpus"] == 6 and not any("--workers" in n for n in s.notes)
    assert s.config["prefill_tensor_parallel_size"] == 4 and s.config["decode_tensor_parallel_size"] == 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--disagg", "prefill=1"], "--disagg"),
        (["--disagg", "prefill=0,decode=2"], "--disagg"),
        (["--disagg", "prefill=a,decode=1"], "--disagg"),
        (["--system", "nvl9000"], "nvl9000"),
        (["--tier", "tps=fast"], "--tier"),
        (["--tier", "ttft_p90=0s"], "--tier"),
        (["--tier", "latency=1"], "--tier"),
        (["--disagg", "prefill=1,decode=1", "--kv-link-gbps", "0"], "--kv-link-gbps"),
        (["--disagg", "prefill=1,decode=1", "--decode-tensor-parallel-size", "0"], "--decode-tensor"),
    ],
)
def test_bad_deployment_flags_are_one_line_errors(argv, needle, capsys):
    assert main(["simulate", "-q", "--max-requests", "5", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
