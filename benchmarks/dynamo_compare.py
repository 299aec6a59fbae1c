"""agentkv's simulator beside Dynamo's offline replay, per router mode, on the same Mooncake files.

Sources: the Mooncake conversation trace as published, and the shared Claude Code traces converted
to one Mooncake file (`write_mooncake`: every session from t=0 at its recorded times, agentkv's
chained block keys as hash ids), since Dynamo's replay reads Mooncake. Both tools replay each file
by timestamp on the same 8-worker H200 cluster (Llama-3.1-8B, agentkv's cost model as Dynamo's
timing table); CPU seconds are each tool's own process time for the replay.
"""

from __future__ import annotations

import gzip
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from dynamo_peer import dynamo_python, perf_table, run_dynamo

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.placement.policy import make_policy
from agentkv.sim.cluster import SimConfig, simulate
from agentkv.trace.accesses import arrivals, block_accesses
from agentkv.trace.formats import load_paths

WORKERS = 8
# agentkv's router -> Dynamo's router_mode (the modes both have; Dynamo 1.6.1's replay has no other)
MODES = {"kv_aware": "kv_router", "round_robin": "round_robin"}


@dataclass(slots=True)
class Side:
    """One tool's replay of one file in one router mode."""

    requests: int
    wall_s: float
    cpu_s: float
    sim_s: float
    hit: float  # agentkv: reported hits / input tokens; Dynamo: prefix_cache_reused_ratio
    ttft_p50_ms: float | None
    preemptions: int | None = None


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def write_mooncake(traces: list, path: Path, block_size: int = 64) -> int:
    """The traces as one Mooncake JSONL file (timestamp ms, input/output length, hash ids of
    `block_size`-token blocks; a partial last block gets an id of its own), every session from t=0
    at its recorded times; returns the requests."""
    ids: dict[object, int] = {}
    with path.open("wb") as f:
        reqs = block_accesses(arrivals(traces), block_size)
        for r in sorted(reqs, key=lambda r: r.time):
            hs = [ids.setdefault(h, len(ids)) for h in r.hashes]
            if len(hs) * block_size < r.input_tokens:  # Dynamo wants the partial last block too
                hs.append(ids.setdefault(("tail", len(ids)), len(ids)))
            row = {
                "timestamp": round(r.time * 1000),
                "input_length": r.input_tokens,
                "output_length": max(1, r.output_tokens),
                "hash_ids": hs,
            }
            f.write(msgspec.json.encode(row) + b"\n")
    return len(reqs)


def run_agentkv(path: Path, ecfg: EngineConfig, router: str, trace_block_size: int) -> Side:
    """agentkv's replay of a Mooncake file by timestamp (load and simulate timed together)."""
    cfg = SimConfig(engine=ecfg, workers=WORKERS, router=router, idle_gap_cap=None)
    w0, c0 = time.perf_counter(), time.process_time()
    res = simulate(load_paths([path], block_size=trace_block_size), cfg)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    s = res.summary
    p50 = None if s.ttft.p50 is None else s.ttft.p50 * 1e3
    return Side(len(res.records), wall, cpu, res.sim_s, s.cache.reported, p50, s.preemptions)


def run_peer(py: str, path: Path, npz: Path, engine: Engine, router: str, trace_block_size: int) -> Side:
    """Dynamo's replay of the same file and cluster; raises RuntimeError when it fails."""
    c = engine.config
    dcfg = {
        "trace": str(path),
        "workers": WORKERS,
        "block_size": c.block_size,
        "trace_block_size": trace_block_size,
        "num_gpu_blocks": engine.num_gpu_blocks,
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "router": MODES[router],
        "perf_npz": str(npz),
    }
    if router == "kv_aware":
        dcfg["prefill_load_scale"] = make_policy("kv_aware").weight
    d = run_dynamo(py, dcfg)
    return Side(
        d["completed_requests"],
        d["wall_s"],
        d["cpu_s"],
        (d["duration_ms"] or 0) / 1e3,
        d["prefix_cache_reused_ratio"] or 0.0,
        d["median_ttft_ms"],
    )


def sources(shared: Path, tmp: Path, which: list[str]) -> list[tuple[str, Path, int]]:
    """(name, plain Mooncake JSONL, its block size) for each source found; missing ones are said."""
    out = []
    if "claude" in which:
        src = shared / "traces" / "claude-code"
        if src.is_dir():
            path = tmp / "claude_code_mooncake.jsonl"
            n = write_mooncake(load_paths([src]), path)
            print(f"claude-code: {src} converted to {n:,} Mooncake requests (64-token blocks, t=0 starts)")
            out.append(("claude-code", path, 64))
        else:
            print(f"claude-code skipped: {src} not found (set AGENTKV_SHARED)")
    if "mooncake" in which:
        src = shared / "traces" / "mooncake" / "conversation_trace.jsonl.gz"
        if src.is_file():
            path = tmp / "conversation_trace.jsonl"
            path.write_bytes(gzip.decompress(src.read_bytes()))  # Dynamo reads plain JSONL
            out.append(("mooncake", path, 512))
        else:
            print(f"mooncake skipped: {src} not found")
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[tuple[str, str, Side, Side | None]]) -> list[str]:
    """The comparison as text lines: CPU s, hit rate and TTFT p50 for each side, and the CPU ratio."""
    out = [
        f"{'source':12} {'router':12} {'requests':>8} {'CPU s':>7} {'hit':>6} {'TTFT50':>7} {'preempt':>7} "
        f"{'Dyn CPU':>7} {'Dyn hit':>7} {'TTFT50':>7} {'CPU ratio':>9}"
    ]
    for name, mode, a, d in results:
        dyn = (
            f"{d.cpu_s:7.1f} {d.hit:7.1%} {_fmt(d.ttft_p50_ms, ',.0f'):>7} {a.cpu_s / d.cpu_s:8.2f}x"
            if d
            else f"{'-':>7} {'-':>7} {'-':>7} {'-':>9}"
        )
        out.append(
            f"{name:12} {mode:12} {a.requests:>8,} {a.cpu_s:7.1f} {a.hit:6.1%} "
            f"{_fmt(a.ttft_p50_ms, ',.0f'):>7} {a.preemptions or 0:>7,} {dyn}"
        )
    return out


def compare(
    shared: Path, which: list[str], routers: list[str], with_dynamo: bool = True
) -> list[tuple[str, str, Side, Side | None]]:
    """Each source in each router mode, agentkv then Dynamo (None when skipped or failed)."""
    ecfg = EngineConfig(gpu="h200", model="llama3-8b")
    engine = Engine(ecfg)
    py, why = dynamo_python() if with_dynamo else (None, "--no-dynamo")
    print(f"    Dynamo: {why if py else 'skipped: ' + why}")
    out = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        npz = tmp / "agentkv_h200_llama3_8b.npz"
        perf_table(engine, npz)
        for name, path, tbs in sources(shared, tmp, which):
            for router in routers:
                print(f"    {name}, {router}: agentkv ...   load average {loadavg()}", flush=True)
                a = run_agentkv(path, ecfg, router, tbs)
                d = None
                if py:
                    print(f"    {name}, {MODES[router]}: Dynamo ...   load average {loadavg()}", flush=True)
                    try:
                        d = run_peer(py, path, npz, engine, router, tbs)
                    except RuntimeError as e:
                        print(f"    Dynamo failed: {e}")
                out.append((name, router, a, d))
                lines = table(out[-1:])  # each row as it finishes: a stopped run keeps what it did
                print("\n".join("    " + x for x in lines[len(out) > 1 :]), flush=True)
    return out
