"""Each KV group kind's prefix-cache rule, as vLLM v1's single-type managers state it
(`single_type_kv_cache_manager.py`): how many leading blocks of a prompt one group can serve, and
which tokens a running request no longer needs.

`cached` is the group's hash -> block map; `limit` the most blocks a hit may cover. Every rule
returns a block count `<= limit`; the pool takes the minimum over groups until it stops moving,
as `HybridKVCacheCoordinator.find_longest_cache_hit` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import indexOf

from agentkv.kv.hashmap import find_run

RULES = ("full", "sliding", "chunked", "state")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_blocks(window: int, block_size: int) -> int:
    """Contiguous blocks a sliding-window hit needs: those covering the last window - 1 tokens."""
    return _cdiv(window - 1, block_size)


def window_before(window: int, block_size: int, end: int) -> tuple[int, int]:
    """The block range [start, end) a hit at block `end` needs of a sliding-window group."""
    return max(0, end - window_blocks(window, block_size)), end


def window_tail(window: int, block_size: int, prompt_len: int) -> tuple[int, int]:
    """The block range [start, end) a sliding-window group caches of a prompt: the window before its
    replay boundary (`prompt_len - 1`, block-aligned), all a later request can hit there (vLLM 0.32's
    `SlidingWindowManager.reachable_block_mask` with `prefix_cache_retention_interval` 0, its default)."""
    return window_before(window, block_size, (prompt_len - 1) // block_size)


def segment_tails(window: int, block_size: int, interval: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The block ranges of [lo, hi) a sliding-window group also caches with vLLM's
    `prefix_cache_retention_interval` N > 0: the window before the end of each N-token segment
    (`SlidingWindowManager.reachable_block_mask`), every block when the window spans a segment."""
    per, need = interval // block_size, window_blocks(window, block_size)
    if need >= per:
        return [(lo, hi)] if lo < hi else []
    out = []
    for end in range((lo // per + 1) * per, hi + need, per):
        a, e = max(lo, end - need), min(hi, end)
        if a < e:
            out.append((a, e))
    return out


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Block ranges [start, end) in order, those that overlap or touch made one (each block once)."""
    out: list[tuple[int, int]] = []
    for a, e in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((a, e))
    return out


def arrival_serves(window: int, pages: Sequence[int], done: int, cut: int) -> bool:
    """Whether a window group whose first `done` tokens arrived from another engine holds the window
    before `cut` in vLLM's own blocks of each size in `pages`: it took none before the window at
    `done` (`skipped_tokens`), and a hit at `cut` needs cdiv(window - 1, page) of them before it."""
    lead = max(0, done - window + 1)
    return all(lead // p * p <= cut - _cdiv(window - 1, p) * p for p in pages)


def full_hit(cached: dict, hashes: Sequence[int], limit: int) -> int:
    """Full attention (and MLA): every block from the first, left to right until a miss."""
    return len(find_run(cached, hashes, limit))


def sliding_hit(cached: dict, hashes: Sequence[int], limit: int, window: int, block_size: int) -> int:
    """Sliding window: right to left, the first run of `window_blocks` cached blocks ends the hit
    (the blocks before it are skipped); with none, the run of cached blocks from the start."""
    need = window_blocks(window, block_size)
    if need == 0:
        return limit
    if need == 1:  # (a window within one block: the rightmost cached block ends the hit; C-level scan)
        if limit <= 0:
            return 0
        try:
            return limit - indexOf(map(cached.__contains__, hashes[limit - 1 :: -1]), True)
        except ValueError:
            return 0
    end = limit - 1  # candidate last block of the run; probe its first block, then the rest
    while end - need + 1 >= 0:
        if hashes[end - need + 1] not in cached:
            end -= need  # every run ending in (end - need, end] holds that block
            continue
        m = end
        while m > end - need + 1 and hashes[m] in cached:
            m -= 1
        if m == end - need + 1:
            return end + 1
        end = m - 1
    run = 0
    while run < limit and hashes[run] in cached:  # too short for a window: the leading run counts
        run += 1
    return run


def chunked_hit(cached: dict, hashes: Sequence[int], limit: int, chunk: int, block_size: int) -> int:
    """Chunked local attention: blocks before the current chunk count as hits (never read again);
    from the chunk's first block on, cached blocks left to right."""
    start = limit * block_size // chunk * chunk // block_size
    i = start
    while i < limit and hashes[i] in cached:
        i += 1
    return i


def state_hit(cached: dict, hashes: Sequence[int], limit: int) -> int:
    """Linear attention / SSM state ('align' mode): the rightmost block boundary with a saved state."""
    for i in range(limit - 1, -1, -1):
        if hashes[i] in cached:
            return i + 1
    return 0


def state_boundary(total: int, block_size: int, n_hashes: int) -> int:
    """The prompt block boundary a step ending at `total` tokens saves a state at (0: none)."""
    k = total // block_size
    return k if total % block_size == 0 and 0 < k <= n_hashes else 0


def state_kept(k: int, prompt_len: int, block_size: int, junction: int = 0, interval: int = 0) -> bool:
    """Whether a state saved after `k` prompt blocks is cached: vLLM 0.32 (its default
    `prefix_cache_retention_interval` 0, `MambaManager.reachable_block_mask`) keeps only the states
    a later request can resume at, the prompt's replay boundary (`(prompt_len - 1) // block`) and a
    shared prefix's junction (`junction` blocks); the chunk ends between are freed uncached. With an
    `interval` of N > 0 tokens it also keeps those ending an N-token segment (all, for N <= a block)."""
    if k == (prompt_len - 1) // block_size or (junction > 0 and k == junction):
        return True
    per = interval // block_size
    return interval > 0 and (per <= 1 or k % per == 0)


def chunk_stop(computed: int, n: int, num_tokens: int, block_size: int, junction: int = 0) -> int:
    """A prefill chunk of `n` tokens from `computed`, cut where a state must be saved (vLLM's
    `_mamba_block_aligned_split` in 'align' mode): on a block boundary, at the last one before the
    request's last token (`(num_tokens - 1) // block`), and at a shared prefix's junction (`junction`
    tokens); 0 when no boundary fits. `computed` need not be on one (a disaggregated decode's arrived
    KV ends a token short of the prompt)."""
    last = (num_tokens - 1) // block_size * block_size
    if computed < last:
        n = max(0, min(computed + n, last) // block_size * block_size - computed)
    if computed < junction < computed + n:
        n = junction - computed
    return n


def skipped_tokens(rule: str, window: int, num_computed: int) -> int:
    """Tokens a running request's next token no longer reads (vLLM's `get_num_skipped_tokens`):
    before the window, before the current chunk; none for full attention (states keep no tokens)."""
    if rule == "sliding":
        return max(0, num_computed - window + 1)
    if rule == "chunked":
        return num_computed // window * window
    return 0


def hit_blocks(rule: str, hit: int, window: int, block_size: int) -> range:
    """Block indices a group shares from the cache for a hit of `hit` blocks (the others are null)."""
    if rule == "full":
        return range(hit)
    if rule == "state":
        return range(hit - 1, hit) if hit else range(0)
    lo = skipped_tokens(rule, window, hit * block_size) // block_size
    return range(min(lo, hit), hit)
