"""Sequence bookkeeping of a KV-event stream, sans I/O: decoding, duplicates, gaps, restarts.

Tolerant by design: a malformed message (wrong frame count, bad sequence frame, undecodable or
ill-typed payload) is counted in `stats.malformed` and skipped. When a sequence number jumps, the
missing batches are fetched from the publisher's replay socket (if given) and delivered, in order
and marked `replayed`, before the batch that revealed the gap; what replay cannot supply is
counted in `stats.lost`. A publisher restart (`stats.resets`) is a jump back below the last
batch, or a repeat of the last seq with other content, or a jump ahead where replay shows a
different batch under the last seq delivered (the new publisher got further than the old one
while the subscriber was away): numbering starts again from 0, the batches of the new publisher
missed before it are replayed, and the first batch delivered after it is marked `restart`, so a
consumer knows to drop what it built from the old publisher before applying it.

One forged or corrupt frame must not distort the counters: a seq at or past `SEQ_LIMIT` is
malformed, and a jump more than `MAX_SEQ_JUMP` ahead is taken only once the publisher vouches for
it (replay holds that very batch), else counted malformed and dropped. Without replay such a jump
is believed when the next message continues it, as a restart (never counted as lost batches).
The sockets are in `agentkv.events.subscriber`.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace

from agentkv.events.publisher import END_SEQ, MalformedFrame, parse_message, parse_payload, parse_seq
from agentkv.kv.events import EventBatch


@dataclass(frozen=True, slots=True)
class Received:
    """One delivered batch with its sequence number and topic; `replayed` if it came via replay."""

    seq: int
    batch: EventBatch
    topic: bytes
    replayed: bool = False
    restart: bool = False  # the first batch of a restarted publisher: state from before it is stale
    payload: bytes = field(default=b"", repr=False, compare=False)  # as sent: tells two publishers apart


@dataclass(slots=True)
class SubscriberStats:
    """Delivered batches, skipped messages, gaps seen and what replay recovered or could not."""

    received: int = 0
    malformed: int = 0
    duplicates: int = 0
    resets: int = 0
    gaps: int = 0
    replay_requests: int = 0
    replay_timeouts: int = 0
    recovered: int = 0
    lost: int = 0
    handshake_failures: int = 0  # a publisher without the pinned CURVE key, or a CURVE / plain mismatch


_END = object()
SEQ_LIMIT = 1 << 53  # no publisher gets this far: a million batches a second for 285 years
MAX_SEQ_JUMP = 1_000_000  # batches: a jump past the expected seq beyond this must be vouched for


class SeqTracker:
    """Decoding and sequence bookkeeping shared by the blocking and asyncio subscribers;
    `token_ids=False` leaves BlockStored token ids undecoded (`StoredNoTokens`: for a router)."""

    def __init__(self, start_seq: int | None, token_ids: bool = True) -> None:
        self.expected = start_seq
        self.token_ids = token_ids
        self.stats = SubscriberStats()
        self._restart = False  # a restart was seen and its first batch is not delivered yet
        self.last_payload: bytes | None = None  # of the last batch delivered
        self._far: int | None = None  # an unvouched far jump's seq, believed if the next one continues it

    def decode(self, frames: Sequence[bytes]) -> Received | None:
        """The live message as Received, or None (counted) if malformed or a duplicate."""
        try:
            topic, seq, batch = parse_message(frames, self.token_ids)
        except MalformedFrame:
            self.stats.malformed += 1
            return None
        if seq >= SEQ_LIMIT:
            self.stats.malformed += 1
            return None
        payload = bytes(frames[2])
        if self.expected is not None and seq < self.expected:
            if seq == self.expected - 1 and seq != 0 and payload == self.last_payload:
                self.stats.duplicates += 1  # the batch just delivered, once more
                return None
            # Numbering went back: one publisher's sequence only grows, so it restarted. Its first
            # batches may have been lost (slow joiner): expect 0, so replay fetches them.
            self._restarted()
        return Received(seq, batch, topic, payload=payload)

    def _restarted(self) -> None:
        self.stats.resets += 1
        self.expected = 0
        self._restart = True

    def far(self, r: Received) -> bool:
        """True if `r` jumps more than MAX_SEQ_JUMP past the expected seq (not yet believed)."""
        return self.expected is not None and r.seq - self.expected > MAX_SEQ_JUMP

    def vouched(self, r: Received, replies: Sequence[Received]) -> bool:
        """Whether replay holds `r` itself; if not, `r` is counted malformed (to be dropped)."""
        if any(x.seq == r.seq and x.payload == r.payload for x in replies):
            return True
        self.stats.malformed += 1
        return False

    def continues_far(self, r: Received) -> bool:
        """Without replay: True (a restart at `r`'s numbering) if `r` follows the last far jump seen;
        otherwise `r` becomes that jump, counted malformed (to be dropped)."""
        if self._far is not None and r.seq == self._far + 1:
            self._far = None
            self._restarted()
            self.expected = r.seq
            return True
        self._far = r.seq
        self.stats.malformed += 1
        return False

    def probe_from(self, gap: int) -> int:
        """Where a gap's replay starts: one batch early when the last one delivered can be compared."""
        return gap - 1 if gap > 0 and self.last_payload is not None else gap

    def renumbered(self, gap: int, replies: Sequence[Received]) -> bool:
        """True (a restart, counted) if replay holds another batch under the last seq delivered: a
        new publisher that got past the old one's numbering while the subscriber was away."""
        if gap == 0 or self.last_payload is None:
            return False
        prev = next((x for x in replies if x.seq == gap - 1), None)
        if prev is None or prev.payload == self.last_payload:
            return False  # same publisher (or too old to tell: the gap is filled as it can be)
        self._restarted()
        return True

    def gap_start(self, r: Received) -> int | None:
        """First missing seq if `r` skips ahead of the expected one."""
        if self.expected is not None and r.seq > self.expected:
            self.stats.gaps += 1
            return self.expected
        return None

    def parse_reply(self, frames: Sequence[bytes]) -> Received | object | None:
        """A replay reply: Received, `_END` for the end marker, None (counted) if malformed.

        Accepts `[b"", topic, seq, payload]` (vLLM 0.32) and `[b"", seq, payload]` (older vLLM).
        """
        try:
            if len(frames) == 4 and frames[0] == b"":
                topic, seq_frame, payload = frames[1], frames[2], frames[3]
            elif len(frames) == 3 and frames[0] == b"":
                topic, seq_frame, payload = b"", frames[1], frames[2]
            else:
                raise MalformedFrame(f"replay reply of {len(frames)} frames")
            if seq_frame == END_SEQ:
                return _END
            return Received(
                parse_seq(seq_frame),
                parse_payload(payload, self.token_ids),
                bytes(topic),
                replayed=True,
                payload=bytes(payload),
            )
        except MalformedFrame:
            self.stats.malformed += 1
            return None

    def take_reply(self, frames: Sequence[bytes], out: list[Received]) -> bool:
        """Add a replay reply's batch to `out`; True at the end marker (malformed replies are counted)."""
        item = self.parse_reply(frames)
        if isinstance(item, Received):
            out.append(item)
        return item is _END

    def handle(
        self, frames: Sequence[bytes], can_replay: bool
    ) -> Generator[int, list[Received], list[Received]]:
        """One live message, sans I/O: yields each replay start seq it needs (the caller sends back
        the replies) and returns the batches to deliver, in order."""
        r = self.decode(frames)
        if r is None:
            return []
        return (yield from self.follow(r, can_replay))

    def in_order(self, r: Received) -> bool:
        """True when `r` neither jumps nor skips ahead: `accept(r, None, [])` delivers it, with no
        generator (the live stream's usual case, on the router's event thread)."""
        return self.expected is None or r.seq <= self.expected

    def follow(self, r: Received, can_replay: bool) -> Generator[int, list[Received], list[Received]]:
        """`handle` for a decoded message."""
        if self.far(r):  # believed only when replay holds it, or (no replay) the next one continues it
            believed = self.vouched(r, (yield r.seq)) if can_replay else self.continues_far(r)
            if not believed:
                return []
        gap = self.gap_start(r)
        replies: list[Received] = []
        if gap is not None and can_replay:
            replies = yield self.probe_from(gap)
            if self.renumbered(gap, replies):
                gap = 0
                replies = yield 0
        return self.accept(r, gap, replies)

    def accept(self, r: Received, gap: int | None, replies: list[Received]) -> list[Received]:
        """Deliver `r`, preceded by the replies that fill [gap, r.seq); advance the expected seq."""
        out: list[Received] = []
        if gap is not None:
            by_seq = {x.seq: x for x in replies if gap <= x.seq < r.seq}
            out = [by_seq[s] for s in sorted(by_seq)]
            self.stats.recovered += len(out)
            self.stats.lost += (r.seq - gap) - len(out)
        out.append(r)
        if self._restart:
            self._restart = False
            out[0] = replace(out[0], restart=True)
        self.stats.received += len(out)
        self.expected = r.seq + 1
        self.last_payload = r.payload
        self._far = None  # a far jump is believed only when the very next message continues it
        return out
