"""What the engine's steps return and count: per-request outputs, step results, decode bursts, stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentkv.engine.request import EngineRequest


@dataclass(slots=True)
class RequestOutput:
    """What one step did for one request: tokens produced and, at the end, why it finished."""

    request: EngineRequest
    new_tokens: int
    finished: bool


@dataclass(slots=True)
class StepResult:
    """One step: its start and end, each request's output, and the batch's make-up."""

    start: float
    end: float
    outputs: list[RequestOutput]
    num_prefill_tokens: int
    num_decode: int
    preempted: int


@dataclass(slots=True)
class DecodeBurst:
    """Consecutive pure-decode steps planned from `start`: step i ends at `ends[i]`."""

    start: float
    ends: list[float]
    requests: list[EngineRequest]


@dataclass(slots=True)
class EngineStats:
    """Counters in vLLM's terms (tokens), plus agentkv's per-tier hits and busy time."""

    steps: int = 0
    busy_s: float = 0.0
    promote_s: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    lower_tier_hits: dict[str, int] = field(default_factory=dict)
