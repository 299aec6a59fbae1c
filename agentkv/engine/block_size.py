"""The KV block size vLLM runs a model with (`Platform.update_block_size_for_backend`): its attention
backend's preferred size when `--block-size` is not given, then the sizes vLLM imposes whatever is
given (DeepSeek-V4's kernels take 256; a hybrid Mamba/linear-attention model's attention page is
raised to cover one layer's state, `_align_hybrid_block_size`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from agentkv.engine.hardware import get_gpu
from agentkv.engine.models.catalogue import get_model
from agentkv.engine.models.groups import GroupKind
from agentkv.engine.models.layout import attention_page, layer_block_bytes
from agentkv.engine.models.shape import ModelShape
from agentkv.errors import UserError

DEFAULT_BLOCK_SIZE = 16  # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE
V4_BLOCK_SIZE = 256  # vLLM's DeepseekV4SparseMLABackend: its only kernel block size
KERNEL_ALIGN = 16  # the smallest kernel block of FLASH_ATTN, FLASHINFER, TRITON_ATTN (the hybrid rounding)


@dataclass(frozen=True, slots=True)
class BlockChoice:
    """The size vLLM picks and why (its log's reason; empty for the plain default)."""

    size: int
    why: str = ""
    aligned: bool = False  # a hybrid model's aligned size: any multiple of 16, not only the flag's choices


def mla_backend_block(shape: ModelShape, gpu_name: str, kv_dtype: str) -> BlockChoice:
    """The first MLA backend of vLLM's priority list that takes this GPU and KV dtype, and its preferred
    size (`platforms/cuda.py` `_get_backend_priorities`, each backend's `get_supported_kernel_block_sizes`):
    Hopper FLASH_ATTN_MLA (multiples of 16) or, for an fp8 KV cache it rejects, FLASHMLA (64); Blackwell
    and Rubin (sm 10.x) FLASHINFER_MLA (32 or 64); sparse MLA with its indexer (DeepSeek-V3.2) 64 on
    NVIDIA; ROCm's AITER/Triton MLA take 16."""
    gpu = get_gpu(gpu_name)
    if gpu.vendor != "nvidia":
        return BlockChoice(DEFAULT_BLOCK_SIZE)
    if shape.family == "deepseek_v32":
        return BlockChoice(64, "its sparse MLA and indexer backends (64-token kernel blocks)")
    if gpu.sm // 10 == 10:
        return BlockChoice(32, "its FLASHINFER_MLA backend on sm 10.x (kernel blocks of 32 or 64)")
    if kv_dtype == "fp8":
        return BlockChoice(64, "its FLASHMLA backend for an fp8 KV cache on Hopper (64-token kernel blocks)")
    return BlockChoice(DEFAULT_BLOCK_SIZE)


def hybrid_block(
    shape: ModelShape, block_size: int, kv_dtype: str, tp: int, kernel: int = KERNEL_ALIGN
) -> int:
    """vLLM's `_align_hybrid_block_size`: the smallest multiple of max(`kernel`, `block_size`) whose
    attention page (one layer, one rank) holds one layer's Mamba/linear-attention state. `kernel` is the
    attention backend's smallest kernel block (16 on GPUs; vLLM's CPU_ATTN takes multiples of 32)."""
    state = max(layer_block_bytes(g, block_size, kv_dtype, tp) for g in shape.groups if g.is_mamba_state)
    align = max(kernel, block_size)
    return align * math.ceil(state / attention_page(shape, align, kv_dtype, tp))


def is_mamba_hybrid(shape: ModelShape) -> bool:
    """A model vLLM treats as hybrid (attention plus Mamba-style states): a state group that is not a
    window (DeepSeek-V4's compressor buffers are sliding-window groups in vLLM)."""
    return any(g.is_mamba_state for g in shape.groups)


def vllm_block_size(
    model: object, asked: int | None, gpu: str = "h200", kv_dtype: str = "bf16", tp: int = 1
) -> BlockChoice:
    """The block size vLLM runs `model` with on `gpu` when `--block-size` is `asked` (None: not given)."""
    try:
        shape = get_model(model)
    except UserError:  # an unknown model is reported where the engine is built
        return BlockChoice(DEFAULT_BLOCK_SIZE if asked is None else asked)
    if shape.family == "deepseek_v4":
        return BlockChoice(V4_BLOCK_SIZE, "vLLM's DeepSeek-V4 kernels take no other size")
    if asked is not None:
        choice = BlockChoice(asked)
    elif any(g.kind is GroupKind.MLA for g in shape.groups):
        choice = mla_backend_block(shape, gpu, kv_dtype)
    else:
        choice = BlockChoice(DEFAULT_BLOCK_SIZE)
    if is_mamba_hybrid(shape):
        size = hybrid_block(shape, choice.size, kv_dtype, tp)
        if size > choice.size:
            why = "vLLM raises a hybrid model's attention page to hold one layer's state"
            return BlockChoice(size, why, aligned=True)
        return BlockChoice(choice.size, choice.why, aligned=True)
    return choice
