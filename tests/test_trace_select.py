"""The trace flags every trace-reading command shares: Mooncake files of any block size
(--trace-block-size), --sample / --traces-limit, --max-context with --over-context; cycling plans
(fresh ids and hash spaces per pass, Mooncake included); `trace synth` output as direct input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agentkv.cli import main
from agentkv.errors import UserError
from agentkv.metrics.records import read_records
from agentkv.trace.blocks import request_tokens
from agentkv.trace.formats import load_paths
from agentkv.trace.model import Request, Session, Trace
from agentkv.trace.plan import ReplayPlan, simulate_schedule
from agentkv.trace.select import fit_context, pick

sys.path.insert(0, str(Path(__file__).parent))
from test_bench_data import ThreadServer  # noqa: E402

# 64-token blocks: the 2nd request shares 3 blocks (192 tokens) with the 1st, the 3rd shares 4 (256)
MOONCAKE_64 = [
    {"timestamp": 0, "input_length": 256, "output_length": 4, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 50, "input_length": 300, "output_length": 4, "hash_ids": [1, 2, 3, 5, 6]},
    {"timestamp": 100, "input_length": 320, "output_length": 4, "hash_ids": [1, 2, 3, 4, 7]},
]
HITS, QUERIES = 192 + 256, 256 + 300 + 320


@pytest.fixture
def mooncake64(tmp_path) -> Path:
    p = tmp_path / "mc64.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in MOONCAKE_64))
    return p


def run_json(capsys, *argv: str) -> dict:
    code = main(list(argv))
    cap = capsys.readouterr()
    assert code == 0, cap.err
    return json.loads(cap.out)


def test_a_64_token_block_mooncake_file_needs_the_flag_and_maps_ids_to_tokens(mooncake64, capsys):
    code = main(["simulate", str(mooncake64), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "at most 1 blocks of 512 (another block size? --trace-block-size)" in err
    (t,) = load_paths([mooncake64], "auto", 64)
    assert t.block_size == 64 and t.hash_id_scope == "global"
    space = f"global:{t.source}"
    toks = [request_tokens(space, r.hash_ids, r.input_tokens, 64) for r in t.session.requests]
    assert [len(x) for x in toks] == [256, 300, 320]  # each request's hash ids give its input_length
    assert np.array_equal(toks[0][:192], toks[1][:192]) and not np.array_equal(
        toks[0][192:256], toks[1][192:256]
    )
    assert np.array_equal(toks[0], toks[2][:256]) and toks[2][256:320].tolist() != toks[0][192:256].tolist()


def test_every_command_reads_it_and_their_hit_rates_agree(mooncake64, capsys):
    bs = ("--trace-block-size", "64")
    stats = run_json(capsys, "trace", "stats", str(mooncake64), *bs, "--json")["total"]
    assert (stats["hit_tokens"], stats["input_tokens"]) == (HITS, QUERIES)
    cache = run_json(capsys, "cache", "analyze", str(mooncake64), *bs, "--json", "-q", "--policy", "lru")
    assert cache["ceilings"][0]["hit_tokens"] == HITS and cache["results"][0]["hit_tokens"] == HITS
    sim = run_json(capsys, "simulate", str(mooncake64), *bs, "--json", "-q")
    assert sim["cache"]["reported"] == pytest.approx(HITS / QUERIES) == sim["cache"]["ceiling"]


def test_bench_replays_it_with_the_server_hitting_what_the_ids_share(mooncake64, tmp_path, capsys):
    with ThreadServer() as srv:  # 16-token prefix blocks, like vLLM's default
        code = main(
            ["bench", str(mooncake64), "--trace-block-size", "64", "--target", srv.url, "-q", "--no-report"]
            + ["--out", str(tmp_path / "o"), "--duration", "none"]
        )
    assert code == 0, capsys.readouterr().err
    recs = read_records(tmp_path / "o" / "requests.jsonl")
    assert sorted(r.input_tokens for r in recs) == [256, 300, 320]
    assert sum(r.cached_tokens for r in recs) == HITS == sum(r.ceiling_tokens for r in recs)


def tree(tid: str, sizes: list[int], subs: list[Session] = ()) -> Trace:
    reqs = [Request(t=float(i), input_tokens=n, output_tokens=8) for i, n in enumerate(sizes)]
    return Trace(id=tid, block_size=16, session=Session(id=tid, requests=reqs, subagents=list(subs)))


def sub(sid: str, t: float, sizes: list[int]) -> Session:
    return Session(
        id=sid,
        t=t,
        requests=[Request(t=0.1 * i, input_tokens=n, output_tokens=8) for i, n in enumerate(sizes)],
    )


def test_over_context_drop_trim_keep_with_subagents():
    # the root passes 1000 (prompt + 8) at its 3rd turn (t=2): the sub-agent spawned at t=1 stays
    # (its own over-limit turn trimmed), the one spawned at t=3 goes with the cut
    traces = [
        tree("ok", [100, 200]),
        tree("big", [100, 500, 1200, 1300], [sub("s1", 1.0, [300, 2000]), sub("s2", 3.0, [50])]),
    ]
    kept, note = fit_context(traces, 1000, "drop")
    assert [t.id for t in kept] == ["ok"] and "7 of 9 requests removed; 1 of 2 session trees dropped" in note
    kept, note = fit_context(traces, 1000, "trim")
    big = kept[1].session
    assert [r.input_tokens for r in big.requests] == [100, 500]
    assert [s.id for s in big.subagents] == ["s1"] and [
        r.input_tokens for r in big.subagents[0].requests
    ] == [300]
    assert "4 of 9 requests removed; 1 trimmed" in note
    assert traces[1].session.requests[2].input_tokens == 1200  # the loaded traces are not changed
    kept, note = fit_context(traces, 1000, "keep")
    assert kept == traces and "1 of 2 session trees have requests over it (kept" in note
    assert fit_context(traces, 10_000, "drop") == (traces, None)
    with pytest.raises(UserError, match="nothing left to replay"):
        fit_context(traces, 50, "trim")


def test_sample_is_seeded_named_and_bounded():
    traces = [tree(f"t{i}", [10]) for i in range(10)]
    a, note = pick(traces, sample=4, seed=1)
    assert [t.id for t in pick(traces, sample=4, seed=1)[0]] == [t.id for t in a]  # same seed, same set
    assert [t.id for t in pick(traces, sample=4, seed=2)[0]] != [t.id for t in a]
    assert [int(t.id[1:]) for t in a] == sorted(int(t.id[1:]) for t in a)  # kept in load order
    assert "random sample (seed 1) of 10 traces: " + ", ".join(t.id for t in a) in note
    first, note = pick(traces, limit=3)
    assert [t.id for t in first] == ["t0", "t1", "t2"] and "the first 3 of 10" in note
    assert pick(traces, sample=10)[0] == traces
    with pytest.raises(UserError, match="--sample 11: the set holds only 10"):
        pick(traces, sample=11)


def test_sample_through_simulate_names_the_traces_in_the_summary(tmp_path, capsys):
    s = run_json(capsys, "simulate", "--sample", "2", "--seed", "3", "--json", "-q", "--max-requests", "5")
    (note,) = [n for n in s["notes"] if n.startswith("--sample 2")]
    assert "random sample (seed 3) of 3 traces" in note


def test_cycling_mooncake_plan_gives_each_pass_new_ids_and_its_own_cache_space(mooncake64):
    (t,) = load_paths([mooncake64], "mooncake", 64)
    for mode, distinct in (("fresh", True), ("shared", False)):
        plan = ReplayPlan([t], cycle=mode)
        spans = simulate_schedule(plan, lambda it: 0.01, until=0.35)
        items = [sp.item for sp in spans]
        assert [it.tree_key for it in items][:7] == ["mc64#0"] * 3 + ["mc64#1"] * 3 + ["mc64#2"]
        assert [sp.start for sp in spans][:4] == pytest.approx([0, 0.05, 0.1, 0.15])  # one mean gap on
        spaces = {it.replay: it.hash_space for it in items}
        assert (len(set(spaces.values())) == len(spaces)) is distinct and len(spaces) >= 3


def test_synth_sessions_are_direct_input_for_simulate_and_bench(tmp_path, capsys):
    out = tmp_path / "synth"
    assert main(["trace", "synth", "--sessions", "2", "--seed", "4", "-o", str(out)]) == 0
    capsys.readouterr()
    files = sorted(out.iterdir())
    assert len(files) == 2
    sim = run_json(capsys, "simulate", str(out), "--json", "-q", "--max-requests", "40")
    assert sim["requests"] == 40 and sim["failed"] == 0
    # a fresh process, as a user runs it, with the bench against a real server
    with ThreadServer() as srv:
        p = subprocess.run(
            [sys.executable, "-m", "agentkv.cli", "bench", str(out), "--target", srv.url, "-q", "--no-report"]
            + ["--out", str(tmp_path / "b"), "--max-requests", "4", "--lanes", "2", "--idle-gap-cap", "1ms"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert p.returncode == 0, p.stderr
    recs = read_records(tmp_path / "b" / "requests.jsonl")
    assert (
        len(recs) == 4
        and all(r.ok for r in recs)
        and {r.trace for r in recs} <= {f.name.split(".")[0] for f in files}
    )
