"""Which clock a bench figure is read on: the target's engine clock (agentkv serve stamps its own
times into each response) or the client's (wall seconds times the time scale)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from agentkv.bench.client import EngineTimes
from agentkv.metrics.records import RequestRecord
from agentkv.metrics.scrape import MetricsSnapshot
from agentkv.metrics.summary import LATENCY_FIGURES

_NONE = np.zeros(0)


@dataclass(slots=True)
class Latency:
    """One request's latencies in target seconds, and every gap between two of its tokens (`gaps`,
    for the run's pooled ITL; `itls`, the same to the microsecond, for its record)."""

    ttft: float | None
    e2e: float
    tpot: float | None = None
    itl_max: float | None = None
    gaps: np.ndarray = field(default_factory=lambda: _NONE)
    itls: list[float] = field(default_factory=list)

    def _set_gaps(self, gaps: np.ndarray) -> None:
        self.gaps, self.itl_max, self.itls = gaps, float(gaps.max()), np.round(gaps, 6).tolist()

    @classmethod
    def of_client(cls, times: list[float], n: int, x: float, ttft: float | None, e2e: float) -> Latency:
        """From the client's token arrival times (wall seconds, `x` target seconds each)."""
        lat = cls(ttft, e2e)
        if len(times) > 1:
            lat._set_gaps(np.diff(np.asarray(times)) * x)
            if n > 1:
                lat.tpot = (times[-1] - times[0]) * x / (n - 1)
        return lat

    @classmethod
    def of_engine(cls, eng: EngineTimes) -> Latency:
        """From agentkv serve's own timestamps (engine seconds), as `simulate` computes them."""
        tt = eng.token_times
        lat = cls(tt[0], eng.end - eng.arrival)
        if len(tt) > 1:
            lat._set_gaps(np.diff(np.asarray(tt)))
            lat.tpot = (tt[-1] - tt[0]) / (len(tt) - 1)
        return lat


def engine_stamp(eng: EngineTimes | None) -> dict:
    """A record's clock fields: `clock` engine, the engine's arrival stamp and which engine's clock
    it is when agentkv serve timed the request (what `agentkv predict` replays arrivals from)."""
    if eng is None:
        return {}
    return {"clock": "engine", "engine_arrival": eng.arrival, "engine_id": eng.engine_id}


def clocks_of(records: Sequence[RequestRecord], scale: float) -> tuple[dict[str, str], list[str]]:
    """The clock of each latency figure and of the duration, and the notes that say so."""
    ok = [r for r in records if r.ok]
    n_engine = sum(1 for r in ok if r.clock == "engine")
    lat = "engine" if ok and n_engine == len(ok) else "client" if not n_engine else "mixed"
    clocks = {**dict.fromkeys(LATENCY_FIGURES, lat), "duration": "client"}
    x = f"{scale:g}"
    wall = "wall seconds" if scale == 1.0 else f"wall x {x}"
    notes = []
    if lat != "client":
        late = np.asarray([r.sent - r.scheduled for r in ok])
        which = (
            "" if lat == "engine" else f" ({n_engine:,} of {len(ok):,} requests; the rest on the client's)"
        )
        notes.append(
            f"clocks: TTFT, TPOT, ITL and E2E on the target's engine clock{which}: agentkv serve stamped "
            f"each request's arrival and tokens, so HTTP and client time is not in them, as in simulate; "
            f"duration and throughput on the client's clock ({wall}); the client sent requests "
            f"{np.percentile(late, 50) * 1e3:,.1f} ms (p50) / {late.max() * 1e3:,.1f} ms (max) after "
            f"they were due, not counted in the latencies"
        )
    else:
        notes.append(
            f"clocks: every time on the client's clock ({wall}), from when the plan said a request was due"
        )
    if scale != 1.0:
        also = "" if lat == "engine" else f", so HTTP and client overheads count {x}x too"
        notes.append(
            f"time scale {x}: the target ran {x}x faster than real time, gaps were replayed {x}x "
            f"shorter and every time is in target seconds{also}"
        )
    return clocks, notes


def catchup_note(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> str | None:
    """A note when agentkv serve fell behind real time during the run and skipped engine time."""
    if before is None or after is None or before.catchup_s is None or after.catchup_s is None:
        return None
    skipped = after.catchup_s - before.catchup_s
    if skipped <= 0:
        return None
    return (
        f"the target fell behind real time and skipped {skipped:,.3f} engine seconds "
        "(agentkv:engine_catchup_seconds_total; a busy host): they are idle time inside some latencies"
    )
