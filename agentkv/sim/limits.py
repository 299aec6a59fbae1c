"""What a simulated request must fit: the engines' max_model_len (raised to the traces' longest
request when none was given) and one engine's KV cache (a longer request could never be scheduled)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from agentkv.engine.config import EngineConfig
from agentkv.engine.hardware import get_model
from agentkv.trace.model import Trace


def _max_len_for(traces: Sequence[Trace]) -> int:
    return max(
        (r.input_tokens + max(1, r.output_tokens) for t in traces for s in t.sessions() for r in s.requests),
        default=1,
    )


def engine_config(traces: Sequence[Trace], ecfg: EngineConfig, notes: list[str]) -> EngineConfig:
    """`ecfg`, its max_model_len raised (with a note) when no --max-model-len was given and the
    model's own limit is too short for the traces."""
    if ecfg.max_model_len is not None:
        return ecfg
    limit = get_model(ecfg.model).max_position  # what an Engine defaults to (no engine built: the
    # pools of a disaggregated run may need a TP the base config does not have)
    need = _max_len_for(traces)
    if need <= limit:
        return ecfg
    notes.append(
        f"max_model_len raised from the model's {limit} to {need} "
        "so that every trace request fits (pass --max-model-len to cap it)"
    )
    return replace(ecfg, max_model_len=need)


def reject_reason(input_tokens: int, out_tokens: int, max_len: int, kv_len: int, notes: list[str]) -> str:
    """Why a request no engine can take fails: empty, over max_model_len, or more KV than one engine
    holds (vLLM would not start with such a max_model_len; said once in `notes`)."""
    if input_tokens < 1:
        return "empty_prompt"
    if input_tokens + out_tokens > max_len:
        return "context_overflow"
    if not any(n.startswith("kv_cache_too_small") for n in notes):
        notes.append(
            f"kv_cache_too_small: a request needs more KV than one engine holds ({kv_len:,} tokens); "
            "such requests fail (lower --max-model-len, or give more memory or TP)"
        )
    return "kv_cache_too_small"
