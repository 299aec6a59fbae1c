"""The hybrid pool's block bookkeeping: ids, reference counts, each group's hash map and each
request's per-group block table (-1: vLLM's null block, a block skipped or never needed), the LRU
of freed cached blocks, and the invariants that tie them together.

Block hashes live as uint64 while every hash fits (`mirror`): each block's in `bkey`, and a
full-attention first group, which caches almost every block of a run (99% on DeepSeek-V4-Pro),
maps them in a `U64Map` updated a batch at a time by compiled loops. The other groups' maps stay
dicts: their rules probe one hash at a time from Python, where a dict is faster. The first hash
outside uint64 turns every map into a dict and the hashes into Python ints (`bhash`), as
`BlockPool` does."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import mul

import numpy as np

from agentkv.kv import group_rules as R
from agentkv.kv.events import BlockRemoved, BlockStored
from agentkv.kv.eviction.base import stamp_loops
from agentkv.kv.group_lru import ByteLRU, grown
from agentkv.kv.hashmap import add_copies, drop_copies, find_run
from agentkv.kv.interface import KVRequest
from agentkv.kv.invariants import check_hybrid
from agentkv.kv.tables import appended
from agentkv.kv.u64map import U64Map, as_keys

NULL = -1
EMPTY = np.zeros(0, dtype=np.int64)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _prompt_len(req: KVRequest, block_size: int) -> int:
    """The request's prompt tokens (a request that does not say: its full blocks and a partial one)."""
    return getattr(req, "prompt_len", 0) or len(req.block_hashes) * block_size + 1


