"""What to try when requests fail: a hint for each common way a target refuses the bench's requests."""

from __future__ import annotations

from agentkv.metrics.validity import ErrorGroup

_TEMPLATE = ("chat template", "chat_template")
_OVERFLOW = (
    "prompts exceed the target's context window: start it with a larger max model length "
    "(vLLM --max-model-len) or replay shorter traces"
)


def hint(g: ErrorGroup, api: str, prompt_mode: str) -> str:
    """A hint for one error group of a run sent with `api` and `prompt_mode`, or "" when none fits."""
    low = g.message.lower()
    if g.error == "not_streamed":
        return (
            "the server answered one JSON document instead of SSE events: it ignores `stream: true` "
            "(bench needs streamed answers; check the server or a proxy in between)"
        )
    if g.error == "context_overflow":
        return _OVERFLOW
    if any(t in low for t in _TEMPLATE):
        return (
            "the model has no chat template: try --api completions, or give the server one "
            "(vLLM --chat-template)"
        )
    if g.status == 404 and api == "completions":
        return "the server has no /v1/completions (a chat-only server?): try --api chat"
    if g.status == 404:
        return "the server has no /v1/chat/completions: try --api completions"
    if g.status in (400, 422) and prompt_mode == "token-ids":
        return (
            "the server may refuse prompts given as token ids: try --prompt-mode text "
            "(with --tokenizer PATH for exact lengths)"
        )
    if g.error == "connect_error":
        return "the target stopped accepting connections during the run: is it still up?"
    if g.error == "incomplete":
        return "streams ended without [DONE]: the server or a proxy cut them short"
    return ""


def add_hints(groups: list[ErrorGroup], api: str, prompt_mode: str) -> None:
    """Fill each group's hint in place."""
    for g in groups:
        g.hint = hint(g, api, prompt_mode)
