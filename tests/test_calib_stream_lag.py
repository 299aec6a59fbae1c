"""calib.streamlag: levels, /metrics parsing, and the lag-per-stream fit on constructed probe data."""

from __future__ import annotations

import random

from agentkv.calib.streamlag import (
    TTFT_METRIC,
    fit_stream_lag,
    lag_points,
    levels,
    parse_metrics,
    server_delta,
)


def _doc(slope: float, noise: float, rounds: int = 4, seed: int = 1) -> dict:
    rng = random.Random(seed)
    client, server = {}, {}
    for n in (0, 2, 4, 8):
        srv = [0.05 + 0.001 * n + rng.uniform(-0.002, 0.002) for _ in range(rounds)]
        server[str(n)] = srv
        client[str(n)] = [s + 0.004 + slope * n + rng.gauss(0, noise) for s in srv]
    return {"levels": [0, 2, 4, 8], "client_ttft_s": client, "server_ttft_s": server}


def test_levels_cap_at_lanes():
    assert levels(None) == (0, 2, 4, 8) and levels(4) == (0, 2, 4) and levels(6) == (0, 2, 4, 6)


def test_fit_recovers_a_known_slope():
    fit = fit_stream_lag(_doc(0.0015, 0.0001))
    assert fit["source"] == "stream_lag curve" and fit["curve_points"] == 16
    assert abs(fit["per_stream_s"] - 0.0015) < 0.0001 and fit["curve_stderr_s"] < 0.0001


def test_noise_falls_back_to_zero():
    fit = fit_stream_lag(_doc(0.0, 0.01))
    assert fit["per_stream_s"] == 0.0 and fit["source"].startswith("none")
    assert fit["curve_per_stream_s"] is not None  # the curve's own slope kept for the record


def test_without_server_view_nothing_is_fitted():
    doc = _doc(0.002, 0.0)
    doc["server_ttft_s"] = {n: [None] * len(v) for n, v in doc["server_ttft_s"].items()}
    assert lag_points(doc) == [] and fit_stream_lag(doc)["per_stream_s"] == 0.0


def test_metrics_parse_and_isolate_one_request():
    text = f'# HELP x\n{TTFT_METRIC}_sum{{model="a"}} 1.5\n{TTFT_METRIC}_count{{model="a"}} 3\nother 9\n'
    before = parse_metrics(text, (TTFT_METRIC,))
    assert before == {f"{TTFT_METRIC}_sum": 1.5, f"{TTFT_METRIC}_count": 3.0}
    after = {f"{TTFT_METRIC}_sum": 1.55, f"{TTFT_METRIC}_count": 4.0}
    assert abs(server_delta(before, after) - 0.05) < 1e-9
    assert server_delta(before, {**after, f"{TTFT_METRIC}_count": 5.0}) is None
    assert server_delta(None, after) is None


def test_line_fit_recovers_slope_error_and_intercept():
    from agentkv.calib.frontend import line_fit

    assert line_fit([(1.0, 2.0)]) == (None, None, None) and line_fit([(1.0, 1.0), (1.0, 3.0)])[0] is None
    slope, se, icpt = line_fit([(0.0, 1.0), (1.0, 3.0)])  # two points: no error
    assert (slope, se, icpt) == (2.0, None, 1.0)
    slope, se, icpt = line_fit([(0.0, 1.0), (1.0, 3.1), (2.0, 4.9), (3.0, 7.0)])
    assert abs(slope - 1.98) < 1e-9 and abs(icpt - 1.03) < 1e-9 and 0 < se < 0.1