class GroupBlocks:
    """Mixin of `HybridPool`: everything that touches block ids. Needs `specs`, `has_state`,
    `group_bytes` (and `_costs`, the same as an int64 array), `retention_interval`, `block_size`,
    `capacity`, `stats`, `_emit` and `hooks` (told of stores and evictions: the eviction policy's
    hints and the tiers below, `group_tiers.GroupHooks`, or None) from the pool."""

    def _setup_blocks(self) -> None:
        self.max_ids = self.capacity // min(sp.block_bytes for sp in self.specs) + 1  # most blocks ever live
        # group 0's map a U64Map when it is full attention (module docstring), the others dicts
        self.cached_maps: list[dict[int, int] | U64Map] = [
            U64Map(min(self.max_ids, 4096)) if g == 0 and s.rule == "full" else {}
            for g, s in enumerate(self.specs)
        ]
        self.dups: list[dict[int, list[int]]] = [{} for _ in self.specs]  # a hash's younger copies
        # per-block arrays sized to the ids taken so far, grown as more are (a policy binds them: full size)
        n = self.max_ids if self.policy is not None else min(self.max_ids, 4096)
        self.ref = np.zeros(n, dtype=np.int32)
        self.bgroup = np.zeros(n, dtype=np.int16)
        self.hashed_blk = np.zeros(n, dtype=bool)
        self.mirror = True  # every hash so far fits in uint64 (off for good at the first that does not)
        self.bkey = np.zeros(n, dtype=np.uint64)  # block -> its hash while cached (any group, copies too)
        self.bhash: np.ndarray | None = None  # the same as Python ints, once the mirror is off (`_to_dict`)
        self.bh64 = np.zeros(n, dtype=np.uint64)  # group 0's as uint64 while cached, else 0 (hint checks)
        # group 0: a recomputed copy -> the block holding its hash then (maybe stale: read via the mirror)
        self.alias = np.full(n, NULL, dtype=np.int64)
        # group 0's younger copies while its map is a U64Map (`dups[0]` stays empty): chains over block
        # ids, kept by compiled loops (a recomputed prefix makes thousands: 16% of the blocks a
        # DeepSeek-V4-Pro run evicts). cnext: the next younger copy; cprev: the next older (-1 at the map's
        # block); ctail: the map's block's youngest copy (-1: none); all -1 on a block outside a chain
        self.cnext = np.full(n, NULL, dtype=np.int64)
        self.cprev = np.full(n, NULL, dtype=np.int64)
        self.ctail = np.full(n, NULL, dtype=np.int64)
        self._ids = np.empty(n, dtype=np.int64)  # freed block ids, a stack (top at the end)
        self._rest = np.empty(n, dtype=np.int64)  # an eviction's victims of groups other than 0 (scratch)
        self._n_ids = 0
        self._fresh = 0  # ids from here on were never taken: they come after the freed ones, ascending
        self.bcost = np.zeros(n, dtype=np.int64)
        self.lru = ByteLRU(self.bcost)  # freed cached blocks of every group, oldest first
        self.empty_bytes = self.capacity
        self.evictable_bytes = 0
        self.tables: dict[str, list[np.ndarray]] = {}  # per group, int64 block ids (NULL: none)
        # per request, per group: the buffer a window or full group's table is the head of (room to
        # grow in place; None: not yet); a table is never written below its length, so views handed
        # out (`block_table`'s hints) keep their blocks
        self._bufs: dict[str, list[np.ndarray | None]] = {}
        # per request, per window group: (prompt length, junction, the block ranges it caches), made
        # at the group's first caching and again only if either changes
        self._tails: dict[str, dict[int, tuple[int, int, list[tuple[int, int]]]]] = {}
        self.hashed: dict[str, list[int]] = {}  # per group: leading blocks whose caching was decided
        self.skip: dict[str, list[int]] = {}  # per group: blocks before this index are null
        # per request, per state group: the page count vLLM's table had when each held page was taken
        # (a page at index p - 1 gets the state after p blocks); [] for the other groups
        self.spos: dict[str, list[list[int]]] = {}
        # per request: the full-attention group's longer prefix at its lookup, in blocks, where the
        # other groups served less (vLLM's `shared_prefix_boundary`: a window caches its tail there)
        self.junction: dict[str, int] = {}
        # per request: (computed from, computed below, total up to) where an allocation changes nothing
        self.quiet: dict[str, tuple[int, int, int]] = {}
        # the groups `remove_skipped` visits (window, chunk, state), with their rule and window
        self._rules = [(g, s.rule, s.window) for g, s in enumerate(self.specs)]
        self._movers = [r for r in self._rules if r[1] != "full"]
        self._epoch = getattr(self, "_epoch", 0)

    def block_cost(self, b: int) -> int:
        return self.specs[int(self.bgroup[b])].block_bytes

    def hash_of(self, block: int) -> int | None:
        """The hash `block` holds (None: none), from whichever table the pool keeps."""
        if not self.hashed_blk[block]:
            return None
        return int(self.bkey[block]) if self.mirror else self.bhash[block]

    def group_copies(self, g: int) -> dict[int, list[int]]:
        """Group `g`'s younger copies: hash -> its blocks other than the map's, oldest first."""
        if g or type(self.cached_maps[0]) is not U64Map:
            return self.dups[g]
        out, cnext = {}, self.cnext
        for head in np.flatnonzero(self.ctail >= 0).tolist():
            blocks, b = [], int(cnext[head])
            while b >= 0:
                blocks.append(b)
                b = int(cnext[b])
            out[int(self.bkey[head])] = blocks
        return out

    def _to_dict(self) -> None:
        """A hash outside uint64 arrived: every map becomes a dict and block hashes Python ints."""
        if not self.mirror:
            return
        self.mirror = False
        if type(self.cached_maps[0]) is U64Map:  # its copies' chains become `dups[0]`
            self.dups[0] = self.group_copies(0)
            for a in (self.cnext, self.cprev, self.ctail):
                a[:] = NULL
        self.cached_maps = [m if type(m) is dict else dict(m.items()) for m in self.cached_maps]
        self.bhash = np.full(len(self.ref), None, dtype=object)
        held = np.flatnonzero(self.hashed_blk)
        self.bhash[held] = np.fromiter(self.bkey[held].tolist(), dtype=object, count=len(held))

    # -- sizes of an allocation ----------------------------------------------------------------
    def new_blocks(self, req: KVRequest, total: int) -> list[int]:
        """Blocks each group must take for a running request to hold `total` tokens."""
        rid, n_tok = req.request_id, _cdiv(total, self.block_size)
        if not self.has_state:
            return [n_tok - len(t) if n_tok > len(t) else 0 for t in self.tables[rid]]
        out = []
        for g, s in enumerate(self.specs):
            if s.rule == "state":  # 'align' mode: a page for each block the request's tokens reach
                out.append(1 if n_tok > self.spos[rid][g][-1] else 0)
            else:
                out.append(max(0, n_tok - len(self.tables[rid][g])))
        return out

    def blocks_bytes(self, counts: Sequence[int]) -> int:
        """Bytes of `counts[g]` blocks of each group `g` (what an allocation takes from the pool)."""
        return sum(map(mul, counts, self.group_bytes))  # (C-level: called for every allocation)

    def first_skips(self, req: KVRequest, hit: int) -> list[int]:
        """Each group's leading null blocks at admission: those a window or chunk has moved past at
        the hit's end, or at the arrived KV's (vLLM's `allocate_new_computed_blocks` pads what
        external tokens skip with the null block: no block is taken for them)."""
        bs = self.block_size
        done = max(hit * bs, req.external_tokens)
        return [R.skipped_tokens(s.rule, s.window, done) // bs for s in self.specs]

    def first_blocks(self, hit: int, total: int, skips: list[int]) -> list[int]:
        """Blocks each group takes at admission after a hit of `hit` blocks (a state: one page, the
        hit's state held beside it, `shared_blocks`)."""
        n_tok = _cdiv(total, self.block_size)
        return [
            1 if s.rule == "state" else max(0, n_tok - max(hit, k))
            for s, k in zip(self.specs, skips, strict=True)
        ]

    def shared_blocks(self, hashes: Sequence[int], hit: int, skips: list[int], full=None) -> list[np.ndarray]:
        """Each group's cached blocks a hit of `hit` blocks shares, from its first non-null block
        (`skips`) on; a state group the hit's state, held until the request's next step copied it
        (vLLM's `last_state_block_idx`); `full`: group 0's, found by the lookup."""
        bs, out = self.block_size, []
        for g, s in enumerate(self.specs):
            if g == 0 and full is not None:
                out.append(np.asarray(full, dtype=np.int64))
                continue
            if s.rule == "state":
                out.append(np.array([self.cached_maps[g][hashes[hit - 1]]], dtype=np.int64) if hit else EMPTY)
                continue
            idx = R.hit_blocks(s.rule, hit, s.window, bs)
            lo = max(idx.start, min(skips[g], hit))
            found = find_run(self.cached_maps[g], hashes, hit, lo)
            if len(found) < hit - lo:
                raise KeyError(f"group {g}: hash {hashes[lo + len(found)]} of a hit is not cached")
            out.append(np.asarray(found, dtype=np.int64))
        return out

    def quiet_range(self, req: KVRequest, computed: int, total: int) -> tuple[int, int, int]:
        """After an allocation at (computed, total): the computed counts below which no window or chunk
        frees a block, and the totals up to which no group takes or caches one."""
        bs, rid, n_hashes = self.block_size, req.request_id, len(req.block_hashes)
        tables, hashed = self.tables[rid], self.hashed[rid]
        c_hi = t_hi = 1 << 62
        for g, rule, w in self._rules:  # (`x if x < y else y` in place of `min`: every allocation asks)
            h = hashed[g]
            if rule == "sliding":
                lead = computed - w + 1
                x = ((lead // bs if lead > 0 else 0) + 1) * bs + w - 1
                c_hi = x if x < c_hi else c_hi
            elif rule == "chunked":
                x = (computed // w + 1) * w
                c_hi = x if x < c_hi else c_hi
            elif rule == "state":  # a new page past the current one's block; the older freed next step
                pos = self.spos[rid][g]
                if len(pos) > 1 and computed + 1 < c_hi:
                    c_hi = computed + 1
                m = pos[-1]  # the current page is hashed when the tokens fill its block
                x = m * bs - 1 if h < m <= n_hashes else m * bs
                t_hi = x if x < t_hi else t_hi
                continue
            x = len(tables[g]) * bs
            t_hi = x if x < t_hi else t_hi
            if h < n_hashes and (h + 1) * bs - 1 < t_hi:
                t_hi = (h + 1) * bs - 1
        return computed, c_hi, t_hi

    # -- changes ---------------------------------------------------------------------------------
    def start(
        self, req: KVRequest, hit: int, shared: list[np.ndarray], new: list[int], total: int, skips: list[int]
    ) -> None:
        """Admit a request whose allocation was checked: share, take, cache (`skips`: `first_skips`)."""
        rid = req.request_id
        for g in range(len(self.specs)):
            if len(shared[g]):
                self._pin(g, shared[g])
        taken = self._take_groups(new)
        tables, pos, n_tok = [], [], _cdiv(total, self.block_size)
        for g, s in enumerate(self.specs):
            if s.rule == "state":  # the hit's state (if any), then the page this step writes
                tables.append(np.concatenate((shared[g], taken[g])))
                pos.append([hit, n_tok] if hit else [n_tok])
            else:  # null up to the window's start (at or past the hit's), then shared, then fresh
                head = np.full(skips[g], NULL, dtype=np.int64)
                tables.append(np.concatenate((head, shared[g], taken[g])))
                pos.append([])
        self.tables[rid], self.skip[rid], self.spos[rid] = tables, list(skips), pos
        self._bufs[rid], self._tails[rid] = [None] * len(self.specs), {}
        self.hashed[rid] = hashed = [hit] * len(self.specs)
        ext, bs = req.external_tokens, self.block_size
        if ext > hit * bs:  # arrived KV: vLLM's finer window blocks may not hold the window at its last cut
            for g, s in enumerate(self.specs):
                if s.page_tokens and not R.arrival_serves(s.window, s.page_tokens, ext, ext // bs * bs):
                    hashed[g] = ext // bs  # none of the arrived blocks is cached
        self._cache(req, total, fresh_state=True)

    def grow(self, req: KVRequest, new: list[int], total: int) -> None:
        """Extend a running request's tables (room was checked), then cache what is full."""
        rid = req.request_id
        tables, bufs = self.tables[rid], self._bufs[rid]
        taken = self._take_groups(new)
        for g, rule, _ in self._rules:
            k = new[g]
            if not k:
                continue
            t = tables[g]
            if rule == "state":  # (its table loses its head as pages are freed: no buffer)
                tables[g] = np.concatenate((t, taken[g]))
                self.spos[rid][g].append(_cdiv(total, self.block_size))
                continue
            buf, n = bufs[g], len(t)  # (`tables.appended` inline: every growth of every group)
            if buf is None or n + k > len(buf):
                bufs[g], tables[g] = appended(buf, t, taken[g])
                continue
            buf[n : n + k] = taken[g]
            tables[g] = buf[: n + k]
        self._cache(req, total, fresh_state=False)

    def remove_skipped(self, rid: str, num_computed: int) -> None:
        """Free the blocks a window or chunk has moved past, right to left (vLLM's order), and a state
        page the last step copied from (vLLM's `MambaManager.remove_skipped_blocks`)."""
        if not self._movers:
            return
        tables, skips, bs = self.tables[rid], self.skip[rid], self.block_size
        spans, most = [], 0  # in group order, as vLLM frees them: unpinned together
        for g, rule, window in self._movers:
            if rule == "state":
                pos = self.spos[rid][g]
                if len(pos) > 1 and pos[0] < _cdiv(num_computed, bs):
                    spans.append((tables[g][:1].copy(), 0, 1))
                    most += 1
                    tables[g] = tables[g][1:]
                    del pos[0]
                continue
            t, lo = tables[g], skips[g]
            if rule == "sliding":  # (`group_rules.skipped_tokens` inline: every allocation asks)
                hi = (num_computed - window + 1) // bs  # (negative: nothing skipped, as max(0, ...))
            else:
                hi = num_computed // window * window // bs
            if hi > len(t):
                hi = len(t)
            if hi > lo:
                spans.append((t, lo, hi))
                most += hi - lo
                skips[g] = hi
        if spans:  # one compiled pass a span: cut (right to left, nulls skipped) and free, as `_unpin`
            cut = stamp_loops().cut_free
            cached = np.empty(most, dtype=np.int64)
            nc, n_ids, cb, eb = 0, self._n_ids, 0, 0
            for t, lo, hi in spans:
                nc, n_ids, c, e = cut(
                    t, lo, hi, self.ref, self.hashed_blk, self.bcost, cached, nc, self._ids, n_ids
                )
                cb, eb = cb + c, eb + e
            self._n_ids = n_ids
            self.empty_bytes += int(eb)
            if nc:
                self.lru.add(cached[:nc])
                self.evictable_bytes += int(cb)

    def release(self, rid: str) -> None:
        """Drop a request's blocks, group by group, each table tail first (vLLM's free order)."""
        tables = self.tables.pop(rid, None)
        if tables is None:
            return
        del self.hashed[rid], self.skip[rid], self.spos[rid], self._bufs[rid], self._tails[rid]
        self.quiet.pop(rid, None)
        self.junction.pop(rid, None)
        arr = np.concatenate([t[::-1] for t in tables])  # group by group, each tail first
        self._unpin(arr[arr >= 0])

    # -- internals -------------------------------------------------------------------------------
    def _cache(self, req: KVRequest, total: int, fresh_state: bool) -> None:
        """Give the blocks `total` tokens fill their hashes; the current state page gets the state at
        an aligned boundary, or (at admission) at the last boundary of KV that arrived from another
        engine; a state cached already gets this page as another copy, as vLLM."""
        rid, bs, n_hashes = req.request_id, self.block_size, len(req.block_hashes)
        tables, hashed = self.tables[rid], self.hashed[rid]
        ends = min(total // bs, n_hashes)
        for g, s in enumerate(self.specs):
            if s.rule != "state":
                n = len(tables[g])  # (else `_cache_tokens` has nothing to do)
                if (ends if ends < n else n) > hashed[g]:
                    self._cache_tokens(req, g, total)
                continue
            k = R.state_boundary(total, bs, n_hashes)
            junction, interval = self.junction.get(rid, 0), self.retention_interval
            if k and not R.state_kept(k, _prompt_len(req, bs), bs, junction, interval):
                k = 0  # a chunk end no later request resumes at: its page is freed uncached
            if not k and fresh_state:  # KV from another engine: its state at the last boundary came
                k = min(req.external_tokens // bs, n_hashes)  # with it (vLLM's connector; docs/simulate.md)
            if not k or k <= hashed[g]:
                continue
            hashed[g] = k
            h, b = req.block_hashes[k - 1], int(tables[g][-1])
            first = self.cached_maps[g].setdefault(h, b)
            self._store(g, [h], [b], req.block_hashes, k - 1, k, req.token_ids, True, True)
            add_copies(self.dups[g], [h], [b], [first])

    def _cache_tokens(self, req: KVRequest, g: int, total: int) -> None:
        rid, t = req.request_id, self.tables[req.request_id][g]
        lo = self.hashed[rid][g]
        full = min(total // self.block_size, len(req.block_hashes), len(t))
        if full <= lo:
            return
        self.hashed[rid][g] = full
        if self.specs[g].rule != "sliding":
            self._cache_range(req, g, lo, full)
            return
        # a window caches only what a later request can hit: the window before the prompt's replay
        # boundary, and before the prefix the full-attention group alone found (vLLM's junction)
        bs, w = self.block_size, self.specs[g].window
        plen, j = _prompt_len(req, bs), self.junction.get(rid, 0)
        memo = self._tails[rid]
        m = memo.get(g)
        if m is None or m[0] != plen or m[1] != j:  # (each chunk of a long prefill asks again)
            tails = [R.window_tail(w, bs, plen)]
            if j:
                tails = R.merge_ranges(tails + [R.window_before(w, bs, j)])
            memo[g] = m = (plen, j, tails)
        tails = m[2]
        if self.retention_interval:  # and the window before each segment's end
            tails = R.merge_ranges(tails + R.segment_tails(w, bs, self.retention_interval, lo, full))
        for a, e in tails:  # (`max(lo, a) < min(full, e)`, lo < full known, without the calls)
            if lo < e and a < full and a < e:
                self._cache_range(req, g, lo if lo > a else a, full if full < e else e)

    def _cache_range(self, req: KVRequest, g: int, lo: int, full: int) -> None:
        """Cache group `g`'s blocks [lo, full) of `req` (the table's nulls skipped): hashes stored, a
        hash cached already recorded as another copy."""
        rid, t = req.request_id, self.tables[req.request_id][g]
        hashes = req.block_hashes
        seg = t[lo:full]
        arr = getattr(req, "hash_array", None)  # the same hashes as uint64: filtered and stored in bulk
        h64 = arr[lo:full] if arr is not None and len(arr) >= full else None
        keep = None
        if lo < self.skip[rid][g]:  # blocks a window has moved past (the table's nulls): not cached
            keep = seg >= 0
            seg = seg[keep]
            if h64 is not None:
                h64 = h64[keep]
        d = self.cached_maps[g]
        if type(d) is U64Map and h64 is None:
            h64 = as_keys(hashes[lo:full] if keep is None else list(compress(hashes[lo:full], keep.tolist())))
            if h64 is None:
                self._to_dict()
                d = self.cached_maps[g]
        if type(d) is U64Map:  # (group 0) one compiled pass: insert, mark, chain the copies
            if not len(seg):
                return
            d.reserve(len(seg))
            mkeys, mvals, shift, mask = d.slots()
            marks = (self.bkey, self.bh64, self.hashed_blk, self.cnext, self.cprev, self.ctail, self.alias)
            new = stamp_loops().cache_run(seg, h64, mkeys, mvals, shift, mask, *marks)
            if new >= 0:
                d.live_changed(new)
                self._announce(g, None, None, hashes, lo, full, req.token_ids, keep is None, seg, h64)
                return
            got = d.setdefault_many(h64, seg)  # a hash of 0 (the map keeps it aside): in steps
            self._store(g, None, None, hashes, lo, full, req.token_ids, keep is None, True, seg, h64)
            copy = got != seg
            if np.count_nonzero(copy):
                blocks, first = seg[copy], got[copy]
                stamp_loops().chain_add(blocks, first, self.cnext, self.cprev, self.ctail)
                self._name_copies(blocks, first)
            return
        if keep is not None:
            hs = h64.tolist() if h64 is not None else list(compress(hashes[lo:full], keep.tolist()))
        else:
            hs = hashes[lo:full]
            hs = hs if type(hs) is list else list(hs)  # a list's slice is a copy already
        bl = seg.tolist()
        got = list(map(d.setdefault, hs, bl))  # inserts only absent hashes, in one pass
        if hs:
            self._store(g, hs, bl, hashes, lo, full, req.token_ids, keep is None, True, seg, h64)
        if got != bl:  # a hash cached already: as vLLM, this block is another copy of it (BlockPool.dups)
            first = np.fromiter(got, np.int64, len(got))
            self._copies(g, hs, bl, got, seg, first, first != seg)

    def _copies(self, g, hs, bl, got, seg, first, copy) -> None:
        """Blocks `seg` cached under hashes the map gave other blocks (`first`, where `copy`): as vLLM,
        each is another copy of its hash (`dups`); group 0's mirror and aliases name them."""
        add_copies(self.dups[g], hs, bl, got)
        if g == 0:
            self._name_copies(seg[copy], first[copy])

    def _name_copies(self, blocks: np.ndarray, first: np.ndarray) -> None:
        """Group 0's copies `blocks` of the blocks `first` the map gives for their hashes: each aliased
        to its first, its mirror entry 0 (the mirror names the block the map gives; `cache_run` writes
        the same in its pass)."""
        self.alias[blocks] = first
        self.bh64[blocks] = 0

    def _store(
        self,
        g,
        hs,
        blocks,
        hashes,
        lo,
        hi,
        token_ids,
        whole=True,
        inserted=False,
        idx=None,
        h64=None,
    ) -> None:
        """Record cached blocks: `hs` and `blocks` as lists, or (`hs`, `blocks` None) `idx` and `h64`
        as arrays, whose lists are made only for the hooks and events (`_mark`, then `_announce`)."""
        idx = blocks if idx is None else idx
        self._mark(g, hs, blocks, idx, h64, inserted)
        self._announce(g, hs, blocks, hashes, lo, hi, token_ids, whole, idx, h64)

    def _announce(self, g, hs, blocks, hashes, lo, hi, token_ids, whole, idx, h64) -> None:
        """`_store`'s counting and telling (hooks, events) of blocks whose hashes and flags are
        written (by `_mark`, or by `stamp_loops.cache_run` in its pass)."""
        self.stats.stored += len(idx)
        if self.hooks is None and self._emit is None:
            return
        if hs is None:
            hs, blocks = h64.tolist(), idx.tolist()
        if self.hooks is not None:
            self.hooks.stored(g, blocks, lo, hashes)
        if self._emit is not None:
            bs = self.block_size
            seg = token_ids[lo * bs : hi * bs] if token_ids is not None and whole else []
            toks = seg.tolist() if hasattr(seg, "tolist") else list(seg)
            s = self.specs[g]
            self._emit(
                BlockStored(
                    block_hashes=list(hs),
                    parent_block_hash=hashes[lo - 1] if lo else None,
                    token_ids=toks,
                    block_size=bs,
                    medium="GPU",
                    group_idx=g,
                    kv_cache_spec_kind=s.event_kind,
                )
            )

    def _mark(self, g, hs, blocks, idx, h64, inserted) -> None:
        """`_store`'s writes: the map (unless `inserted`), each block's hash and its hashed flag."""
        if self.mirror:
            key = h64 if h64 is not None else as_keys(hs)
            if key is None:
                self._to_dict()
        if not inserted:
            self.cached_maps[g].update(zip(hs, blocks, strict=True))
        if self.mirror:
            self.bkey[idx] = key
            if g == 0:
                self.bh64[idx] = key
        else:
            self.bhash[idx] = hs
        self.hashed_blk[idx] = True

    def _pin(self, g: int, arr: np.ndarray) -> None:
        """Share cached blocks of group `g`: those unreferenced leave the LRU."""
        free = arr[self.ref[arr] == 0]
        if len(free):
            self.lru.removed(free)
            self.evictable_bytes -= len(free) * self.specs[g].block_bytes
        self.ref[arr] += 1

    def _unpin(self, arr: np.ndarray) -> None:
        """Drop one reference to each of `arr` (any groups, in freeing order, no block twice): cached
        ones that reach zero join the LRU's tail, the others are free at once (one compiled pass,
        `stamp_loops.unpin`)."""
        n = len(arr)
        cached, empty = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        nc, ne, cb, eb = stamp_loops().unpin(arr, self.ref, self.hashed_blk, self.bcost, cached, empty)
        if nc:
            self.lru.add(cached[:nc])
            self.evictable_bytes += int(cb)
        if ne:
            self.empty_bytes += int(eb)
            self._push_ids(empty[:ne])

    def _push_ids(self, ids: np.ndarray) -> None:
        m, k = self._n_ids, len(ids)
        self._ids[m : m + k] = ids
        self._n_ids = m + k

    def _take(self, g: int, n: int) -> np.ndarray:
        """`n` fresh blocks of group `g` (ref 1), evicting least recently freed cached blocks for room."""
        return self._take_groups([n if i == g else 0 for i in range(len(self.specs))])[g]

    def _take_groups(self, new: list[int]) -> list[np.ndarray]:
        """`new[g]` fresh blocks for each group `g` (ref 1), after one eviction for all of them (the
        same victims, ids and order as a take per group), with one pass over the per-block arrays."""
        n = sum(new)
        if n <= 0:
            return [EMPTY] * len(new)
        need = self.blocks_bytes(new)
        if self.empty_bytes < need:
            self._evict(need)
        self.empty_bytes -= need
        short = n - self._n_ids  # ids beyond the freed stack: never-taken ones, the arrays grown for them
        if short > 0 and self._fresh + short > len(self.ref):
            self._grow_ids(self._fresh + short)
        arr = np.empty(n, dtype=np.int64)
        # off the freed stack (top first), then never-taken ids, ascending: ref 1, no hash (a recycled
        # id's was cleared from `bhash` when it was evicted), group, bytes; one compiled pass
        self._n_ids, self._fresh = stamp_loops().take_ids(
            self._ids,
            self._n_ids,
            self._fresh,
            np.array(new, dtype=np.int64),
            self._costs,
            self.ref,
            self.hashed_blk,
            self.bgroup,
            self.bcost,
            arr,
        )
        self.stats.allocated += n
        out, i = [], 0
        for k in new:
            if k:
                out.append(arr[i : i + k])
                i += k
            else:
                out.append(EMPTY)
        return out

    def _grow_ids(self, upto: int) -> None:
        """Per-block arrays long enough for ids below `upto` (doubling, up to `max_ids`)."""
        size = max(upto, min(2 * len(self.ref), self.max_ids))
        for name in ("ref", "bgroup", "hashed_blk", "bkey", "bh64", "bcost", "_ids", "_rest"):
            setattr(self, name, grown(getattr(self, name), size))
        for name in ("alias", "cnext", "cprev", "ctail"):
            setattr(self, name, grown(getattr(self, name), size, NULL))
        if self.bhash is not None:
            self.bhash = grown(self.bhash, size)
        self.lru.grown(self.bcost)

    def _evict(self, need: int) -> None:
        victims, freed = self.lru.pop_bytes(need - self.empty_bytes)
        self.evictable_bytes -= freed
        self.empty_bytes += freed
        d0 = self.cached_maps[0]
        if type(d0) is U64Map and self.mirror and self._emit is None and self.hooks is None:
            # (nobody listens: group 0's victims in one compiled pass, the other groups' dicts after)
            mkeys, mvals, shift, mask = d0.slots()
            args = (self.cnext, self.cprev, self.ctail, self.bh64, mkeys, mvals, shift, mask)
            rest = self._rest  # (as long as the id arrays: never fewer than the victims)
            n, zero, nr = stamp_loops().evict_first(
                victims, self.bgroup, self.hashed_blk, self.bkey, *args, self._ids, self._n_ids, rest
            )
            self._dropped_zero(d0, n, zero)
            if nr:  # group by group, as below
                order, counts = self._by_group(rest[:nr])
                i = 0
                for g, k in enumerate(counts):
                    if k:
                        mine, i = order[i : i + k], i + k
                        drop_copies(self.cached_maps[g], self.dups[g], None, mine, self.bkey[mine].tolist())
            self._n_ids += len(victims)
            self._epoch += 1
            self.stats.evicted += len(victims)
            return
        self.hashed_blk[victims] = False
        # per group present, in group order: its hashes in LRU order, and those no copy holds any more
        removed: dict[int, list[int] | None] = {}
        gone: dict[int, list[int] | None] = {}
        order, counts = self._by_group(victims)
        i = 0
        if self.mirror:
            keys, hs = self.bkey[order], None
        else:
            keys, hs = None, self.bhash[order].tolist()
            self.bhash[victims] = None
        listen = self._emit is not None or self.hooks is not None
        for g, k in enumerate(counts):
            if k:
                i += k
                d, kg = self.cached_maps[g], None if keys is None else keys[i - k : i]
                if hs is not None:
                    lst = hs[i - k : i]
                else:  # Python ints only where a dict, a copy or a listener needs them
                    lst = kg.tolist() if listen or self.dups[g] or type(d) is not U64Map else None
                removed[g] = lst
                if type(d) is U64Map:  # group 0, its copies chained (a copy promoted: the mirror names it)
                    gone[g] = self._drop_chained(d, order[i - k : i], kg, listen)
                else:
                    named = self.bh64 if g == 0 and self.mirror else None
                    gone[g] = drop_copies(d, self.dups[g], None, order[i - k : i], lst, None, named)
        self.bh64[victims] = 0  # (after: a copy promoted and then evicted in this batch is named no more)
        self._push_ids(victims)
        self._epoch += 1
        self.stats.evicted += len(victims)
        if self._emit is not None:  # one hash a copy, as vLLM
            for g, lst in removed.items():
                self._emit(BlockRemoved(block_hashes=lst, medium="GPU", group_idx=g))
        if self.hooks is not None:
            self.hooks.evicted(gone)

    def _by_group(self, blocks: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """`blocks` sorted by group, each group's in their given (LRU) order, and each group's count
        from group 0 on (group 0's alone, the common case: as given, no sort)."""
        groups = self.bgroup[blocks]
        if not np.count_nonzero(groups):
            return blocks, [len(blocks)]
        return blocks[groups.argsort(kind="stable")], np.bincount(groups).tolist()

    def _drop_chained(
        self, d: U64Map, victims: np.ndarray, keys: np.ndarray, listen: bool
    ) -> list[int] | None:
        """Forget group 0's evicted blocks (in LRU order; `keys` their hashes), each hash handed to its
        next oldest copy where one is left (`drop_copies` for the chains); the hashes no block holds
        any more, as a list only when someone listens."""
        gone = np.empty(len(victims), dtype=np.uint64)
        mkeys, mvals, shift, mask = d.slots()
        args = (self.cnext, self.cprev, self.ctail, self.bh64, mkeys, mvals, shift, mask, gone)
        n, zero = stamp_loops().chain_drop(victims, keys, *args)
        self._dropped_zero(d, n, zero)
        return gone[:n].tolist() if listen else None

    @staticmethod
    def _dropped_zero(d: U64Map, n: int, zero: int) -> None:
        """After a compiled drop from `d`'s table (`chain_drop`, `evict_first`) of `n` hashes, key
        0's outcome (-2 untouched, -1 gone, else its block), which the map keeps aside, through its
        dict API; the map's count told of the rest."""
        if zero != -2:
            if zero == -1:
                del d[0]
            else:
                d[0] = zero
        d.live_changed(-(n - (zero == -1)))

    check_invariants = check_hybrid  # bytes add up; LRU, maps, tables and the uint64 mirror agree
