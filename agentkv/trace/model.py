"""The one in-memory model of agentic traffic: a trace holds a session tree of requests.

Every reader produces it, the writer saves it, and stats, the replay plan, the simulator and
the benchmark consume it. Times are seconds; token counts are ints; `hash_ids` are the trace's
prefix block ids (block size `Trace.block_size`), local to one trace unless `hash_id_scope`
says "global".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import msgspec

from agentkv.errors import UserError


class TraceError(UserError, ValueError):
    """Bad input: names the file, the record and the field, so a user can fix it."""

    def __init__(self, path: str, record: str | int | None, field: str | None, message: str):
        self.path, self.record, self.field, self.message = path, record, field, message
        where = str(path) if str(path).isprintable() else repr(str(path))  # one line, whatever the name
        if record is not None:
            where += f": record {record}"
        if field:
            where += f", field '{field}'"
        super().__init__(f"{where}: {message}")


class Request(msgspec.Struct, kw_only=True):
    """One model call: it arrives at offset `t` (s) from its session's start."""

    t: float
    input_tokens: int
    output_tokens: int
    hash_ids: list[int] = msgspec.field(default_factory=list)
    think_time: float = 0.0  # think/tool gap before this request, after the previous one ended
    model: str = ""
    kind: str = "n"  # AgentX request type: "n" (main-line call) or "s" (side call, e.g. a summary)
    stop: str = ""  # stop reason: tool_use, end_turn, max_tokens, ...
    api_time: float | None = None  # measured end-to-end time of the original call (s)
    ttft: float | None = None  # measured time to first token of the original call (s)
    input_types: list[str] = msgspec.field(default_factory=list)
    output_types: list[str] = msgspec.field(default_factory=list)


class Session(msgspec.Struct, kw_only=True):
    """A session (or sub-agent) with its ordered requests and child sub-agents.

    A sub-agent is a `Session` in `subagents` (kept in spawn order, then end order) whose `t` is
    its spawn offset inside the parent; its requests' `t` count from that spawn. The root session
    has `t == 0`.
    """

    id: str
    requests: list[Request] = msgspec.field(default_factory=list)
    subagents: list[Session] = msgspec.field(default_factory=list)
    t: float = 0.0
    agent_type: str = ""
    status: str = ""
    system_tokens: int = 0
    tool_tokens: int = 0
    duration: float | None = None  # recorded duration of a sub-agent (s), when known
    total_tokens: int | None = None  # a sub-agent's reported token total (AgentX `total_tokens`), when known
    tool_use_count: int | None = (
        None  # a sub-agent's reported tool calls (AgentX `tool_use_count`), when known
    )

    def walk(self, offset: float = 0.0, depth: int = 0) -> Iterator[tuple[float, int, Session]]:
        """Yield (absolute start, depth, session) for this session and every descendant."""
        start = offset + self.t
        yield start, depth, self
        for sub in self.subagents:
            yield from sub.walk(start, depth + 1)


class TimedRequest(NamedTuple):
    """A request placed on the trace's absolute timeline."""

    time: float
    session: Session
    request: Request
    depth: int


class Trace(msgspec.Struct, kw_only=True):
    """One trace: a root session tree, the block size of its hash ids and where it came from."""

    id: str
    block_size: int
    session: Session
    hash_id_scope: str = "local"
    source: str = ""  # file it was read from ("" when synthesised)
    format: str = ""  # agentx | mooncake | claude_code | synth
    replay: str = "session"  # "session": gaps drive replay; "timestamp": arrival times do (Mooncake)

    def hash_space(self, run: str) -> str:
        """The space its hash ids live in during one replay `run` (a live session tree): the run itself
        for local ids; for global ids, the file it came from (that file's traces share one cache)."""
        return run if self.hash_id_scope == "local" else f"global:{self.source or self.id}"

    def sessions(self) -> Iterator[Session]:
        for _, _, s in self.session.walk():
            yield s

    def timeline(self) -> list[TimedRequest]:
        """All requests in time order; a sub-agent's at its spawn offset plus their own `t`.

        Ties keep file order (parent before the sub-agents it spawned), so the order is stable.
        """
        out: list[tuple[float, int, TimedRequest]] = []
        for start, depth, s in self.session.walk():
            for r in s.requests:
                out.append((start + r.t, len(out), TimedRequest(start + r.t, s, r, depth)))
        out.sort(key=lambda x: (x[0], x[1]))
        return [x[2] for x in out]

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions())

    @property
    def num_subagents(self) -> int:
        return sum(1 for _ in self.sessions()) - 1
