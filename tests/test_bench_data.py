"""bench's requests and datasets from the command line, against a real loopback server: --header,
--extra-body and the API key arrive (and the key is written nowhere), sessions over the target's
max_model_len are dropped or trimmed and reported, --cycle repeats the set with fresh ids and cache."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from agentkv.bench.testserver import StreamTestServer
from agentkv.cli import main
from agentkv.metrics.records import read_records
from agentkv.trace.formats.agentx import write_agentx
from agentkv.trace.model import Request, Session, Trace

KEY = "sk-test-7f3a9c1e55d04b2a"


class ThreadServer:
    """A StreamTestServer on its own event loop in a thread, so the CLI can run in this one."""

    def __init__(self, **kw):
        self.loop = asyncio.new_event_loop()
        self.srv = StreamTestServer(**kw)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> StreamTestServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.srv.start(), self.loop).result(10)
        return self.srv

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.srv.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def session_trace(tid: str, sizes: list[int], base: int = 0) -> Trace:
    """Turns whose prompts are `sizes` tokens (16-token blocks), each extending the last."""
    reqs = [
        Request(t=i * 0.001, input_tokens=n, output_tokens=2, hash_ids=list(range(base, base + -(-n // 16))))
        for i, n in enumerate(sizes)
    ]
    return Trace(id=tid, block_size=16, session=Session(id=tid, requests=reqs))


def write(folder: Path, *traces: Trace) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for t in traces:
        write_agentx(t, folder / f"{t.id}.json")
    return folder


def bench(capsys, url: str, traces: Path, out: Path, *flags: str) -> tuple[int, str, str]:
    code = main(
        [
            "bench",
            str(traces),
            "--target",
            url,
            "--out",
            str(out),
            "--no-report",
            "-q",
            "--idle-gap-cap",
            "none",
        ]
        + ["--duration", "none", *flags]
    )
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_header_extra_body_and_key_reach_the_server_and_the_key_is_written_nowhere(tmp_path, capsys):
    traces = write(tmp_path / "t", session_trace("a", [64, 96]))
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY + "\n")
    out = tmp_path / "out"
    with ThreadServer(api_key=KEY) as srv:
        code, so, se = bench(
            capsys,
            srv.url,
            traces,
            out,
            "--api-key-file",
            str(keyfile),
            "--header",
            "X-Tenant: team-a",
            "--header",
            "X-Api-Key:second-secret",
            "--extra-body",
            '{"top_k": 1, "temperature": 0.5, "priority": -3}',
        )
    assert code == 0, se
    assert len(srv.seen) == 2 and len(srv.seen_headers) == 2
    for h, body in zip(srv.seen_headers, srv.seen, strict=True):
        assert h["Authorization"] == f"Bearer {KEY}" and h["X-Tenant"] == "team-a"
        assert h["X-Api-Key"] == "second-secret"
        assert body["top_k"] == 1 and body["temperature"] == 0.5 and body["priority"] == -3
        assert body["stream"] is True and len(body["prompt"]) in (64, 96)  # the trace's own prompt
    config = json.loads((out / "summary.json").read_text())["config"]
    assert config["requests"]["headers"] == {"X-Tenant": "team-a", "X-Api-Key": "<redacted>"}
    assert config["requests"]["api_key"] == "<redacted>"
    assert config["requests"]["extra_body"] == {"top_k": 1, "temperature": 0.5, "priority": -3}
    for f in out.iterdir():
        text = f.read_text()
        assert KEY not in text and "second-secret" not in text, f.name
    assert KEY not in so + se and "second-secret" not in so + se


def test_key_from_the_environment_and_a_wrong_key_is_refused_without_printing_it(
    tmp_path, capsys, monkeypatch
):
    traces = write(tmp_path / "t", session_trace("a", [64]))
    monkeypatch.delenv("AGENTKV_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with ThreadServer(api_key=KEY) as srv:
        code, _, se = bench(capsys, srv.url, traces, tmp_path / "o1")
        assert code == 0 and srv.seen_headers[0]["Authorization"] == f"Bearer {KEY}", se
        code, so, se = bench(capsys, srv.url, traces, tmp_path / "o2", "--api-key", "sk-wrong-0123456789")
    assert code == 2 and "401" in se and "Traceback" not in se
    assert "sk-wrong-0123456789" not in so + se


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--extra-body", "{bad json"], "--extra-body: not valid JSON"),
        (["--extra-body", "[1, 2]"], "--extra-body: expected a JSON object"),
        (["--extra-body", '{"prompt": "x"}'], "--extra-body: prompt is built from the trace"),
        (["--header", "NoColon"], "--header: expected NAME:VALUE"),
        (["--header", "X-A: b\r\nInjected: 1"], "--header X-A: the value must be one line"),
        (["--header", "Bad Name: 1"], "not a valid HTTP header name"),
        (["--header", "Content-Length: 5"], "set by agentkv bench itself"),
        (["--api-key-file", "/nonexistent/key"], "--api-key-file: cannot read /nonexistent/key"),
        (["--api-key-file", "."], "--api-key-file: cannot read ."),
        (["--api-key", "a", "--api-key-file", "k"], "--api-key and --api-key-file"),
        (["--trace-block-size", "0"], "--trace-block-size: must be between 1"),
        (["--trace-block-size", "-64"], "--trace-block-size: must be between 1"),
        (["--trace-block-size", "99999999999"], "--trace-block-size: must be between 1"),
        (["--trace-block-size", "big"], "--trace-block-size: expected a number"),
        (["--sample", "9"], "--sample 9: the set holds only 2 traces"),
        (["--sample", "0"], "--sample: must be at least 1"),
        (["--sample", "1", "--traces-limit", "1"], "pick one"),
        (["--max-context", "lots"], "--max-context: expected a number of tokens"),
        (["--max-context", "100", "--over-context", "drop"], "nothing left to replay"),
        (["--cycle"], "--cycle repeats the traces without end"),
    ],
)
def test_bad_dataset_and_request_flags_are_one_line_errors(tmp_path, capsys, flags, needle):
    traces = write(tmp_path / "t", session_trace("a", [160]), session_trace("b", [320]))
    empty = tmp_path / "empty"
    empty.write_text("")
    flags = [str(empty) if f == "k" else f for f in flags]
    code = main(["bench", str(traces), "--target", "http://127.0.0.1:9", "-q", "--duration", "none", *flags])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_sessions_over_the_targets_max_model_len_are_dropped_or_trimmed_and_reported(tmp_path, capsys):
    # the target takes 200 tokens (prompt + max_tokens); "big" grows past it at its third turn
    traces = write(
        tmp_path / "t", session_trace("fits", [64, 96]), session_trace("big", [96, 160, 240, 320], 500)
    )
    with ThreadServer(max_model_len=200) as srv:
        code, so, se = bench(capsys, srv.url, traces, tmp_path / "drop")
        assert code == 0, se
        recs = read_records(tmp_path / "drop" / "requests.jsonl")
        assert sorted(r.trace for r in recs) == ["fits", "fits"] and all(r.ok for r in recs)
        note = "the target's max_model_len (test-model) 200 tokens"
        summary = json.loads((tmp_path / "drop" / "summary.json").read_text())
        assert any(note in n and "1 of 2 session trees dropped" in n for n in summary["notes"])
        assert note in se and "4 of 6 requests removed" in se

        code, so, se = bench(capsys, srv.url, traces, tmp_path / "trim", "--over-context", "trim")
        assert code == 0, se
        recs = read_records(tmp_path / "trim" / "requests.jsonl")
        big = sorted(r.input_tokens for r in recs if r.trace == "big")
        assert big == [96, 160] and all(r.ok for r in recs)  # cut before the 240-token turn
        assert "2 of 6 requests removed; 1 trimmed" in se

        # told not to look, the long turns overflow the window and the run says it is invalid
        code, so, se = bench(capsys, srv.url, traces, tmp_path / "none", "--max-context", "none")
        recs = read_records(tmp_path / "none" / "requests.jsonl")
        assert code == 3 and sum(r.error == "context_overflow" for r in recs) == 2


def test_cycle_repeats_the_set_with_new_session_ids_and_no_hits_across_passes(tmp_path, capsys):
    traces = write(tmp_path / "t", session_trace("a", [64, 96]))
    with ThreadServer() as srv:
        flags = ("--lanes", "1", "--cycle", "--max-requests", "6")
        code, _, se = bench(capsys, srv.url, traces, tmp_path / "fresh", *flags)
        assert code == 0, se
        recs = sorted(read_records(tmp_path / "fresh" / "requests.jsonl"), key=lambda r: r.id)
        assert [r.tree for r in recs] == ["a#0", "a#0", "a#1", "a#1", "a#2", "a#2"]
        assert [r.cached_tokens for r in recs] == [0, 64] * 3  # each pass hits only itself
        assert [r.ceiling_tokens for r in recs] == [0, 64] * 3

        code, _, se = bench(capsys, srv.url, traces, tmp_path / "shared", *flags, "--cycle-cache", "shared")
        assert code == 0, se
        recs = sorted(read_records(tmp_path / "shared" / "requests.jsonl"), key=lambda r: r.id)
        assert [r.cached_tokens for r in recs] == [0, 64, 64, 96, 64, 96]  # later passes reuse the first
    cfg = json.loads((tmp_path / "shared" / "summary.json").read_text())["config"]
    assert cfg["cycle"] == "shared"
