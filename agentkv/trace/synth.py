"""Seeded synthetic agentic sessions, shaped like the real Claude Code traces (see docs/traces.md).

Each session is one `Trace`: a system+tools prefix shared by all its requests, a context that grows
every turn, think/tool gaps, occasional cache breaks and compactions (the context restarts after
the prefix), side calls, and rare bursts of parallel sub-agents that share their own prefix.
Hash ids are local to a trace. Session `i` of seed `s` depends on `(s, i)` only, so a bigger
`--sessions` run extends a smaller one, and the same seed gives byte-identical files.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np

from agentkv.trace.model import Request, Session, Trace


class LogNormal(msgspec.Struct, frozen=True, array_like=True):
    """A log-normal by its median and log-space sigma (p90 = median * exp(1.28 sigma))."""

    median: float
    sigma: float

    def draw(self, rng: np.random.Generator) -> float:
        return self.median * math.exp(self.sigma * rng.standard_normal())


class SynthConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of the generator. Defaults: fits to the 119 shared Claude Code traces (medians, sigmas)."""

    block_size: int = 64
    model: str = "synth-agent"
    turns: LogNormal = LogNormal(65, 0.85)  # requests per main session: p50 65, p90 155, max 317
    side_turns: LogNormal = LogNormal(14, 1.2)  # requests per side-call session: p50 14, p90 74
    max_turns: int = 320
    system_tokens: LogNormal = LogNormal(2795, 0.25)
    tool_tokens: LogNormal = LogNormal(12319, 0.08)
    first_user: LogNormal = LogNormal(4000, 0.6)  # fresh first turn beyond the prefix: p50 19.5k in all
    resumed_share: float = 0.4  # 47 of 119 sessions start from a resumed context (>= 60k tokens)
    resumed_input: LogNormal = LogNormal(160_000, 0.6)  # real p50 134k, p90 310k
    growth: LogNormal = LogNormal(660, 1.3)  # input delta per turn: p50 660, p90 3.5k
    output: LogNormal = LogNormal(212, 1.05)  # main-line ("n") output: p50 212, p90 809
    side_output: LogNormal = LogNormal(242, 1.25)  # side-call ("s") output: p50 242, p90 1.68k
    gap_tool: LogNormal = LogNormal(9, 1.6)  # after tool_use: p50 9 s, p90 74 s
    gap_user: LogNormal = LogNormal(230, 2.0)  # after end_turn (the user thinks): p50 230 s
    gap_quiet: LogNormal = LogNormal(106, 1.5)  # after a call with no stop reason: p50 106 s
    max_gap: float = 12 * 3600.0
    end_turn_share: float = 0.06  # stop reasons of main-line calls: end_turn 6%, none 1.4%, else tool_use
    quiet_share: float = 0.014
    side_session_share: float = 0.23  # 27 of 119 sessions are all side calls ...
    side_call_share: float = 0.029  # ... and 2.9% of the other sessions' calls are
    side_quiet_share: float = 0.58  # side sessions' stop reasons: none 58%, end_turn 6%, else tool_use
    break_prefix: float = 0.012  # per turn: the cached context past the prefix is lost (1.2%) ...
    break_partial: float = 0.0087  # ... or lost from a random point (0.9%)
    compacting_share: float = 0.6  # sessions with a ~158k-token window; the rest compact at context_cap
    compact_at: LogNormal = LogNormal(158_000, 0.05)
    compacted: LogNormal = LogNormal(21_000, 0.5)  # context after compaction, beyond the prefix
    context_cap: int = 500_000  # the largest real input is 543k
    burst_rate: float = 0.0008  # per main-line tool call: spawn parallel sub-agents (6 in 7,190)
    burst_sizes: tuple[float, ...] = (0.5, 0.25, 0.25)  # P(1 child), P(2), P(3)
    sub_turns: LogNormal = LogNormal(7, 0.5)
    sub_system_tokens: LogNormal = LogNormal(1000, 0.25)
    sub_tool_tokens: LogNormal = LogNormal(7450, 0.02)
    sub_first_user: LogNormal = LogNormal(3300, 0.3)  # sub-agent first input p50 11.7k in all
    sub_growth: LogNormal = LogNormal(2100, 1.6)
    sub_gap: LogNormal = LogNormal(4, 0.8)
    api_base: float = 1.55  # api_time = (base + out * per_out + in * per_in) * LogNormal(1, noise): a
    api_per_out: float = 0.01525  # least-squares fit to 7,506 recorded calls
    api_per_in: float = 1.15e-5
    api_noise: float = 0.3


