"""Engine settings under vLLM's flag names: the flags, and their validation once, so every later
part can trust them (shared by simulate and serve)."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from agentkv.engine.block_size import vllm_block_size
from agentkv.engine.models.catalogue import model_help
from agentkv.errors import UserError
from agentkv.kv import HASH_ALGOS
from agentkv.kv.eviction import ENGINE_POLICIES

# --kv-cache-dtype (vLLM's spellings) -> the KV element type the cost model and sizing read; one table
# for simulate, serve and cache analyze
KV_CACHE_DTYPES = {
    "auto": "bf16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "nvfp4": "nvfp4",  # Blackwell and later; attention K/V only (no MLA latent)
}
KV_DTYPES = tuple(KV_CACHE_DTYPES)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
# --quantization (vLLM's name): the weight dtype the cost model reads; None keeps the checkpoint's
QUANTIZATION = {"fp8": "fp8", "mxfp4": "fp4", "nvfp4": "fp4"}


@dataclass(slots=True)
class EngineConfig:
    """One engine: a GPU, a model and vLLM's scheduler/cache knobs (`--block-size` etc.)."""

    gpu: str = "h200"
    model: str = "llama3-8b"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # DP ranks sharing one expert group (each simulated engine is one rank)
    enable_expert_parallel: bool = False
    expert_imbalance: float = 1.0  # EP: the hottest GPU's routed load over the mean (--expert-imbalance)
    quantization: str | None = None  # fp8 | mxfp4 | nvfp4 (None: the checkpoint's dtypes)
    block_size: int | None = None  # None: what vLLM picks for the model, GPU and KV dtype
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own limit
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # vLLM 0.32's --prefix-cache-retention-interval: 0 keeps a window's tail and a state only where a
    # later prompt resumes (replay boundary, junction); N > 0 also once per N-token segment
    prefix_cache_retention_interval: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_offloading_size: float = 0.0  # GiB of CPU memory for KV offload (vLLM: --kv-offloading-size)
    kv_disk_size: float = 0.0  # GiB of SSD below the CPU tier (agentkv's own)
    num_gpu_blocks_override: int | None = None
    eviction_policy: str = "lru"
    hash_algo: str = "xxhash"  # --prefix-caching-hash-algo: xxhash | sha256 | sha256_cbor
    seed: int = 0
    cost_profile: str | None = None  # --profile: cost coefficients from `agentkv calibrate` (None: bundled)
    cost_profile_name: str | None = None  # the profile's name (served model @ target), for summaries

    def __post_init__(self) -> None:
        def bad(flag: str, msg: str) -> UserError:
            return UserError(f"--{flag.replace('_', '-')}: {msg}")

        if self.kv_cache_dtype not in KV_DTYPES:
            raise bad("kv_cache_dtype", f"'{self.kv_cache_dtype}' is not one of {', '.join(KV_DTYPES)}")
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "must be >= 1")
        asked = self.block_size
        choice = vllm_block_size(self.model, asked, self.gpu, self.kv_dtype, self.tensor_parallel_size)
        if asked is not None and asked not in BLOCK_SIZES and not (choice.aligned and choice.size == asked):
            raise bad("block_size", f"{asked} is not one of {', '.join(map(str, BLOCK_SIZES))}")
        self.block_size = choice.size
        n = self.prefix_cache_retention_interval
        if n < 0 or n % self.block_size:
            raise bad(
                "prefix_cache_retention_interval",
                f"{n} must be non-negative and a multiple of the block size ({self.block_size})",
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.data_parallel_size < 1:
            raise bad("data_parallel_size", "must be >= 1")
        if not (math.isfinite(self.expert_imbalance) and self.expert_imbalance >= 1.0):
            raise bad("expert_imbalance", f"must be a finite number >= 1.0, got {self.expert_imbalance}")
        if self.quantization is not None and self.quantization not in QUANTIZATION:
            raise bad("quantization", f"'{self.quantization}' is not one of {', '.join(QUANTIZATION)}")
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
        if self.eviction_policy not in ENGINE_POLICIES:
            raise bad(
                "eviction_policy", f"'{self.eviction_policy}' is not one of {', '.join(ENGINE_POLICIES)}"
            )
        if self.hash_algo not in HASH_ALGOS:
            raise bad("prefix_caching_hash_algo", f"'{self.hash_algo}' is not one of {', '.join(HASH_ALGOS)}")

    @property
    def kv_dtype(self) -> str:
        """The KV element type the cost model understands: 'bf16', 'fp16', 'fp8' or 'nvfp4'."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def weight_dtype(self) -> str | None:
        """The linear weights' dtype for the cost model: --quantization's, or None (the checkpoint's)."""
        return QUANTIZATION[self.quantization] if self.quantization else None

    def cost_kwargs(self) -> dict:
        """CostModel's parallelism and dtype arguments for this engine."""
        return {
            "tp": self.tensor_parallel_size,
            "kv_dtype": self.kv_dtype,
            "weight_dtype": self.weight_dtype,
            "dp": self.data_parallel_size,
            "ep": self.enable_expert_parallel,
            "expert_imbalance": self.expert_imbalance,
        }

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of the flags `add_engine_args` defines (sizes parsed, then validated)."""
        from agentkv.units import parse_capacity

        gib = float(1 << 30)
        offload = args.kv_offloading_size
        if args.cpu_offload:
            offload = parse_capacity(args.cpu_offload, "--cpu-offload") / gib
        disk = parse_capacity(args.disk_offload, "--disk-offload") / gib if args.disk_offload else 0.0
        profile_name = None
        if getattr(args, "profile", None):
            from agentkv.engine.cost import profile_name as _name

            profile_name = _name(args.profile)
        asked = args.block_size
        cfg = cls(
            gpu=args.gpu,
            model=args.model,
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=getattr(args, "data_parallel_size", 1),
            enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
            expert_imbalance=getattr(args, "expert_imbalance", 1.0),
            quantization=getattr(args, "quantization", None),
            block_size=asked,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_cache_retention_interval=getattr(args, "prefix_cache_retention_interval", 0),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_offloading_size=offload,
            kv_disk_size=disk,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            eviction_policy=args.eviction_policy,
            hash_algo=args.hash_algo,
            cost_profile=getattr(args, "profile", None),
            cost_profile_name=profile_name,
        )
        if asked is not None and cfg.block_size != asked:  # as vLLM warns when it overrides the flag
            why = vllm_block_size(cfg.model, asked, cfg.gpu, cfg.kv_dtype, cfg.tensor_parallel_size).why
            print(
                f"note: --block-size {asked} overridden: {cfg.model} runs with {cfg.block_size}-token KV "
                f"blocks ({why})",
                file=sys.stderr,
            )
        return cfg


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's knobs, under vLLM's flag names where vLLM has one (simulate and serve)."""
    g = p.add_argument_group("engine (vLLM flag names)")
    g.add_argument("--gpu", default="h200", help="accelerator from the catalogue (default h200)")
    g.add_argument(
        "--model",
        default="llama3-8b",
        help=model_help(),
    )
    _add_parallel_args(g)
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV cache block size in tokens (default: vLLM's pick for the model, GPU and KV dtype, 16 for most; "
        "MLA 64 with fp8 KV on Hopper, 32 on Blackwell; DeepSeek-V4 always 256; hybrid linear-attention "
        "models raised to hold a layer's state, as vLLM does)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (bf16), fp8, or nvfp4 (4-bit values + an fp8 scale per 16: 0.5625 bytes an element; "
        "GPUs with fp4, not MLA models)",
    )
    g.add_argument(
        "--max-model-len", type=int, default=None, help="context limit in tokens (default: the model's own)"
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of GPU memory for weights, activations and KV cache (default 0.9)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached KV blocks across requests (default on)",
    )
    g.add_argument(
        "--prefix-cache-retention-interval",
        type=int,
        default=0,
        metavar="TOKENS",
        help="sliding-window and Mamba-state groups: 0 (default, vLLM 0.32's) caches a window's tail and a "
        "state only where a later prompt resumes (its replay boundary, a shared prefix's junction); N > 0, "
        "a multiple of the block size, also once per N-token segment",
    )
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests in a batch (default 256)")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="token budget of a step (default 8192)"
    )
    _add_cache_args(g)


def _add_cache_args(g) -> None:
    """The KV cache's tiers, block count, eviction, hashing and the cost profile (add_engine_args)."""
    g.add_argument(
        "--kv-offloading-size",
        type=float,
        default=0.0,
        metavar="GIB",
        help="CPU memory for KV offload, in GiB (vLLM's flag)",
    )
    g.add_argument(
        "--cpu-offload",
        default=None,
        metavar="SIZE",
        help="CPU offload tier as a size, e.g. 512GB (same as --kv-offloading-size)",
    )
    g.add_argument(
        "--disk-offload", default=None, metavar="SIZE", help="SSD tier below the CPU tier, e.g. 2TB"
    )
    g.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="GPU KV blocks, instead of sizing from memory",
    )
    g.add_argument(
        "--eviction-policy",
        default="lru",
        choices=ENGINE_POLICIES,
        help=f"{', '.join(ENGINE_POLICIES)} (default lru)",
    )
    g.add_argument(
        "--prefix-caching-hash-algo",
        dest="hash_algo",
        default="xxhash",
        choices=HASH_ALGOS,
        help="block hash function (default xxhash)",
    )
    g.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="cost model coefficients from `agentkv calibrate` (default: the bundled H200 fit)",
    )


def _add_parallel_args(g) -> None:
    """Parallelism and weight dtype, under vLLM's names."""
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="GPUs per engine (tensor parallel; default 1)",
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="DP ranks sharing one expert group of tp x dp GPUs (MoE); each simulated engine is one rank",
    )
    g.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="split experts by expert over the tp x dp GPUs, with all-to-all dispatch/combine",
    )
    g.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        metavar="X",
        help="with -ep: the hottest GPU's routed tokens over the mean (default 1.0, balanced); "
        "scales its expert GEMMs, expert reads and all-to-all bytes",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=tuple(QUANTIZATION),
        help="weight dtype: fp8, mxfp4 or nvfp4 (fp4); default the checkpoint's (bf16, fp8 for DeepSeek)",
    )
