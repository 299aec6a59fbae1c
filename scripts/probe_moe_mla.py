"""Time a DeepSeek-V3 MoE layer's routed experts and its absorbed MLA decode attention on one GPU
(held out of the cost fit, like the long-context points), and print the cost model's prediction.

Usage: python scripts/probe_moe_mla.py [--out FILE] [--quick]   (needs torch and a CUDA GPU)
       python scripts/probe_moe_mla.py --compare FILE             (CPU: predicted vs measured)
One GPU of an 8-GPU expert-parallel group (dp=8, --enable-expert-parallel): it holds 256/8 = 32 whole
experts (bf16, random weights) and runs the tokens routed to them; `batch` is the whole group's tokens.
MLA decode: 128 heads on one GPU's DP rank (attention is replicated under DP), scores against the
512 + 64 latent, values the 512 latent dims (vLLM's absorbed path), one query per sequence.
JSON: {"device", "torch", "parts": {"deepseek-v3-moe": {"decode": [{batch, layer_GBps, layer_ms,
model_ms}]}, "deepseek-v3-mla": {"decode": [{batch, ctx, ...}]}}}, as shared/calibration's files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_long_context import _timeit  # noqa: E402  (the long-context probe's CUDA-event median)

HIDDEN, EXPERTS, TOPK, WIDTH, GROUP = 7168, 256, 8, 2048, 8
HEADS, LATENT, ROPE, LAYERS, MOE_LAYERS = 128, 512, 64, 61, 58
MOE_BATCHES = (1, 8, 32, 64, 128, 256, 1024)
MLA_GRID = ((1, 4096), (1, 32768), (16, 8192), (64, 8192), (64, 32768), (256, 4096))


def route(batch: int, seed: int = 0) -> list[int]:
    """Tokens per expert on GPU 0 (experts 0 .. E/GROUP-1) when `batch` tokens each pick TOPK experts."""
    rng, counts = random.Random(seed), [0] * (EXPERTS // GROUP)
    for _ in range(batch):
        for e in rng.sample(range(EXPERTS), TOPK):
            if e < len(counts):
                counts[e] += 1
    return counts


def layer_bytes(kind: str, batch: int, ctx: int = 0) -> float:
    """Bytes the timed part must read: the GPU's touched experts (bf16) or the batch's latents."""
    if kind == "moe":
        return sum(1 for c in route(batch) if c) * 3 * HIDDEN * WIDTH * 2
    return batch * ctx * (LATENT + ROPE) * 2


def point(kind: str, layer_ms: float, **grid) -> dict:
    """One measured point as the calibration file's: grid, layer_GBps, layer_ms, model_ms (x layers)."""
    layers = MOE_LAYERS if kind == "moe" else LAYERS
    gbps = layer_bytes(kind, grid["batch"], grid.get("ctx", 0)) / (layer_ms * 1e6)
    return {**grid, "layer_GBps": gbps, "layer_ms": layer_ms, "model_ms": layer_ms * layers}


def predict(kind: str, p: dict) -> float:
    """The cost model's ms for one layer's part that the probe times (H200, dp=8 with EP, tp=1)."""
    from agentkv.engine.cost import CostModel
    from agentkv.engine.cost_terms import pnorm

    cm = CostModel("h200", "deepseek-v3", tp=1, dp=GROUP, ep=True, weight_dtype="bf16")
    t = cm.terms()
    if kind == "moe":
        moe, rank_tokens = t.moe, p["batch"] / GROUP
        w, fl = moe.weights_s(rank_tokens) / moe.frac, rank_tokens * moe.flop_tok / moe.frac
        return pnorm(w, fl, t.overlap_k) * 1e3
    g = t.groups[0]
    return g.time(0, 0, 0, 0, 0, p["batch"], p["batch"] * p["ctx"], p["ctx"]) / g.frac * 1e3


def compare(doc: dict) -> list[tuple[str, dict, float, float]]:
    """(kind, point, measured ms, predicted ms) for every point of a probe file."""
    out = []
    for kind in ("moe", "mla"):
        for p in doc["parts"].get(f"deepseek-v3-{kind}", {}).get("decode", []):
            out.append((kind, p, p["layer_ms"], predict(kind, p)))
    return out


def probe_moe(torch, batches) -> list[dict]:
    """Routed experts on one GPU: gate/up GEMM, SiLU x up, down GEMM per touched expert (eager)."""
    dev, dt, n = "cuda", torch.bfloat16, EXPERTS // GROUP
    w1 = torch.randn(n, 2 * WIDTH, HIDDEN, device=dev, dtype=dt) * 0.01
    w2 = torch.randn(n, HIDDEN, WIDTH, device=dev, dtype=dt) * 0.01
    out = []
    for batch in batches:
        xs = [torch.randn(c, HIDDEN, device=dev, dtype=dt) if c else None for c in route(batch)]

        def run(xs=xs):
            for e, x in enumerate(xs):
                if x is not None:
                    gu = x @ w1[e].T
                    (torch.nn.functional.silu(gu[:, :WIDTH]) * gu[:, WIDTH:]) @ w2[e].T

        out.append(point("moe", _timeit(run, 20, 3), batch=batch))
    return out


def probe_mla(torch, grid) -> list[dict]:
    """Absorbed MLA decode: q (B, H, 576) . latent (B, ctx, 576) -> softmax -> . latent[..., :512]."""
    out = []
    for batch, ctx in grid:
        q = torch.randn(batch, HEADS, LATENT + ROPE, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(batch, ctx, LATENT + ROPE, device="cuda", dtype=torch.bfloat16)

        def run(q=q, kv=kv):
            s = torch.softmax((q @ kv.transpose(1, 2)).float() * 0.07, dim=-1).to(q.dtype)
            s @ kv[:, :, :LATENT]

        out.append(point("mla", _timeit(run, 20, 3), batch=batch, ctx=ctx))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the JSON here (default: stdout only)")
    ap.add_argument("--quick", action="store_true", help="three points of each kind")
    ap.add_argument("--compare", metavar="FILE", help="print predicted vs measured for a probe file")
    args = ap.parse_args()
    if args.compare:
        for kind, p, meas, pred in compare(json.loads(Path(args.compare).read_text())):
            grid = ", ".join(f"{k}={v}" for k, v in p.items() if k in ("batch", "ctx"))
            print(f"{kind} {grid}: measured {meas:.3f} ms, predicted {pred:.3f} ms ({pred / meas - 1:+.1%})")
        return 0
    try:
        import torch
    except ImportError:
        print("probe_moe_mla: needs torch (pip install torch) and a CUDA GPU", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("probe_moe_mla: no CUDA device; nothing measured", file=sys.stderr)
        return 2
    moe, mla = (MOE_BATCHES[::3], MLA_GRID[::2]) if args.quick else (MOE_BATCHES, MLA_GRID)
    doc = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "parts": {
            "deepseek-v3-moe": {"decode": probe_moe(torch, moe)},
            "deepseek-v3-mla": {"decode": probe_mla(torch, mla)},
        },
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
