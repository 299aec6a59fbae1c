"""The grid `cache analyze` runs: capacities x block sizes x eviction policies, parsed from its flags."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.engine.config import KV_CACHE_DTYPES as KV_DTYPES  # the engine's one table
from agentkv.errors import UserError
from agentkv.kv.eviction import POLICIES
from agentkv.units import parse_capacity


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


def _block_sizes(text: str) -> list[int]:
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


def _policies(text: str | None) -> list[str]:
    """`--policy` as known eviction policies; every policy when the flag is not given."""
    pols = _items(text, "--policy") if text is not None else list(POLICIES)
    for p in pols:
        if p not in POLICIES:
            raise UserError(f"--policy: unknown policy {p!r} (choose from {', '.join(POLICIES)})")
    return pols


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
    sizes = _block_sizes(block_size)
    pols = _policies(policy)
    if kv_cache_dtype not in KV_DTYPES:
        raise UserError(f"--kv-cache-dtype: {kv_cache_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    shape = get_model(model)
    dtype = KV_DTYPES[kv_cache_dtype]
    shape.check_kv_dtype(dtype)
    per_token = int(shape.kv_bytes_per_token(dtype))
    cpu_spec = (cpu, parse_capacity(cpu, "--cpu")) if cpu else None
    for label, nbytes in caps:
        for bs in sizes:
            if nbytes < bs * per_token:
                raise UserError(
                    f"--capacity: {label} holds no block of {bs} tokens of {shape.name} "
                    f"{dtype} KV ({bs * per_token:,} bytes a block)"
                )
    if cpu_spec is not None and cpu_spec[1] < max(sizes) * per_token:
        raise UserError(
            f"--cpu: {cpu} holds no block of {max(sizes)} tokens ({max(sizes) * per_token:,} bytes)"
        )
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
    )
