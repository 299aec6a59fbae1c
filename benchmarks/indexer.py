"""Router block-index throughput on the Mooncake conversation trace, one core, three designs.

The trace (12,031 requests, 512-token blocks) is re-blocked to 16-token blocks with `chain_keys`
and played on 8 simulated workers (LRU caches of `--capacity` blocks, vLLM's tail-first eviction,
requests routed to the longest cached prefix, ties to the least full worker). That first pass
records the op stream: one find-matches per request, then the worker's BlockStored (new run,
with its parent) and BlockRemoved (evictions) events. The timed pass replays the stream into a
fresh index of each design:
- `sets (BlockIndex)`: agentkv.route.index.BlockIndex, the one the router uses (a hash set per
  worker and tier; find-matches walks the workers holding the first block, at C speed);
- `tenants (TenantIndex)`: the router's per-tenant layer over it (event attribution), one tenant;
- `dict+bitmask`: one dict hash -> worker bitmask, one walk narrowing the live mask;
- `radix tree`: per-block nodes with worker bitmasks and a per-worker hash -> node table (the
  shape of Dynamo's first indexer and SGLang's radix cache), in Python.
An index operation is one block stored, one block removed, or one block of a find-matches query
(inserts + lookups, as Dynamo counts them); event and query rates are printed too.

Run: .venv/bin/python benchmarks/indexer.py [--trace PATH] [--limit N] [--capacity BLOCKS]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import OrderedDict
from pathlib import Path

from agentkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from agentkv.route.index import BlockIndex, TenantIndex
from agentkv.trace.blocks import chain_keys
from agentkv.trace.formats import load

DESIGNS = ("sets (BlockIndex)", "tenants (TenantIndex)", "dict+bitmask", "radix tree")
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl.gz"


def _credit(out: dict[int, int], mask: int, blocks: int) -> None:
    """Every worker whose bit is set in `mask` matched `blocks` leading blocks."""
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = blocks
        mask ^= low


class RadixIndex:
    """Per-block radix nodes: children by hash, a worker bitmask per node, a per-worker lookup table."""

    __slots__ = ("root", "_table")

    class Node:
        __slots__ = ("children", "workers", "parent", "key")

        def __init__(self, parent, key):
            self.children: dict[int, RadixIndex.Node] = {}
            self.workers = 0
            self.parent, self.key = parent, key

    def __init__(self):
        self.root = RadixIndex.Node(None, None)
        self._table: dict[int, dict[int, RadixIndex.Node]] = {}

    def apply(self, worker, ev):
        table = self._table.setdefault(worker, {})
        if isinstance(ev, BlockStored):
            node = self.root if ev.parent_block_hash is None else table.get(ev.parent_block_hash, self.root)
            bit = 1 << worker
            for h in ev.block_hashes:
                child = node.children.get(h)
                if child is None:
                    child = node.children[h] = RadixIndex.Node(node, h)
                child.workers |= bit
                table[h] = child
                node = child
        elif isinstance(ev, BlockRemoved):
            keep = ~(1 << worker)
            for h in ev.block_hashes:
                node = table.pop(h, None)
                if node is not None:
                    node.workers &= keep
                    if not node.workers and not node.children:
                        del node.parent.children[node.key]
        elif isinstance(ev, AllBlocksCleared):
            for h in list(table):
                self.apply(worker, BlockRemoved(block_hashes=[h]))

    def find_matches(self, hashes):
        out: dict[int, int] = {}
        node = self.root
        live = -1
        for i, h in enumerate(hashes):
            node = node.children.get(h)
            m = node.workers & live if node is not None else 0
            gone = live & ~m if live != -1 else 0
            if gone and i:
                _credit(out, gone, i)
            live = m
            if not m:
                return out
        if live > 0:
            _credit(out, live, len(hashes))
        return out


class BitmaskIndex:
    """A dict hash -> bitmask of workers (one walk narrows the live mask), plus per-worker sets for clears."""

    def __init__(self):
        self.masks: dict[int, int] = {}
        self.held: dict[int, set[int]] = {}

    def apply(self, worker, ev):
        d, get = self.masks, self.masks.get
        if isinstance(ev, BlockStored):
            bit = 1 << worker
            for h in ev.block_hashes:
                d[h] = get(h, 0) | bit
            self.held.setdefault(worker, set()).update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            keep = ~(1 << worker)
            for h in ev.block_hashes:
                m = get(h)
                if m is not None:
                    m &= keep
                    if m:
                        d[h] = m
                    else:
                        del d[h]
            self.held.get(worker, set()).difference_update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            self.apply(worker, BlockRemoved(block_hashes=list(self.held.pop(worker, ()))))

    def find_matches(self, hashes):
        out: dict[int, int] = {}
        get = self.masks.get
        live = get(hashes[0], 0)
        i = 0
        for h in hashes:
            m = get(h, 0) & live
            if m != live:
                gone = live & ~m
                if gone and i:
                    _credit(out, gone, i)
                live = m
                if not m:
                    return out
            i += 1  # noqa: SIM113  (faster than enumerate here)
        if live:
            _credit(out, live, len(hashes))
        return out


def build_ops(keys: list[list[int]], workers: int, capacity: int):
    """Simulate the workers once; return the op stream [(None, hashes) | (worker, event)] and counts."""
    index = BlockIndex()
    lru = [OrderedDict() for _ in range(workers)]
    ops: list = []
    stored = removed = queried = 0
    for hashes in keys:
        if not hashes:
            continue
        ops.append((None, hashes))
        queried += len(hashes)
        matches = index.find_matches(hashes)
        w = min(range(workers), key=lambda i: (-(matches[i].gpu if i in matches else 0), len(lru[i])))
        cache = lru[w]
        hit = matches[w].gpu if w in matches else 0
        for h in reversed(hashes[:hit]):  # vLLM frees tail first: the head stays youngest
            cache.move_to_end(h)
        new = hashes[hit:]
        events = []
        if new:
            ev = BlockStored(
                block_hashes=new, parent_block_hash=hashes[hit - 1] if hit else None, block_size=16
            )
            events.append(ev)
            for h in reversed(new):
                cache[h] = None
            stored += len(new)
        victims = []
        while len(cache) > capacity:
            victims.append(cache.popitem(last=False)[0])
        if victims:
            events.insert(0, BlockRemoved(block_hashes=victims))
            removed += len(victims)
        for ev in events:
            index.apply(w, ev)
            ops.append((w, ev))
    return ops, stored, removed, queried


def replay(index, ops) -> float:
    apply, find = index.apply, index.find_matches
    gc.disable()
    t0 = time.perf_counter()
    for w, x in ops:
        if w is None:
            find(x)
        else:
            apply(w, x)
    elapsed = time.perf_counter() - t0
    gc.enable()
    return elapsed


class _TenantAdapter:
    def __init__(self):
        self.t = TenantIndex()
        self.apply = self.t.apply

    def find_matches(self, hashes):
        return self.t.find_matches("", hashes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=65_536, help="GPU blocks per worker (default 65,536)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--designs", default=",".join(DESIGNS))
    args = ap.parse_args()
    trace = load(args.trace)[0]
    reqs = trace.session.requests[: args.limit]
    t0 = time.perf_counter()
    keys = [
        chain_keys(trace.id, r.hash_ids, trace.block_size, args.block_size, r.input_tokens).tolist()
        for r in reqs
    ]
    ops, stored, removed, queried = build_ops(keys, args.workers, args.capacity)
    n_events = sum(1 for w, _ in ops if w is not None)
    total = stored + removed + queried
    print(
        f"{len(reqs):,} requests re-blocked {trace.block_size}->{args.block_size} on {args.workers} workers "
        f"x {args.capacity:,} blocks: {n_events:,} events ({stored:,} blocks stored, {removed:,} removed), "
        f"{len(reqs):,} find-matches over {queried:,} blocks; prepared in {time.perf_counter() - t0:.1f} s"
    )
    makers = {
        "sets (BlockIndex)": BlockIndex,
        "tenants (TenantIndex)": _TenantAdapter,
        "dict+bitmask": BitmaskIndex,
        "radix tree": RadixIndex,
    }
    for name in [d.strip() for d in args.designs.split(",")]:
        s = replay(makers[name](), ops)
        print(
            f"{name:>22}: {total / s / 1e6:6.2f} M index ops/s  ({s:.2f} s; {n_events / s:,.0f} events/s, "
            f"{len(reqs) / s:,.0f} find-matches/s incl. event load)"
        )


if __name__ == "__main__":
    main()
