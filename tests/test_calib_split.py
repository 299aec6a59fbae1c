"""The front end's rate from the split of client TTFT (issue #17): client less the server's own TTFT
of the same prompt, against prompt tokens, on constructed samples."""

from __future__ import annotations

import pytest

from agentkv.calib.split import after_engine_s, fit_split, split_lengths, split_points

LENGTHS = (64, 1024, 2048, 4096)


def _doc(rate: float, at0: float, noise: list[float], server: float = 0.05) -> dict:
    """Rounds of one prompt per length: the server's TTFT `server`, the client's `at0` + `rate` a
    token later (+ that round's noise)."""
    client = {str(n): [server + at0 + after_engine_s(rate, n) + e for e in noise] for n in LENGTHS}
    return {
        "lengths": list(LENGTHS),
        "client_ttft_s": client,
        "server_ttft_s": {n: [server] * len(noise) for n in client},
    }


def test_a_rate_the_lengths_resolve_is_fitted_with_its_intercept_apart() -> None:
    got = fit_split(_doc(4e-6, 3.4e-3, [0.0, 5e-4, -5e-4]), 1e-6)
    assert got["source"] == "split" and got["split_points"] == 12 and got["before_engine"] == 0.0
    assert got["token_s"] == pytest.approx(4e-6, rel=0.05)
    assert got["split_lag_at_0_s"] == pytest.approx(3.4e-3, rel=0.1)  # the per-request part, not the rate's
    assert got["split_stderr_s"] < 1e-6


def test_samples_scattering_more_than_the_rate_fall_back_to_the_single_probes() -> None:
    doc = _doc(1e-6, 3e-3, [0.0, 0.02, -0.015])
    doc["client_ttft_s"]["4096"] = [0.05, 0.04, 0.03]  # the longest prompt read earliest
    got = fit_split(doc, 2.5e-6)
    assert got["source"].startswith("prompt_token_s") and got["token_s"] == 2.5e-6
    assert got["split_stderr_s"] > 0 and got["split_token_s"] is not None  # the spread is reported


def test_no_metrics_leaves_the_curve_s_fit_and_unisolated_samples_are_skipped() -> None:
    none = {"client_ttft_s": {"64": [0.1]}, "server_ttft_s": {"64": [None]}}
    assert split_points(none) == [] and fit_split(none, 1e-6) is None
    doc = _doc(4e-6, 0.0, [0.0, 1e-4])
    doc["server_ttft_s"]["1024"] = [None, 0.05]
    assert len(split_points(doc)) == 7


def test_one_formula_for_fit_and_predict() -> None:
    """The split's x is predict's read of one request alone at the front end."""
    assert after_engine_s(4e-6, 2048) == pytest.approx(4e-6 * 2048)
    assert split_lengths(8192) == LENGTHS and split_lengths(2048) == (64, 1024) and split_lengths(64) == (64,)
