"""The launch-floor probes: one stream decoding long from a tiny and from a moderate context.

A layer's time is ||(GPU time, launch floor)||_floor_k, and every step reads all weights, so a
layer's GPU time is never under its weight read: the floor shows most where the step is the weight
read alone, one stream at a tiny context (`FLOOR_CTX[0]`; Qwen2.5-7B on an H100 with a 60 us floor
under a 157 us read: 3.2% of the step), and less as the step's KV read grows (`FLOOR_CTX[1]`: 2.5%);
the pair gives the floor's decay, which tells the floor from its exponent. A stream of `FLOOR_OUT`
tokens averages its steps, so its inter-token time carries little of the host's jitter.
"""

from __future__ import annotations

from agentkv.calib.plan import Probe

FAMILY = "floor"
FLOOR_CTX = (16, 2048)  # the weight read alone; a KV read of ~1/8 of it (a 7B model at ~80 GB/s a stream)
FLOOR_OUT = 256


def floor_probes(max_model_len: int, kv_tokens: int | None = None) -> tuple[list[Probe], dict[str, str]]:
    """(The floor probes that fit `max_model_len` and the KV cache, label: why for those that do not)."""
    out, skipped = [], {}
    room = min(max_model_len, int(kv_tokens * 0.9)) if kv_tokens else max_model_len
    for ctx in FLOOR_CTX:
        p = Probe(FAMILY, n=1, ctx=ctx, out=FLOOR_OUT)
        need = ctx + FLOOR_OUT + 1
        if need > room:
            what = "max model length" if room == max_model_len else "KV cache (90%)"
            skipped[p.label()] = (
                f"needs {need:,} tokens ({ctx:,} context + {FLOOR_OUT} output + 1), the target's {what} holds {room:,}"
            )
        else:
            out.append(p)
    return out, skipped


def floor_first(plan: list[Probe]) -> list[Probe]:
    """The plan's floor probes, which calibrate chooses before the cheapest-first rest (as the
    decode anchors): their streams are long, so a cheapest-first cut would drop them first."""
    return [p for p in plan if p.family == FAMILY]
