"""KV events in vLLM's wire format: what a pool stores and removes, batched and msgpack-encoded.

Observed on a live vLLM 0.32 (../shared/vllm/README.md): a batch is the array
`[ts, [event, ...], data_parallel_rank]`; each event is a map tagged `"type"` with every field
present (None as nil). Decoding tolerates missing optional fields, so older and newer
publishers (SGLang, earlier vLLM) decode too.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True):
    """Full blocks were stored (hashes in chain order; `parent_block_hash` precedes the first)."""

    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", kw_only=True):
    """Blocks were evicted from `medium` (a tier move shows as Removed here, Stored below)."""

    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = 0


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    """Every block was dropped (cache reset or restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventLog:
    """Where a pool's events go (`BlockPool` and `HybridPool` alike): to `on_event`, else to a buffer
    that `take_events` empties when `record_events`, else nowhere; and a cache reset's notice."""

    def _setup_events(self, on_event: Callable[[KVEvent], None] | None, record_events: bool) -> None:
        self._events: list[KVEvent] = []
        self._emit = on_event if on_event is not None else (self._events.append if record_events else None)

    def take_events(self) -> list[KVEvent]:
        """The buffered events (record_events=True), oldest first; the buffer is emptied."""
        events = self._events[:]
        self._events.clear()
        return events

    def _cleared(self) -> None:
        """The prefix cache was dropped: earlier lookups are stale; listeners hear AllBlocksCleared."""
        self._epoch += 1
        if self._emit is not None:
            self._emit(AllBlocksCleared())


class EventBatch(msgspec.Struct, array_like=True):
    """One published message: a timestamp, its events and the data-parallel rank."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class StoredNoTokens(BlockStored, tag="BlockStored"):
    """A BlockStored decoded for a reader that never looks at its token ids (a router): they stay
    undecoded msgpack (`msgspec.Raw`, any type), so a 100K-token prompt costs no 100K int objects."""

    token_ids: msgspec.Raw = msgspec.Raw()


class BatchNoTokens(EventBatch):
    """An EventBatch whose BlockStored events are `StoredNoTokens` (the same wire format)."""

    events: list[StoredNoTokens | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)
_no_tokens_decoder = msgspec.msgpack.Decoder(BatchNoTokens)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes, token_ids: bool = True) -> EventBatch:
    """Decode one payload (`token_ids=False`: BlockStored token ids left undecoded, see
    `StoredNoTokens`); raises msgspec.DecodeError / ValidationError on a malformed one."""
    return (_decoder if token_ids else _no_tokens_decoder).decode(payload)
