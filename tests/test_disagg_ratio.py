"""The prefill:decode ratio search (`--sweep disagg=NpMd,... --sweep lanes=LO..HI`): on constructed
traces the cost model's answer is known: long prompts with few output tokens need prefill engines,
short-prefill long decodes need decode engines; bad splits are one-line errors."""

import dataclasses
import itertools
import json

import pytest

from agentkv.cli import main
from agentkv.engine.config import EngineConfig
from agentkv.engine.kv_move import parse_disagg
from agentkv.errors import UserError
from agentkv.sim.cluster import SimConfig, simulate
from agentkv.sim.knee import best_line, bisect_lanes, knees
from agentkv.sim.sweep import apply, parse_sweep
from agentkv.trace.model import Request, Session, Trace

_IDS = itertools.count(1)


def _traces(prompt: int, output: int, n: int = 8, turns: int = 4) -> list[Trace]:
    """`n` sessions of `turns` back-to-back calls, every prompt uncached (fresh hash ids)."""

    def call() -> Request:
        return Request(
            t=0.0,
            input_tokens=prompt,
            output_tokens=output,
            hash_ids=[next(_IDS) for _ in range(prompt // 16)],
        )

    return [
        Trace(id=f"s{i}", block_size=16, session=Session(id=f"s{i}", requests=[call() for _ in range(turns)]))
        for i in range(n)
    ]


def _search(traces, tier: tuple[float, float]) -> list[tuple[str, object, bool]]:
    """Each split's lanes search on 4 TP 1 engines of a DGX H200 (1 minute of steady load)."""
    base = SimConfig(
        engine=EngineConfig(max_model_len=32_000),
        cycle=True,
        duration=60.0,
        system="dgx-h200",
        tier_tps=tier[0],
        tier_ttft_p90=tier[1],
    )
    results = []
    for g in parse_sweep(["disagg=1p3d,3p1d"]):
        cfg = apply(base, g)
        pts = bisect_lanes(
            lambda n, cfg=cfg: simulate(traces, dataclasses.replace(cfg, lanes=n)).summary, 1, 64
        )
        results += [({**g, "lanes": str(n)}, s) for n, s in pts]
    return knees(results)


def test_prefill_heavy_traces_pick_more_prefill_engines():
    """16K-token uncached prompts, 4 output tokens: TTFT p90 binds, so 3 prefill engines carry
    about 3x the lanes of 1 (the cost model: one prefill ~0.26 s, queueing scales with lanes)."""
    searched = _search(_traces(16_000, 4), (20.0, 4.0))
    found = {where: k for where, k, _ in searched}
    p1, p3 = found["disagg=1p3d"], found["disagg=3p1d"]
    assert p1 is not None and p3 is not None and p3.sessions >= 2 * p1.sessions
    assert p3.agents_per_mw > p1.agents_per_mw
    assert "best (2 of 2 settings meet the tier): disagg=3p1d:" in best_line(searched)


def test_decode_heavy_traces_pick_more_decode_engines():
    """8K prompts, 2,000 output tokens: the per-user rate binds (one decode engine's batch reads every
    sequence's KV each step), so 3 decode engines carry more lanes than 1."""
    searched = _search(_traces(8_000, 2_000), (100.0, 10.0))
    found = {where: k for where, k, _ in searched}
    p1, p3 = found["disagg=1p3d"], found["disagg=3p1d"]
    assert p1 is not None and p3 is not None and p1.sessions > 1.5 * p3.sessions
    assert best_line(searched).startswith("best (2 of 2 settings meet the tier): disagg=1p3d:")


def test_split_spellings_and_bad_splits():
    """NpMd (vLLM's xPyD) and prefill=N,decode=M say the same; zero, missing or garbled pools are
    one-line errors naming the flag."""
    assert parse_disagg("2p6d") == parse_disagg("prefill=2,decode=6") == (2, 6)
    assert parse_disagg(" 1P3D ") == (1, 3)
    cfg = apply(SimConfig(), {"disagg": "3p5d"})
    assert (cfg.prefill_workers, cfg.decode_workers) == (3, 5)
    for bad in ("0p4d", "4p", "p2d", "2:2", "prefill=2", ""):
        with pytest.raises(UserError, match="--sweep disagg: expected prefill=N,decode=M or NpMd"):
            apply(SimConfig(), {"disagg": bad})
    with pytest.raises(UserError, match="--disagg: expected"):
        parse_disagg("1p0d")


def test_cli_ratio_search_prints_each_split_and_the_best(capsys):
    """Through the CLI on the bundled sample: one knee line per split, then the best by agents/MW;
    a bad split fails with a one-line error and no traceback."""
    base = ["simulate", "-q", "--max-requests", "20", "--max-model-len", "200000", "--system", "dgx-h200"]
    assert main([*base, "--sweep", "disagg=1p1d,1p2d", "--sweep", "lanes=1..2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "knee (disagg=1p1d)" in out and "knee (disagg=1p2d)" in out
    assert "best (" in out and "agents/MW" in out and "GPUs" in out
    assert main([*base, "--sweep", "disagg=1p1d,0p2d", "--sweep", "lanes=1..2"]) == 2
    err = capsys.readouterr().err
    assert "--sweep disagg: expected" in err and "Traceback" not in err


def test_a_single_cli_run_with_disagg_runs_the_pools(capsys):
    """`simulate --disagg 1p1d` without a sweep runs the prefill and decode pools (it once ran one
    aggregated engine priced as two): the summary has both pools' hit rates and the KV moves."""
    args = ["simulate", "-q", "--json", "--max-requests", "10", "--lanes", "2", "--max-model-len", "200000"]
    assert main([*args, "--disagg", "1p1d"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["disagg"]["prefill_workers"] == s["disagg"]["decode_workers"] == 1
    assert s["disagg"]["transfers_nvlink"] == 10 and s["config"]["gpus"] == 2
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["disagg"] is None


def test_arrived_kv_of_a_whole_block_prompt_is_admitted_on_a_hybrid_model():
    """A hybrid-KV model schedules block-aligned chunks: a disaggregated decode whose prompt is a whole
    number of blocks (its arrived KV a token short) is admitted, not left waiting forever, and a
    V4-Pro disaggregated run on such prompts finishes every request."""
    from agentkv.engine.engine import Engine

    eng = Engine(
        EngineConfig(model="deepseek-v4-pro", gpu="gb300", tensor_parallel_size=4, max_model_len=8192)
    )
    eng.add_request("a", max_tokens=3, prompt_len=1024, block_hashes=list(range(64)), external_tokens=1023)
    res = eng.step()
    assert res.num_prefill_tokens == 1 and len(res.outputs) == 1
    cfg = SimConfig(
        engine=EngineConfig(model="deepseek-v4-pro", tensor_parallel_size=4, max_model_len=32_000),
        lanes=4,
        max_requests=12,
        prefill_workers=1,
        decode_workers=1,
        system="gb300-nvl72",
    )
    s = simulate(_traces(4096, 8, n=4, turns=3), cfg).summary
    assert s.succeeded == 12 and s.failed == 0


def test_a_run_that_stalls_with_requests_queued_is_invalid():
    """Should requests be left waiting with nothing to step (as the hybrid admission bug left them),
    the run says how many never finished and is invalid, instead of a valid summary of the rest."""
    from agentkv.sim.disagg import DisaggCluster

    class _LosesArrivals(DisaggCluster):
        def _kv_arrived(self, w, now, seq):  # the KV arrives but the decode worker never queues it
            self.arrivals.pop(seq)

    cfg = SimConfig(engine=EngineConfig(max_model_len=32_000), lanes=2, max_requests=6)
    cfg = dataclasses.replace(cfg, prefill_workers=1, decode_workers=1)
    s = _LosesArrivals(_traces(512, 4, n=2, turns=3), cfg).run().summary
    assert not s.valid and s.succeeded == 0
    assert "released requests never finished" in s.invalid_reason
    ok = simulate(_traces(512, 4, n=2, turns=3), cfg).summary
    assert ok.valid and ok.succeeded == 6
