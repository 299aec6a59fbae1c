"""`agentkv trace synth`: reproducible, well-formed agentic sessions whose statistics stay within the
stated tolerances of the real traces (the table in docs/traces.md is checked against a fresh run)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
from real_traces import claude_report

from agentkv.cli import main
from agentkv.trace.compare import markdown, rows
from agentkv.trace.formats import load_paths
from agentkv.trace.stats import StatsReport, compute
from agentkv.trace.synth import SynthConfig, synth_session, synthesize, write_traces

DOC = Path(__file__).resolve().parents[1] / "docs" / "traces.md"
EVENTFUL = SynthConfig(
    burst_rate=0.2, compacting_share=1.0, turns=msgspec.structs.replace(SynthConfig().turns, median=120)
)  # forces sub-agent bursts and compactions into a few sessions


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_seed_gives_byte_identical_files(tmp_path):
    for gz in (False, True):
        a = write_traces(synthesize(4, seed=7), tmp_path / f"a{gz}", gz=gz)
        b = write_traces(synthesize(4, seed=7), tmp_path / f"b{gz}", gz=gz)
        assert [p.name for p in a] == [p.name for p in b]
        assert _files(tmp_path / f"a{gz}") == _files(tmp_path / f"b{gz}")
    write_traces(synthesize(4, seed=8), tmp_path / "c")
    assert list(_files(tmp_path / "c").values()) != list(_files(tmp_path / "aFalse").values())


def test_a_session_does_not_depend_on_how_many_are_made():
    assert synthesize(2, seed=3) == synthesize(5, seed=3)[:2]
    assert synth_session(4, seed=3) == synthesize(5, seed=3)[4]


def test_sessions_are_well_formed():
    cfg = EVENTFUL
    traces = synthesize(6, seed=1, config=cfg)
    subs = compactions = 0
    for tr in traces:
        root = tr.session
        prefix = (root.system_tokens + root.tool_tokens) // cfg.block_size
        assert tr.format == "synth" and tr.hash_id_scope == "local"
        head = root.requests[0].hash_ids[:prefix]
        assert head == list(range(1, prefix + 1))  # ids are local: each trace counts from 1
        for prev, cur in zip(root.requests, root.requests[1:], strict=False):
            assert cur.hash_ids[:prefix] == head  # the system+tools prefix is shared by every request
            assert cur.t >= prev.t + prev.api_time
            if cur.input_tokens < prev.input_tokens:  # compaction: restart just after the prefix
                compactions += 1
                assert prev.input_tokens >= cfg.compact_at.median * 0.7
                assert not set(cur.hash_ids[prefix:]) & set(prev.hash_ids)
        for s in tr.sessions():
            for r in s.requests:
                assert len(r.hash_ids) == -(-r.input_tokens // cfg.block_size)
                assert r.kind in ("n", "s") and r.output_tokens >= 1
        bursts: dict[float, list] = {}
        for sub in root.subagents:
            bursts.setdefault(sub.t, []).append(sub)
            subs += 1
            assert sub.duration == pytest.approx(sub.requests[-1].t + sub.requests[-1].api_time)
            first = sub.requests[0].hash_ids
            sub_prefix = (sub.system_tokens + sub.tool_tokens) // cfg.block_size
            assert first[:sub_prefix] == root.subagents[0].requests[0].hash_ids[:sub_prefix]
            assert not set(first) & set(head)  # the sub-agent's own prompt, not the parent's
        for at, group in bursts.items():  # the parent waits for the whole burst before going on
            end = max(at + g.duration for g in group)
            later = [r for r in root.requests if r.t > at]
            assert not later or later[0].t >= end
    assert subs >= 3 and compactions >= 3


def test_written_files_read_back_unchanged(tmp_path):
    traces = synthesize(3, seed=2, config=EVENTFUL)
    back = load_paths(write_traces(traces, tmp_path, gz=True))
    assert [msgspec.structs.replace(b, source="", format="synth") for b in back] == traces


def test_calibrated_to_the_real_traces(shared_dir):
    """Every compared statistic within tolerance, and docs/traces.md shows this very table."""
    real = claude_report(shared_dir).total
    synth = compute(synthesize(120, seed=0)).total
    table = rows(real, synth)
    text = markdown(table)
    assert all(r.ok for r in table), text
    doc = DOC.read_text()
    m = re.search(r"<!-- calibration:begin -->\n(.*?)\n<!-- calibration:end -->", doc, re.S)
    assert m, "docs/traces.md lacks the calibration table markers"
    assert m.group(1).strip() == text, "docs/traces.md is stale: rerun python -m agentkv.trace.compare"


def test_cli_writes_readable_traces(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["trace", "synth", "--sessions", "3", "--seed", "5", "-o", str(out)]) == 0
    assert "wrote 3 traces" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [f"synth-5-{i:04d}.json" for i in range(3)]
    assert main(["trace", "stats", str(out), "--json"]) == 0
    report = msgspec.json.decode(capsys.readouterr().out, type=StatsReport)
    assert report.total.traces == 3 and all(t.format == "agentx" for t in report.traces)


@pytest.mark.parametrize(
    "args, needle", [(["--sessions", "0"], "--sessions"), (["-o", "/proc/x/y"], "/proc/x")]
)
def test_cli_bad_arguments_are_one_line_and_exit_2(capsys, args, needle):
    assert main(["trace", "synth", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err
