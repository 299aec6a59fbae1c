"""What `agentkv serve` adds on top of the engine: streamed tokens/s and per-token latency, 200 streams.

Run: .venv/bin/python benchmarks/serve_overhead.py [--streams 200] [--duration 8]

The server runs in its own process (as in use), the client (aiohttp, SSE) in this one. Two phases:
1. saturation: `--time-scale 1e6`, so engine time is negligible; every stream asks for the next
   request as soon as one ends. Prints tokens/s (the server's ceiling on this machine) and the
   per-token latency at that load (mostly queueing behind the other streams).
2. paced: the time scale set so the engine itself produces `--rate` tokens/s over all streams
   (one decode step every streams/rate seconds). Server-added latency of a token = when the
   client parsed it minus when the engine's timeline said it was ready (both CLOCK_MONOTONIC;
   the server process records each token's due time through the runner's `on_step` hook).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

import aiohttp
import msgspec

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine

PROMPT_LEN = 32


def _server(conn, time_scale: float, max_seqs: int) -> None:
    """Child process: serve, record each token's due time, hand them over when told to stop."""
    from agentkv.serve.app import ServeOptions, Server

    async def main() -> None:
        server = Server(
            EngineConfig(max_model_len=4096, max_num_seqs=max_seqs),
            ServeOptions(port=0, time_scale=time_scale),
        )
        real = server.runner.real
        due: dict[str, list[float]] = {}
        metrics_hook = server.runner.on_step

        def on_step(result, itl) -> None:
            metrics_hook(result, itl)
            ready = time.perf_counter() - (real.now() - result.end) / real.time_scale
            for out in result.outputs:
                due.setdefault(out.request.request_id, []).append(ready)

        server.runner.on_step = on_step
        await server.start()
        cpu0 = os.times()
        conn.send(server.port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        cpu1 = os.times()
        await server.stop()
        conn.send((due, (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system), server.runner.jumped_s))

    asyncio.run(main())


async def _stream_loop(session, url: str, max_tokens: int, stop_at: float, recv: list) -> None:
    """One client stream: back-to-back streamed requests until stop_at; (request id, token times) each."""
    dec = msgspec.json.Decoder()
    body = {"prompt": list(range(1000, 1000 + PROMPT_LEN)), "max_tokens": max_tokens, "stream": True}
    while time.perf_counter() < stop_at:
        times: list[float] = []
        rid = None
        async with session.post(url, json=body) as r:
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                t = time.perf_counter()
                chunk = dec.decode(line[6:])
                rid = chunk["id"]
                n = len(chunk["choices"][0]["text"].split())
                times.extend([t] * n)
        recv.append((rid, times))


async def _client(port: int, streams: int, max_tokens: int, duration: float) -> tuple[list, float]:
    url = f"http://127.0.0.1:{port}/v1/completions"
    recv: list = []
    conn = aiohttp.TCPConnector(limit=streams + 8)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(_stream_loop(session, url, max_tokens, t0 + duration, recv) for _ in range(streams))
        )
        elapsed = time.perf_counter() - t0
    return recv, elapsed


def run_phase(name: str, time_scale: float, streams: int, max_tokens: int, duration: float) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(child, time_scale, max(256, streams)))
    proc.start()
    try:
        port = parent.recv()
        recv, elapsed = asyncio.run(_client(port, streams, max_tokens, duration))
        parent.send("stop")
        due, server_cpu, jumped = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    lat = []
    tokens = 0
    for rid, times in recv:
        tokens += len(times)
        for t_recv, t_due in zip(times, due.get(rid, ()), strict=False):
            lat.append(t_recv - t_due)
    lat.sort()
    q = statistics.quantiles(lat, n=100) if len(lat) > 100 else [float("nan")] * 99
    out = {
        "phase": name,
        "time_scale": time_scale,
        "streams": streams,
        "requests": len(recv),
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "server_cpu_us_per_token": server_cpu / max(1, tokens) * 1e6,
        "lag_wall_s": jumped / time_scale,
    }
    print(
        f"{name:<11} time-scale {time_scale:<9.4g} {streams} streams  {len(recv):>5} requests  "
        f"{tokens:>7} tokens in {elapsed:5.1f}s = {out['tokens_per_s']:>7.0f} tokens/s   "
        f"server-added latency per token p50 {out['p50_ms']:6.2f} ms  p99 {out['p99_ms']:6.2f} ms   "
        f"server CPU {out['server_cpu_us_per_token']:.0f} us/token   engine fell behind by "
        f"{out['lag_wall_s']:.2f} s",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per phase (default 8)")
    ap.add_argument("--rate", type=float, default=2000.0, help="paced phase: engine tokens/s (default 2000)")
    args = ap.parse_args()
    print(
        f"agentkv serve overhead: {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f} at start), "
        "server and client in separate processes; every request streams the same 32-token prompt"
    )
    sat = run_phase("saturation", 1e6, args.streams, args.max_tokens, args.duration)
    eng = Engine(EngineConfig(max_model_len=4096, max_num_seqs=max(256, args.streams)))
    step = eng.cost.step_time([], [PROMPT_LEN + args.max_tokens // 2] * args.streams)  # a mid-request decode
    scale = step / (args.streams / args.rate)  # one decode step per streams/rate wall seconds
    paced = run_phase("paced", scale, args.streams, args.max_tokens, args.duration)
    ok = sat["tokens_per_s"] >= 2000 and args.streams >= 200
    print(
        f"target (>= 2,000 tokens/s with >= 200 concurrent streams): {'met' if ok else 'NOT met'}; the paced "
        f"engine decodes {args.rate:.0f} tokens/s in steady state, {paced['tokens_per_s']:.0f}/s over the "
        "whole phase (prefill steps and request turnover included)"
    )


if __name__ == "__main__":
    main()
