"""Every `agentkv ...` command in README.md and docs/*.md code blocks runs as written (shortened).

How it reads the docs: each fenced code block; a line starting `agentkv ` (or `$ agentkv `), with
`\\` continuations joined and `# comments` dropped, is a command. A block right after a line
`<!-- no-run: REASON -->` is skipped (a synopsis with placeholders, an excerpt); say why.

How it runs them, in-process through `agentkv.cli.main`, one temporary folder per doc (so
`--out out/x` then `compare out/x ...` chain), in doc order:
- shortened: `simulate` at most 40 requests; `bench` at most 6 requests, `--duration none`, 100x
  time scale, against one shared embedded `agentkv serve` (the `--target` a doc names is replaced);
- the public trace sets a doc tells the reader to clone stand in as local files (no network
  here): `kv-cache-tester/traces` -> the bundled sample, Mooncake's conversation trace -> a small
  Mooncake JSONL;
- parse-only (flags checked by argparse, nothing run), with the reason in PARSE_ONLY: servers that
  run until stopped, commands that need a live GPU server or a Ray cluster.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from pathlib import Path

import pytest

from agentkv.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BUNDLED = ROOT / "agentkv" / "data" / "traces"
MOONCAKE = "Mooncake/FAST25-release/traces/conversation_trace.jsonl"
NO_RUN = re.compile(r"<!--\s*no-run:\s*(\S.*?)\s*-->")
PARSE_ONLY = {  # first words (or a flag) -> why the command is only parsed
    ("serve",): "a server: it runs until stopped",
    ("route",): "a router: it runs until stopped",
    ("calibrate",): "probes a live GPU server for minutes",
    ("security", "side-channel"): "times a live server for minutes",
    ("--ray",): "needs a Ray cluster (pip install 'agentkv[ray]')",
}
SIM_MAX, BENCH_MAX = 40, 6


def commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of every `agentkv` command in the runnable code blocks of `path`."""
    out, block, skip, prev, start = [], None, False, "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            if block is None:
                block, skip = [], bool(NO_RUN.search(prev))
            else:
                out += [] if skip else _join(block)
                block = None
        elif block is not None:
            block.append((n, line))
        if line.strip():
            prev = line
        start = n
    assert block is None, f"{path.name}: unclosed code block (line {start})"
    return out


def _join(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Commands of one block, continuation lines joined."""
    out, cur, first = [], "", 0
    for n, line in block:
        text = line.strip().removeprefix("$ ")
        if not cur and not text.startswith("agentkv "):
            continue
        first = first or n
        cur += " " + text.rstrip("\\").strip()
        if not text.endswith("\\"):
            out.append((first, cur.strip()))
            cur, first = "", 0
    return out


def _parse_only(argv: list[str]) -> str | None:
    for key, why in PARSE_ONLY.items():
        flag = key[0].startswith("--") and any(a == key[0] or a.startswith(key[0] + "=") for a in argv)
        if flag or tuple(argv[: len(key)]) == key:
            return why
    return None


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag value` (replacing the doc's own value, if any)."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return [*argv[:i], flag, value, *argv[i + 2 :]]
        if a.startswith(flag + "="):
            return [*argv[:i], flag, value, *argv[i + 1 :]]
    return [*argv, flag, value]


def _cap(argv: list[str], flag: str, most: int) -> list[str]:
    cur = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag), None)
    return _set(argv, flag, str(most if cur is None or int(cur) > most else cur))


def shorten(argv: list[str], target: str, mooncake: Path) -> list[str]:
    """The doc's command as the test runs it (see the module docstring)."""
    swap = {"kv-cache-tester/traces": str(BUNDLED), MOONCAKE: str(mooncake)}
    argv = [swap.get(a.rstrip("/"), a) for a in argv]
    argv = [str(ROOT / a) if a.startswith("agentkv/data/") else a for a in argv]
    if argv[0] == "simulate":
        argv = _cap(argv, "--max-requests", SIM_MAX)
    if argv[0] == "bench":
        argv = _cap(argv, "--max-requests", BENCH_MAX)
        if "--warmup" in argv:  # a count warm-up leaves some of the capped requests measured
            argv = _set(argv, "--warmup", "2")
        argv = _set(_set(_set(argv, "--duration", "none"), "--time-scale", "100"), "--target", target)
    return argv


def _mooncake(path: Path) -> Path:
    """A small Mooncake JSONL: 30 requests, 512-token blocks, some shared prefixes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(30):
        blocks = 2 + i % 3  # a shared two-block prefix, then the request's own blocks
        ids = [0, 1, *(100 + 10 * i + k for k in range(blocks - 2))]
        lines.append(
            {"timestamp": i * 400, "input_length": 512 * blocks, "output_length": 20, "hash_ids": ids}
        )
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


ALL = [(doc, n, cmd) for doc in DOCS for n, cmd in commands(doc)]


def test_docs_have_commands_and_no_machine_paths():
    """The extraction finds the README's examples; no command points at a folder only the
    developers' machines have (../shared): README.md#traces says where traces come from."""
    assert sum(1 for d, _, _ in ALL if d.name == "README.md") >= 5
    bad = [f"{d.name}:{n}: {c}" for d, n, c in ALL if "../shared" in c or "/work/" in c]
    assert not bad, f"commands using paths a fresh clone lacks: {bad}"


@pytest.fixture(scope="module")
def target():
    from agentkv.bench.embedded import EmbeddedServer

    with EmbeddedServer(time_scale=100, max_model_len=200_000) as srv:
        yield srv.url


@pytest.mark.parametrize("doc", [d for d in DOCS if any(x[0] == d for x in ALL)], ids=lambda d: d.name)
def test_doc_commands_run(doc, target, tmp_path):
    mooncake = _mooncake(tmp_path / MOONCAKE)
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        for n, cmd in commands(doc):
            argv = shlex.split(cmd, comments=True)[1:]
            where = f"{doc.name}:{n}: {cmd}"
            if _parse_only(argv):
                try:
                    build_parser().parse_args(argv)
                except SystemExit:
                    pytest.fail(f"{where}: argparse refuses it")
                continue
            run = shorten(argv, target, mooncake)
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = main(run)
                except SystemExit as e:
                    rc = e.code
            assert rc == 0, f"{where}\n  ran: agentkv {shlex.join(run)}\n  exit {rc}: {err.getvalue()[-800:]}"
    finally:
        os.chdir(old)


# imported but not a base dependency, and why (everything else `make install` must bring)
OPTIONAL_IMPORTS = {
    "ray": "the [ray] extra: simulate --sweep --ray",
    "pynvml": "bench's GPU figures when NVML is installed (absent: the summary says why)",
}
IMPORT_NAMES = {"zmq": "pyzmq", "prometheus_client": "prometheus-client"}


def test_make_install_brings_every_import():
    """`make install` (the base dependencies) covers what agentkv imports, `--tokenizer` included."""
    import ast
    import sys
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    imported = set()
    for path in (ROOT / "agentkv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third = {m for m in imported if m not in sys.stdlib_module_names and m != "agentkv"}
    missing = {m for m in third - set(OPTIONAL_IMPORTS) if IMPORT_NAMES.get(m, m).lower() not in names}
    assert "tokenizers" in third and not missing, f"imported but not in [project] dependencies: {missing}"
