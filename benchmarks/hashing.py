"""Block hashing speed: fast xxhash, vLLM-exact sha256 / sha256_cbor, trace tokens and chain keys.

Run: .venv/bin/python benchmarks/hashing.py   (prints best-of-N wall times; targets: 1M tokens
under 50 ms and well under 1 ms per 10K tokens on a 200K prompt for the fast path)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from timing import best_ms

from agentkv.kv.hashing import (
    VllmHasher,
    XxHasher,
    block_hashes,
)
from agentkv.trace.blocks import chain_keys, request_tokens, space_key


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    rng = np.random.default_rng(0)
    m1 = rng.integers(0, 128_000, 1_000_000).astype(np.int32)
    m1_list = m1.tolist()
    p200 = m1[:200_000]
    print("fast path (xxhash, XXH3-64 chained)")
    for bs in (16, 64):
        print(
            f"  1M tokens, block {bs:3d}, int32 array : {best_ms(lambda bs=bs: block_hashes(m1, bs)):7.2f} ms"
        )
        print(
            f"  1M tokens, block {bs:3d}, Python list : {best_ms(lambda bs=bs: block_hashes(m1_list, bs)):7.2f} ms"
        )
    for bs in (16, 64):
        ms = best_ms(lambda bs=bs: block_hashes(p200, bs))
        print(f"  200K prompt, block {bs:3d}: {ms:6.2f} ms = {ms / 20:.3f} ms per 10K tokens")
    ms = best_ms(lambda: XxHasher().hashes(p200, 16, cache_salt="tenant", lora_name="adapter"))
    print(f"  200K prompt, block  16, salt + LoRA: {ms:6.2f} ms")
    seq = XxHasher().sequence(16)
    t = time.perf_counter()
    for tok in m1_list[:100_000]:
        seq.extend((tok,))
    print(f"  decode, one token per extend (block 16): {(time.perf_counter() - t) * 10:.2f} us per token")

    print("vLLM-exact (32-byte digests, event form = low 64 bits)")
    for algo in ("sha256", "sha256_cbor"):
        h = VllmHasher(algo, None)
        for bs in (16, 32):
            ms = best_ms(lambda h=h, bs=bs: h.event_hashes(p200, bs), repeat=3)
            print(f"  {algo:11s} 200K tokens, block {bs}: {ms:7.1f} ms = {ms / 20:.2f} ms per 10K tokens")

    print("trace tokens (request_tokens) and key-level chain_keys")
    ids = list(range(1, 200_000 // 64 + 1))
    ms = best_ms(lambda: request_tokens("trace_0001", ids, 200_000, 64))
    print(
        f"  200K-token prompt from 64-token trace blocks: {ms:6.2f} ms ({200_000 / ms / 1e3:.0f} M tokens/s)"
    )
    ids1m = list(range(1, 1_000_000 // 64 + 1))
    key = space_key("trace_0001")
    for bs in (16, 64, 256):
        ms = best_ms(lambda bs=bs: chain_keys(key, ids1m, 64, bs, 1_000_000))
        print(f"  chain_keys 1M tokens, trace block 64 -> engine block {bs:3d}: {ms:6.2f} ms")
    tok = request_tokens("trace_0001", ids1m, 1_000_000, 64)
    ms = best_ms(lambda: block_hashes(tok, 16))
    print(f"  (for comparison: materialised 1M tokens hashed at block 16: {ms:6.2f} ms)")


if __name__ == "__main__":
    main()
