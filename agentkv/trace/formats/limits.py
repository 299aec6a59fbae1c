"""Bounds on what a trace file may hold: every number a reader accepts, and the file's size.

Real traces stay far inside them (the 121 shared traces: inputs under 2**20 tokens, hash ids
under 2**18, at most 3 MB decompressed); hostile ones get a `TraceError` naming the field, so
later arithmetic (numpy int64/uint64 block keys, per-token arrays, float clocks) never overflows.
"""

from __future__ import annotations

import os
from typing import Annotated

import msgspec

from agentkv.errors import UserError

MAX_TOKENS = 1 << 26  # one request's input or output (67M; contexts reach 10M): the simulator's
# block keys take ~6 bytes per token, so a request stays under ~400 MB
MAX_TOTAL_TOKENS = 1 << 40  # a sub-agent's reported total over all its calls
MAX_COUNT = 1 << 31  # counts such as a sub-agent's tool calls
MAX_HASH_ID = (1 << 63) - 1  # ids become int64 (viewed as uint64) when keyed
MAX_BLOCK_SIZE = 1 << 20  # tokens per hash id (real traces: 16 to 512)
MAX_SECONDS = float(1 << 32)  # any time or offset (136 years; Unix-epoch seconds fit)
MAX_MILLIS = MAX_SECONDS * 1000.0  # the same in milliseconds (Mooncake timestamps, durations)

Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
TotalTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOTAL_TOKENS)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
HashId = Annotated[int, msgspec.Meta(ge=0, le=MAX_HASH_ID)]
BlockSize = Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCK_SIZE)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
Millis = Annotated[float, msgspec.Meta(ge=0, le=MAX_MILLIS)]
Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]

MAX_BYTES = 256 << 20  # one trace file, on disk and again after gunzip (largest real one: 3 MB)
MAX_BYTES_ENV = "AGENTKV_TRACE_MAX_BYTES"  # overrides MAX_BYTES: a size such as 1GiB or 2000000


def max_bytes() -> int:
    """The size cap in force: `$AGENTKV_TRACE_MAX_BYTES` when set, else `MAX_BYTES`."""
    text = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not text:
        return MAX_BYTES
    from agentkv.units import parse_capacity

    cap = parse_capacity(text, MAX_BYTES_ENV)
    if cap <= 0:
        raise UserError(f"{MAX_BYTES_ENV}: must be a positive size, got {text!r}")
    return cap
