"""scripts/whatif_deploy.py prints the deployment what-if table (its --quick row) and rejects bad names."""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv.cli import build_parser
from agentkv.sim.command import sim_config_from_args
from agentkv.sim.deploy import pool_engine, total_gpus

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "whatif_deploy.py"
TRACES = Path("/work/shared/traces/claude-code")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.skipif(not TRACES.is_dir(), reason="needs the shared Claude Code traces")
def test_quick_prints_a_row_with_the_ratio_to_aa_agentperf():
    p = _run("--quick")
    assert p.returncode == 0, p.stderr
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| DeepSeek-V4-Pro | 8x H200 | agg")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[4] == "8" and cells[5].startswith(("default:", "relaxed:", "none met"))
    if not cells[5].startswith("none"):
        # the knee with the least lanes the search saw miss above it (the bracket the bisection left)
        m = re.fullmatch(r"(default|relaxed): (\d+)\+? lanes(?: \((\d+) missed\))?", cells[5])
        assert m, cells[5]
        assert m[3] is None or int(m[3]) > int(m[2])
        agents_gpu, agents_mw = float(cells[6]), float(cells[7].replace(",", ""))
        # agents/MW is agents/GPU over the DGX H200's provisioned 1,275 W per GPU
        assert agents_mw == pytest.approx(agents_gpu / 1275 * 1e6, rel=0.01)
        assert "of 2,594/MW" in cells[8]


def test_unknown_system_is_a_one_line_error(tmp_path):
    p = _run("--systems", "dgx-h100", "--traces", str(tmp_path))
    assert p.returncode == 2 and "unknown dgx-h100" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("split", ["6p4d", "0p9d", "p9d", "6p3", "sixp3d"])
def test_bad_rack_split_is_a_one_line_error(split):
    """--rack-split names a whole rack's TP 8 engines: N prefill + M decode = 9, each at least 1."""
    p = _run("--rack", "--rows", "disagg", "--rack-split", split)
    assert p.returncode == 2 and f"got {split!r}" in p.stderr and "Traceback" not in p.stderr


def test_a_failing_point_is_reported_not_hidden(tmp_path):
    p = _run(
        "--models",
        "DeepSeek-V3",
        "--systems",
        "8x H200",
        "--rows",
        "agg",
        "--traces",
        str(tmp_path / "missing"),
    )
    assert p.returncode == 0
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| DeepSeek-V3")]
    assert len(rows) == 1 and "error:" in rows[0]


