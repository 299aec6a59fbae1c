"""`agentkv serve` refuses a token-id list of max_model_len ids or more on its raw bytes (#18):
over real HTTP the 400 is vLLM's over-length error, and the ids are never decoded into Python ints."""

from __future__ import annotations

import time
import tracemalloc

from serveutil import run, serving

from agentkv.engine.config import EngineConfig
from agentkv.gate.options import HttpLimits

MAX_LEN = 256
IDS = 400_000


async def _post(s, url: str, body: bytes):
    async with s.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


def test_long_id_list_is_refused_before_decoding():
    ids = ",".join(str(100_000 + i % 20_000) for i in range(IDS))  # 7 bytes an id: ~2.8 MB
    huge = b'{"model": "llama3-8b", "max_tokens": 1, "prompt": [' + ids.encode() + b"]}"
    nested = b'{"max_tokens": 1, "prompt": [[' + ids.encode() + b"]]}"  # vLLM's [[ids]] form

    async def main():
        # parse_processes=0: large bodies are parsed in a thread of this process, where tracemalloc sees them
        http = HttpLimits(parse_processes=0)
        async with serving(EngineConfig(max_model_len=MAX_LEN), http=http) as (_, url, s):
            out = {}
            for name, body in (("huge", huge), ("nested", nested)):
                tracemalloc.start()
                t0 = time.perf_counter()
                status, err = await _post(s, url, body)
                out[name] = (status, err, time.perf_counter() - t0, tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()
            edge = ",".join(str(1000 + i) for i in range(MAX_LEN)).encode()
            out["edge"] = await _post(s, url, b'{"max_tokens": 1, "prompt": [' + edge + b"]}")
            under = ",".join(str(1000 + i) for i in range(MAX_LEN - 1)).encode()
            out["under"] = await _post(s, url, b'{"max_tokens": 1, "prompt": [' + under + b"]}")
            return out

    out = run(main())
    for name in ("huge", "nested"):
        status, err, secs, peak = out[name]
        assert status == 400, err
        e = err["error"]
        assert e["param"] == "prompt" and e["type"] == "BadRequestError"
        assert e["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens.")
        assert f"your request has {IDS} input tokens" in e["message"]
        # decoded, 400,000 ids are ~14 MB of Python ints; the raw body is 2.8 MB, read once
        assert peak < 3 * len(huge), (
            f"{name}: peak {peak / 2**20:.1f} MiB for a {len(huge) / 2**20:.1f} MiB body"
        )
        assert secs < 10
    status, err = out["edge"]  # max_model_len ids: too long, as before
    assert status == 400 and f"has {MAX_LEN} input tokens" in err["error"]["message"]
    status, body = out["under"]  # one fewer, with one output token: fits
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == MAX_LEN - 1 and body["usage"]["completion_tokens"] == 1
