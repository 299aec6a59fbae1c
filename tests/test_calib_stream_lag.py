"""calib.streamlag: levels, /metrics parsing, and the lag-per-stream fit on constructed probe data."""

from __future__ import annotations

import random

from agentkv.calib.streamlag import (
    TTFT_METRIC,
    _server_ttft,
    fit_stream_lag,
    lag_points,
    levels,
    parse_metrics,
    stream_lag_s,
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
    assert abs(_server_ttft(before, after) - 0.05) < 1e-9
    assert _server_ttft(before, {**after, f"{TTFT_METRIC}_count": 5.0}) is None
    assert _server_ttft(None, after) is None


def test_one_formula():
    assert stream_lag_s(0.001, 3) == 0.003 and stream_lag_s(0.001, -1) == 0.0