@pytest.mark.skipif(not TRACES.is_dir(), reason="needs the shared Claude Code traces")
def test_rack_row_simulates_all_72_gpus_and_reports_its_cpu():
    """--rack: the GB300 NVL72 row is 9 TP 8 engines in one simulation (72 GPUs), priced at the
    rack's provisioned W per GPU, with the CPU seconds of its points."""
    p = _run(
        *("--rack", "--models", "DeepSeek-V4-Pro", "--systems", "GB300 NVL72", "--rows", "agg"),
        *("--traces-limit", "2", "--duration", "30s", "--max-lanes", "9"),
    )
    assert p.returncode == 0, p.stderr
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| DeepSeek-V4-Pro | GB300 NVL72")]
    assert len(rows) == 1, p.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[2] == "agg (9x TP8, whole rack)" and cells[4] == "72"
    if cells[5].startswith("default:"):
        agents_gpu, agents_mw = float(cells[6]), float(cells[7].replace(",", ""))
        assert agents_gpu == pytest.approx(agents_mw * (142e3 / 72) / 1e6, abs=0.006)  # 2 decimals
    assert cells[-1].endswith("(1)") and cells[-1].split()[0].replace(",", "").isdigit()
    traces = cells[-2].split()[0]  # the mix it replayed: at most the 2 traces it was given
    if not cells[5].startswith("error"):
        assert traces.isdigit() and 1 <= int(traces) <= 2 and cells[-2].endswith("K)")


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("whatif_deploy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_mix_names_the_traces_a_point_replayed_and_their_mean_prompt():
    """A slice and a rack on one --traces-limit replay different traces (lanes take them in path
    order); the row says which, so tokens/s per MW is compared on the same mix."""
    mod = _module()
    sessions = [{"trace": "t1"}, {"trace": "t1"}, {"trace": "t2"}, {"trace": "t3"}]
    s = {"sessions": sessions, "input_tokens": 1_380_000, "succeeded": 10}
    assert mod.mix(s) == "3 (138K)"
    assert mod.mix({"sessions": [], "input_tokens": 0, "succeeded": 0}) == "0 (0K)"


def test_per_mw_only_reference_gives_one_ratio():
    """B300 and MI355X are published per MW only: the ratio names that figure, no per-GPU one."""
    mod = _module()
    row = mod.Row("DeepSeek-V4-Pro", "8x MI355X", "agg", "default")
    text = mod.ratio(row, {"agents_mw": 3551 * 3.0, "agents_gpu": 5.0})
    assert text == "3.00x of 3,551/MW (outside 0.5-2x)"
    row = mod.Row("DeepSeek-V4-Pro", "8x B300", "agg", "default")
    assert mod.ratio(row, {"agents_mw": 21053 * 0.6, "agents_gpu": 1.0}) == "0.60x of 21,053/MW"


@pytest.mark.parametrize(
    ("kind", "prefill", "decode"),
    [
        ("disagg-wide-ep", (6, 8, 1, False), (24, 1, 24, True)),
        ("disagg-ep", (48, 1, 48, True), (24, 1, 24, True)),
    ],
)
def test_whatif_rack_rows_fill_the_rack(kind, prefill, decode):
    """--rack --rows disagg-wide-ep / disagg-ep --rack-split 6p3d: the command each point runs parses
    to 72 GPUs: 6 TP 8 prefill engines (or 48 EP prefill ranks) and a 24-rank wide-EP decode group."""
    mod = _module()
    row = mod.Row("DeepSeek-V4-Pro", "GB300 NVL72", kind, "default", rack=True, split="6p3d")
    a = argparse.Namespace(traces="t", traces_limit=12, duration="10m")  # what command() reads
    argv = mod.command(row, 96, a)
    args = build_parser().parse_args(argv[argv.index("simulate") :])
    cfg = sim_config_from_args(args)
    assert total_gpus(cfg) == 72 and cfg.system == "gb300-nvl72" and cfg.decode_router == "session"
    for pool, (n, tp, dp, ep) in (("prefill", prefill), ("decode", decode)):
        e = pool_engine(cfg, cfg.engine, pool)
        assert getattr(cfg, f"{pool}_workers") == n
        assert (e.tensor_parallel_size, e.data_parallel_size, e.enable_expert_parallel) == (tp, dp, ep)


def test_rack_wide_ep_row_runs_at_the_expert_imbalance_asked():
    """--rack --rows wide-ep --expert-imbalance 1.5: each point prices the hottest expert GPU at 1.5x
    the mean (the what-if's one imbalanced rack point); without the flag the rack runs 1.0 and
    --wide-ep slices run 1.0 and 1.5."""
    mod = _module()
    base = ["--models", "DeepSeek-V4-Pro", "--systems", "GB300 NVL72"]
    a = mod.parser().parse_args([*base, "--rack", "--rows", "wide-ep", "--expert-imbalance", "1.5"])
    [row] = mod.rows(a)
    argv = mod.command(row, 1440, a)
    cfg = sim_config_from_args(build_parser().parse_args(argv[argv.index("simulate") :]))
    assert total_gpus(cfg) == 72 and cfg.engine.expert_imbalance == 1.5
    a = mod.parser().parse_args([*base, "--rack", "--rows", "wide-ep"])
    assert [r.imbalance for r in mod.rows(a)] == [1.0]
    a = mod.parser().parse_args([*base, "--wide-ep"])
    assert [r.imbalance for r in mod.rows(a)] == [1.0, 1.5]


@pytest.mark.parametrize("value", ["0.5", "nan", "inf"])
def test_bad_expert_imbalance_is_a_one_line_error(value):
    p = _run("--rack", "--rows", "wide-ep", "--expert-imbalance", value)
    assert p.returncode == 2 and "--expert-imbalance: must be" in p.stderr and "Traceback" not in p.stderr


def test_rack_offload_gives_every_rack_engine_a_cpu_tier():
    """--rack-offload SIZE: each --rack row's simulate command adds --cpu-offload SIZE (per engine)
    and the row's label says so; without it no tier is added."""
    mod = _module()
    argv = [
        "--rack",
        "--models",
        "DeepSeek-V4-Pro",
        "--systems",
        "GB300 NVL72,8x H200",
        "--rows",
        "agg,wide-ep",
    ]
    a = mod.parser().parse_args([*argv, "--rack-offload", "256GB"])
    rows = mod.rows(a)
    assert [(r.mode, r.system, r.offload) for r in rows] == [
        ("agg", "GB300 NVL72", "256GB"),
        ("wide-ep", "GB300 NVL72", "256GB"),
    ]
    cmd = mod.command(rows[1], 72, a)
    assert cmd[cmd.index("--cpu-offload") + 1] == "256GB" and cmd[cmd.index("--workers") + 1] == "72"
    plain = mod.rows(mod.parser().parse_args(argv))
    assert all("--cpu-offload" not in mod.command(r, 9, a) for r in plain)


@pytest.mark.parametrize("exact", [False, True])
def test_knee_bisects_to_a_bracket_and_exact_walks_it_to_the_first_miss(monkeypatch, exact):
    """Lanes meet the tier up to 70 and from 73 to 75 again (TTFT p90 is not monotone near a knee):
    the bisection stops within 25% (1, 192, 14, 52, 100, 72, 61 -> 61, 72 missed); --exact runs 62, 63,
    ... and stops at the first miss (71), so the knee is 70 and the row reads '70 lanes (71 missed)'."""
    mod = _module()
    met = set(range(1, 71)) | {73, 74, 75}
    monkeypatch.setattr(mod, "point", lambda row, n, a: row.points.setdefault(n, {"n": n}))
    monkeypatch.setattr(mod, "meets", lambda s, tier: s["n"] in met)
    row = mod.Row("DeepSeek-V4-Pro", "8x H200", "agg", "default")
    k = mod.knee(row, mod.DEFAULT_TIER, 1, 192, argparse.Namespace(exact=exact, bracket=1.25))
    assert k == (70 if exact else 61)
    assert min(n for n in row.points if n > k) == (71 if exact else 72)


def test_bracket_narrows_the_bisection(monkeypatch):
    """--bracket 1.05 bisects on past the default 25%: where the tier is met up to 70 the knee at 61
    (72 missed) becomes 69 (72 missed, within 5%) in two more points, 66 and 69; the default is 1.25."""
    mod = _module()
    met = set(range(1, 71))
    monkeypatch.setattr(mod, "point", lambda row, n, a: row.points.setdefault(n, {"n": n}))
    monkeypatch.setattr(mod, "meets", lambda s, tier: s["n"] in met)
    row = mod.Row("DeepSeek-V4-Pro", "8x H200", "agg", "default")
    a = mod.parser().parse_args(["--bracket", "1.05"])
    assert mod.knee(row, mod.DEFAULT_TIER, 1, 192, a) == 69
    assert sorted(row.points) == [1, 14, 52, 61, 66, 69, 72, 100, 192]
    assert mod.parser().parse_args([]).bracket == 1.25


@pytest.mark.parametrize("value", ["1", "0.9", "nan", "inf", "x"])
def test_bad_bracket_is_a_one_line_error(value):
    p = _run("--bracket", value)
    assert p.returncode == 2 and "--bracket: must be a finite number above 1" in p.stderr
    assert "Traceback" not in p.stderr
