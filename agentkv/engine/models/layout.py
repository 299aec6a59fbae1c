"""A model's layer groups as the KV pool's groups, after vLLM v1's hybrid allocator
(`kv_cache_utils._get_kv_cache_groups_uniform_page_size`): layers of one spec split into KV cache
groups of `group_size` layers (the fewest layers any spec has, or the most when they are within
1.25x), a spec short of a multiple padded up; one shared pool of pages.

Groups that share a prefix-cache rule (full attention and MLA at any compression ratio; one window,
DeepSeek-V4's compressor buffers among them; one chunk; states) share a block table, so they become
one `GroupSpec` whose block costs the sum of their (padded) bytes. A model whose groups all keep
every block (full attention, MLA) has no layout: the engine keeps its single-table `BlockPool`.
"""

from __future__ import annotations

import math
from collections import defaultdict

from agentkv.engine.models.groups import GroupKind, LayerGroup
from agentkv.engine.models.shape import ModelShape
from agentkv.kv.groups import GroupSpec

_RULE = {
    GroupKind.FULL: "full",
    GroupKind.MLA: "full",
    GroupKind.SLIDING: "sliding",
    GroupKind.CHUNKED: "chunked",
    GroupKind.STATE: "state",
}
_EVENT_KIND = {  # vLLM's kv_cache_spec_kind names
    "full": "full_attention",
    "sliding": "sliding_window",
    "chunked": "chunked_local_attention",
    "state": "mamba",
}


def is_hybrid(shape: ModelShape) -> bool:
    """True when the model needs per-group block tables: some group is not full attention or MLA.
    Groups that all keep every block (DeepSeek-V3.2's latent and indexer keys) share one table."""
    return any(g.kind not in (GroupKind.FULL, GroupKind.MLA) for g in shape.groups)


def group_size(groups: tuple[LayerGroup, ...]) -> int:
    """vLLM's layers per KV cache group: the smallest spec's layer count, or the largest when every
    spec is within 1.25x of the smallest (so near-equal specs are not split)."""
    counts = [g.num_layers for g in groups]
    lo, hi = min(counts), max(counts)
    return hi if hi < lo * 1.25 else lo


def padded_layers(g: LayerGroup, size: int) -> int:
    """Layers a group occupies in the pool: its KV cache groups x `size` (the last one padded)."""
    return math.ceil(g.num_layers / size) * size


def layer_block_bytes(g: LayerGroup, block_size: int, dtype: str, tp: int) -> float:
    """One layer's page for one block: `block_size` tokens of entries, or one state."""
    if g.is_state:
        return g.state_bytes_per_seq(tp) / g.num_layers
    return g.token_bytes(dtype, tp) * block_size


def attention_page(shape: ModelShape, block_size: int, dtype: str, tp: int) -> float:
    """One layer's largest attention page for a block: what vLLM pads a state's page up to, and the
    page a hybrid model's block size is raised until it holds a state (`block_size.hybrid_block`)."""
    return max((layer_block_bytes(g, block_size, dtype, tp) for g in shape.attention_groups), default=0.0)


def kv_layout(shape: ModelShape, block_size: int, dtype: str = "bf16", tp: int = 1) -> tuple[GroupSpec, ...]:
    """The pool's groups for `shape`: one per prefix-cache rule, in vLLM's order (full first)."""
    size = group_size(shape.groups)
    page = attention_page(shape, block_size, dtype, tp)
    bytes_by: dict[tuple[str, int], float] = defaultdict(float)
    names: dict[tuple[str, int], list[str]] = defaultdict(list)
    pages: dict[tuple[str, int], set[int]] = defaultdict(set)
    for g in shape.groups:
        key = ("sliding" if g.is_window_state else _RULE[g.kind], g.window)  # V4's compressors: windows
        layer = layer_block_bytes(g, block_size, dtype, tp)
        if g.is_state:  # vLLM pads a state's page up to the attention page ("Padding mamba page size")
            layer = max(layer, page)
        bytes_by[key] += layer * padded_layers(g, size)
        names[key].append(g.name)
        if g.page_tokens and g.page_tokens < block_size:
            pages[key].add(g.page_tokens)
    order = {"full": 0, "sliding": 1, "chunked": 2, "state": 3}
    keys = sorted(bytes_by, key=lambda k: (order[k[0]], k[1]))
    return tuple(
        GroupSpec(
            rule,
            math.ceil(bytes_by[(rule, w)]),
            window=w,
            name=" + ".join(names[(rule, w)]),
            event_kind=_EVENT_KIND[rule],
            page_tokens=tuple(sorted(pages[(rule, w)])),
        )
        for rule, w in keys
    )


def page_bytes(shape: ModelShape, block_size: int, dtype: str = "bf16", tp: int = 1) -> int:
    """vLLM's page, the unit `num_gpu_blocks` counts in: `group_size` layers of the largest page."""
    size = group_size(shape.groups)
    return int(size * attention_page(shape, block_size, dtype, tp))


def dense_block_bytes(shape: ModelShape, block_size: int, dtype: str = "bf16", tp: int = 1) -> float:
    """One block if every layer group kept every token (today's single-table sizing)."""
    return shape.kv_bytes_per_token(dtype, tp) * block_size
