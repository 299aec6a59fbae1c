"""How fast can `agentkv bench` drive a server? 1,000 concurrent streams against an instant server.

The server (a raw asyncio protocol, one token per SSE chunk, answering at once) runs in a child
process pinned to CPU 0; the bench runs here on CPU 1, through the real path users run (replay
plan, prompts, client, per-token timestamps, records, summary). Prints output tokens/s, the
client's CPU use and TTFT counted from each request's scheduled start, beside the ceiling: the
same server read by a client that only counts tokens (what the server and host allow at all).
`--client http1,aiohttp --rounds 3` alternates the two stream transports (the same bodies, SSE
reader and per-read timestamps; only the HTTP layer differs); `--burst` has the server write each
answer at once, so reads hold many tokens and the client's own cost sets the pace. Then, where
it installs (`pip install aiperf` into .venv-peers/aiperf), AIPerf against the same server.

    .venv/bin/python benchmarks/client_overhead.py [--streams 1000] [--tokens 200] [--turns 3]
        [--client http1,aiohttp] [--rounds 3] [--loops uvloop] [--burst] [--no-aiperf]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from proccpu import cpu_seconds  # noqa: E402  (benchmarks/proccpu.py, beside this script)

TOKEN = b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":" t","finish_reason":null}]}\n\n'
DONE_TAIL = (
    b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"","finish_reason":"length"}]}'
    b"\n\n"
)
MODELS = b'{"object":"list","data":[{"id":"instant","object":"model"}]}'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


TOKEN_CHUNK = _chunk(TOKEN)


def _tail(prompt: int, total: int) -> bytes:
    """A stream's end: the finish chunk, usage, [DONE] and the last (empty) HTTP chunk."""
    usage = (
        b'data: {"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,'
        b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n' % (prompt, total)
    )
    return _chunk(DONE_TAIL) + _chunk(usage) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class _Http(asyncio.Protocol):
    """Minimal HTTP/1.1 keep-alive server: GET /v1/models, POST /v1/completions (streamed), else 404."""

    def __init__(self, streams: list, burst: bool):
        self.streams, self.burst, self.buf, self.t = streams, burst, b"", None

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data: bytes):
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].decode("latin-1")
            m = re.search(r"(?im)^content-length:\s*(\d+)", head)
            n = int(m.group(1)) if m else 0
            if len(self.buf) < head_end + 4 + n:
                return
            body = self.buf[head_end + 4 : head_end + 4 + n]
            self.buf = self.buf[head_end + 4 + n :]
            self._handle(head.split(" ", 2), body)

    def _handle(self, line, body: bytes):
        method, path = line[0], line[1]
        if method == "GET" and path == "/v1/models":
            self.t.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(MODELS), MODELS)
            )
        elif method == "POST" and path == "/v1/completions":
            m = re.search(rb'"max_tokens":\s*(\d+)', body)
            p = re.search(rb'"prompt":\s*\[([^\]]*)\]', body)
            prompt = p.group(1).count(b",") + 1 if p else 0
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            n = int(m.group(1)) if m else 16
            if self.burst:  # the whole answer in one write: reads hold many tokens, the client sets the pace
                self.t.write(head + TOKEN_CHUNK * n + _tail(prompt, n))
            else:
                self.t.write(head)
                self.streams.append([self.t, n, prompt, n])
        else:
            self.t.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")


