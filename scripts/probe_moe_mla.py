"""Time DeepSeek-V3 MoE routed experts, absorbed MLA decode and DeepSeek-V3.2 sparse (top-k) MLA decode
on one GPU (held out of the cost fit, like the long-context points), and print the cost model's prediction.

Usage: python scripts/probe_moe_mla.py [--out FILE] [--quick]   (needs torch and a CUDA GPU)
       python scripts/probe_moe_mla.py --compare FILE             (CPU: predicted vs measured)
One GPU of an 8-GPU expert-parallel group (dp=8, --enable-expert-parallel): it holds 256/8 = 32 whole
experts (random weights) and runs the tokens routed to them; `batch` is the whole group's tokens. Modes:
`eager` (one launch per kernel), `graph` (the same kernels replayed from a CUDA graph, as vLLM decodes),
`grouped` (one grouped GEMM per projection, torch._grouped_mm, as a fused-MoE kernel), `fp8` (fp8 e4m3
weights and activations, torch._scaled_mm per expert, rows padded to 16, graphed).
MLA decode: 128 heads on one GPU's DP rank (attention is replicated under DP), scores against the
512 + 64 latent, values the 512 latent dims (vLLM's absorbed path), one query per sequence.
Sparse (V3.2): the indexer's 64 heads x 128 dims score every cached key (bf16 here; the model assumes
fp8), the top 2,048 latents are gathered and attended as MLA decode.
JSON: {"device", "torch", "parts": {"deepseek-v3-moe": {"decode": [{batch, mode, layer_GBps, layer_ms,
model_ms}]}, "deepseek-v3-mla": ..., "deepseek-v32-sparse": {"decode": [{batch, ctx, mode, ...}]}}}.
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
IDX_HEADS, IDX_DIM, IDX_TOPK = 64, 128, 2048
MOE_BATCHES = (1, 8, 32, 64, 128, 256, 1024)
MOE_MODES = ("eager", "graph", "grouped", "fp8")
MLA_GRID = ((1, 4096), (1, 32768), (1, 131072), (1, 524288), (16, 8192), (64, 8192), (64, 32768), (256, 4096))
SPARSE_GRID = ((1, 32768), (1, 524288), (16, 32768), (64, 32768), (16, 131072))
PARTS = {"moe": "deepseek-v3-moe", "mla": "deepseek-v3-mla", "sparse": "deepseek-v32-sparse"}


def route(batch: int, seed: int = 0) -> list[int]:
    """Tokens per expert on GPU 0 (experts 0 .. E/GROUP-1) when `batch` tokens each pick TOPK experts."""
    rng, counts = random.Random(seed), [0] * (EXPERTS // GROUP)
    for _ in range(batch):
        for e in rng.sample(range(EXPERTS), TOPK):
            if e < len(counts):
                counts[e] += 1
    return counts


def layer_bytes(kind: str, batch: int, ctx: int = 0, mode: str = "eager") -> float:
    """Bytes the timed part must read: the GPU's touched experts, the batch's latents, or (sparse) the
    indexer keys plus the top-k latents."""
    if kind == "moe":
        wb = 1 if mode == "fp8" else 2
        return sum(1 for c in route(batch) if c) * 3 * HIDDEN * WIDTH * wb
    if kind == "sparse":
        return batch * (ctx * IDX_DIM * 2 + min(ctx, IDX_TOPK) * (LATENT + ROPE) * 2)
    return batch * ctx * (LATENT + ROPE) * 2


def point(kind: str, layer_ms: float, mode: str = "eager", **grid) -> dict:
    """One measured point as the calibration file's: grid, mode, layer_GBps, layer_ms, model_ms (x layers)."""
    layers = MOE_LAYERS if kind == "moe" else LAYERS
    gbps = layer_bytes(kind, grid["batch"], grid.get("ctx", 0), mode) / (layer_ms * 1e6)
    return {**grid, "mode": mode, "layer_GBps": gbps, "layer_ms": layer_ms, "model_ms": layer_ms * layers}


