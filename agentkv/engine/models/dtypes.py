"""Element sizes of weight and KV dtypes, and the name key catalogue lookups use."""

from __future__ import annotations

import re

from agentkv.errors import UserError

DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5}
KV_DTYPES = ("bf16", "fp16", "fp8")


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