class _Ids:
    """The trace's block-id counter: fresh ids for new content, from 1 up."""

    def __init__(self) -> None:
        self.next = 1

    def new(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def _blocks(chain: list[int], keep: int, tokens: int, ids: _Ids, bs: int) -> tuple[list[int], list[int]]:
    """Hash ids of a `tokens`-long input keeping `chain[:keep]`, and the new chain of full blocks."""
    full = tokens // bs
    kept = chain[: min(keep, full)]
    chain = kept + ids.new(full - len(kept))
    return chain + (ids.new(1) if tokens % bs else []), chain


class _Gen:
    """Builds one session tree from one random stream."""

    def __init__(self, cfg: SynthConfig, rng: np.random.Generator):
        self.cfg, self.rng, self.ids = cfg, rng, _Ids()
        self.sub_prefix: tuple[int, int, list[int]] | None = None  # system, tools, shared block ids

    def _tok(self, d: LogNormal, lo: int = 1) -> int:
        return max(lo, round(d.draw(self.rng)))

    def _secs(self, d: LogNormal) -> float:
        return round(min(d.draw(self.rng), self.cfg.max_gap), 3)

    def _api(self, n_in: int, n_out: int) -> float:
        c = self.cfg
        base = c.api_base + n_out * c.api_per_out + n_in * c.api_per_in
        return round(base * math.exp(c.api_noise * self.rng.standard_normal()), 3)

    def _stop(self, side_session: bool) -> str:
        u, c = self.rng.random(), self.cfg
        if side_session:
            return (
                "" if u < c.side_quiet_share else "end_turn" if u < c.side_quiet_share + 0.06 else "tool_use"
            )
        return (
            "end_turn" if u < c.end_turn_share else "" if u < c.end_turn_share + c.quiet_share else "tool_use"
        )

    def _gap(self, stop: str, sub: bool) -> float:
        c = self.cfg
        if sub:
            return self._secs(c.sub_gap)
        return self._secs(
            c.gap_tool if stop == "tool_use" else c.gap_user if stop == "end_turn" else c.gap_quiet
        )

    def _request(
        self, t: float, n_in: int, hash_ids: list[int], kind: str, stop: str, gap: float, after: str
    ) -> Request:
        out = self._tok(self.cfg.side_output if kind == "s" else self.cfg.output)
        return Request(
            t=round(t, 3),
            input_tokens=n_in,
            output_tokens=out,
            hash_ids=hash_ids,
            think_time=gap,
            model=self.cfg.model,
            kind=kind,
            stop=stop,
            api_time=self._api(n_in, out),
            input_types=["tool_result"] if after == "tool_use" else ["text"],
            output_types=["text", "tool_use"] if stop == "tool_use" else ["text"],
        )

    def root(self, sid: str) -> Session:
        """The main agent: its turns, compactions, side calls and sub-agent bursts."""
        c, rng = self.cfg, self.rng
        system, tools = self._tok(c.system_tokens), self._tok(c.tool_tokens)
        prefix_tokens = system + tools
        prefix = self.ids.new(prefix_tokens // c.block_size)
        side_session = rng.random() < c.side_session_share
        turns = min(c.max_turns, self._tok(c.side_turns if side_session else c.turns, lo=2))
        if rng.random() < c.resumed_share:
            n_in = max(prefix_tokens + 1, self._tok(c.resumed_input))
        else:
            n_in = prefix_tokens + self._tok(c.first_user)
        window = c.compact_at.draw(rng) if rng.random() < c.compacting_share else c.context_cap
        if n_in >= window:
            window = c.context_cap  # a resumed context this large implies a large window
        s = Session(id=sid, system_tokens=system, tool_tokens=tools)
        chain, keep, t, gap, after = prefix, len(prefix), 0.0, 0.0, ""
        for k in range(turns):
            hash_ids, chain = _blocks(chain, keep, n_in, self.ids, c.block_size)
            kind = "s" if side_session or rng.random() < c.side_call_share else "n"
            stop = "end_turn" if k == turns - 1 else self._stop(side_session)
            r = self._request(t, n_in, hash_ids, kind, stop, gap, after)
            s.requests.append(r)
            done = t + r.api_time
            if kind == "n" and stop == "tool_use" and k < turns - 1 and rng.random() < c.burst_rate:
                done = self._burst(s, done + self._secs(c.sub_gap))
            gap, after = self._gap(stop, sub=False), stop
            t = done + gap
            # the next turn's input: compaction restarts after the prefix; else it grows
            if n_in >= window:
                n_in, keep, after = prefix_tokens + self._tok(c.compacted), len(prefix), "compaction"
                continue
            n_in, keep = n_in + self._tok(c.growth), len(chain)
            u = rng.random()
            if u < c.break_prefix:
                keep = len(prefix)
            elif u < c.break_prefix + c.break_partial:
                keep = int(rng.integers(len(prefix), len(chain) + 1))
        return s

    def _burst(self, parent: Session, at: float) -> float:
        """Spawn 1-3 sub-agents at one offset; returns when the last of them finishes."""
        c, rng = self.cfg, self.rng
        p = np.asarray(c.burst_sizes, dtype=np.float64)
        n = 1 + int(rng.choice(len(p), p=p / p.sum()))
        end = at
        for _ in range(n):
            sub = self.subagent(f"{parent.id}/agent_{len(parent.subagents) + 1:03d}", round(at, 3))
            parent.subagents.append(sub)
            end = max(end, sub.t + (sub.duration or 0.0))
        parent.subagents.sort(key=lambda a: (a.t, a.t + (a.duration or 0.0)))  # the model's order
        return end

    def subagent(self, sid: str, at: float) -> Session:
        """A sub-agent: its own prefix (shared by the trace's sub-agents), growing context, tool gaps."""
        c = self.cfg
        if self.sub_prefix is None:
            system, tools = self._tok(c.sub_system_tokens), self._tok(c.sub_tool_tokens)
            self.sub_prefix = (system, tools, self.ids.new((system + tools) // c.block_size))
        system, tools, prefix = self.sub_prefix
        s = Session(
            id=sid, t=at, agent_type="Explore", status="completed", system_tokens=system, tool_tokens=tools
        )
        n_in, chain, t, gap, after = system + tools + self._tok(c.sub_first_user), prefix, 0.0, 0.0, ""
        turns = min(c.max_turns, self._tok(c.sub_turns, lo=2))
        for k in range(turns):
            hash_ids, chain = _blocks(chain, len(chain), n_in, self.ids, c.block_size)
            stop = "end_turn" if k == turns - 1 else "tool_use"
            r = self._request(t, n_in, hash_ids, "n", stop, gap, after)
            s.requests.append(r)
            gap, after = self._gap(stop, sub=True), stop
            t = round(t + r.api_time + gap, 3)
            n_in = min(n_in + self._tok(c.sub_growth), c.context_cap)
        last = s.requests[-1]
        s.duration = round(last.t + (last.api_time or 0.0), 3)
        s.tool_use_count = sum(r.stop == "tool_use" for r in s.requests)
        return s


def synth_session(index: int, seed: int = 0, config: SynthConfig | None = None) -> Trace:
    """Session `index` of the run seeded `seed`: one trace, independent of the other sessions."""
    rng = np.random.default_rng([seed, index])
    cfg = config or SynthConfig()
    tid = f"synth-{seed}-{index:04d}"
    root = _Gen(cfg, rng).root(tid)
    return Trace(id=tid, block_size=cfg.block_size, session=root, format="synth")


def synthesize(sessions: int, seed: int = 0, config: SynthConfig | None = None) -> list[Trace]:
    """`sessions` synthetic traces (sessions 0..n-1 of `seed`)."""
    return [synth_session(i, seed, config) for i in range(sessions)]


def write_traces(traces: list[Trace], out: str | Path, gz: bool = False) -> list[Path]:
    """Save each trace as `<out>/<trace id>.json[.gz]` in AgentX format; returns the paths."""
    from agentkv.errors import UserError
    from agentkv.trace.formats.agentx import write_agentx

    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{folder}: cannot create output directory: {e.strerror or e}") from None
    suffix = ".json.gz" if gz else ".json"
    return [write_agentx(tr, folder / f"{tr.id}{suffix}") for tr in traces]