def predict(kind: str, p: dict) -> float:
    """The cost model's ms for one layer's part that the probe times (H200, dp=8 with EP, tp=1)."""
    from agentkv.engine.cost import CostModel
    from agentkv.engine.cost_terms import pnorm

    model, wdt = ("deepseek-v32", "bf16") if kind == "sparse" else ("deepseek-v3", "bf16")
    if kind == "moe" and p.get("mode") == "fp8":
        wdt = "fp8"
    t = CostModel("h200", model, tp=1, dp=GROUP, ep=True, weight_dtype=wdt).terms()
    if kind == "moe":
        moe, rank_tokens = t.moe, p["batch"] / GROUP
        w, fl = moe.weights_s(rank_tokens) / moe.frac, rank_tokens * moe.flop_tok / moe.frac
        return pnorm(w, fl, t.overlap_k) * 1e3
    b, c = p["batch"], p["ctx"]
    return sum(g.time(0, 0, 0, 0, 0, b, b * c, c) / g.frac for g in t.groups) * 1e3


def compare(doc: dict) -> list[tuple[str, dict, float, float]]:
    """(kind, point, measured ms, predicted ms) for every point of a probe file."""
    out = []
    for kind, part in PARTS.items():
        for p in doc["parts"].get(part, {}).get("decode", []):
            if "error" not in p:
                out.append((kind, p, p["layer_ms"], predict(kind, p)))
    return out


