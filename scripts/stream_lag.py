"""Time the first-token lag under N decoding streams on a target (issue 17): `calib.streamlag`.

`python scripts/stream_lag.py URL MODEL [ROUNDS [OUT [NEW [BG_NEW BG_OUT [PAST]]]]]`: the timed
prompt's output and cold tokens, the background streams' cold and output tokens, the timed prompt's
cached prefix. Prints per level the client's and the server's (/metrics) median TTFT and their
difference, then `fit_stream_lag` and the samples as JSON."""

from __future__ import annotations

import asyncio
import json
import statistics

from agentkv.bench.client import BenchClient
from agentkv.calib import streamlag
from agentkv.calib.probes import Prober
from agentkv.calib.streamlag import StreamLag, fit_stream_lag


async def main(url: str, model: str, rounds: int, out: int, new: int, past: int) -> None:
    async with BenchClient(url) as client:
        prober = Prober(client, model, 32, 1.0)
        lag = StreamLag(rounds=rounds, out=out, new=new, past=past)
        for _ in range(2):  # warm-up
            await prober._send(prober._ids(32), 1)
        while not lag.done:
            await lag.pair(prober)
    doc = lag.result()
    for n in lag.levels:
        c = statistics.median(lag.client[n])
        s = [v for v in lag.server[n] if v is not None]
        sm = statistics.median(s) if s else float("nan")
        print(f"n={n}: client {c * 1e3:.1f} ms, server {sm * 1e3:.1f} ms, lag {(c - sm) * 1e3:.1f} ms")
    print(json.dumps({"fit": fit_stream_lag(doc), "samples": doc}))


def _args():
    """The command line (integers checked by argparse: a bad one is a one-line error, exit 2)."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("model")
    for name, default in (("rounds", 5), ("out", 1), ("new", 32), ("bg_new", None), ("bg_out", None)):
        ap.add_argument(name, type=int, nargs="?", default=default)
    ap.add_argument("past", type=int, nargs="?", default=0)
    return ap.parse_args()


if __name__ == "__main__":
    a = _args()
    if a.bg_new is not None:  # background streams' cold tokens and output tokens
        streamlag.BG_NEW, streamlag.BG_OUT = a.bg_new, a.bg_out if a.bg_out is not None else streamlag.BG_OUT
    asyncio.run(main(a.url, a.model, a.rounds, a.out, a.new, a.past))
