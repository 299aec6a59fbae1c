"""Check that peer tools work against `agentkv serve`: AIPerf (a profile run) and sglang-router (forwarding).

Run: .venv/bin/python scripts/check_peers.py [--skip-install]

Each peer is pip-installed into its own venv under `.venv-peers/` (`aiperf`, `sglang-router`)
unless already there; a peer that cannot be installed is skipped with the reason. Neither peer
can download a tokenizer here, so the built-in tokenizer is exported as a Hugging Face
tokenizer (`.venv-peers/agentkv-tokenizer`) and passed to both. Exit status: 0 when every peer
that could be installed passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".venv-peers"
MODEL = "llama3-8b"


def say(msg: str) -> None:
    print(f"[check_peers] {msg}", flush=True)


def ensure_venv(name: str, package: str, probe: str, skip_install: bool) -> Path | None:
    """The venv's python with `package` importable as `probe`, installing it if needed; None to skip."""
    venv = PEERS / name
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([py, "-c", f"import {probe}"], capture_output=True).returncode == 0:
        return py
    if skip_install:
        say(f"SKIP {package}: not installed in {venv} and --skip-install given")
        return None
    say(f"installing {package} into {venv.relative_to(ROOT)} (pip) ...")
    steps = [[sys.executable, "-m", "venv", str(venv)], [str(py), "-m", "pip", "install", "-q", package]]
    for cmd in steps:
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            tail = [ln for ln in (p.stderr or p.stdout).splitlines() if not ln.startswith("WARNING")][-3:]
            say(f"SKIP {package}: cannot install ({' | '.join(tail) or 'exit ' + str(p.returncode)})")
            return None
    return py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def generation_tokens(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = re.search(rb"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", r.read(), re.M)
    return float(m.group(1)) if m else 0.0


def start_server() -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "agentkv.cli",
        "serve",
        "--port",
        "0",
        "--time-scale",
        "100",
        "--max-model-len",
        "8192",
        "--served-model-name",
        MODEL,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    m = re.search(r"http://[\d.]+:\d+", line)
    if not m:
        proc.kill()
        raise SystemExit(f"agentkv serve did not start: {line!r}")
    return proc, m.group(0)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def check_aiperf(py: Path, url: str, tokenizer: Path) -> bool:
    """A short AIPerf profile (chat, streaming) must complete every request without errors."""
    aiperf = py.parent / "aiperf"
    n = 8
    with tempfile.TemporaryDirectory() as art:
        cmd = [
            str(aiperf),
            "profile",
            "--model",
            MODEL,
            "--url",
            url,
            "--endpoint-type",
            "chat",
            "--streaming",
            "--tokenizer",
            str(tokenizer),
            "--use-server-token-count",
            "--request-count",
            str(n),
            "--concurrency",
            "2",
            "--synthetic-input-tokens-mean",
            "300",
            "--output-tokens-mean",
            "16",
            "--artifact-dir",
            art,
            "--ui-type",
            "none",
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=art)
        export = Path(art) / "profile_export_aiperf.json"
        if p.returncode != 0 or not export.exists():
            say(f"FAIL aiperf: exit {p.returncode}: {(p.stdout + p.stderr)[-800:]}")
            return False
        d = json.loads(export.read_text())
    done = d.get("request_count", {}).get("avg", 0)
    errors = (d.get("error_request_count") or {}).get("avg", 0)
    osl = d.get("output_sequence_length", {}).get("avg")
    ttft = d.get("time_to_first_token", {}).get("p50")
    ok = done == n and not errors and osl == 16
    say(
        f"{'PASS' if ok else 'FAIL'} aiperf: {done:.0f}/{n} requests, {errors or 0:.0f} errors, output length "
        f"{osl}, TTFT p50 {ttft:.1f} ms (aiperf {d.get('aiperf_version')})"
    )
    return ok


def check_sglang_router(py: Path, url: str, tokenizer: Path) -> bool:
    """sglang-router with --worker-urls must register the worker and forward completions and chat."""
    port = free_port()
    cmd = [
        str(py),
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        url,
        "--policy",
        "cache_aware",
        "--tokenizer-path",
        str(tokenizer),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    with tempfile.TemporaryFile(mode="w+") as log:
        router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            ok, detail = _through_router(router, f"http://127.0.0.1:{port}", url)
        finally:
            stop(router)
        if detail is None:
            log.seek(0)
            detail = f"no answer through the router: {log.read()[-800:]}"
    out = subprocess.run(
        [str(py), "-m", "pip", "show", "sglang-router"], capture_output=True, text=True
    ).stdout
    v = re.search(r"^Version: (.+)$", out, re.M)
    say(f"{'PASS' if ok else 'FAIL'} sglang-router {v.group(1) if v else '?'}: {detail}")
    return ok


def _through_router(router: subprocess.Popen, router_url: str, url: str) -> tuple[bool, str | None]:
    """Send a completion (retrying while the router starts) and a chat; check agentkv served them."""
    before = generation_tokens(url)
    deadline = time.monotonic() + 60
    while True:
        try:
            body = http_json(
                router_url + "/v1/completions",
                {"model": MODEL, "prompt": "hello from the router", "max_tokens": 5},
                timeout=5,
            )
            break
        except OSError:
            if time.monotonic() > deadline or router.poll() is not None:
                return False, None
            time.sleep(0.5)
    chat = http_json(
        router_url + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    moved = generation_tokens(url) - before
    ok = body["usage"]["completion_tokens"] == 5 and chat["usage"]["completion_tokens"] == 3 and moved >= 8
    return (
        ok,
        f"completion and chat forwarded to agentkv serve ({moved:.0f} tokens generated behind the router)",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-install", action="store_true", help="use only peers already installed")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from agentkv.trace.tokens import write_hf_tokenizer

    PEERS.mkdir(exist_ok=True)
    tokenizer = write_hf_tokenizer(PEERS / "agentkv-tokenizer")
    peers = [
        ("aiperf", "aiperf", "aiperf", check_aiperf),
        ("sglang-router", "sglang-router", "sglang_router", check_sglang_router),
    ]
    pythons = {name: ensure_venv(name, pkg, probe, args.skip_install) for name, pkg, probe, _ in peers}
    if not any(pythons.values()):
        say("no peer could be installed; nothing checked")
        return 0
    server, url = start_server()
    say(f"agentkv serve at {url}")
    results = []
    try:
        for name, _, _, check in peers:
            if pythons[name] is not None:
                results.append(check(pythons[name], url, tokenizer))
    finally:
        stop(server)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