def _graphed(torch, fn):
    """`fn` captured in a CUDA graph (after warm-up on a side stream): its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _moe_fn(torch, mode: str, counts: list[int], w1, w2):
    """One MoE layer's routed-expert work on this GPU for `counts` tokens per expert, in `mode`."""
    silu, dt = torch.nn.functional.silu, torch.bfloat16
    if mode == "grouped":
        x = torch.randn(sum(counts), HIDDEN, device="cuda", dtype=dt)
        offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        w1t, w2t = w1.transpose(-2, -1), w2.transpose(-2, -1)

        def run():
            gu = torch._grouped_mm(x, w1t, offs=offs)
            torch._grouped_mm(silu(gu[:, :WIDTH]) * gu[:, WIDTH:], w2t, offs=offs)

        return run
    if mode == "fp8":
        f8, one = torch.float8_e4m3fn, torch.ones((), device="cuda")
        xs = [torch.randn(-(-c // 16) * 16, HIDDEN, device="cuda").to(f8) if c else None for c in counts]

        def run():
            for e, x in enumerate(xs):
                if x is not None:
                    gu = torch._scaled_mm(x, w1[e].T, scale_a=one, scale_b=one, out_dtype=dt)
                    h = (silu(gu[:, :WIDTH]) * gu[:, WIDTH:]).to(f8)
                    torch._scaled_mm(h, w2[e].T, scale_a=one, scale_b=one, out_dtype=dt)

        return run
    xs = [torch.randn(c, HIDDEN, device="cuda", dtype=dt) if c else None for c in counts]

    def run():
        for e, x in enumerate(xs):
            if x is not None:
                gu = x @ w1[e].T
                (silu(gu[:, :WIDTH]) * gu[:, WIDTH:]) @ w2[e].T

    return run


def probe_moe(torch, batches, modes=MOE_MODES) -> list[dict]:
    """Routed experts on one GPU: gate/up GEMM, SiLU x up, down GEMM per touched expert, per mode;
    a mode that fails on this torch/GPU is recorded as an error, not fatal."""
    n, out = EXPERTS // GROUP, []
    w1 = torch.randn(n, 2 * WIDTH, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.01
    w2 = torch.randn(n, HIDDEN, WIDTH, device="cuda", dtype=torch.bfloat16) * 0.01
    for mode in modes:
        ws = (w1.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)) if mode == "fp8" else (w1, w2)
        for batch in batches:
            try:
                fn = _moe_fn(torch, mode, route(batch), *ws)
                fn = _graphed(torch, fn) if mode in ("graph", "fp8") else fn
                out.append(point("moe", _timeit(fn, 20, 3), mode, batch=batch))
            except Exception as e:  # an API this torch lacks: say so in the file
                out.append({"batch": batch, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"probe_moe_mla: moe {mode} batch {batch}: {out[-1]['error']}", file=sys.stderr)
        del ws
    return out


def _mla(torch, q, kv):
    s = torch.softmax((q @ kv.transpose(1, 2)).float() * 0.07, dim=-1).to(q.dtype)
    return s @ kv[:, :, :LATENT]


def probe_mla(torch, grid, modes=("eager", "graph")) -> list[dict]:
    """Absorbed MLA decode: q (B, H, 576) . latent (B, ctx, 576) -> softmax -> . latent[..., :512]."""
    out = []
    for batch, ctx in grid:
        q = torch.randn(batch, HEADS, LATENT + ROPE, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(batch, ctx, LATENT + ROPE, device="cuda", dtype=torch.bfloat16)
        for mode in modes:
            fn = (lambda q=q, kv=kv: _mla(torch, q, kv)) if mode == "eager" else None
            fn = fn or _graphed(torch, lambda q=q, kv=kv: _mla(torch, q, kv))
            out.append(point("mla", _timeit(fn, 20, 3), mode, batch=batch, ctx=ctx))
        del q, kv
    return out


def probe_sparse(torch, grid) -> list[dict]:
    """V3.2 sparse decode (graphed): indexer scores over every key, top-k, gather, MLA on the k latents."""
    out, dt = [], torch.bfloat16
    for batch, ctx in grid:
        qi = torch.randn(batch, IDX_HEADS, IDX_DIM, device="cuda", dtype=dt)
        ki = torch.randn(batch, ctx, IDX_DIM, device="cuda", dtype=dt)
        wi = torch.randn(batch, IDX_HEADS, 1, device="cuda", dtype=torch.float32)
        q = torch.randn(batch, HEADS, LATENT + ROPE, device="cuda", dtype=dt)
        kv = torch.randn(batch, ctx, LATENT + ROPE, device="cuda", dtype=dt)
        k = min(ctx, IDX_TOPK)

        def run(qi=qi, ki=ki, wi=wi, q=q, kv=kv, k=k):
            score = (torch.relu(qi @ ki.transpose(1, 2)).float() * wi).sum(1)  # (B, ctx)
            idx = score.topk(k, dim=-1).indices
            sel = kv.gather(1, idx.unsqueeze(-1).expand(-1, -1, LATENT + ROPE))
            return _mla(torch, q, sel)

        out.append(point("sparse", _timeit(_graphed(torch, run), 20, 3), "graph", batch=batch, ctx=ctx))
        del qi, ki, wi, q, kv
    return out


def _gpu_state() -> dict:
    """NVML's clocks, power and temperature now (empty when pynvml is missing)."""
    try:
        import pynvml as nv

        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        return {
            "sm_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "mem_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
            "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000,
            "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "driver": nv.nvmlSystemGetDriverVersion(),
        }
    except Exception as e:  # no NVML here: the timings stand without it
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def _print_compare(path: str) -> None:
    for kind, p, meas, pred in compare(json.loads(Path(path).read_text())):
        grid = ", ".join(f"{k}={v}" for k, v in p.items() if k in ("batch", "ctx"))
        mode = p.get("mode", "eager")
        print(
            f"{kind} {mode} {grid}: measured {meas:.3f} ms, predicted {pred:.3f} ms ({pred / meas - 1:+.1%})"
        )


def run_probe(
    name: str, doc: str, measure, print_compare, errors=(OSError, ValueError, KeyError, TypeError)
) -> int:
    """A GPU probe's command line (shared by the probes): `--compare FILE` prints predicted beside
    measured on the CPU; else `measure(quick)` (a dict, or an exit code) is printed and kept."""
    ap = argparse.ArgumentParser(prog=name, description=doc.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the JSON here (default: stdout only)")
    ap.add_argument("--quick", action="store_true", help="a few points of each kind")
    ap.add_argument("--compare", metavar="FILE", help="print predicted vs measured for a probe file")
    args = ap.parse_args()
    if args.compare:
        try:
            print_compare(args.compare)
        except errors as e:  # a missing or malformed probe file
            print(f"{name}: {args.compare}: not a probe file ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        return 0
    out = measure(args.quick)
    if isinstance(out, int):
        return out
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _measure(quick: bool) -> dict | int:
    try:
        import torch
    except ImportError:
        print("probe_moe_mla: needs torch (pip install torch) and a CUDA GPU", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("probe_moe_mla: no CUDA device; nothing measured", file=sys.stderr)
        return 2
    moe, mla = (MOE_BATCHES[::3], MLA_GRID[::2]) if quick else (MOE_BATCHES, MLA_GRID)
    sparse = SPARSE_GRID[:1] if quick else SPARSE_GRID
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "gpu_before": _gpu_state()}
    doc["parts"] = {
        PARTS["moe"]: {"decode": probe_moe(torch, moe)},
        PARTS["mla"]: {"decode": probe_mla(torch, mla)},
        PARTS["sparse"]: {"decode": probe_sparse(torch, sparse)},
    }
    doc["gpu_after"] = _gpu_state()
    return doc


def main() -> int:
    return run_probe("probe_moe_mla", __doc__, _measure, _print_compare)


if __name__ == "__main__":
    sys.exit(main())
