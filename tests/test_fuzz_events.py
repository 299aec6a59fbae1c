"""Fuzzing the KV event decoder through the subscriber's tolerant path, and the router index that
applies what it delivers: arbitrary frames, mutated msgpack payloads of valid batches, replay
replies, and a smaller run over real ZMQ sockets. A message is delivered or counted (malformed,
duplicate, lost), never an exception; the index never raises on a delivered event; memory stays flat.
"""

from __future__ import annotations

import time
import tracemalloc

import msgspec
import pytest
import zmq
from fuzzutil import byte_mutation, count, fuzz_settings, json_mutation, note, report
from hypothesis import given
from hypothesis import strategies as st

from agentkv.events.publisher import seq_bytes
from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.events.tracker import MAX_SEQ_JUMP, Received, SeqTracker
from agentkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch
from agentkv.route.index import TenantIndex

SALTS = {"salt-a": "tenant-a", "salt-b": "tenant-b"}
EVENT_KEYS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
]


def _valid_batches() -> list[list]:
    """vLLM-shaped batches as msgpack builtins: [ts, [event maps], dp rank]."""
    batches = [
        EventBatch(
            1.5,
            [
                BlockStored(
                    block_hashes=[11, 12, 13],
                    parent_block_hash=None,
                    token_ids=list(range(48)),
                    block_size=16,
                    extra_keys=[["salt-a"], None, None],
                ),
                BlockStored(block_hashes=[14], parent_block_hash=13, block_size=16, medium="CPU"),
            ],
            0,
        ),
        EventBatch(
            2.0, [BlockRemoved(block_hashes=[12, 13]), BlockRemoved(block_hashes=[14], medium="CPU")], None
        ),
        EventBatch(3.0, [AllBlocksCleared()], 0),
        EventBatch(
            4.0,
            [
                BlockStored(
                    block_hashes=[2**63, 2**64 - 1],
                    parent_block_hash=None,
                    lora_id=3,
                    lora_name="x",
                    extra_keys=[[["img", 0, 5]], ["salt-b"]],
                )
            ],
            1,
        ),
    ]
    return [msgspec.msgpack.decode(encode_batch(b)) for b in batches]


VALID = _valid_batches()


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    report(request.config, "events ")


def _deliver(tracker: SeqTracker, index: TenantIndex, frames: list[bytes], target: str) -> None:
    """The subscriber's tolerant path, then the router index; both must take anything."""
    before = tracker.stats.malformed + tracker.stats.duplicates
    lost = tracker.stats.lost
    try:
        next(tracker.handle(frames, can_replay=False))
        raise AssertionError("no replay to ask, yet the tracker asked")
    except StopIteration as done:
        delivered = done.value
    assert tracker.stats.lost - lost <= MAX_SEQ_JUMP  # no forged seq inflates the lost count
    if not delivered:
        assert tracker.stats.malformed + tracker.stats.duplicates == before + 1  # counted, not lost silently
        count(target, "counted skip")
        return
    for got in delivered:
        for ev in got.batch.events:
            index.apply(1, ev)
        index.find_matches("tenant-a", [11, 12, 13, 14])
    count(target, "delivered")


@st.composite
def payloads(draw) -> bytes:
    """A msgpack payload: a mutated valid batch, a byte-mutated one, or arbitrary bytes."""
    kind = draw(st.sampled_from(["valid", "structure", "structure", "bytes", "random"]))
    base = draw(st.sampled_from(VALID))
    if kind == "valid":
        return msgspec.msgpack.encode(base)
    if kind == "structure":
        mutant = base
        for _ in range(draw(st.integers(1, 2))):
            mutant = draw(json_mutation(mutant, EVENT_KEYS))
        try:
            return msgspec.msgpack.encode(mutant)
        except (OverflowError, TypeError):  # ints beyond 64 bits have no msgpack form
            return msgspec.msgpack.encode(base)
    if kind == "bytes":
        return draw(byte_mutation(msgspec.msgpack.encode(base)))
    return draw(st.binary(max_size=300))


seqs = (
    st.integers(0, 40).map(seq_bytes)
    | st.binary(max_size=10)
    | st.just(b"\xff" * 8)
    | st.integers(0, 2**64 - 1).map(seq_bytes)
)


@given(frames=st.lists(st.binary(max_size=64), max_size=5))
@fuzz_settings(400)
def test_arbitrary_frames_are_counted_skips(frames):
    _deliver(SeqTracker(0), TenantIndex(SALTS), frames, "events arbitrary-frames")


