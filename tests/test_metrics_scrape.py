"""The one /metrics text parser (agentkv.metrics.scrape) on real pages, and on hostile ones: nothing a
server sends makes it raise, and the router's scrape loop outlives any page a worker serves."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cluster import free_ports
from fuzzutil import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentkv.metrics import scrape
from agentkv.metrics.scrape import MetricsSnapshot, parse_prometheus, snapshot
from agentkv.route import workers
from agentkv.route.index import TenantIndex
from agentkv.route.workers import WorkerPool, WorkerSpec, parse_load

# GET /metrics of a live vLLM 0.32.0 (CPU build, tests/vllm's tiny Llama, --max-num-seqs 2) while
# it served 6 requests: 2 running, 4 waiting (also reported as vllm:num_requests_waiting_by_reason)
VLLM_PAGE = (Path(__file__).parent / "fixtures" / "metrics" / "vllm-0.32.0-cpu.txt").read_text()


def sglang_page() -> str:
    """A /metrics page as SGLang writes one: prometheus_client with SGLang's metric names, HELP and
    labels (sglang/srt/metrics/collector.py, scheduler_metrics_mixin.py), two data-parallel ranks."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank"]
    running = Gauge("sglang:num_running_reqs", "The number of running requests.", labels, registry=reg)
    queue = Gauge(
        "sglang:num_queue_reqs", "The number of requests in the waiting queue.", labels, registry=reg
    )
    usage = Gauge("sglang:token_usage", "The token usage.", labels, registry=reg)
    hit = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", labels, registry=reg)
    prompt = Counter(
        "sglang:prompt_tokens", "Number of prefill tokens processed.", ["model_name"], registry=reg
    )
    ttft = Histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        ["model_name"],
        registry=reg,
    )
    model = "Qwen/Qwen3-0.6B"
    for dp, (r, q, u) in enumerate([(3, 2, 0.25), (5, 0, 0.75)]):
        key = (model, "unified", "0", "0", str(dp))
        running.labels(*key).set(r)
        queue.labels(*key).set(q)
        usage.labels(*key).set(u)
        hit.labels(*key).set(0.4)
    prompt.labels(model).inc(8128902)
    ttft.labels(model).observe(0.05)
    return generate_latest(reg).decode()


def test_a_live_vllm_page():
    s = snapshot(VLLM_PAGE)
    assert s == MetricsSnapshot(
        prefix_queries=1800.0, prefix_hits=384.0, kv_usage=0.000915541313801782, running=2.0, waiting=4.0
    )
    assert parse_load(VLLM_PAGE) == 6.0  # waiting_by_reason is another metric, not counted again
    every = parse_prometheus(VLLM_PAGE)
    assert every["vllm:num_requests_waiting_by_reason"] == [4.0, 0.0]
    assert every["vllm:prefix_cache_queries_created"]  # the page's own names, as written
    assert len(every["vllm:time_to_first_token_seconds_bucket"]) > 10


def test_an_sglang_page():
    page = sglang_page()
    assert snapshot(page) == MetricsSnapshot(kv_usage=0.5, running=8.0, waiting=2.0)
    assert parse_load(page) == 10.0
    assert parse_prometheus(page)["sglang:prompt_tokens_total"] == [8128902.0]


def test_vllm_names_win_over_sglang_ones():
    page = "sglang:num_running_reqs 9\nvllm:num_requests_running 2\nsglang:num_queue_reqs 5\n"
    assert snapshot(page) == MetricsSnapshot(running=2.0, waiting=5.0)


