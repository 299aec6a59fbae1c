"""Run agentkv's own CLI (`bench`, `simulate`) as a user would, against or beside the live vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_server import BLOCK_SIZE, MAX_MODEL_LEN, VllmServer

from agentkv.metrics.records import RequestRecord, read_records

HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def agentkv(*args: str, timeout: float = 600) -> str:
    """`agentkv ARGS` in a subprocess; its stdout, or an assertion error carrying its stderr."""
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, f"agentkv {' '.join(args)} exited {p.returncode}:\n{p.stderr[-3000:]}"
    return p.stdout


@dataclass
class BenchRun:
    """One `agentkv bench --target` run: its records, summary and the server's counter deltas."""

    records: list[RequestRecord]
    summary: dict
    hits_delta: float
    queries_delta: float

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_tokens for r in self.records)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens or 0 for r in self.records)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens


def bench(server: VllmServer, trace: Path, out: Path, *extra: str) -> BenchRun:
    """Replay `trace` on one lane against `server` to the end; counters scraped around the run."""
    before = server.metrics()
    agentkv(
        "bench",
        str(trace),
        "--target",
        server.url,
        "--lanes",
        "1",
        "--duration",
        "none",
        "--cache-bust",
        "--out",
        str(out),
        "--quiet",
        "--no-report",
        *extra,
    )
    after = server.metrics()
    return BenchRun(
        read_records(out / "requests.jsonl"),
        json.loads((out / "summary.json").read_text()),
        after[HITS] - before[HITS],
        after[QUERIES] - before[QUERIES],
    )


def simulate(
    trace: Path,
    num_blocks: int,
    max_requests: int,
    model_dir: Path,
    block_size: int = BLOCK_SIZE,
    *extra: str,
) -> dict:
    """`agentkv simulate` of `trace` on one engine shaped like the live one; the summary as JSON."""
    out = agentkv(
        "simulate",
        str(trace),
        "--model",
        str(model_dir),
        "--block-size",
        str(block_size),
        "--num-gpu-blocks-override",
        str(num_blocks),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--lanes",
        "1",
        "--max-requests",
        str(max_requests),
        "--json",
        "--quiet",
        *extra,
    )
    return json.loads(out)


def live_and_simulated(server: VllmServer, trace: Path, out: Path) -> tuple[BenchRun, dict]:
    """Replay `trace` on `server` from an empty cache, then simulate it with the server's model,
    block size and block count (vLLM's `cache_config_info`) and its extra engine flags (those
    `simulate` shares with vLLM); both runs checked complete."""
    cfg = server.cache_config()
    blocks, block_size = int(cfg["num_gpu_blocks"]), int(cfg["block_size"])
    server.reset_prefix_cache()  # start from an empty cache, as the simulator does
    live = bench(server, trace, out)
    n = len(live.records)
    assert all(r.ok for r in live.records)
    assert live.hits_delta == live.cached_tokens and live.queries_delta == live.prompt_tokens
    sim = simulate(trace, blocks, n, server.model_dir, block_size, *server.spec.extra)
    assert sim["requests"] == sim["succeeded"] == n
    assert sim["preemptions"] == 0
    return live, sim
