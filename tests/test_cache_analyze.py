"""`agentkv cache analyze`: hit rates over capacities and policies against Belady and the unbounded ceiling."""

from __future__ import annotations

import json

import pytest

from agentkv.cache.analyze import analyze, fitting
from agentkv.cache.grid import make_grid
from agentkv.cache.view import write_plot
from agentkv.cli import main
from agentkv.errors import UserError
from agentkv.kv.eviction import POLICIES
from agentkv.trace.accesses import arrivals, block_accesses
from agentkv.trace.ceiling import ceiling_tokens
from agentkv.trace.formats import bundled_sample, load_paths
from agentkv.trace.stats import ceiling

ONLINE = [p for p in POLICIES if p != "belady"]
# small real traces from ../shared (8 to 32 requests each, one with sub-agents): 5.3M input tokens
SHARED_SUBSET = ("trace_0702", "trace_0076", "trace_0630", "trace_0606", "trace_0291")


@pytest.fixture(scope="module")
def sample():
    return load_paths(bundled_sample())


@pytest.fixture(scope="module")
def sample_grid(sample):
    """All policies on the bundled sample at block size 64, from mostly-too-small to roomy."""
    return analyze(sample, make_grid("12GB,24GB", "64"))


@pytest.fixture(scope="module")
def shared_grid(shared_dir):
    traces = load_paths([shared_dir / "traces" / "claude-code" / f"{t}.json.gz" for t in SHARED_SUBSET])
    return analyze(traces, make_grid("4GB,8GB,16GB", "64"))


def _by(a, policy):
    return [r for r in a.results if r.policy == policy]


def _check_bounds(a):
    """Belady >= every online policy at each capacity, the unbounded ceiling >= Belady."""
    ceil = {c.block_size: c.hit_rate for c in a.ceilings}
    cells = {(r.block_size, r.capacity, r.policy): r.hit_rate for r in a.results}
    for bs in a.block_sizes:
        for cap in a.capacities:
            best = cells[(bs, cap, "belady")]
            for p in ONLINE:
                assert cells[(bs, cap, p)] <= best + 1e-12, (bs, cap, p)
            assert best <= ceil[bs]


def test_hit_rate_grows_with_capacity(sample_grid):
    for p in POLICIES:
        rates = [r.hit_rate for r in _by(sample_grid, p)]
        assert rates == sorted(rates) and rates[-1] > rates[0] + 0.3, (p, rates)


def test_belady_bounds_every_policy_on_the_sample(sample_grid):
    _check_bounds(sample_grid)
    # the grid is not trivial: the policies differ and some requests do not fit the smallest pool
    assert len({round(r.hit_rate, 6) for r in sample_grid.results if r.capacity == "24GB"}) > 2
    assert sample_grid.results[0].too_big > 0


@pytest.mark.shared
def test_belady_bounds_every_policy_on_shared_traces(shared_grid):
    _check_bounds(shared_grid)
    for p in POLICIES:
        rates = [r.hit_rate for r in _by(shared_grid, p)]
        assert rates == sorted(rates), (p, rates)
    lru = {r.capacity: r.hit_rate for r in _by(shared_grid, "lru")}
    belady = {r.capacity: r.hit_rate for r in _by(shared_grid, "belady")}
    assert any(belady[c] > lru[c] + 0.01 for c in lru)  # there is room above LRU somewhere


def test_ceiling_matches_trace_stats_at_the_trace_block_size(sample):
    reqs = block_accesses(arrivals(sample), 64)
    q = sum(r.input_tokens for r in reqs)
    assert ceiling_tokens(reqs, 64) / q == pytest.approx(ceiling(sample), abs=2e-3)
    # finer blocks share at least as much
    fine = block_accesses(arrivals(sample), 16)
    assert ceiling_tokens(fine, 16) >= ceiling_tokens(reqs, 64)
    assert sum(map(len, (r.hashes for r in fine))) >= 4 * sum(map(len, (r.hashes for r in reqs)))


