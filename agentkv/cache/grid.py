"""The grid `cache analyze` runs: capacities x block sizes x eviction policies, parsed from its flags."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.engine.config import KV_CACHE_DTYPES as KV_DTYPES  # the engine's one table
from agentkv.errors import UserError
from agentkv.kv.eviction import ENGINE_POLICIES, POLICIES
from agentkv.kv.groups import GroupSpec
from agentkv.units import parse_capacity

# the hybrid pool's policies: the engine's (Belady needs one order over every group's blocks);
# with no --policy, LRU alone (vLLM's one free queue): each hybrid cell runs the engine's scheduler
HYBRID_POLICIES = ENGINE_POLICIES
HYBRID_DEFAULT = ("lru",)


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """A hybrid model's KV groups at one block size (the engine's `kv_layout`) and vLLM's page."""

    specs: tuple[GroupSpec, ...]
    page_bytes: int
    page_layers: int  # layers of the largest group in one page (`group_size`): one copy below is a layer's

    @property
    def block_bytes(self) -> int:
        """One block in every group: the least a pool must hold."""
        return sum(s.block_bytes for s in self.specs)


@dataclass(frozen=True, slots=True)
class Grid:
    """The validated settings of one analysis."""

    capacities: tuple[tuple[str, int], ...]  # (label, bytes)
    block_sizes: tuple[int, ...]
    policies: tuple[str, ...]
    model: str
    kv_dtype: str  # bf16 | fp16 | fp8 | nvfp4
    kv_bytes_per_token: int
    num_layers: int
    cpu: tuple[str, int] | None = None
    concurrency: int | None = None
    layouts: tuple[tuple[int, GroupLayout], ...] = ()  # per block size, for a hybrid model

    def layout(self, block_size: int) -> GroupLayout | None:
        """The hybrid pool's groups at `block_size`; None for a single-table model."""
        return dict(self.layouts).get(block_size)


def _items(text: str, flag: str) -> list[str]:
    items = [x.strip() for x in str(text).split(",")]
    if not all(items):
        raise UserError(f"{flag}: empty item in {text!r}; give a comma-separated list")
    return list(dict.fromkeys(items))


def _capacities(text: str) -> list[tuple[str, int]]:
    """`--capacity` as (label, bytes) pairs, each more than 0 bytes."""
    caps = []
    for c in _items(text, "--capacity"):
        b = parse_capacity(c, "--capacity")
        if b <= 0:
            raise UserError(f"--capacity: {c!r} must be more than 0 bytes")
        caps.append((c, b))
    return caps


def parse_block_sizes(text: str) -> list[int]:
    """`--block-size` as positive whole numbers of tokens."""
    sizes = []
    for s in _items(text, "--block-size"):
        try:
            n = int(s)
        except ValueError:
            raise UserError(f"--block-size: {s!r} is not a whole number of tokens") from None
        if n <= 0:
            raise UserError(f"--block-size: must be a positive number of tokens, got {n}")
        sizes.append(n)
    return sizes


def _vllm_sizes(shape: object, sizes: list[int], dtype: str) -> list[int]:
    """Each size as vLLM runs the model with it (DeepSeek-V4's 256; a hybrid model's aligned page),
    the engine's rule (`vllm_block_size`), duplicates dropped."""
    from agentkv.engine.block_size import vllm_block_size

    out: list[int] = []
    for bs in sizes:
        got = vllm_block_size(shape, bs, kv_dtype=dtype).size
        if got not in out:
            out.append(got)
    return out


def _policies(text: str | None, hybrid: str | None = None) -> list[str]:
    """`--policy` as known eviction policies; every policy when the flag is not given (for a hybrid
    model, described by `hybrid`, LRU: vLLM's own)."""
    pols = _items(text, "--policy") if text is not None else list(HYBRID_DEFAULT if hybrid else POLICIES)
    for p in pols:
        if p not in POLICIES:
            raise UserError(f"--policy: unknown policy {p!r} (choose from {', '.join(POLICIES)})")
        if hybrid and p not in HYBRID_POLICIES:
            raise UserError(
                f"--policy {p}: {hybrid}; Belady's farthest-next-use order is not defined across "
                "them: whether a window or state block is read again depends on where the other "
                "groups' hit ends, not on the accesses alone (and blocks of two groups may differ in "
                f"bytes); use {', '.join(HYBRID_POLICIES)} (the ceiling is the unbounded cache)"
            )
    return pols


def _layouts(shape, sizes: list[int], dtype: str) -> tuple[tuple[int, GroupLayout], ...]:
    """The engine's groups and page at each block size, for a model with hybrid KV groups."""
    from agentkv.engine.models.layout import group_size, is_hybrid, kv_layout, page_bytes

    if not is_hybrid(shape):
        return ()
    out = []
    for bs in sizes:
        specs = kv_layout(shape, bs, dtype)
        for s in specs:
            if s.rule == "chunked" and s.window % bs:
                raise UserError(
                    f"--block-size: {bs} does not divide {shape.name}'s {s.window}-token attention "
                    "chunk (vLLM needs whole blocks per chunk)"
                )
        out.append((bs, GroupLayout(specs, page_bytes(shape, bs, dtype), group_size(shape.groups))))
    return tuple(out)


def make_grid(
    capacity: str = "100GB",
    block_size: str = "16",
    policy: str | None = None,
    model: str = "llama3-8b",
    kv_cache_dtype: str = "auto",
    cpu: str | None = None,
    concurrency: int | None = None,
) -> Grid:
    """Parse the command's flags (comma lists) into a `Grid`; UserError naming the flag on bad input."""
    from agentkv.engine.hardware import get_model

    caps = _capacities(capacity)
    sizes = parse_block_sizes(block_size)
    if kv_cache_dtype not in KV_DTYPES:
        raise UserError(f"--kv-cache-dtype: {kv_cache_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    shape = get_model(model)
    dtype = KV_DTYPES[kv_cache_dtype]
    shape.check_kv_dtype(dtype)
    sizes = _vllm_sizes(shape, sizes, dtype)
    layouts = _layouts(shape, sizes, dtype)
    hybrid = None
    if layouts:
        hybrid = f"{shape.name} has hybrid KV groups ({', '.join(s.name for s in layouts[0][1].specs)})"
    pols = _policies(policy, hybrid)
    per_token = int(shape.kv_bytes_per_token(dtype))
    cpu_spec = (cpu, parse_capacity(cpu, "--cpu")) if cpu else None
    for label, nbytes in caps:
        for bs in sizes:
            need = dict(layouts)[bs].block_bytes if layouts else bs * per_token
            if nbytes < need:
                raise UserError(
                    f"--capacity: {label} holds no block of {bs} tokens of {shape.name} "
                    f"{dtype} KV ({need:,} bytes a block{' in every group' if layouts else ''})"
                )
    # a hybrid tier keeps each group's blocks apart: it must hold the largest of them
    cpu_block = max(s.block_bytes for _, x in layouts for s in x.specs) if layouts else max(sizes) * per_token
    if cpu_spec is not None and cpu_spec[1] < cpu_block:
        raise UserError(f"--cpu: {cpu} holds no block of {max(sizes)} tokens ({cpu_block:,} bytes)")
    if concurrency is not None and concurrency < 1:
        raise UserError(f"--concurrency: must be at least 1, got {concurrency}")
    return Grid(
        tuple(caps),
        tuple(sizes),
        tuple(pols),
        shape.name,
        dtype,
        per_token,
        shape.layers,
        cpu_spec,
        concurrency,
        layouts,
    )
