"""A trimmed real trace for the live vLLM: two Claude Code sessions scaled to fit `--max-model-len 8192`.

Lengths shrink by an integer factor while every hash id is kept: the trace's block size shrinks
by the same factor (64 -> 8 tokens for x8), so each request still covers exactly its hash ids and
two requests still share exactly the blocks they shared. Outputs are capped at 8 tokens.

The two sessions then take turns (A1, B1, A2, B2, ...) in one session with no think time: two
agents sharing one engine, one request at a time. Replayed on one lane, every request starts after
the previous one ended, so the live engine and the simulator see the same order whatever their
speeds, and the cache-hit rates compare the cache models alone (block accounting, eviction order,
the last-token rule), not scheduling. Both contexts grow to ~6,600 tokens (~210 blocks of 32), so
a cache of a few hundred blocks must evict.
"""

from __future__ import annotations

import math
from itertools import zip_longest
from pathlib import Path

from agentkv.trace.formats import load_paths
from agentkv.trace.formats.agentx import write_agentx
from agentkv.trace.model import Request, Session, Trace

SOURCES = ("trace_0462", "trace_0684")  # 31 + 26 turns, no sub-agents, up to 53,164 tokens
SCALE = 8
MAX_OUTPUT = 8
MAX_MODEL_LEN = 8192


def scaled_requests(
    src: Trace,
    scale: int = SCALE,
    max_output: int = MAX_OUTPUT,
    id_offset: int = 0,
    max_len: int = MAX_MODEL_LEN,
) -> list[Request]:
    """The main session's requests with lengths / `scale`, hash ids + `id_offset`, outputs capped."""
    if src.block_size % scale:
        raise ValueError(f"{src.id}: block size {src.block_size} is not divisible by {scale}")
    out = []
    for r in src.session.requests:
        n_in = math.ceil(r.input_tokens / scale)
        n_out = max(1, min(r.output_tokens, max_output))
        if n_in + n_out > max_len:
            raise ValueError(f"{src.id}: a request of {n_in} + {n_out} tokens does not fit {max_len}")
        out.append(
            Request(
                t=0.0,
                input_tokens=n_in,
                output_tokens=n_out,
                hash_ids=[h + id_offset for h in r.hash_ids],
                model=r.model,
                kind=r.kind,
                stop=r.stop,
            )
        )
    return out


def interleaved_trace(sources: list[Trace], scale: int = SCALE, max_output: int = MAX_OUTPUT) -> Trace:
    """The sources' main sessions, scaled, taking turns in one session (hash ids kept apart)."""
    runs, offset = [], 0
    for src in sources:
        runs.append(scaled_requests(src, scale, max_output, offset))
        offset += max((h for r in src.session.requests for h in r.hash_ids), default=-1) + 1
    turns = [r for group in zip_longest(*runs) for r in group if r is not None]
    name = "+".join(s.id for s in sources)
    return Trace(
        id=f"{name}-x{scale}",
        block_size=sources[0].block_size // scale,
        session=Session(id=name, requests=turns),
        format="agentx",
    )


def write_trimmed(shared: Path, out: Path, names: tuple[str, ...] = SOURCES) -> Path:
    """Write the interleaved, scaled trace as AgentX JSON under `out`; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    srcs = [load_paths([shared / "traces" / "claude-code" / f"{n}.json.gz"])[0] for n in names]
    t = interleaved_trace(srcs)
    return write_agentx(t, out / f"{t.id}.json")
