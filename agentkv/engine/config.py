"""Engine settings under vLLM's flag names, validated once so every later part can trust them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from agentkv.errors import UserError

KV_DTYPES = ("auto", "bf16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)


@dataclass(slots=True)
class EngineConfig:
    """One engine: a GPU, a model and vLLM's scheduler/cache knobs (`--block-size` etc.)."""

    gpu: str = "h200"
    model: str = "llama3-8b"
    tensor_parallel_size: int = 1
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own limit
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_offloading_size: float = 0.0  # GiB of CPU memory for KV offload (vLLM: --kv-offloading-size)
    kv_disk_size: float = 0.0  # GiB of SSD below the CPU tier (agentkv's own)
    num_gpu_blocks_override: int | None = None
    eviction_policy: str = "lru"
    hash_algo: str = "xxhash"  # --prefix-caching-hash-algo: xxhash | sha256 | sha256_cbor
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(flag: str, msg: str) -> UserError:
            return UserError(f"--{flag.replace('_', '-')}: {msg}")

        if self.block_size not in BLOCK_SIZES:
            raise bad("block_size", f"{self.block_size} is not one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise bad("kv_cache_dtype", f"'{self.kv_cache_dtype}' is not one of {', '.join(KV_DTYPES)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "must be >= 1")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens < self.block_size:
            raise bad("max_num_batched_tokens", f"must be >= the block size ({self.block_size})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", "must be >= 1")
        for name, flag in (("kv_offloading_size", "kv_offloading_size"), ("kv_disk_size", "disk_offload")):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise bad(flag, f"must be a finite size >= 0, got {v}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise bad("num_gpu_blocks_override", "must be >= 1")

    @property
    def kv_dtype(self) -> str:
        """The KV element type the cost model understands: 'bf16' or 'fp8'."""
        return "fp8" if self.kv_cache_dtype.startswith("fp8") else "bf16"
