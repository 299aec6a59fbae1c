"""Element sizes of weight and KV dtypes, and the name key catalogue lookups use."""

from __future__ import annotations

import re

from agentkv.errors import UserError

# NVFP4 KV (vLLM's --kv-cache-dtype nvfp4, TensorRT-LLM's NVFP4 KV cache): e2m1 values, half a byte,
# plus one fp8 (E4M3) scale per 16 elements; the per-tensor fp32 scale is left out (a few bytes a layer)
NVFP4_BYTES = 0.5 + 1 / 16
DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5, "nvfp4": NVFP4_BYTES}
KV_DTYPES = ("bf16", "fp16", "fp8", "nvfp4")


def lookup_key(name: str) -> str:
    """Lookup key: lower case, org prefix and '-instruct' dropped, separators removed."""
    s = name.strip().lower().rsplit("/", 1)[-1]
    s = re.sub(r"[-_ ]instruct$", "", s)
    return re.sub(r"[\s_.\-]", "", s)


def check_dtype(dtype: str, allowed) -> str:
    """`dtype` if it is one of `allowed`; a UserError naming the choices otherwise."""
    if dtype not in allowed:
        raise UserError(f"dtype '{dtype}' is not one of {', '.join(allowed)}")
    return dtype
