"""agentkv serve's clock: arrivals stamped exactly, so its latency histograms and the `agentkv`
timestamps of a response never exceed what the client itself measured (wall time x time scale)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from serveutil import metrics, run, serving

from agentkv.engine.config import EngineConfig
from agentkv.serve.runner import SLACK_WALL_S

TTFT, E2E = "vllm:time_to_first_token_seconds_sum", "vllm:e2e_request_latency_seconds_sum"
EPS = 1e-6  # wall seconds: float noise between the client's and the server's perf_counter readings


async def timed_stream(s, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, dict]:
    """Stream one completion; (wall seconds to the first token, to the end, the `agentkv` object)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    chunks = []
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                first = first or time.perf_counter()
                chunks.append(json.loads(line[6:]))
    end = time.perf_counter()
    assert chunks[-1]["choices"] == [] and "agentkv" in chunks[-1]
    return first - t0, end - t0, chunks[-1]["agentkv"]


@pytest.mark.parametrize("scale", [1.0, 10.0, 50.0])
def test_idle_server_histograms_fit_the_clients_wall_time(scale):
    """A request at an idle server starts at its arrival: TTFT is its prefill step, no more than the
    client waited (before the fix, the arrival was stamped up to 20 ms of wall time in the past)."""
    n = 1000

    async def main():
        async with serving(time_scale=scale) as (server, url, s):
            cost = server.runner.engine.cost
            for i in range(3):
                await asyncio.sleep(0.02)  # the loop is idle, waiting on its event
                before = await metrics(s, url)
                prompt = list(range(2000 * i + 1, 2000 * i + 1 + n))
                wall_ttft, wall_e2e, times = await timed_stream(s, url, prompt, 4)
                after = await metrics(s, url)
                ttft, e2e = after[TTFT] - before[TTFT], after[E2E] - before[E2E]
                step = cost.step_time([(n, 0)], [])
                assert step * (1 - 1e-9) <= ttft <= (wall_ttft + EPS) * scale, (step, ttft, wall_ttft * scale)
                assert ttft < e2e <= (wall_e2e + EPS) * scale, (e2e, wall_e2e * scale)
                # the response's own timestamps are the histograms' figures
                assert times["token_times"][0] == pytest.approx(ttft, abs=1e-8)
                assert times["end"] - times["arrival"] == pytest.approx(e2e, abs=1e-8)
                assert len(times["token_times"]) == 4 and times["time_scale"] == scale

    run(main())


def test_busy_server_stamps_arrivals_on_its_timeline():
    """While another request decodes, a new one's TTFT is no less than its own prefill and no more
    than the client waited, plus the lag the timeline may keep behind real time (the slack)."""
    scale = 10.0
    n = 512

    async def main():
        async with serving(EngineConfig(max_model_len=8192), time_scale=scale) as (server, url, s):
            cost = server.runner.engine.cost
            background = asyncio.create_task(timed_stream(s, url, list(range(1, 2001)), 400))
            while not server.runner.engine.num_running:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)  # decoding now
            for i in range(3):
                before = await metrics(s, url)
                wall_ttft, _, times = await timed_stream(
                    s, url, list(range(5000 + 1000 * i, 5000 + 1000 * i + n)), 2
                )
                after = await metrics(s, url)
                ttft = after[TTFT] - before[TTFT]
                assert server.runner.engine.num_running  # the background request still decodes
                step = cost.step_time([(n, 0)], [])
                assert step * (1 - 1e-9) <= ttft <= (wall_ttft + EPS + SLACK_WALL_S) * scale
                assert times["token_times"][0] == pytest.approx(ttft, abs=1e-8)
            _, _, bg = await background
            assert len(bg["token_times"]) == 400 and bg["preemptions"] == 0

    run(main())


def test_openai_client_ignores_the_agentkv_object():
    openai = pytest.importorskip("openai")

    async def main():
        async with serving() as (server, url, s):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            c = await client.completions.create(model="llama3-8b", prompt="hello agent", max_tokens=3)
            assert c.usage.completion_tokens == 3 and c.model_extra["agentkv"]["clock"] == "engine"
            stream = await client.completions.create(
                model="llama3-8b",
                prompt="hello again",
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [ch async for ch in stream]
            assert chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices
            assert len(chunks[-1].model_extra["agentkv"]["token_times"]) == 3
            await client.close()

    run(main())
