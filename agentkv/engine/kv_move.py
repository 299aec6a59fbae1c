"""What moving a prompt's KV between two engines costs (disaggregated prefill/decode): the bytes each
link carries and the copy size, from the receiving engine's model, layout and tensor parallelism.
One home for `simulate --disagg` and `serve --disagg`, so both price a transfer the same way."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from agentkv.errors import UserError
from agentkv.kv.transfer import LinkModel

if TYPE_CHECKING:
    from agentkv.engine.engine import Engine


def kv_transfer_seconds(dst: Engine, tokens: int, tp_src: int, link: LinkModel) -> tuple[float, int]:
    """(seconds, bytes moved in all) to send `tokens` tokens of prompt KV to `dst`: each of its ranks
    receives its shard in copies of one layer's block, and the narrower side's TP bounds the links in
    use at once (a TP 8 prefill feeding a TP 4 decode uses 4 links)."""
    if tokens <= 0:
        return 0.0, 0
    tp_dst = dst.config.tensor_parallel_size
    rank_bpt = dst.cost.kv_bytes_per_token  # one receiving rank's bytes per token, all layers
    per_link = tokens * rank_bpt * tp_dst / min(tp_src, tp_dst)
    chunk = max(1, int(dst.config.block_size * rank_bpt / dst.model_shape.layers))
    return link.seconds(int(per_link), chunk), int(tokens * rank_bpt * tp_dst)


XPYD = re.compile(r"\s*(\d+)\s*p\s*(\d+)\s*d\s*", re.IGNORECASE)


def parse_disagg(spec: str | None, flag: str = "--disagg") -> tuple[int, int]:
    """`prefill=N,decode=M` or `NpMd` (vLLM's and llm-d's xPyD) -> (N, M); None -> (0, 0) (aggregated)."""
    if spec is None:
        return 0, 0
    want = f"{flag}: expected prefill=N,decode=M or NpMd (e.g. 2p6d) with N, M >= 1, got {spec!r}"
    m = XPYD.fullmatch(spec)
    out: dict[str, int] = {"prefill": int(m[1]), "decode": int(m[2])} if m else {}
    for part in () if m else (s.strip() for s in spec.split(",") if s.strip()):
        key, sep, val = part.partition("=")
        if not sep or key.strip() not in ("prefill", "decode") or not val.strip().isdigit():
            raise UserError(want)
        out[key.strip()] = int(val)
    if set(out) != {"prefill", "decode"} or min(out.values()) < 1:
        raise UserError(want)
    return out["prefill"], out["decode"]
