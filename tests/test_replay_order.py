"""`agentkv predict`'s replay serves requests in the order they reached the engine: agentkv serve's
stamps say when (two prompts sent 1 ms apart can reach it in the other order, and a first-come-first-
served engine then prefills the later-sent one first); on the client's clock, one front end's queue."""

from __future__ import annotations

import pytest

from agentkv.calib.replay import clock_offsets, replay
from agentkv.engine.config import EngineConfig
from agentkv.metrics.records import RequestRecord
from agentkv.trace.model import Request, Session, Trace

ENGINE = EngineConfig(gpu="h100", model="qwen2.5-7b", max_num_batched_tokens=8192, max_model_len=32768)


def _item(i: int, n: int, sent: float, arrival: float | None):
    """Record `i` of an `n`-token prompt sent at `sent`; `arrival` given: agentkv serve's engine
    clock stamped it (first token less its engine TTFT), else the client's clock."""
    tr = Trace(id=f"t{i}", block_size=16, session=Session(id=f"s{i}", requests=[]))
    req = Request(t=0.0, input_tokens=n, output_tokens=2, hash_ids=[i * 1000 + k for k in range(n // 16)])
    rec = RequestRecord(id=i, trace=tr.id, session=f"s{i}#0", tree=f"s{i}#0", sent=sent, input_tokens=n)
    rec.output_tokens = 2
    if arrival is not None:
        rec.clock, rec.first_token, rec.ttft = "engine", arrival + 1.0, 1.0
    return rec, tr, req


def test_engine_stamped_arrivals_set_the_order() -> None:
    """Sent 0.0 then 0.001, reached the engine at 0.020 and 0.010: the second-sent prefills first."""
    pred = replay(ENGINE, [_item(0, 6000, 0.0, 0.020), _item(1, 6000, 0.001, 0.010)], (0.0, 0.0), False)
    assert abs(pred[0].arrival - 0.020) < 1e-9 and abs(pred[1].arrival - 0.010) < 1e-9
    assert pred[1].first_token < pred[0].first_token


def test_client_clock_arrivals_queue_through_one_front_end() -> None:
    """On the client's clock a 16,000-token prompt sent first and a 2,000-token one 1 ms later, 1 us of
    host time a prompt token: the short one does not overtake the long one (vLLM's API server takes
    requests one at a time): its 2 ms start when the long one's 16 ms end. A request sent once the
    front end is idle meets only its own delay; without overheads, arrivals are the send times."""
    items = [_item(0, 16000, 0.0, None), _item(1, 2000, 0.001, None), _item(2, 2000, 0.5, None)]
    late = replay(ENGINE, items, (0.0, 1e-6), False)
    assert [late[i].arrival for i in range(3)] == pytest.approx([0.016, 0.018, 0.502])
    assert late[0].first_token < late[1].first_token
    plain = replay(ENGINE, items, (0.0, 0.0), False)
    assert [plain[i].arrival for i in range(3)] == pytest.approx([0.0, 0.001, 0.5])


def test_engine_arrivals_come_from_serves_stamp_not_the_delivery() -> None:
    """agentkv serve's engine clock runs 100 s behind the client's; request 1's first token took 30 ms
    longer to reach the client than request 0's. Its arrival is its engine stamp moved by the fastest
    delivery (0.5 ms): 6.5 ms, not its first token less its TTFT (36.5 ms)."""
    items = [_item(0, 4000, 0.0, None), _item(1, 4000, 0.001, None)]
    for (rec, _, _), true, lag in zip(items, (0.004, 0.006), (0.0005, 0.0305), strict=True):
        rec.clock, rec.ttft, rec.engine_arrival = "engine", 1.0, true - 100.0
        rec.first_token = true + rec.ttft + lag
    pred = replay(ENGINE, items, (0.0, 0.0), False)
    assert abs(pred[0].arrival - 0.0045) < 1e-9 and abs(pred[1].arrival - 0.0065) < 1e-9
    for rec, _, _ in items:  # a run recorded before bench kept the stamp: first token less TTFT
        rec.engine_arrival = None
    assert abs(replay(ENGINE, items, (0.0, 0.0), False)[1].arrival - 0.0365) < 1e-9


def _on_engine(rec: RequestRecord, true: float, behind: float, engine_id: str, lag: float = 0.0005) -> None:
    """Stamp `rec` as agentkv serve engine `engine_id` would: arrived at `true` (client clock) on an
    engine clock `behind` seconds behind the client's; its first token delivered `lag` after it."""
    rec.clock, rec.ttft, rec.engine_arrival, rec.engine_id = "engine", 1.0, true - behind, engine_id
    rec.first_token = true + rec.ttft + lag


def test_two_engines_behind_a_router_each_get_their_own_clock_offset() -> None:
    """Through `agentkv route`, worker a's clock runs 100 s behind the client's and worker b's 250 s:
    one offset for both would put b's arrivals 150 s early (clamped to their send time); one offset
    each puts every arrival where it was, and the note says how many clocks it told apart."""
    items = [_item(i, 4000, 0.001 * i, None) for i in range(4)]
    for (rec, _, _), true, behind, eng in zip(
        items, (0.004, 0.006, 0.020, 0.030), (100.0, 100.0, 250.0, 250.0), "aabb", strict=True
    ):
        _on_engine(rec, true, behind, eng)
    clocks = clock_offsets([r for r, _, _ in items])
    assert clocks.offsets == pytest.approx({"a": 100.0005, "b": 250.0005})
    assert "2 engines' stamps, each on its own clock" in clocks.note
    pred = replay(ENGINE, items, (0.0, 0.0), False, clocks)
    assert [pred[i].arrival for i in range(4)] == pytest.approx([0.0045, 0.0065, 0.0205, 0.0305], abs=1e-9)


def test_stamps_naming_no_engine_are_not_put_on_a_guessed_clock() -> None:
    """Stamps without an engine id (an older serve): behind a router (the target answered no
    /server_info) or beside stamps that name their engine, they cannot be put on one clock; they
    arrive at their first token less their engine TTFT, and the note says so."""
    items = [_item(i, 4000, 0.001 * i, None) for i in range(2)]
    _on_engine(items[0][0], 0.004, 100.0, "", lag=0.0005)
    _on_engine(items[1][0], 0.006, 250.0, "", lag=0.0305)
    recs = [r for r, _, _ in items]
    routed = clock_offsets(recs, one_server=False)
    assert routed.offsets == {} and "not one agentkv serve (a router?)" in routed.note
    pred = replay(ENGINE, items, (0.0, 0.0), False, routed)
    assert [pred[0].arrival, pred[1].arrival] == pytest.approx([0.0045, 0.0365], abs=1e-9)
    items[0][0].engine_id = "a"
    mixed = clock_offsets(recs)
    assert mixed.offsets == pytest.approx({"a": 100.0005}) and "other stamps name theirs" in mixed.note
    assert replay(ENGINE, items, (0.0, 0.0), False, mixed)[1].arrival == pytest.approx(0.0365, abs=1e-9)
    items[0][0].engine_id = ""  # one agentkv serve (it answered /server_info): its one clock, as before
    assert clock_offsets(recs).note == "arrivals: one engine's stamps, moved onto the client's clock"