def test_arrivals_by_timestamps_and_by_concurrency(sample):
    everyone = arrivals(sample)
    assert sorted(a.start for a in everyone) == sorted(x.time for t in sample for x in t.timeline())
    assert [a.start for a in everyone] == sorted(a.start for a in everyone)
    assert {a.space for a in everyone} == {f"{t.id}#{i}" for i, t in enumerate(sample)}
    one = arrivals(sample, concurrency=1)  # each trace whole, the next starting when it ends
    assert len(one) == len(everyone)
    order = list(dict.fromkeys(a.space for a in one))
    assert len(order) == len(sample)
    for a, b in zip(order, order[1:], strict=False):
        end = max(x.end for x in one if x.space == a)
        assert min(x.start for x in one if x.space == b) >= end - 1e-9
    two = arrivals(sample, concurrency=2)
    assert sum(a.start == 0.0 for a in two) == 2


def test_one_session_at_a_time_hits_more_at_a_small_capacity(sample):
    grid = make_grid("16GB", "64", "lru")
    together = analyze(sample, grid).results[0].hit_rate
    alone = analyze(sample, make_grid("16GB", "64", "lru", concurrency=1)).results[0].hit_rate
    assert alone > together


def test_cpu_tier_raises_the_hit_rate_at_a_small_gpu(sample):
    without = analyze(sample, make_grid("16GB", "64", "lru,session")).results
    with_cpu = analyze(sample, make_grid("16GB", "64", "lru,session", cpu="64GB")).results
    for a, b in zip(without, with_cpu, strict=True):
        assert b.hit_rate > a.hit_rate + 0.05
        assert b.tier_hit_tokens["GPU"] + b.tier_hit_tokens["CPU"] == b.hit_tokens
        assert b.tier_hit_tokens["CPU"] > 0 and set(a.tier_hit_tokens) == {"GPU"}


def test_a_cpu_tier_smaller_than_a_request_still_runs(sample):
    res = analyze(sample, make_grid("24GB", "64", "lru", cpu="4GB")).results[0]
    assert res.tier_hit_tokens["CPU"] > 0


def test_block_sizes_16_and_64_both_run(sample):
    small = sample[1:]  # the two smaller traces
    a = analyze(small, make_grid("8GB", "16,64", "lru,belady"))
    cells = {(r.block_size, r.policy): r for r in a.results}
    assert set(cells) == {(16, "lru"), (64, "lru"), (16, "belady"), (64, "belady")}
    n16, n64 = cells[(16, "lru")].num_blocks, cells[(64, "lru")].num_blocks
    assert 4 * n64 <= n16 < 4 * (n64 + 1)  # the same bytes in blocks a quarter the size
    assert all(0 < r.hit_rate <= 1 for r in a.results)
    assert [c.block_size for c in a.ceilings] == [16, 64]


