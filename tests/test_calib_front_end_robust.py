"""The front end's fit on constructed curves (issue #17): a queue the rounds resolve is fitted from the
curve; rounds that scatter more than the queue adds fall back to the single probes' per-token time."""

from __future__ import annotations

import pytest

from agentkv.calib.frontend import front_end_reads, robust_front_end

PAST, NEW = 4096, 16
TOKENS = PAST + NEW
NONE = lambda n: (0.0, 0.0)  # noqa: E731 - no engine time


def _curve(rate: float, base: list[float], noise: list[float]) -> dict:
    """Rounds whose one stream reads its first token at `base[i]` and `n` streams at the queue's
    mean read (`rate` s a token) plus `noise[i]`; every stream ends 100 ms after its round's base: the
    first tokens read late are caught up by the stream's end (all of the queue after the engine)."""

    def mean_read(n: int) -> float:
        return sum(front_end_reads([(k, 0.0, TOKENS) for k in range(n)], rate).values()) / n

    tt = {
        str(n): [b + mean_read(n) + (e if n > 1 else 0.0) for b, e in zip(base, noise, strict=True)]
        for n in (1, 2, 4)
    }
    return {
        "past": PAST,
        "new": NEW,
        "ttft_s": tt,
        "e2e_s": {n: [b + 0.1 for b in base] for n in tt},
    }


def test_a_queue_the_rounds_resolve_is_fitted_from_the_curve() -> None:
    got = robust_front_end(_curve(5e-6, [0.05, 0.06, 0.055], [0.001, -0.001, 0.0005]), NONE, 0.0, 1.0, 1e-6)
    assert got["source"] == "curve" and got["curve_points"] == 6
    assert got["token_s"] == pytest.approx(5e-6, rel=0.1) and got["curve_stderr_s"] < 1e-6
    assert got["before_engine"] == pytest.approx(0.0, abs=0.05)  # ends caught up: after the engine


def test_rounds_scattering_more_than_the_queue_fall_back_to_the_measured_constant() -> None:
    """The live run's shape: one stream's TTFT 38-84 ms between rounds, 4 streams sometimes faster
    than one; the curve alone would clip to 0 and drop the host time per prompt token."""
    noisy = _curve(2e-6, [0.060, 0.084, 0.038], [0.01, -0.05, -0.02])
    got = robust_front_end(noisy, NONE, 0.0, 1.0, 4.05e-6)
    assert got["source"].startswith("prompt_token_s")
    assert got["token_s"] == 4.05e-6 and got["before_engine"] == 0.0
    assert got["curve_stderr_s"] > 0 and got["curve_token_s"] is not None  # the spread is reported
    alone = {"past": PAST, "new": NEW, "ttft_s": {"1": [0.1]}, "e2e_s": {"1": [0.2]}}
    assert robust_front_end(alone, NONE, 0.0, 1.0, 3e-6)["token_s"] == 3e-6  # no round to fit
