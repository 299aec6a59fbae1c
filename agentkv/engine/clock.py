"""Clocks the engine runs on: a virtual one for the simulator, a scaled real one for the server."""

from __future__ import annotations

import time


class VirtualClock:
    """Simulated seconds that move only when the driver advances them."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0):
        self._now = start

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t > self._now:
            self._now = t


class RealClock:
    """Wall-clock seconds since creation, in engine time: `time_scale` engine seconds per wall second."""

    __slots__ = ("_t0", "time_scale")

    def __init__(self, time_scale: float = 1.0):
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self._t0 = time.perf_counter()
        self.time_scale = time_scale

    def now(self) -> float:
        return (time.perf_counter() - self._t0) * self.time_scale

    def wall_delay(self, engine_seconds: float) -> float:
        """Wall seconds that `engine_seconds` of engine time take."""
        return engine_seconds / self.time_scale

    def advance_to(self, t: float) -> None:
        """Real time cannot be moved; the driver sleeps instead."""
