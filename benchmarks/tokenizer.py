"""The built-in tokenizer's encode on prompts rendered from token ids: the word table alone against
what `encode` does now (whole-array passes from `_ARRAY_CHARS` characters up), per prompt length,
for ids across the vocabulary (3-syllable words, a table cache miss each) and for the low 4,096
ids `benchmarks/router.py` sends (2-syllable words).

Run: .venv/bin/python benchmarks/tokenizer.py [--lengths 64 256 1024 8192 65536]
"""

from __future__ import annotations

import argparse
import os
import random
import time

from agentkv.trace import tokens as T


def best_us(f, texts: list[str], repeat: int = 5) -> float:
    """Best of `repeat` passes over `texts`: microseconds per text."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for x in texts:
            f(x)
        best = min(best, (time.perf_counter() - t0) / len(texts) * 1e6)
    return best


def table_only(text: str) -> list[int]:
    saved, T._ARRAY_CHARS = T._ARRAY_CHARS, 1 << 62
    try:
        return T.encode(text)
    finally:
        T._ARRAY_CHARS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 160, 256, 1024, 8192, 65536])
    args = ap.parse_args()
    T.warm_up()
    rng = random.Random(0)
    print(f"load average {os.getloadavg()[0]:.1f}; microseconds per prompt, best of 5")
    for n in args.lengths:
        for name, lo, hi in (("whole vocabulary", 0, T.VOCAB_SIZE), ("ids 64-4159", 64, 4160)):
            texts = [
                " ".join(T.token_text(rng.randrange(lo, hi)) for _ in range(n))
                for _ in range(max(3, 6400 // n))
            ]
            assert all(T.encode(x) == table_only(x) for x in texts)
            old, new = best_us(table_only, texts), best_us(T.encode, texts)
            print(f"{n:>6} tokens, {name:>16}: table {old:9.1f} us, now {new:9.1f} us ({old / new:4.1f}x)")


if __name__ == "__main__":
    main()
