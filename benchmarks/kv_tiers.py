"""Tier transfer costs by KV layout, and the TierStack's own bookkeeping speed.

Run: .venv/bin/python benchmarks/kv_tiers.py   (prints modelled transfer times from the bundled
H200 measurements, then best-of-5 wall times of the Python bookkeeping)
"""

from __future__ import annotations

import argparse

from timing import best_ms

from agentkv.kv.tiers import TierSpec, TierStack
from agentkv.kv.transfer import DiskModel, h200_link, kv_bytes_per_token_layer

KiB, MiB = 1 << 10, 1 << 20


def transfer_table() -> None:
    link, disk = h200_link(), DiskModel()
    per_tl = kv_bytes_per_token_layer(num_kv_heads=8, head_dim=128)  # Llama-3 8B and 70B, bf16
    print(f"host link: H200 pinned copies, per-copy floor {link.min_copy_s * 1e6:.1f} us")
    print(f"{'model':<11}{'block':>7}{'bytes':>10}  {'layout (chunk)':<26}{'us/block':>9}{'GB/s':>7}")
    for model, layers in (("llama3-8b", 32), ("llama3-70b", 80)):
        for block_size in (16, 64):
            nbytes = block_size * layers * per_tl
            layouts = (
                ("K,V split per layer", block_size * per_tl // 2),
                ("KV per layer (default)", block_size * per_tl),
                ("whole block contiguous", nbytes),
            )
            for name, chunk in layouts:
                s = link.seconds(nbytes, chunk)
                print(
                    f"{model:<11}{block_size:>7}{nbytes // KiB:>8}Ki  {name} ({chunk // KiB} KiB)".ljust(64)
                    + f"{s * 1e6:>9.0f}{nbytes / s / 1e9:>7.1f}"
                )
    nbytes = 16 * 32 * per_tl
    read = disk.seconds(nbytes, 1, write=False)
    print(
        f"SSD default (7 GB/s read, 80 us/IO, QD1): 2 MiB block read {read * 1e6:.0f} us "
        f"({nbytes / read / 1e9:.1f} GB/s); +host copy {link.seconds(nbytes, 64 * KiB) * 1e6:.0f} us"
    )


def bookkeeping() -> None:
    n = 100_000

    def churn() -> None:
        s = TierStack(
            [TierSpec("CPU", capacity_blocks=20_000), TierSpec("DISK", capacity_blocks=50_000)],
            2 * MiB,
            num_layers=32,
            block_size=16,
        )
        for h in range(n):
            s.on_gpu_evict(h)
        hashes = list(range(n - 60_000, n))
        s.match(hashes, 0)
        s.promote(hashes[:10_000])

    ms = best_ms(churn)
    print(
        f"TierStack: {n:,} evictions (cascading CPU->DISK->drop) + match 60K + promote 10K: "
        f"{ms:.0f} ms ({ms * 1e3 / n:.2f} us per eviction)"
    )


def cpu_match() -> None:
    """The simulator's hot path with one CPU tier: looking up GPU misses there (each run touched)."""
    s = TierStack([TierSpec("CPU", capacity_blocks=300_000)], 2 * MiB, num_layers=32, block_size=16)
    for h in range(200_000):
        s.on_gpu_evict(h)
    runs = [[*range(b, b + 3000), -1] for b in range(0, 190_000, 997)]  # 3,000-block prefixes

    def lookups() -> None:
        for r in runs:
            s.match(r)

    ms = best_ms(lookups)
    print(
        f"TierStack.match, one CPU tier: {len(runs)} lookups of 3,000 cached blocks: {ms:.1f} ms "
        f"({len(runs) * 3000 / ms / 1e3:.2f} M blocks/s)"
    )


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    transfer_table()
    bookkeeping()
    cpu_match()
