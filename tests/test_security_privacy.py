"""Prompt privacy: no prompt or completion text in any log, metric or error message of serve, route
and bench, at DEBUG (the most verbose level), including for requests that fail.

serve and route run as real subprocesses at `--log-level debug`; every prompt carries a marker
string, in good requests and in ones that are refused at each validation step. bench runs
against a deliberately leaky server that quotes prompts back in errors, malformed chunks and
stream errors, and streams completions that carry the marker; bench's output must hold none of it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import threading

import pytest
from aiohttp import web
from cluster import CLI, Cluster, get_text, post, write_keys

pytestmark = pytest.mark.slow
MARK = "Zqxv" + secrets.token_hex(4)  # a marker no log line could hold by chance
KEYS = {"key-a": "tenant-a"}


def _c(body: dict, ok=frozenset({200})) -> tuple[str, bytes, set[int]]:
    return "/v1/completions", json.dumps(body).encode(), set(ok)


def _chat(body: dict, ok=frozenset({200})) -> tuple[str, bytes, set[int]]:
    return "/v1/chat/completions", json.dumps(body).encode(), set(ok)


_BAD = frozenset({400})


def _completion_bodies() -> list[tuple[str, bytes, set[int]]]:
    m, c, bad = MARK, _c, _BAD
    return [
        c({"prompt": f"hello {m} world", "max_tokens": 8}),
        c(
            {
                "prompt": f"tell {m}",
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ),
        c({"prompt": [m, m]}, bad),  # batched
        c({"prompt": m, "max_tokens": "x"}, bad),  # wrong type
        c({"prompt": m + " ba" * 3000, "max_tokens": 10}, bad),  # longer than --max-model-len
        c({"prompt": m, "max_tokens": 10**9}, bad),
        c({"prompt": m, "max_tokens": 0}, bad),
        c({"prompt": m, "n": 3}, bad),
        c({"prompt": m, "echo": True}, bad),
        c({"prompt": [[1, 2, m]]}, bad),
        c({"prompt": m, "model": "no-such-model"}, {404}),
        c({"prompt": m, "stream": False, "stream_options": {"include_usage": True}}, bad),
        c({"prompt": m + " " * 70_000}, {413}),  # over --max-body-size
        ("/v1/completions", b'{"prompt": "' + m.encode() + b'", broken', {400}),  # malformed JSON
        ("/v1/completions", b'["' + m.encode() + b'"]', {400}),  # not an object
    ]


def _chat_and_tokenize_bodies() -> list[tuple[str, bytes, set[int]]]:
    m, j, chat, bad = MARK, json.dumps, _chat, _BAD
    return [
        chat({"messages": [{"role": "user", "content": f"my secret is {m}"}], "max_tokens": 4}),
        chat(
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": m,
                        "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "f", "arguments": m}}
                        ],
                    },
                    {"role": "tool", "content": m, "tool_call_id": "1"},
                ],
                "max_tokens": 2,
            }
        ),
        chat({"messages": [{"role": "wizard", "content": m}]}, bad),
        chat({"messages": [{"role": "user", "content": [{"type": "image_url", "text": m}]}]}, bad),
        chat({"messages": m}, bad),
        chat({"messages": []}, bad),
        chat(
            {
                "messages": [{"role": "user", "content": m}],
                "add_generation_prompt": True,
                "continue_final_message": True,
            },
            bad,
        ),
        ("/tokenize", j({"prompt": m}).encode(), {200}),
        ("/tokenize", j({"messages": [{"role": "user", "content": m}]}).encode(), {200}),
        ("/tokenize", j({"other": m}).encode(), {400}),
        ("/detokenize", j({"tokens": [m]}).encode(), {400}),
    ]


def _bodies() -> list[tuple[str, bytes, set[int]]]:
    """(path, body, acceptable statuses): good requests and each kind of refusal, all with the marker."""
    return _completion_bodies() + _chat_and_tokenize_bodies()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("privacy")
    with Cluster(tmp, 1, replay=False) as c:
        c.start_workers(
            time_scale=20, log_level="debug", extra=("--max-model-len", "2048", "--max-body-size", "64KiB")
        )
        c.start_router(
            [
                "--api-keys",
                str(write_keys(tmp, KEYS)),
                "--router-secret",
                "x",
                "--tokenizer",
                "builtin",
                "--log-level",
                "debug",
            ]
        )
        c.wait_ready()
        yield c.procs, c.worker_url(0), c.router_url()


def test_serve_and_route_never_log_prompts_or_completions(cluster):
    procs, worker, router = cluster
    completions: list[str] = []
    checked = 0
    for base, key in ((worker, None), (router, "key-a")):
        for path, body, ok in _bodies():
            if base == router and path in ("/tokenize", "/detokenize"):
                continue  # the router serves the OpenAI endpoints only
            status, out = post(base + path, body, key=key)
            assert status in ok, (base, path, body[:80], status, out[:300])
            text = out.decode("utf-8", "replace")
            if status == 200 and path.startswith("/v1/"):
                completions += _texts(text)
            else:
                assert MARK not in text, (path, text[:300])  # error messages never quote the prompt
            checked += 1
    # the router's own refusals: no key, bad JSON, a JSON array
    for body, key, status in (
        (json.dumps({"prompt": MARK}).encode(), None, 401),
        (json.dumps({"prompt": MARK}).encode(), "wrong", 401),
        (b'{"prompt": "' + MARK.encode(), "key-a", 400),
        (json.dumps([MARK]).encode(), "key-a", 400),
    ):
        got, out = post(router + "/v1/completions", body, key=key)
        assert got == status and MARK not in out.decode()
        checked += 1
    metrics = get_text(worker + "/metrics") + get_text(router + "/metrics")
    logs = procs.output("worker0") + procs.output("router")
    print(f"\n{checked} requests with the marker; {len(logs.splitlines())} log lines at DEBUG checked")
    assert (
        "-> 400" in logs and "-> 413" in logs and "Using selector" in logs
    )  # refusals and DEBUG lines logged
    assert MARK not in logs and MARK.lower() not in logs.lower()
    assert MARK not in metrics
    long_outputs = [t for t in completions if len(t) >= 20]
    assert long_outputs
    for t in long_outputs:
        assert t not in logs and t not in metrics


def _texts(raw: str) -> list[str]:
    """Completion texts of a JSON or SSE response."""
    if raw.startswith("data:"):
        parts = []
        for line in raw.splitlines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:]).get("choices", []):
                    parts.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
        return ["".join(parts)]
    d = json.loads(raw)
    return [ch.get("text") or (ch.get("message") or {}).get("content") or "" for ch in d.get("choices", [])]


class LeakyServer:
    """An OpenAI-ish server that misbehaves with prompt text: it quotes prompts in 400 errors, in a
    malformed chunk and in a stream error, and streams completions carrying the marker."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.n = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _chat(self, request):
        body = await request.json()
        prompt = body["messages"][0]["content"]
        self.prompts.append(prompt)
        self.n += 1
        kind = self.n % 4
        if kind == 1:
            return web.json_response(
                {"error": {"message": f"bad prompt: {prompt[:200]}", "code": 400}}, status=400
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if kind == 2:
            await resp.write(f"data: {{{MARK} {prompt[:100]} not json\n\n".encode())
        elif kind == 3:
            await resp.write(
                b"data: "
                + json.dumps({"error": {"message": f"stream failed on {prompt[:100]}"}}).encode()
                + b"\n\n"
            )
        else:
            for i in range(3):
                chunk = {"choices": [{"index": 0, "delta": {"content": f" {MARK} completion {i}"}}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def __enter__(self) -> LeakyServer:
        self._thread.start()

        async def start():
            app = web.Application()
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/chat/completions", self._chat)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_bench_keeps_prompts_and_completions_out_of_its_output(tmp_path):
    trace = {
        "id": "p",
        "block_size": 16,
        "requests": [
            {"t": i * 0.01, "type": "n", "in": 96, "out": 3, "hash_ids": [i, i + 1, i + 2]} for i in range(12)
        ],
    }
    (tmp_path / "p.json").write_text(json.dumps(trace))
    out = tmp_path / "out"
    with LeakyServer() as srv:
        run = subprocess.run(
            [
                *CLI,
                "bench",
                str(tmp_path / "p.json"),
                "--target",
                srv.url,
                "--api",
                "chat",
                "--prompt-mode",
                "text",
                "--duration",
                "none",
                "--lanes",
                "2",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        prompts = list(srv.prompts)
    assert run.returncode == 3, run.stderr[-2000:]  # 9 of 12 failed: an invalid run, outputs written
    assert len(prompts) == 12
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == 9 and set(summary["errors"]) == {"http_400", "bad_chunk", "stream_error"}
    texts = {"stdout": run.stdout, "stderr": run.stderr}
    texts.update({p.name: p.read_text("utf-8", "replace") for p in out.iterdir()})
    assert set(texts) >= {"requests.jsonl", "summary.json", "report.html"}
    records = [json.loads(line) for line in texts["requests.jsonl"].splitlines()]
    details = {r["error"]: r["error_detail"] for r in records if not r.get("ok", True)}
    assert "bad prompt: [prompt]" in details["http_400"], details  # the message kept, not the prompt
    assert "stream failed on [prompt]" in details["stream_error"], details
    for name, text in texts.items():
        assert MARK not in text, name
        for p in prompts:
            for i in range(0, len(p) - 40, 40):
                assert p[i : i + 40] not in text, (name, p[i : i + 40])
