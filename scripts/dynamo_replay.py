"""Run Dynamo's offline trace replay (`dynamo.replay.run_trace_replay`) once and print one JSON line.

Runs inside a Python 3.10 venv with `ai-dynamo==1.6.1` (not agentkv's venv): benchmarks/simulate.py
calls it as a subprocess with a JSON config as its only argument, so the peer's timing is measured
in its own process. Keys: trace, workers, block_size, trace_block_size, num_gpu_blocks, router,
max_num_seqs, max_num_batched_tokens, prefill_load_scale (the KV router's weight of a block to
prefill against a block of decode load), perf_npz (optional: a mocker timing table).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("DYN_LOG", "error")  # the KV router logs every routing decision at INFO
    from dynamo._core import KvRouterConfig
    from dynamo.mocker.config import normalize_mocker_config
    from dynamo.replay import run_trace_replay

    engine = {
        "block_size": cfg["block_size"],
        "num_gpu_blocks": cfg["num_gpu_blocks"],
        "max_num_seqs": cfg.get("max_num_seqs", 256),
        "max_num_batched_tokens": cfg.get("max_num_batched_tokens", 8192),
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
    }
    if cfg.get("perf_npz"):
        engine["timing_model"] = {
            "type": "external",
            "provider": "dynamo_profile",
            "config": {"path": cfg["perf_npz"]},
        }
    args = normalize_mocker_config({"engine": engine})
    router = (
        KvRouterConfig(prefill_load_scale=cfg["prefill_load_scale"]) if "prefill_load_scale" in cfg else None
    )
    wall0, cpu0 = time.perf_counter(), time.process_time()
    report = run_trace_replay(
        [cfg["trace"]],
        extra_engine_args=args,
        num_workers=cfg["workers"],
        router_mode=cfg.get("router", "kv_router"),
        router_config=router,
        trace_block_size=cfg["trace_block_size"],
        trace_format="mooncake",
    )
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    s = report.summary
    keep = (
        "num_requests",
        "completed_requests",
        "total_input_tokens",
        "total_output_tokens",
        "duration_ms",
        "wall_time_ms",
        "prefix_cache_reused_ratio",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "output_throughput_tok_s",
    )
    out = {"wall_s": wall, "cpu_s": cpu, **{k: s.get(k) for k in keep}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
