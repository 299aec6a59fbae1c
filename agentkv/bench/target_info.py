"""What a target says about its model before a run: vLLM's `max_model_len` in GET /v1/models.

Read once, synchronously, before the traces are selected, so sessions over the target's window
are dropped or trimmed (--over-context) instead of failing as context_overflow mid-run.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from agentkv.bench.client import normalize_target

MODELS_TIMEOUT = 10.0


def max_model_len(target: str, headers: dict[str, str], model: str | None) -> tuple[int | None, str]:
    """(max_model_len of `model`, else of the first model, as /v1/models reports it; that model's id).

    (None, "") when the target does not answer or does not report one (an unreachable target is
    reported by the run itself, with its own error).
    """
    req = urllib.request.Request(normalize_target(target) + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=MODELS_TIMEOUT) as resp:  # noqa: S310 - the user's target
            data = json.loads(resp.read(1 << 20))
    except (OSError, ValueError, urllib.error.URLError):
        return None, ""
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list):
        return None, ""
    rows = [m for m in models if isinstance(m, dict)]
    pick = next((m for m in rows if m.get("id") == model), None) if model else (rows[0] if rows else None)
    n = pick.get("max_model_len") if pick else None
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        return None, ""
    return n, str(pick.get("id", ""))
