"""`agentkv serve --disagg`: prefill and decode workers behind the proxy, as vLLM's NIXL proxy drives
them (kv_transfer_params), in-process over real HTTP on loopback, and the CLI as a real subprocess."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import aiohttp
import pytest
from cluster import free_port_range, stop_process
from serveutil import FAST, run, serving
from test_serve_cli import read_lines, start

from agentkv.cli import main
from agentkv.engine.config import EngineConfig
from agentkv.engine.kv_move import kv_transfer_seconds
from agentkv.gate.options import HttpLimits
from agentkv.kv.transfer import nvlink
from agentkv.serve.pd_proxy import PDProxy

BUNDLED = Path(__file__).resolve().parents[1] / "agentkv" / "data" / "traces"
CFG = EngineConfig(max_model_len=8192)
PROMPT = list(range(1, 1001))  # 1,000 tokens: 62 full blocks of 16 and a partial one


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


def test_decode_waits_for_its_kv_and_moves_only_what_it_lacks():
    slow = nvlink(0.5)  # 0.5 GB/s: 1,000 tokens of Llama-3.1-8B KV (131 MB) take ~0.26 engine s

    async def go():
        async with (
            serving(CFG, time_scale=1.0) as (prefill, p_url, session),
            serving(CFG, time_scale=1.0, kv_link=slow) as (decode, d_url, _),
        ):
            ask = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            status, handoff = await _post(session, p_url, ask)
            assert status == 200, handoff
            params = handoff["kv_transfer_params"]
            assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 63
            assert params["remote_port"] == prefill.port and params["tp_size"] == 1
            expect, _ = kv_transfer_seconds(decode.runner.engine, 0, len(PROMPT) - 1, 1, slow)
            waits = []
            for _ in range(2):  # the second time the decode worker caches the prompt itself
                t0 = decode.runner.event_time()
                body = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
                status, out = await _post(session, d_url, body)
                assert status == 200, out
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
                assert out["usage"]["completion_tokens"] == 4
                assert "agentkv" not in out  # its engine times would start when the KV arrived
                waits.append(decode.runner.last_arrival - t0)
            return expect, waits

    expect, (first, second) = run(go())
    assert expect > 0.2
    assert expect <= first < expect + 0.2  # decode admitted only once its KV arrived
    assert second < first - expect + 0.05  # 992 tokens cached there: only the last block's worth moves


def test_proxy_runs_prefill_then_decode_and_keeps_a_session_on_its_prefill_worker():
    async def go():
        async with contextlib.AsyncExitStack() as stack:
            workers = [await stack.enter_async_context(serving(CFG)) for _ in range(3)]
            (p0, u0, session), (p1, u1, _), (d0, ud, _) = workers
            proxy = PDProxy([u0, u1], [ud], "127.0.0.1", 0, HttpLimits())
            url = await proxy.start()
            stack.push_async_callback(proxy.stop)
            usages = []
            for turn in range(3):
                body = {"prompt": PROMPT[: 400 + 200 * turn], "max_tokens": 5, "stream": True}
                body["stream_options"] = {"include_usage": True}
                async with session.post(
                    url + "/v1/completions", json=body, headers={"x-session-id": "s1"}
                ) as r:
                    assert r.status == 200
                    data = [line[6:].strip() async for line in r.content if line.startswith(b"data: ")]
                assert data[-1] == b"[DONE]"
                usages.append(json.loads(data[-2])["usage"])
            status, refused = await _post(session, url, {"prompt": [1, 2], "model": "nope"})
            async with session.post(url + "/v1/completions", data=b"{nope") as r:
                bad = (r.status, await r.json())
            counts = [w[0].runner.engine.stats.requests_finished for w in workers]
            return usages, counts, (status, refused), bad

    usages, counts, (status, refused), bad = run(go())
    assert [u["completion_tokens"] for u in usages] == [5, 5, 5]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [399, 599, 799]
    assert sorted(counts[:2]) == [0, 3] and counts[2] == 3  # one prefill worker took the whole session
    assert status == 404 and "does not exist" in refused["error"]["message"]  # the worker's own refusal
    assert bad[0] == 400 and "not valid JSON" in bad[1]["error"]["message"]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"do_remote_decode": True, "do_remote_prefill": True}, "exclusive"),
        ({"do_remote_prefill": True}, "remote_block_ids"),
        ({"do_remote_prefill": True, "remote_block_ids": [0], "tp_size": 0}, "tp_size"),
        ({"do_remote_prefill": True, "remote_block_ids": "all"}, "kv_transfer_params"),
    ],
)
def test_bad_transfer_params_are_400s(params, message):
    async def go():
        async with serving(CFG) as (_, url, session):
            return await _post(
                session, url, {"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": params}
            )

    status, body = run(go())
    assert status == 400 and message in body["error"]["message"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--disagg", "prefill=0,decode=1", "--port", "20000"], "--disagg"),
        (["--disagg", "prefill=1", "--port", "20000"], "--disagg"),
        (["--disagg", "prefill=1,decode=1", "--workers", "2", "--port", "20000"], "--workers"),
        (["--disagg", "prefill=1,decode=1", "--port", "0"], "--port"),
        (["--disagg", "prefill=1,decode=1", "--port", "20000", "--kv-link-gbps", "0"], "--kv-link-gbps"),
    ],
)
def test_bad_disagg_flags_are_one_line_errors(args, message, capsys):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bench_against_a_disaggregated_pair(tmp_path):
    """The CLI as users run it: a 1+1 pair with its proxy, a bench of a bundled trace through it."""
    base = free_port_range(3)
    proc = start("--disagg", "prefill=1,decode=1", "--port", str(base), "--time-scale", str(FAST))
    try:
        lines = read_lines(proc, r"^agentkv serve: (proxy|worker)", 3, timeout=120)
        assert any(f"proxy: http://127.0.0.1:{base} " in line for line in lines)
        trace = sorted(BUNDLED.glob("*.json.gz"))[0]
        args = [
            "bench",
            "--target",
            f"http://127.0.0.1:{base}",
            str(trace),
            "--max-requests",
            "6",
            "--over-context",
            "trim",
        ]
        assert (
            main([*args, "--time-scale", str(FAST), "--duration", "none", "--out", str(tmp_path), "-q"]) == 0
        )
    finally:
        assert stop_process(proc, 30) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["valid"] and summary["succeeded"] == 6
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    # as vLLM's decode reports it: the prompt's KV arrived, all but the last token counts as cached
    assert all(r["cached_tokens"] == r["input_tokens"] - 1 for r in records)
    assert re.search(r"Traceback", proc.stderr.read()) is None
