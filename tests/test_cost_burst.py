"""A decode burst's step ends from the fitted formula equal the per-step path to the last bit."""

from __future__ import annotations

import random

import pytest

from agentkv.engine.cost import CostModel


@pytest.mark.parametrize(
    ("gpu", "model", "tp"), [("h200", "llama3-8b", 1), ("h200", "llama3-70b", 4), ("b200", "llama3-8b", 2)]
)
def test_decode_step_ends_equal_the_per_step_sum(gpu, model, tp):
    cm = CostModel(gpu, model, tp=tp)
    rng = random.Random(7)
    for _ in range(300):
        n, k, now = rng.randint(1, 256), rng.randint(1, 40), rng.uniform(0, 1e4)
        ctx_max = rng.randint(1, 200_000)
        ctx_sum = rng.randint(ctx_max, ctx_max * n)
        ends, t = cm.decode_step_ends(now, n, ctx_sum, ctx_max, k), now
        assert ends is not None and len(ends) == k
        for i, end in enumerate(ends):
            t += cm.step_time_agg(0, 0, 0.0, 0.0, False, 0, n, ctx_sum + i * n, ctx_max + i)
            assert end == t  # bit-equal: simulated records must not move


def test_models_outside_the_fitted_formula_keep_the_per_step_path():
    cm = CostModel("h200", "deepseek-v4-flash", tp=2)
    assert cm.decode_step_ends(0.0, 4, 4000, 1000, 3) is None