HOSTILE = [
    "",
    "\n\n\n",
    "garbage line",
    "{",
    "}}}} 1",
    'vllm:num_requests_running{engine="0" 3',
    "vllm:num_requests_running{engine=0} 3",
    'vllm:num_requests_running{engine="\\"} 3',
    "vllm:num_requests_running 0x10",
    "vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\nvllm:kv_cache_usage_perc -Inf",
    "vllm:num_requests_running 1e309",
    "vllm:num_requests_running",
    "vllm:num_requests_running ",
    "# TYPE vllm:num_requests_running histogram\nvllm:num_requests_running 1",
    "\x00\x01\x02 vllm:num_requests_running 1",
    "vllm:num_requests_running\t\t",
    '{"vllm:num_requests_running"} 2',
    "vllm:num_requests_running{" + 'a="b",' * 20_000 + "} 1",
    "vllm:num_requests_running 1 2 3 4 5",
    "\ufeffvllm:num_requests_running 1",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_text_never_raises(text):
    for page in (text, text + "\n" + VLLM_PAGE, VLLM_PAGE + text):
        m = parse_prometheus(page)
        assert all(math.isfinite(v) for vs in m.values() for v in vs)
        s = snapshot(page)
        assert all(v is None or math.isfinite(v) for v in (s.running, s.waiting, s.kv_usage))
        assert math.isfinite(parse_load(page))


def test_a_bad_line_costs_only_itself():
    bad = ["garbage line", "{", "vllm:num_requests_running{engine=0} 3", "vllm:num_requests_waiting 0x10"]
    lines = VLLM_PAGE.splitlines()
    mixed = "\n".join(x for i, line in enumerate(lines) for x in (line, bad[i % len(bad)]))
    assert snapshot(mixed) == snapshot(VLLM_PAGE)


@fuzz_settings(300)
@given(st.lists(st.one_of(st.text(max_size=80), st.sampled_from(VLLM_PAGE.splitlines())), max_size=40))
def test_fuzzed_lines_never_raise(lines):
    page = "\n".join(lines)
    assert all(math.isfinite(v) for vs in parse_prometheus(page).values() for v in vs)
    assert math.isfinite(parse_load(page))


def test_bounds_on_lines_and_samples():
    long = 'vllm:num_requests_running{x="' + "y" * scrape.MAX_LINE + '"} 7\nvllm:num_requests_waiting 1\n'
    assert snapshot(long) == MetricsSnapshot(waiting=1.0)
    many = "".join(f'vllm:num_requests_running{{engine="{i}"}} 1\n' for i in range(scrape.MAX_SAMPLES + 50))
    assert snapshot(many).running == scrape.MAX_SAMPLES
    assert parse_load("vllm:num_requests_running 1e308\nvllm:num_requests_waiting 1e308\n") == 0.0


class MetricsServer:
    """A worker's /metrics on loopback serving whatever page (body, headers, status) the test sets."""

    def __init__(self) -> None:
        self.body: bytes = b""
        self.headers: dict[str, str] = {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        self.status = 200
        self.served = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        (port,) = free_ports(1)
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.served += 1
        if "chunked" in self.headers.get("X-Test", ""):  # no Content-Length: the reader must stop itself
            resp = web.StreamResponse(status=self.status, headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            for i in range(0, len(self.body), 65536):
                await resp.write(self.body[i : i + 65536])
            return resp
        return web.Response(body=self.body, status=self.status, headers=self.headers)

    async def serve(self, body: bytes, **headers: str) -> None:
        """Serve `body` from now on and wait until the router has fetched it twice."""
        self.body = body
        self.headers = {"Content-Type": "text/plain; version=0.0.4; charset=utf-8", **headers}
        start = self.served
        for _ in range(1000):
            if self.served >= start + 2:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the router stopped scraping /metrics")


def test_the_router_scrape_loop_outlives_hostile_pages(monkeypatch):
    monkeypatch.setattr(workers, "MAX_METRICS_BYTES", 256 << 10)

    async def main() -> None:
        srv = MetricsServer()
        await srv.start()
        pool = WorkerPool(
            [WorkerSpec(srv.url)], TenantIndex(), 16, health_interval=3600, scrape_interval=0.01
        )
        w = pool.workers[0]
        async with aiohttp.ClientSession() as session:
            await pool.start(session)
            try:
                await srv.serve(VLLM_PAGE.encode())
                assert w.scraped_active == 6
                for bad in (b"\xff\xfe\x00garbage\x80", bytes(range(256)) * 100):
                    await srv.serve(bad)
                    assert w.scraped_active == 6  # undecodable: the last value stays
                await srv.serve(b"{" * 100_000 + b"\n}} 1\nvllm:num_requests_running NaN\n")
                assert w.scraped_active == 0  # no usable line: none running, as a page without them
                await srv.serve(VLLM_PAGE.encode())
                await srv.serve(b"vllm:num_requests_running 1e308\nvllm:num_requests_waiting 1e308\n")
                assert w.scraped_active == 0  # a sum past float range counts as none
                await srv.serve(VLLM_PAGE.encode())
                huge = b"vllm:num_requests_running 3\n" + b"#" * (300 << 10)
                await srv.serve(huge)  # past MAX_METRICS_BYTES by its Content-Length
                assert w.scraped_active == 6
                await srv.serve(huge, **{"X-Test": "chunked"})  # past it while reading
                assert w.scraped_active == 6
                await srv.serve(
                    b"vllm:num_requests_running 4\n", **{"Content-Type": "text/plain; charset=bogus"}
                )
                assert w.scraped_active == 4
                await srv.serve(
                    "vllm:num_requests_running 5\n# \xe9\n".encode("latin-1"),
                    **{"Content-Type": "text/plain; charset=latin-1"},
                )
                assert w.scraped_active == 5
                srv.status = 500
                await srv.serve(b"vllm:num_requests_running 9\n")
                assert w.scraped_active == 5
                srv.status = 200

                def boom(text: str) -> float:
                    raise RuntimeError("a parser bug")

                with monkeypatch.context() as m:
                    m.setattr(workers, "parse_load", boom)
                    await srv.serve(b"vllm:num_requests_running 9\n")
                await srv.serve(sglang_page().encode())
                assert w.scraped_active == 10  # the loop is still running
            finally:
                await pool.close()
                await srv.runner.cleanup()

    asyncio.run(main())
