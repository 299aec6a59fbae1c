"""Classifier statistics for the attack harness: ROC AUC with DeLong's confidence interval, and
accuracy with Wilson's interval. Scores are "higher means the attacker thinks it was cached"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True, slots=True)
class Interval:
    """A point estimate with a two-sided confidence interval at `level`."""

    value: float
    low: float
    high: float
    level: float

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high


def _z(level: float) -> float:
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    return NormalDist().inv_cdf(0.5 + level / 2)


def auc_delong(pos: Sequence[float], neg: Sequence[float], level: float = 0.95) -> Interval:
    """ROC AUC = P(score of a positive > score of a negative), ties counting one half, with
    DeLong's (1988) variance: the variance of each example's placement values, per class."""
    x = np.asarray(pos, dtype=float)
    y = np.asarray(neg, dtype=float)
    m, n = len(x), len(y)
    if m < 2 or n < 2:
        raise ValueError(f"need at least 2 examples of each class, got {m} positive and {n} negative")
    diff = x[:, None] - y[None, :]
    psi = (diff > 0) + 0.5 * (diff == 0)
    v10 = psi.mean(axis=1)  # per positive: the share of negatives it outranks
    v01 = psi.mean(axis=0)  # per negative: the share of positives that outrank it
    auc = float(v10.mean())
    se = math.sqrt(v10.var(ddof=1) / m + v01.var(ddof=1) / n)
    z = _z(level)
    return Interval(auc, max(0.0, auc - z * se), min(1.0, auc + z * se), level)


def wilson(successes: int, total: int, level: float = 0.95) -> Interval:
    """A binomial proportion with Wilson's score interval (sound near 0 and 1, unlike the normal one)."""
    if total <= 0:
        raise ValueError("total must be > 0")
    p = successes / total
    z = _z(level)
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the ends, not 1e-17 off
    high = 1.0 if successes == total else min(1.0, centre + half)
    return Interval(p, low, high, level)