def _serve(port_q, cpu: int | None, burst: bool) -> None:
    """The instant server: every loop tick writes one token to every open stream (round robin), or
    with `burst` each whole answer at once; pinned to `cpu` unless None."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    streams: list = []

    async def main():
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(lambda: _Http(streams, burst), "127.0.0.1", 0, backlog=4096)
        port_q.put(srv.sockets[0].getsockname()[1])
        while True:
            if not streams:
                await asyncio.sleep(0.0005)
                continue
            keep = []
            for s in streams:
                t, left, prompt, total = s
                if t.is_closing():
                    continue
                if left > 0:
                    t.write(TOKEN_CHUNK)
                    s[1] = left - 1
                    keep.append(s)
                else:
                    t.write(_tail(prompt, total))
            streams[:] = keep
            await asyncio.sleep(0)

    asyncio.run(main())


def start_server(cpu: int | None, burst: bool = False) -> tuple[mp.Process, int]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_serve, args=(q, cpu, burst), daemon=True)
    p.start()
    return p, q.get(timeout=30)


def _traces(streams: int, turns: int, tokens: int):
    from agentkv.trace.model import Request, Session, Trace

    return [
        Trace(
            id=f"s{i}",
            block_size=16,
            session=Session(
                id=f"s{i}",
                requests=[
                    Request(t=0.0, input_tokens=32, output_tokens=tokens, hash_ids=[2 * i, 2 * i + 1])
                    for _ in range(turns)
                ],
            ),
        )
        for i in range(streams)
    ]


def reference_loop() -> float:
    """Seconds this process takes for a 10M-iteration Python loop: how fast (and how busy) this core is."""
    t, x = time.process_time(), 0
    for i in range(10_000_000):
        x += i
    return time.process_time() - t


class _Drain(asyncio.Protocol):
    """A do-nothing client connection: counts SSE events and re-sends its request when a stream ends."""

    def __init__(self, counts: list[int], request: bytes):
        self.counts, self.request, self.t = counts, request, None

    def connection_made(self, transport):
        self.t = transport
        transport.write(self.request)

    def data_received(self, data: bytes):
        self.counts[0] += data.count(b"data: {")
        if data.endswith(b"0\r\n\r\n"):
            self.t.write(self.request)


def run_ceiling(port: int, streams: int, tokens: int, seconds: float = 5.0) -> dict:
    """The server's (and this host's) ceiling: the same streams read by a client that parses and times
    nothing. No client that looks at its tokens can beat it; ours is printed as a share of it."""
    import uvloop

    body = b'{"max_tokens":%d,"prompt":[1,2],"stream":true}' % tokens
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    async def go() -> dict:
        loop, counts = asyncio.get_running_loop(), [0]
        conns = [
            (await loop.create_connection(lambda: _Drain(counts, request), "127.0.0.1", port))[0]
            for _ in range(streams)
        ]
        await asyncio.sleep(1.0)  # every stream running
        n0, t0, c0 = counts[0], time.perf_counter(), time.process_time()
        await asyncio.sleep(seconds)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        for t in conns:
            t.close()
        return {"tok_s": (counts[0] - n0) / wall, "cpu": cpu / wall}

    return uvloop.run(go())


def run_ours(url: str, streams: int, turns: int, tokens: int, loop: str, client: str) -> dict:
    """One bench run (every stream a session of `turns` back-to-back requests) on this process's CPU,
    its streams through `client` (the BenchClient transport: http1 or aiohttp)."""
    from agentkv.bench.live import run_loop
    from agentkv.bench.runner import BenchConfig, BenchRun

    cfg = BenchConfig(
        target=url,
        lanes=streams,
        duration=None,
        idle_gap_cap=None,
        monitor_gpu=False,
        sample_every=1.0,
        transport=client,
    )
    with tempfile.TemporaryDirectory() as tmp:
        run = BenchRun(cfg, _traces(streams, turns, tokens), out=Path(tmp))
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        res = run_loop(run.run(), loop)
        wall = time.perf_counter() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    s = res.summary
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    peak = max((p.in_flight for p in s.timeline), default=0)
    return {
        "loop": loop,
        "client": client,
        "requests": s.requests,
        "failed": s.failed,
        "tokens": s.output_tokens,
        "wall": wall,
        "tok_s": s.output_tokens / wall,
        "cpu": cpu / wall,
        "us_per_token": cpu / max(s.output_tokens, 1) * 1e6,
        "peak_in_flight": peak,
        "ttft_p50": s.ttft.p50,
        "ttft_p99": s.ttft.p99,
    }


def _tokenizer_dir(path: Path) -> Path:
    """A small local word-level tokenizer for AIPerf's synthetic prompts (it must not download one)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0}
    for i in range(1, 5000):
        w, n = "", i
        while n:
            n, r = divmod(n - 1, 26)
            w = chr(97 + r) + w
        vocab["\u0120" + w] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "model_max_length": 1 << 20}
        )
    )
    return path


