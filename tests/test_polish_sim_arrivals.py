"""`agentkv simulate --session-rate R --arrivals poisson|constant` (#21): session trees arrive at R a
simulated second, as bench's open loop releases them, seeded by --seed; --lanes becomes a cap."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agentkv.cli import main
from agentkv.sim.cluster import SimConfig, simulate
from agentkv.trace.model import Request, Session, Trace


def _traces(n: int, turns: int = 1, out: int = 4) -> list[Trace]:
    """`n` small one-session traces, each its own tree."""
    return [
        Trace(
            id=f"t{i}",
            block_size=16,
            session=Session(
                id=f"t{i}",
                requests=[
                    Request(
                        t=k, input_tokens=64 * (k + 1), output_tokens=out, hash_ids=list(range(4 * (k + 1)))
                    )
                    for k in range(turns)
                ],
            ),
        )
        for i in range(n)
    ]


def _tree_starts(records) -> list[float]:
    """When each session tree's first request was due, in arrival order."""
    first: dict[str, float] = {}
    for r in records:
        first[r.tree] = min(first.get(r.tree, r.scheduled), r.scheduled)
    return sorted(first.values())


def _run(**kw):
    return simulate(_traces(200), SimConfig(idle_gap_cap=None, **kw)).records


def test_trees_arrive_at_the_session_rate():
    rate = 4.0
    const = _tree_starts(_run(session_rate=rate, arrivals="constant", lanes=None))
    assert len(const) == 200
    assert np.diff(const) == pytest.approx(1 / rate)  # evenly spaced, from 0

    pois = _tree_starts(_run(session_rate=rate, arrivals="poisson", lanes=None, seed=1))
    gaps = np.diff(pois)
    assert len(pois) == 200 and pois[0] == 0.0
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.25)  # 199 exponential gaps
    assert np.std(gaps) == pytest.approx(1 / rate, rel=0.35)  # exponential: std == mean; constant: 0
    assert _tree_starts(_run(session_rate=rate, arrivals="poisson", lanes=None, seed=1)) == pois
    assert _tree_starts(_run(session_rate=rate, arrivals="poisson", lanes=None, seed=2)) != pois

    closed = _tree_starts(_run(lanes=16))  # closed loop: the first 16 trees start at once
    assert closed[:16] == [0.0] * 16


def test_lanes_cap_the_trees_in_flight():
    # long trees, fast arrivals: with a cap of 2, later trees wait for a lane, so start late
    recs = simulate(
        _traces(12, turns=3, out=200), SimConfig(session_rate=50.0, lanes=2, idle_gap_cap=None)
    ).records
    starts = _tree_starts(recs)
    assert starts[2] > 10 * (2 / 50.0)  # the third tree waited for one of the first two to drain
    spans = {}
    for r in recs:
        lo, hi = spans.get(r.tree, (r.scheduled, r.end))
        spans[r.tree] = (min(lo, r.scheduled), max(hi, r.end))
    for t in np.linspace(0, max(h for _, h in spans.values()), 200):
        assert sum(lo <= t < hi for lo, hi in spans.values()) <= 2


def test_cli_flags_and_summary_config(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["simulate", "--session-rate", "0.5", "--arrivals", "constant", "--max-requests", "40", "-q"]
    assert main([*argv, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    cfg = summary["config"]
    assert (cfg["session_rate"], cfg["arrivals"], cfg["lanes"]) == (0.5, "constant", None)
    assert any(
        n.startswith("load: 3 session trees arrived (constant, 0.5/s, no cap") for n in summary["notes"]
    )
    first: dict[str, float] = {}
    for ln in (out / "requests.jsonl").read_text().splitlines():
        r = json.loads(ln)
        first[r["tree"]] = min(first.get(r["tree"], r["scheduled"]), r["scheduled"])
    starts = sorted(first.values())
    assert np.diff(starts) == pytest.approx(2.0)  # the bundled sample's trees, 2 s apart
    capsys.readouterr()
    for bad in ("0", "-1", "inf"):
        assert main(["simulate", "--session-rate", bad, "-q"]) == 2
        err = capsys.readouterr().err
        assert "--session-rate must be > 0" in err and "Traceback" not in err
