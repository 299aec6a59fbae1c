"""Check that simulator speed work leaves its records bit-identical: run `agentkv simulate` on a
subset of the shared Claude Code traces in several configurations (dense, overloaded, sliding
window, DeepSeek-V4, a CPU tier, linear state, a non-LRU policy, disaggregated), and compare each
requests.jsonl with a reference run's, printing each run's CPU seconds.

Run: .venv/bin/python scripts/sim_identity.py --out /tmp/new [--ref /tmp/ref] [--only dense,rr] [--traces 24]
Exit status: 0 when every compared file matches (or no --ref), 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("AGENTKV_SHARED", ROOT.parent / "shared"))

# name -> simulate flags beyond the traces (8 H200s, 64 lanes unless said)
CONFIGS = {
    "dense": ["--model", "Llama-3.1-8B", "--workers", "8", "--router", "kv_aware"],
    "rr": ["--model", "Llama-3.1-8B", "--workers", "2", "--router", "round_robin"],
    "gptoss": ["--model", "gpt-oss-120b", "--workers", "2", "--router", "kv_aware"],
    "v4flash": ["--model", "DeepSeek-V4-Flash", "-tp", "2", "--kv-cache-dtype", "fp8", "--workers", "4"],
    "v4pro": ["--model", "DeepSeek-V4-Pro", "-tp", "8", "--kv-cache-dtype", "fp8", "--workers", "1"],
    "cpu": [
        "--model",
        "Llama-3.1-8B",
        "--workers",
        "2",
        "--router",
        "round_robin",
        "--gpu-memory-utilization",
        "0.3",
        "--cpu-offload",
        "64GB",
    ],
    "qwen3next": ["--model", "Qwen3-Next-80B-A3B", "-tp", "2", "--workers", "2"],
    "lfu": ["--model", "Llama-3.1-8B", "--workers", "2", "--eviction-policy", "lfu"],
    # disaggregated: decode routed by session, and by kv_aware at the default weights
    "disagg": ["--model", "Llama-3.1-8B", "--disagg", "2p2d", "--decode-router", "session"],
    "disaggkv": ["--model", "Llama-3.1-8B", "--disagg", "2p2d", "--decode-router", "kv_aware"],
}


def run(name: str, flags: list[str], out: Path, traces: int) -> tuple[float, str]:
    """One simulate run into out/name; (CPU seconds, sha256 of its requests.jsonl)."""
    d = out / name
    argv = ["simulate", str(SHARED / "traces" / "claude-code"), "--traces-limit", str(traces)]
    argv += ["--lanes", "64", *flags, "--out", str(d), "--no-report", "-q"]
    code = f"import sys; from agentkv.cli import main; sys.argv = ['agentkv'] + {argv!r}; main()"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode not in (0, 3):  # 3: an invalid run (e.g. failed requests) still writes records
        sys.exit(f"{name}: simulate failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return cpu, hashlib.sha256((d / "requests.jsonl").read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for this run's outputs")
    ap.add_argument("--ref", type=Path, default=None, help="a reference run's --out to compare with")
    ap.add_argument("--only", default=None, help=f"comma-separated of {', '.join(CONFIGS)}")
    ap.add_argument("--traces", type=int, default=24, help="the first N traces (default 24)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        sys.exit(f"--only: unknown {', '.join(bad)} (known: {', '.join(CONFIGS)})")
    failed = 0
    for name in names:
        cpu, digest = run(name, CONFIGS[name], args.out, args.traces)
        verdict = ""
        if args.ref is not None:
            ref = args.ref / name / "requests.jsonl"
            same = ref.is_file() and hashlib.sha256(ref.read_bytes()).hexdigest() == digest
            verdict = "identical" if same else "DIFFERS" if ref.is_file() else "no reference"
            failed += not same
        print(f"{name:10} {cpu:7.2f} s CPU  {digest[:16]}  {verdict}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
