"""Requests whose stream merged several steps' tokens into one chunk (or read several chunks at once)
are flagged per row and their errors reported apart (issue #17), never dropped."""

from __future__ import annotations

import pytest

from agentkv.bench.clocks import Latency
from agentkv.calib.accuracy import READ_APART_S, accuracy, chunks, row
from agentkv.calib.replay import Predicted
from agentkv.metrics.records import RequestRecord


def _record(i: int, chunk_times: list[float], tokens: int) -> RequestRecord:
    """A client-clock record from the arrival times of the chunks that carried its `tokens`."""
    lat = Latency.of_client(chunk_times, tokens, 1.0, chunk_times[0], chunk_times[-1])
    return RequestRecord(
        id=i, trace="t", session=f"s{i}", sent=0.0, first_token=chunk_times[0], end=chunk_times[-1],
        ttft=lat.ttft, e2e=lat.e2e, tpot=lat.tpot, itl_max=lat.itl_max, itls=lat.itls,
        input_tokens=100, output_tokens=tokens, cached_tokens=0,
    )  # fmt: skip


def test_a_stream_with_fewer_chunks_than_tokens_is_flagged_and_reported_apart() -> None:
    one = _record(0, [0.1 + 0.01 * k for k in range(8)], 8)  # 8 chunks, 8 tokens
    merged = _record(1, [0.1, 0.11, 0.17], 8)  # 8 tokens in 3 chunks: the server merged steps
    pair = _record(5, [0.1, 0.1001] + [0.11 + 0.01 * k for k in range(6)], 8)  # first two read together
    whole = _record(2, [0.1], 4)  # all 4 tokens in one chunk
    burst = _record(4, [0.1 + 0.0001 * k for k in range(4)], 4)  # 4 chunks read within 0.3 ms
    assert [chunks(r) for r in (one, merged, whole, burst)] == [8, 3, 1, 4]
    assert chunks(burst, READ_APART_S) == 1 and chunks(one, READ_APART_S) == 8
    old = RequestRecord(id=3, trace="t", session="s", output_tokens=4, itl_max=0.01)
    assert chunks(old) is None  # gaps not kept: unknown, not merged
    preds = {
        0: Predicted(0.0, 0.1, 0.17, 8, 0),  # exact
        1: Predicted(0.0, 0.1, 0.24, 8, 0),  # TPOT 20 ms against 10 ms measured: +100%
        2: Predicted(0.0, 0.1, 0.13, 4, 0),  # TPOT 10 ms against 0 measured (None: skipped)
    }
    preds[4] = Predicted(0.0, 0.1, 0.13, 4, 0)
    preds[5] = preds[0]
    rows = [row(r, preds[r.id], 0.0) for r in (one, merged, whole, burst, pair)]
    assert [x["merged"] for x in rows] == [False, True, True, True, False]  # pair: 8 tokens in 7 reads
    assert rows[4]["reads"] == 7 and rows[4]["chunks"] == 8
    doc = accuracy(rows[:3])
    assert doc["requests"] == 3 and doc["merged_requests"] == 2
    alone, both = doc["by_delivery"]["one token a chunk"], doc["by_delivery"]["merged chunks"]
    assert alone["requests"] == 1 and alone["tpot"]["mape_pct"] == pytest.approx(0.0, abs=1e-6)
    assert both["requests"] == 2 and both["tpot"]["mape_pct"] == pytest.approx(100.0)
    assert doc["overall"]["tpot"]["n"] == 2  # the merged ones stay in the overall figures
