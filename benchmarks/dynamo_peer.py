"""Dynamo's offline replay as a peer for benchmarks/simulate.py (b): its Python 3.10 venv with
ai-dynamo, agentkv's cost model as its timing table, and one replay run through scripts/dynamo_replay.py."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

from agentkv.engine.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
DYNAMO_VENV = ROOT / ".venv-peers" / "dynamo"
DYNAMO_PIN = "ai-dynamo==1.6.1"


def perf_table(engine: Engine, path: Path) -> None:
    """agentkv's cost model as a Dynamo mocker timing table (npz): prefill ms by new tokens in a
    step, decode ms by (active KV tokens, context length), batch = tokens / context."""
    cost, cap = engine.cost, engine.num_gpu_blocks * engine.config.block_size
    isl = np.unique(np.geomspace(1, engine.config.max_num_batched_tokens, 96).round())
    ttft = [cost.step_time([(int(n), 0)], []) * 1e3 for n in isl]
    kv = np.linspace(0, cap, 64)
    ctx = np.unique(np.geomspace(1, engine.max_model_len, 64).round())
    seqs = engine.config.max_num_seqs
    batch = [[int(min(seqs, max(1, round(k / c)))) for c in ctx] for k in kv]
    itl = np.array(
        [
            [cost.decode_steps(b, b * int(c), int(c), 1)[0] * 1e3 for b, c in zip(row, ctx, strict=True)]
            for row in batch
        ]
    )
    np.savez(
        path,
        prefill_isl=isl,
        prefill_ttft_ms=np.array(ttft),
        decode_active_kv_tokens=kv,
        decode_context_length=ctx,
        decode_itl=itl,
    )


def dynamo_python() -> tuple[str | None, str]:
    """The 3.10 interpreter with ai-dynamo, creating the venv when missing; (None, reason) if not."""
    env = os.environ.get("DYNAMO_PYTHON")
    if env:
        return env, f"DYNAMO_PYTHON={env}"
    py = DYNAMO_VENV / "bin" / "python"
    if not py.exists():
        bases = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10.*/bin/python"))) or [
            p for p in [shutil.which("python3.10")] if p
        ]
        if not bases:
            return None, "no Python 3.10 found (pyenv ~/.pyenv/versions/3.10.* or python3.10 on PATH)"
        print(f"    creating {DYNAMO_VENV} with {bases[-1]} and installing {DYNAMO_PIN} ...")
        try:
            subprocess.run([bases[-1], "-m", "venv", str(DYNAMO_VENV)], check=True, capture_output=True)
            subprocess.run(
                [str(py), "-m", "pip", "install", "-q", DYNAMO_PIN],
                check=True,
                capture_output=True,
                timeout=1800,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            err = (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()[-1:]
            return None, f"installing {DYNAMO_PIN} failed: {' '.join(err) or e}"
    probe = subprocess.run([str(py), "-c", "from dynamo.replay import run_trace_replay"], capture_output=True)
    if probe.returncode:
        return (
            None,
            f"{py} cannot import dynamo.replay: {probe.stderr.decode(errors='replace').strip()[-300:]}",
        )
    return str(py), str(py)


def run_dynamo(py: str, cfg: dict) -> dict:
    env = {**os.environ, "DYN_LOG": "error"}
    proc = subprocess.run(
        [py, str(ROOT / "scripts" / "dynamo_replay.py"), json.dumps(cfg)],
        capture_output=True,
        env=env,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(f"dynamo replay failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
