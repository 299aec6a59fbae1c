"""`chain_keys`' compiled loop (numba): a request's engine-block keys in one pass over its blocks,
instead of a dozen whole-array numpy passes (each splitmix64 round is six of them)."""

from __future__ import annotations

import numba
import numpy as np

from agentkv.trace.blocks import _GOLDEN as GOLDEN
from agentkv.trace.blocks import _M1 as M1
from agentkv.trace.blocks import _M2 as M2

_U = np.uint64
SUB = _U(0xAEF17502108EF2D9)  # mixed with a sub-block's place in its trace block
GROUP = _U(0xDB4F0B9175AE2165)  # folds an engine block's sub-blocks
DEPTH = _U(0x8CB92BA72F3D8DD7)  # mixed with a key's depth
R = _U(0xFF51AFD7ED558CCD)  # odd multiplier of the polynomial prefix hash
S30, S27, S31 = _U(30), _U(27), _U(31)


@numba.njit(cache=True, nogil=True, inline="always")
def mix(x):
    """splitmix64's finaliser (`blocks._mix` on one uint64)."""
    x = (x ^ (x >> S30)) * M1
    x = (x ^ (x >> S27)) * M2
    return x ^ (x >> S31)


@numba.njit(cache=True, nogil=True)
def chain(ids, real, fill, r, per, n, out, state, j0, p0):
    """out[j]: the key of engine block j (j0 <= j < n) of `per` sub-blocks, r sub-blocks to a trace
    slot, and state[j] its prefix hash P_j; the chain starts at block j0 from P_{j0-1} = p0 (0 at j0 = 0).

    A slot's base is mix(real + id * GOLDEN) for the request's ids, then mix(fill + i * GOLDEN) for
    filler slot i; a sub-block mixes its place into its slot's base (r > 1); a block folds its
    sub-blocks (ident = mix(ident * GROUP + sub)); key j = mix(P_j ^ (j + 1) * DEPTH) with
    P_j = P_{j-1} * R + ident_j, the polynomial prefix hash `blocks._chained` computes by cumsum."""
    k = len(ids)
    p = p0
    slot, base = -1, _U(0)
    q = j0 * per
    for j in range(j0, n):
        ident = _U(0)
        for s in range(per):
            si = q // r
            if si != slot:
                slot = si
                base = mix(real + ids[si] * GOLDEN) if si < k else mix(fill + _U(si - k) * GOLDEN)
            sub = mix(base ^ (_U(q % r + 1) * SUB)) if r > 1 else base
            ident = sub if s == 0 else mix(ident * GROUP + sub)
            q += 1
        p = p * R + ident
        state[j] = p
        out[j] = mix(p ^ (_U(j + 1) * DEPTH))
