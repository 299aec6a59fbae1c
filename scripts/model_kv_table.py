"""Print the KV tables of docs/simulate.md: bytes per token by model and layer group, and how many tokens
of KV fit on H200s at 0.9 memory utilisation after the checkpoint's weights (NVFP4 KV on B200s).

    .venv/bin/python scripts/model_kv_table.py            # both tables (Markdown)
    .venv/bin/python scripts/model_kv_table.py --groups   # the per-group table only

TP is the smallest power of two (dividing the attention heads) that leaves room for 128K tokens of bf16
KV at the engine's full-context count. Bytes are the whole model's (TP 1); tokens are per replica (TP
GPUs, each holding its share of every token): what the engine's pool holds.
"""

from __future__ import annotations

import argparse

from agentkv.engine.cost import CostModel
from agentkv.engine.models import builtin_models
from agentkv.errors import UserError

GIB = 2**30
MIN_TOKENS = 128 * 1024


def pick_tp(model, gpu: str = "h200") -> CostModel | None:
    """The cost model at the smallest TP with room for MIN_TOKENS of bf16 KV (None when none has)."""
    for tp in (1, 2, 4, 8, 16):
        if model.heads % tp:
            continue
        try:
            cm = CostModel(gpu, model, tp=tp)
            if cm.kv_capacity_bytes() / cm.kv_bytes_per_token >= MIN_TOKENS:
                return cm
        except UserError:
            continue
    return None


def _tokens(cm: CostModel, per_token: float) -> str:
    return f"{cm.kv_capacity_bytes() / per_token / 1e3:,.0f}K"


def _nvfp4(m, tp: int) -> tuple[str, str]:
    """NVFP4 KV bytes a token (TP 1) and the full-context tokens on B200s at the same TP; '-' where
    refused (MLA latents). The H200 has no FP4: its engines refuse --kv-cache-dtype nvfp4."""
    try:
        c4 = CostModel("b200", m, tp=tp, kv_dtype="nvfp4")
    except UserError:
        return "-", "-"
    return f"{m.kv_bytes_per_token('nvfp4'):,.2f}", _tokens(c4, m.kv_bytes_per_token("nvfp4", tp))


def capacity_table() -> list[str]:
    """One row per built-in model: bytes per token, TP, weights and KV per GPU, tokens that fit."""
    rows = [
        "| model | family | KV B/token bf16 | fp8 | nvfp4 | long-context B/token fp8 | state/seq | weights | TP "
        "| weights/GPU | KV/GPU | tokens bf16 | tokens fp8 | tokens fp8, long context | tokens nvfp4, B200 |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in builtin_models():
        cm = pick_tp(m)
        if cm is None:
            rows.append(f"| {m.name} | {m.family} | does not fit on 16 H200s |")
            continue
        tp = cm.tp
        bf, f8 = m.kv_bytes_per_token("bf16", tp), m.kv_bytes_per_token("fp8", tp)
        long8 = m.long_context_bytes_per_token("fp8", tp)
        c8 = CostModel("h200", m, tp=tp, kv_dtype="fp8")
        dtype = cm.weight_dtype + (f" (experts {m.expert_dtype})" if m.expert_dtype else "")
        state = f"{m.state_bytes_per_seq() / 2**20:,.1f} MiB" if m.state_bytes_per_seq() else "-"
        long_tokens = _tokens(c8, long8) if long8 < f8 else "="
        fp4, fp4_tokens = _nvfp4(m, tp)
        rows.append(
            f"| {m.name} | {m.family} | {m.kv_bytes_per_token('bf16'):,.0f} | {m.kv_bytes_per_token('fp8'):,.2f} "
            f"| {fp4} | {m.long_context_bytes_per_token('fp8'):,.2f} | {state} | {dtype} | {tp} "
            f"| {cm.weights_bytes / GIB:,.1f} GiB | {cm.kv_capacity_bytes() / GIB:,.1f} GiB "
            f"| {_tokens(cm, bf)} | {_tokens(c8, f8)} | {long_tokens} | {fp4_tokens} |"
        )
    return rows


def group_table() -> list[str]:
    """One row per layer group of every model with more than one group: kind, layers, bytes."""
    rows = [
        "| model | group | kind | layers | B/token/layer bf16 | fp8 | B/token bf16 (all its layers) "
        "| state/seq (all layers) | prefix-cache rule |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for m in builtin_models():
        if len(m.groups) == 1:
            continue
        for g in m.groups:
            state = f"{g.state_bytes_per_seq() / 2**20:,.2f} MiB" if g.is_state else "-"
            rows.append(
                f"| {m.name} | {g.name} | {g.kind} | {g.num_layers} | {g.token_bytes('bf16'):,.4g} "
                f"| {g.token_bytes('fp8'):,.4g} | {g.bytes_per_token('bf16'):,.2f} | {state} | {g.prefix_rule} |"
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", action="store_true", help="print the per-group table only")
    args = p.parse_args()
    if not args.groups:
        print("\n".join(capacity_table()))
        print()
    print("\n".join(group_table()))


if __name__ == "__main__":
    main()
