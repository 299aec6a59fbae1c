"""Mooncake (FAST'25 release) JSONL traces: one request a line, arrival times in ms, global block ids.

A line is `{"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int]}`; ids
name prefix blocks of `block_size` tokens (512 in the published traces; `--trace-block-size`, as
Dynamo's replay takes it) shared across the whole file. One file becomes one `Trace` whose root
session holds every request in file order, replayed by arrival time (`replay="timestamp"`).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from agentkv.trace.formats._errors import from_msgspec
from agentkv.trace.formats.limits import HashId, Millis, Tokens
from agentkv.trace.model import Request, Session, Trace, TraceError

BLOCK_SIZE = 512  # tokens per hash id in the published traces; per file: `read(..., block_size)`


class _Line(msgspec.Struct, gc=False):
    """One line; every number bounded (`limits`), so a 400-digit length is a TraceError here."""

    timestamp: Millis
    input_length: Tokens
    output_length: Tokens
    hash_ids: list[HashId]


_decode_line = msgspec.json.Decoder(_Line).decode


def sniff(path: Path, head: bytes) -> bool:
    s = head.lstrip()
    return s[:1] == b"{" and b'"input_length"' in s and b'"hash_ids"' in s


def read(path: Path, data: bytes, block_size: int | None = None) -> list[Trace]:
    """One `Trace` (format "mooncake") with `t = timestamp / 1000` s for each request, in file order."""
    bs = block_size or BLOCK_SIZE
    requests = []
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            row = _decode_line(line)
        except msgspec.DecodeError as e:
            raise from_msgspec(str(path), e, record=n) from None
        limit = -(-row.input_length // bs)
        if len(row.hash_ids) > limit:
            raise TraceError(
                str(path),
                n,
                "hash_ids",
                f"{len(row.hash_ids)} blocks but input_length = {row.input_length} tokens "
                f"implies at most {limit} blocks of {bs} (another block size? --trace-block-size)",
            )
        requests.append(
            Request(
                t=row.timestamp / 1000.0,
                input_tokens=row.input_length,
                output_tokens=row.output_length,
                hash_ids=row.hash_ids,
            )
        )
    if not requests:
        raise TraceError(str(path), None, None, "no requests (the file holds no JSON lines)")
    tid = path.name.split(".")[0]
    return [
        Trace(
            id=tid,
            block_size=bs,
            session=Session(id=tid, requests=requests),
            hash_id_scope="global",
            source=str(path),
            format="mooncake",
            replay="timestamp",
        )
    ]
