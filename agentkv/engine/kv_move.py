"""What moving a prompt's KV between two engines costs (disaggregated prefill/decode): the bytes each
link carries and the copy size, from the receiving engine's model, layout and tensor parallelism.
One home for `simulate --disagg` and `serve --disagg`, so both price a transfer the same way."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from agentkv.engine.models.groups import GroupKind, LayerGroup
from agentkv.errors import UserError
from agentkv.kv.transfer import LinkModel

if TYPE_CHECKING:
    from agentkv.engine.engine import Engine
    from agentkv.engine.models.shape import ModelShape


def window_tail_blocks(window: int, block_size: int) -> int:
    """Blocks of a sliding-window group vLLM's NIXL connector sends (`get_exchange_clipped_blocks`,
    `blocks_per_sw`): the last cdiv(window, block_size) + 1, one more for a window that does not
    start on a block boundary."""
    return -(-window // block_size) + 1


def sent_tokens(g: LayerGroup, start: int, end: int, block_size: int) -> range:
    """Prompt positions whose KV group `g` sends when tokens [start, end) arrive and the receiver
    caches [0, start) (whole blocks) already: all of them (full attention, MLA), the window's tail
    blocks (sliding window, clipped as vLLM's connector does), the current chunk's blocks (chunked
    local: the receiver pads passed chunks with vLLM's null block), none for a state group."""
    if g.is_state or end <= start:
        return range(0)
    if g.kind is GroupKind.SLIDING:
        lo = (-(-end // block_size) - window_tail_blocks(g.window, block_size)) * block_size
    elif g.kind is GroupKind.CHUNKED:
        lo = end // g.window * g.window // block_size * block_size
    else:
        lo = 0
    return range(max(start, lo), end)


def group_transfer_bytes(g: LayerGroup, start: int, end: int, block_size: int, dtype: str, tp: int) -> float:
    """One receiving rank's bytes of group `g` for arrived tokens [start, end): the entries of
    `sent_tokens` (one per `compress` tokens) in every layer, or one state (state groups)."""
    if end <= start:
        return 0.0
    if g.is_state:
        return g.state_bytes_per_seq(tp)
    sent = sent_tokens(g, start, end, block_size)
    entries = sent.stop // g.compress - sent.start // g.compress
    return entries * g.entry_bytes(dtype, tp) * g.num_layers


def kv_transfer_bytes(shape: ModelShape, start: int, end: int, block_size: int, dtype: str, tp: int) -> float:
    """One receiving rank's bytes to move prompt tokens [start, end) of KV (the receiver caches the
    first `start`): each layer group by its own rule (`group_transfer_bytes`). A dense model's is
    (end - start) x its bytes per token, as before window groups were clipped."""
    return sum(group_transfer_bytes(g, start, end, block_size, dtype, tp) for g in shape.groups)


def kv_transfer_seconds(dst: Engine, start: int, end: int, tp_src: int, link: LinkModel) -> tuple[float, int]:
    """(seconds, bytes moved in all) to send prompt tokens [start, end) of KV to `dst`, which caches
    the first `start`: each of its ranks receives its shard (`kv_transfer_bytes`) in copies of one
    layer's block, and the narrower side's TP bounds the links in use at once (a TP 8 prefill
    feeding a TP 4 decode uses 4 links)."""
    cost, tp_dst, bs = dst.cost, dst.config.tensor_parallel_size, dst.config.block_size
    rank = kv_transfer_bytes(cost.model, start, end, bs, cost.kv_dtype, cost.tp)
    if rank <= 0:
        return 0.0, 0
    per_link = rank * tp_dst / min(tp_src, tp_dst)
    chunk = max(1, int(bs * cost.kv_bytes_per_token / dst.model_shape.layers))
    return link.seconds(int(per_link), chunk), int(rank * tp_dst)


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