def test_too_big_requests_count_as_misses(sample):
    reqs = block_accesses(arrivals(sample), 64)
    fit = fitting(reqs, 1000, 64)
    assert 0 < len(fit) < len(reqs)
    assert all(-(-(r.input_tokens + r.output_tokens) // 64) <= 1000 for r in fit)
    # every lane that keeps a request keeps exactly one last one
    lanes = {r.session for r in fit}
    assert sum(r.last for r in fit) == len(lanes)
    res = analyze(sample, make_grid("1GB", "64", "lru")).results[0]  # 119 blocks: nothing fits
    assert (
        res.too_big == 178 and res.hit_tokens == 0 and res.query_tokens == sum(r.input_tokens for r in reqs)
    )


def test_parallel_workers_give_the_same_results(sample):
    small = sample[1:]
    grid = make_grid("8GB,16GB", "64", "lru,belady")
    one, two = analyze(small, grid, jobs=1), analyze(small, grid, jobs=2)
    strip = [(r.block_size, r.capacity, r.policy, r.hit_tokens, r.evicted) for r in one.results]
    assert strip == [(r.block_size, r.capacity, r.policy, r.hit_tokens, r.evicted) for r in two.results]


def test_json_output_shape(capsys):
    sample = [str(p) for p in bundled_sample()][1:]
    assert (
        main(
            [
                "cache",
                "analyze",
                *sample,
                "--capacity",
                "8GB,16GB",
                "--block-size",
                "64",
                "--policy",
                "lru,belady",
                "--json",
                "-q",
                "-j",
                "1",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert {
        "model",
        "kv_cache_dtype",
        "kv_bytes_per_token",
        "traces",
        "requests",
        "input_tokens",
        "order",
        "concurrency",
        "cpu",
        "cpu_bytes",
        "capacities",
        "block_sizes",
        "policies",
        "ceilings",
        "results",
        "seconds",
    } <= set(out)
    assert out["model"] == "Llama-3.1-8B" and out["kv_bytes_per_token"] == 131072 and out["traces"] == 2
    assert out["capacities"] == ["8GB", "16GB"] and out["policies"] == ["lru", "belady"]
    assert [c["block_size"] for c in out["ceilings"]] == [64]
    assert [(r["capacity"], r["policy"]) for r in out["results"]] == [
        ("8GB", "lru"),
        ("8GB", "belady"),
        ("16GB", "lru"),
        ("16GB", "belady"),
    ]
    r = out["results"][0]
    assert r["capacity_bytes"] == 8 * 10**9 and r["num_blocks"] == 8 * 10**9 // (64 * 131072)
    assert r["hit_rate"] == pytest.approx(r["hit_tokens"] / r["query_tokens"])
    assert r["tier_hit_tokens"] == {"GPU": r["hit_tokens"]}


def test_table_and_fp8(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    sample = [str(p) for p in bundled_sample()][2:]
    assert (
        main(
            [
                "cache",
                "analyze",
                *sample,
                "--capacity",
                "4GB",
                "--block-size",
                "64",
                "--policy",
                "lru,belady",
                "--kv-cache-dtype",
                "fp8",
                "-q",
                "-j",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "65,536 bytes a token" in out and "belady (offline optimum)" in out and "unbounded cache" in out
    assert "4GB" in out and "953 blocks" in out  # fp8: 4e9 // (64 x 65,536), twice the bf16 blocks


def test_plot_html_and_svg(tmp_path, sample):
    a = analyze(sample[2:], make_grid("4GB,8GB", "64", "lru,arc"))
    for name in ("chart.html", "chart.svg"):
        write_plot(a, tmp_path / name)
        text = (tmp_path / name).read_text()
        assert text.count("<svg") >= 1 and "lru" in text and "arc" in text and "unbounded" in text
    assert (tmp_path / "chart.svg").read_text().startswith("<svg")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--capacity", "lots"], "--capacity"),
        (["--capacity", "1KB"], "holds no block"),
        (["--capacity", "10GB,"], "empty item"),
        (["--policy", "lru,fifo"], "unknown policy 'fifo'"),
        (["--block-size", "0"], "positive"),
        (["--block-size", "sixteen"], "whole number"),
        (["--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
        (["--model", "gpt-9"], "unknown model"),
        (["--cpu", "much"], "--cpu"),
        (["--concurrency", "0"], "--concurrency"),
        (["--plot", "out.png"], ".html or .svg"),
        (["--jobs", "0"], "--jobs"),
    ],
)
def test_bad_input_is_one_line_exit_2(flags, message, capsys, tmp_path):
    path = str(bundled_sample()[-1])
    assert main(["cache", "analyze", path, "-q", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agentkv: error:") and message in err and "\n" not in err


def test_missing_trace_file_is_a_user_error(capsys, tmp_path):
    assert main(["cache", "analyze", str(tmp_path / "nope.json"), "-q", "--policy", "lru"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_make_grid_defaults():
    g = make_grid()
    assert g.capacities == (("100GB", 10**11),) and g.block_sizes == (16,) and g.policies == POLICIES
    assert g.kv_dtype == "bf16" and g.cpu is None and g.concurrency is None
    with pytest.raises(UserError):
        make_grid(cpu="1KB")


def test_piped_progress_is_a_line_a_step_and_quiet_is_silent(capsys):
    """Off a terminal there is no bar, so each finished step is one line on stderr (a long run is
    not silent); `-q` prints none."""
    sample = [str(p) for p in bundled_sample()][1:]
    argv = ["cache", "analyze", *sample, "--capacity", "8GB,16GB", "--policy", "lru,arc", "--jobs", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    steps = [x for x in err if " steps, " in x]
    assert [x.split(" ")[0] for x in steps] == [f"{i}/5" for i in range(1, 6)], err
    assert steps[0].endswith("block size 16: accesses and ceiling")
    assert {x.split(": ", 1)[1] for x in steps[1:]} == {
        f"{p} at {c}, block size 16" for p in ("lru", "arc") for c in ("8GB", "16GB")
    }
    assert main([*argv, "-q"]) == 0
    assert " steps, " not in capsys.readouterr().err