@given(data=st.data())
@fuzz_settings(250)
def test_mutated_payloads_decode_or_are_skipped(data):
    tracker, index = SeqTracker(0), TenantIndex(SALTS)
    for _ in range(data.draw(st.integers(1, 4))):  # a short stream: sequence logic sees gaps and repeats
        frames = [data.draw(st.sampled_from([b"kv-events", b""])), data.draw(seqs), data.draw(payloads())]
        _deliver(tracker, index, frames, "events mutated-payloads")


@given(data=st.data())
@fuzz_settings(150)
def test_replay_replies_are_parsed_or_skipped(data):
    tracker = SeqTracker(0)
    n = data.draw(st.sampled_from([3, 4, 2, 5]))
    frames = (
        [data.draw(st.sampled_from([b"", b"x"]))]
        + [data.draw(seqs)] * (n == 3)
        + ([b"kv-events", data.draw(seqs)] if n == 4 else [])
        + [data.draw(payloads())] * (n in (3, 4))
        + [data.draw(st.binary(max_size=20)) for _ in range(n if n in (2, 5) else 0)]
    )
    out = tracker.parse_reply(frames)
    assert out is None or isinstance(out, Received) or out.__class__ is object
    count("events replay-replies", "skipped" if out is None else "parsed")


def test_memory_stays_flat_over_a_long_fuzzed_stream():
    """50k messages, a third malformed, through one tracker and index: nothing accumulates."""
    import random

    rng = random.Random(3)
    good = [msgspec.msgpack.encode(b) for b in VALID]
    tracker, index = SeqTracker(0), TenantIndex(SALTS)
    seq = 0

    def feed(n: int) -> None:
        nonlocal seq
        for _ in range(n):
            payload = rng.choice(good)
            if rng.random() < 0.33:
                b = bytearray(payload)
                b[rng.randrange(len(b))] = rng.randrange(256)
                payload = bytes(b)
            seq += rng.choice((1, 1, 1, 2))  # some gaps
            r = tracker.decode([b"kv-events", seq_bytes(seq), payload])
            if r is not None:
                for got in tracker.accept(r, tracker.gap_start(r), []):
                    for ev in got.batch.events:
                        index.apply(rng.randrange(4), ev)

    feed(10_000)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        feed(40_000)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    s = tracker.stats
    note(
        "events long-stream",
        f"50000 messages, {s.malformed} malformed, {s.lost} lost, {grown / 1024:.0f} KiB kept",
    )
    assert s.malformed > 5_000 and s.received > 25_000
    assert grown < 1 << 20


def test_real_sockets_take_fuzzed_frames():
    """Fuzzed multipart messages over a real PUB -> SUB pair: the subscriber keeps delivering."""
    import random

    rng = random.Random(11)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ZmqEventSubscriber(f"tcp://127.0.0.1:{port}", start_seq=None)
    index = TenantIndex(SALTS)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the slow joiner: wait until a probe gets through
            pub.send_multipart([b"kv-events", seq_bytes(0), msgspec.msgpack.encode(VALID[2])])
            if sub.recv(0.05) is not None:
                break
        sent = 0
        good = [msgspec.msgpack.encode(b) for b in VALID]
        for round_ in range(300):
            for _ in range(5):
                frames = [
                    bytes(rng.randrange(256) for _ in range(rng.randrange(12)))
                    for _ in range(rng.choice((1, 2, 3, 3, 4)))
                ]
                if len(frames) == 3 and rng.random() < 0.5:
                    p = bytearray(rng.choice(good))
                    p[rng.randrange(len(p))] = rng.randrange(256)
                    frames = [b"kv-events", seq_bytes(rng.randrange(50)), bytes(p)]
                pub.send_multipart(frames)
                sent += 1
            # a valid sentinel (seq 0 is always taken: a restart at worst) must come through
            pub.send_multipart([b"kv-events", seq_bytes(0), good[round_ % len(good)]])
            got = None
            end = time.monotonic() + 5
            while got is None or got.seq != 0:
                assert time.monotonic() < end, "the subscriber stopped delivering (hang)"
                got = sub.recv(0.5)
                if got is not None:
                    for ev in got.batch.events:
                        index.apply(0, ev)
        note("events real-sockets", f"{sent} fuzzed messages, {sub.stats.malformed} malformed")
        assert sub.stats.malformed > 0
    finally:
        sub.close()
        ctx.destroy(linger=0)
