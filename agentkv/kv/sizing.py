"""KV memory sizing: bytes a token's K and V take, and how many blocks fit in a capacity."""

from __future__ import annotations

DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str | int = "bf16") -> int:
    """Bytes of K and V one token occupies: 2 x layers x kv_heads x head_dim x bytes per element."""
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {dtype!r} (expected one of: {', '.join(DTYPE_BYTES)})")
        nbytes = DTYPE_BYTES[dtype.lower()]
    else:
        nbytes = int(dtype)
    for name, v in (
        ("layers", layers),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("dtype bytes", nbytes),
    ):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    return 2 * layers * kv_heads * head_dim * nbytes


def num_blocks_for(
    capacity_bytes: int, block_size: int, layers: int, kv_heads: int, head_dim: int, dtype: str | int = "bf16"
) -> int:
    """How many whole blocks of `block_size` tokens fit in `capacity_bytes` of KV memory."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return int(capacity_bytes) // (block_size * kv_bytes_per_token(layers, kv_heads, head_dim, dtype))
