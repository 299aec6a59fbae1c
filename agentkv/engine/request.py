"""A request inside the engine: its prompt as block hashes, progress, and timing of every phase."""

from __future__ import annotations

from enum import IntEnum

from agentkv.kv.interface import ComputedBlocks


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    ABORTED = 3


class EngineRequest:
    """Progress of one request, as vLLM's `Request`: `num_tokens = prompt_len + num_output`.

    `block_hashes` are the prompt's full-block hashes (the prefix-cache keys); it is the block
    pool's `KVRequest`. Times are on the engine's clock; `token_times` holds each output token's
    time when `record_tokens` is set.
    """

    __slots__ = (
        "request_id",
        "external_tokens",
        "prompt_len",
        "max_tokens",
        "block_hashes",
        "token_ids",
        "session_id",
        "arrival",
        "status",
        "num_computed",
        "num_output",
        "num_cached_tokens",
        "num_lower_tokens",
        "lower_tier_tokens",
        "num_preemptions",
        "first_scheduled",
        "first_token",
        "finished_at",
        "last_token",
        "itl_max",
        "token_times",
        "finish_reason",
        "promote_s",
        "user_data",
        "hash_array",
        "hint",
        "computed",
        "block_ids",
        "measured",
    )

    def __init__(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        block_hashes: list[int],
        arrival: float,
        *,
        session_id: object = None,
        token_ids=None,
        record_tokens: bool = False,
        user_data: object = None,
    ):
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.block_hashes = block_hashes
        self.token_ids = token_ids
        self.session_id = session_id
        self.arrival = arrival
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_output = 0
        self.num_cached_tokens = 0  # prompt tokens found on the GPU at first scheduling
        self.num_lower_tokens = 0  # prompt tokens promoted from CPU/DISK at first scheduling
        self.lower_tier_tokens: dict[str, int] = {}
        self.num_preemptions = 0
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.finished_at: float | None = None
        self.last_token: float | None = None
        self.itl_max = 0.0
        self.token_times: list[float] | None = [] if record_tokens else None
        self.finish_reason: str | None = None
        self.promote_s = 0.0
        self.user_data = user_data
        self.measured = True  # False: a warm-up request, its token gaps kept out of the ITL sink
        self.hash_array = None  # block_hashes as uint64, when the caller has them (fast lookups)
        self.hint = None  # block ids of the session's previous turn on this engine (lookup hint)
        self.computed: ComputedBlocks | None = None  # the last prefix lookup (None: not looked up yet)
        self.external_tokens = 0  # prompt tokens whose KV arrived from another engine (disaggregated decode)
        self.block_ids: list[int] | None = None  # [] asks the engine to keep its block ids at the finish

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output

    @property
    def is_prefill(self) -> bool:
        """Still computing prompt (or recomputing after preemption) rather than one decode token."""
        return self.num_tokens - self.num_computed > 1 or self.num_computed < self.prompt_len

    def __repr__(self) -> str:
        return (
            f"EngineRequest({self.request_id!r}, prompt={self.prompt_len}, out={self.num_output}/"
            f"{self.max_tokens}, computed={self.num_computed}, {self.status.name})"
        )
