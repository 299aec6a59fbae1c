"""agentkv serve over real HTTP on loopback (server in-process on the test's event loop)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from serveutil import metrics, run, serving, settle, sse

from agentkv.engine.config import EngineConfig
from agentkv.gate.options import HttpLimits
from agentkv.trace.tokens import decode, encode, output_ids


def test_streaming_completions_both_prompt_forms():
    ids = list(range(1000, 1040))

    async def main():
        async with serving() as (server, url, s):
            for prompt in (ids, decode(ids)):
                chunks = await sse(
                    s,
                    url + "/v1/completions",
                    {
                        "prompt": prompt,
                        "max_tokens": 7,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                )
                *tokens, last = chunks
                assert last["choices"] == [] and last["usage"]["completion_tokens"] == 7
                assert last["usage"]["prompt_tokens"] == 40
                assert last["usage"]["total_tokens"] == 47
                assert all(c["object"] == "text_completion" and c["model"] == "llama3-8b" for c in chunks)
                assert len({c["id"] for c in chunks}) == 1
                text = "".join(c["choices"][0]["text"] for c in tokens)
                assert encode(text) == output_ids(7)
                assert [c["choices"][0]["finish_reason"] for c in tokens][-1] == "length"
                assert all(c["choices"][0]["finish_reason"] is None for c in tokens[:-1])
            # the second request's prompt was the same ids: its full blocks were cached
            assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

    run(main())


def test_non_streaming_completion_and_chat():
    async def main():
        async with serving(served_model_name="agent") as (server, url, s):
            async with s.post(
                url + "/v1/completions", json={"prompt": "hi there", "max_tokens": 3, "model": "agent"}
            ) as r:
                body = await r.json()
            assert r.status == 200 and body["object"] == "text_completion" and body["model"] == "agent"
            assert body["choices"][0]["finish_reason"] == "length"
            assert encode(body["choices"][0]["text"]) == output_ids(3)
            assert body["usage"] == {
                "prompt_tokens": 2,
                "completion_tokens": 3,
                "total_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            async with s.post(
                url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            ) as r:
                body = await r.json()
            assert body["object"] == "chat.completion"
            msg = body["choices"][0]["message"]
            assert msg["role"] == "assistant" and encode(msg["content"]) == output_ids(4)
            assert body["usage"]["completion_tokens"] == 4

    run(main())


def test_chat_stream_and_cached_tokens_rise_on_the_second_turn():
    system = "You are a coding agent. " + decode(range(2000, 2100))
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the failing test."}]

    async def turn(s, url, messages):
        chunks = await sse(
            s,
            url + "/v1/chat/completions",
            {
                "messages": messages,
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
                "session_id": "s1",
            },
        )
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
        return text, chunks[-1]["usage"]

    async def main():
        async with serving() as (server, url, s):
            reply, u1 = await turn(s, url, turn1)
            assert u1["prompt_tokens_details"]["cached_tokens"] == 0
            turn2 = [
                *turn1,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Now run it."},
            ]
            _, u2 = await turn(s, url, turn2)
            assert u2["prompt_tokens"] > u1["prompt_tokens"]
            # every full block of turn 1's prompt is a hit on turn 2
            assert u2["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"] // 16 * 16 > 0

    run(main())


def test_metrics_parse_and_move():
    async def main():
        async with serving() as (server, url, s):
            before = await metrics(s, url)
            assert before["vllm:prefix_cache_queries_total"] == 0
            assert (
                before[
                    "vllm:cache_config_info{block_size=16,cache_dtype=auto,enable_prefix_caching=True,"
                    "gpu_memory_utilization=0.9,num_cpu_blocks=0,num_gpu_blocks="
                    f"{server.runner.engine.num_gpu_blocks},prefix_cache_retention_interval=0,"
                    "prefix_caching_hash_algo=xxhash}"
                ]
                == 1
            )
            prompt = list(range(500, 564))  # 4 full blocks
            for _ in range(2):
                async with s.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5}) as r:
                    assert r.status == 200
            m = await metrics(s, url)
            assert m["vllm:prefix_cache_queries_total"] == 128
            assert m["vllm:prefix_cache_hits_total"] == 48  # the last prompt token is always recomputed
            assert m["agentkv:prefix_cache_hits_by_tier_total{medium=GPU}"] == 48
            assert m["vllm:prompt_tokens_total"] == 128
            assert m["vllm:generation_tokens_total"] == 10
            assert m["vllm:request_success_total{finished_reason=length}"] == 2
            assert m["vllm:time_to_first_token_seconds_count"] == 2
            assert m["vllm:inter_token_latency_seconds_count"] == 8
            assert m["vllm:e2e_request_latency_seconds_count"] == 2
            assert m["vllm:time_to_first_token_seconds_sum"] > 0
            assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            assert m["vllm:kv_cache_usage_perc"] == 0
            assert m["vllm:num_preemptions_total"] == 0

    run(main())


def test_bad_inputs_are_openai_errors_and_logs_hold_no_prompt(caplog):
    secret = "TOPSECRET"
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"prompt": secret, "max_tokens": "9"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": [secret, secret]}).encode(), 400, "prompt"),
        (json.dumps({"prompt": secret + " ba" * 1100, "max_tokens": 10}).encode(), 400, "prompt"),  # > 1024
        (json.dumps({"prompt": secret, "max_tokens": -1}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": secret, "max_tokens": 10**15}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": ""}).encode(), 400, "prompt"),
        (json.dumps({"prompt": secret, "cache_salt": ""}).encode(), 400, "cache_salt"),
        (json.dumps({"prompt": secret, "cache_salt": "a/b"}).encode(), 400, "cache_salt"),
        (json.dumps({"prompt": secret, "n": 2}).encode(), 400, "n"),
        (json.dumps({"prompt": secret, "model": "other"}).encode(), 404, "model"),
        (json.dumps({"prompt": secret + " " * 9000}).encode(), 413, None),  # over --max-body-size
    ]

    async def main():
        cfg = EngineConfig(max_model_len=1024)
        async with serving(cfg, http=HttpLimits(max_body_bytes=8192)) as (server, url, s):
            for body, status, param in cases:
                async with s.post(
                    url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    err = await r.json()
                assert r.status == status, (status, err)
                assert set(err["error"]) == {"message", "type", "param", "code"}
                assert err["error"]["code"] == status and err["error"]["param"] == param
                assert secret not in err["error"]["message"]
            async with s.post(
                url + "/v1/chat/completions", json={"messages": [{"role": "x", "content": secret}]}
            ) as r:
                assert r.status == 400
            assert not server.runner.engine.requests

    with caplog.at_level(logging.DEBUG, logger="agentkv"):
        run(main())
    assert "-> 400" in caplog.text and "-> 413" in caplog.text
    assert secret not in caplog.text


def test_client_disconnect_aborts_and_frees_blocks():
    async def main():
        async with serving(time_scale=1.0) as (server, url, s):  # real time: 500 tokens take seconds
            host, port = url.removeprefix("http://").split(":")
            for stream in (True, False):
                body = json.dumps({"prompt": list(range(100)), "max_tokens": 500, "stream": stream}).encode()
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body
                )
                await writer.drain()
                if stream:
                    assert b"200 OK" in await reader.readuntil(b"\r\n\r\n")
                    await reader.readuntil(b"\n\n")  # the first token
                else:
                    for _ in range(500):
                        if server.runner.engine.kv_usage > 0:
                            break
                        await asyncio.sleep(0.005)
                assert server.runner.engine.kv_usage > 0
                writer.close()
                await settle(server)
                assert server.runner.engine.kv_usage == 0
                assert server.runner.engine.num_running == 0
            m = await metrics(s, url)
            assert m["vllm:request_success_total{finished_reason=abort}"] == 2
            assert m["vllm:kv_cache_usage_perc"] == 0

    run(main())


def test_openai_client():
    openai = pytest.importorskip("openai")

    async def main():
        async with serving() as (server, url, s):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            models = await client.models.list()
            assert [m.id for m in models.data] == ["llama3-8b"]
            c = await client.completions.create(model="llama3-8b", prompt="hello agent", max_tokens=4)
            assert c.usage.completion_tokens == 4 and encode(c.choices[0].text) == output_ids(4)
            stream = await client.chat.completions.create(
                model="llama3-8b",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"cache_salt": "tenant-a"},
            )
            chunks = [ch async for ch in stream]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert encode(text) == output_ids(6)
            assert chunks[-1].usage.completion_tokens == 6
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
            with pytest.raises(openai.BadRequestError) as e:
                await client.completions.create(model="llama3-8b", prompt="x", max_tokens=-2)
            assert e.value.status_code == 400
            await client.close()

    run(main())


def test_info_endpoints_and_tokenize():
    async def main():
        async with serving() as (server, url, s):
            async with s.get(url + "/health") as r:
                assert r.status == 200
            for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/version"):
                async with s.get(url + path) as r:
                    assert r.status == 200 and isinstance(await r.json(), dict)
            async with s.post(url + "/tokenize", json={"prompt": decode([7, 8, 9])}) as r:
                assert (await r.json())["tokens"] == [7, 8, 9]
            async with s.post(url + "/detokenize", json={"tokens": [7, 8, 9]}) as r:
                assert (await r.json())["prompt"] == decode([7, 8, 9])

    run(main())


def test_many_concurrent_streams():
    async def main():
        async with serving() as (server, url, s):
            bodies = [{"prompt": list(range(i, i + 30)), "max_tokens": 20, "stream": True} for i in range(40)]
            results = await asyncio.gather(*(sse(s, url + "/v1/completions", b) for b in bodies))
            for chunks in results:
                assert encode("".join(c["choices"][0]["text"] for c in chunks)) == output_ids(20)
            await settle(server)
            assert server.runner.engine.kv_usage == 0

    run(main())


def test_chunked_body_over_the_limit_and_http2_probes(caplog):
    async def main():
        async with serving(http=HttpLimits(max_body_bytes=4096)) as (server, url, s):

            async def chunks():
                for _ in range(10):
                    yield b" " * 1000

            async with s.post(url + "/v1/completions", data=chunks()) as r:  # no Content-Length
                assert r.status == 413
                assert (await r.json())["error"]["code"] == 413
            # an HTTP/2 prior-knowledge preface, as sglang-router's connection-mode probe sends
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            await writer.drain()
            assert b" 400 " in await reader.readline()
            writer.close()
            async with s.get(url + "/health") as r:
                assert r.status == 200

    with caplog.at_level(logging.INFO):
        run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_session_header_feeds_the_session_eviction_policy():
    prompt = list(range(4000, 4100))

    async def main():
        async with serving(EngineConfig(max_model_len=4096, eviction_policy="session")) as (server, url, s):
            seen = []
            policy = server.runner.engine.pool.policy
            orig_paused, orig_resumed = policy.session_paused, policy.session_resumed
            policy.session_paused = lambda sid, now, reason: (
                seen.append(("paused", sid)),
                orig_paused(sid, now, reason),
            )
            policy.session_resumed = lambda sid, now: (seen.append(("resumed", sid)), orig_resumed(sid, now))
            usages = []
            for turn in range(2):
                async with s.post(
                    url + "/v1/completions",
                    json={"prompt": prompt + [turn], "max_tokens": 3},
                    headers={"x-session-id": "agent-7"},
                ) as r:
                    usages.append((await r.json())["usage"])
            assert seen == [("resumed", "agent-7"), ("paused", "agent-7")] * 2
            assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 96

    run(main())


def test_long_text_prompt_is_tokenized_exactly():
    ids = [(i * 7919) % 128000 for i in range(60_000)]  # ~400 KB of text: parsed off the event loop

    async def main():
        async with serving(EngineConfig(max_model_len=65536)) as (server, url, s):
            for prompt in (decode(ids), ids):
                async with s.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
                    usage = (await r.json())["usage"]
                assert usage["prompt_tokens"] == 60_000
            assert usage["prompt_tokens_details"]["cached_tokens"] == 59_984  # same ids: every full block

    run(main())