def run_aiperf(url: str, streams: int, requests: int, tokens: int, cpu: int) -> str:
    """AIPerf against the same server, pinned to the client's core (its own venv under .venv-peers/aiperf)."""
    import json

    venv = ROOT / ".venv-peers" / "aiperf"
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        py = shutil.which("python3") or sys.executable
        r = subprocess.run(
            f"{py} -m venv {venv} && {venv}/bin/pip install -q aiperf",
            shell=True,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if r.returncode or not exe.exists():
            return f"skipped: pip install aiperf failed ({(r.stderr or r.stdout).strip().splitlines()[-1:]})"
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as tokdir:
        cmd = [
            str(exe),
            *f"profile --model instant --url {url} --endpoint-type completions --streaming "
            f"--concurrency {streams} --request-count {requests} --synthetic-input-tokens-mean 32 "
            f"--output-tokens-mean {tokens} --extra-inputs ignore_eos:true --ui-type none "
            "--use-server-token-count".split(),
            *["--artifact-dir", tmp, "--tokenizer", str(_tokenizer_dir(Path(tokdir)))],
        ]
        c0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        try:
            r = subprocess.run(["taskset", "-c", str(cpu), *cmd], capture_output=True, text=True, timeout=900)
        except (subprocess.TimeoutExpired, OSError) as e:
            return f"skipped: aiperf did not finish ({e})"
        wall = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
        try:
            data = json.loads((Path(tmp) / "profile_export_aiperf.json").read_text())
            tput = data["output_token_throughput"]["avg"]
            ttft = data["time_to_first_token"]
        except (OSError, KeyError, ValueError):
            tail = " | ".join(
                ln.strip("│ ")
                for ln in (r.stdout + r.stderr).splitlines()
                if "Reason" in ln or "Error:" in ln
            )
            return f"skipped: aiperf exited {r.returncode} without results ({tail[:400]})"
        return (
            f"{tput:,.0f} output tokens/s (its own figure), {requests:,} requests x {tokens} tokens at "
            f"concurrency {streams}; {cpu_s / wall:.2f} cores over its {wall:.0f} s run (startup included) = "
            f"{requests * tokens / max(cpu_s, 1e-9):,.0f} tokens per CPU-second; "
            f"its TTFT p50 {ttft.get('p50', float('nan')):,.0f} ms p99 {ttft.get('p99', float('nan')):,.0f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1000, help="concurrent streams (lanes)")
    ap.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    ap.add_argument("--turns", type=int, default=3, help="requests per stream")
    ap.add_argument("--loops", default="uvloop,asyncio", help="event loops to measure")
    ap.add_argument("--client", default="http1", help="stream transports to measure: http1, aiohttp or both")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of every client x loop")
    ap.add_argument("--burst", action="store_true", help="server writes each answer at once (client-bound)")
    ap.add_argument("--no-aiperf", action="store_true")
    a = ap.parse_args()
    if not set(a.client.split(",")) <= {"http1", "aiohttp"}:
        ap.error(f"--client: expected http1, aiohttp or both, got {a.client!r}")
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = cpus[0], cpus[-1]
    srv, port = start_server(server_cpu, a.burst)
    os.sched_setaffinity(0, {client_cpu})
    url = f"http://127.0.0.1:{port}"
    print(
        f"instant server on CPU {server_cpu}, client on CPU {client_cpu}; {a.streams} streams x {a.turns} "
        f"requests x {a.tokens} tokens{', each answer written at once (--burst)' if a.burst else ''}"
    )
    try:
        print(
            f"reference: a 10M-iteration Python loop takes {reference_loop():.2f} s of CPU on the client core "
            f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
        )
        ceiling = run_ceiling(port, a.streams, a.tokens)
        print(
            f"ceiling (a client that only counts tokens): {ceiling['tok_s']:,.0f} output tokens/s, "
            f"client {ceiling['cpu']:.2f} cores"
        )
        runs = [(c, lp) for _ in range(a.rounds) for c in a.client.split(",") for lp in a.loops.split(",")]
        for client, loop in runs:  # A, B, A, B: drift in the host's load falls on both alike
            s0 = cpu_seconds(srv.pid)
            r = run_ours(url, a.streams, a.turns, a.tokens, loop, client)
            server_cores = (cpu_seconds(srv.pid) - s0) / r["wall"]
            print(
                f"agentkv bench ({r['client']}, {r['loop']}): {r['tok_s']:,.0f} output tokens/s, "
                f"{r['tokens']:,} tokens each timestamped, {r['requests']:,} requests ({r['failed']} failed), "
                f"peak {r['peak_in_flight']:,} in flight, {r['wall']:.1f} s; client {r['cpu']:.2f} cores, "
                f"{r['us_per_token']:.2f} us CPU per token, server {server_cores:.2f} cores; TTFT from "
                f"scheduled start p50 {r['ttft_p50'] * 1000:,.0f} ms p99 {r['ttft_p99'] * 1000:,.0f} ms; "
                f"{r['tok_s'] / ceiling['tok_s']:.0%} of the ceiling",
                flush=True,
            )
        if not a.no_aiperf:
            print(f"AIPerf: {run_aiperf(url, a.streams, a.streams * a.turns, a.tokens, client_cpu)}")
    finally:
        srv.terminate()
        srv.join(5)


if __name__ == "__main__":
    main()
