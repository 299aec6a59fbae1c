"""Time Qwen3-Next's Gated DeltaNet (linear attention: a constant state per sequence) on one GPU with the
fla kernels vLLM vendors, and print the cost model's prediction (held out of the fit, like the MoE/MLA probe).

Usage: python scripts/probe_linear.py [--out FILE] [--quick]   (needs torch, a CUDA GPU and fla-core)
       python scripts/probe_linear.py --compare FILE             (CPU: predicted vs measured)
One Gated DeltaNet layer's recurrence (no projections, no conv: those are GEMMs the model prices apart):
16 key heads, 32 value heads (TP 1; 16 at TP 2), 128 dims each, state (heads, 128, 128) per sequence.
`decode`: fused_recurrent_gated_delta_rule, one token for each of `batch` sequences from their states,
graphed (vLLM decodes from CUDA graphs). `prefill`: chunk_gated_delta_rule over `seqs` sequences of
`tokens` tokens each (varlen, as vLLM batches prefills), from a cached state, eager and graphed.
fla reads the state in its dtype (bf16 here) and writes the new one in float32.
JSON: {"device", "torch", "fla", "parts": {"qwen3-next-gdn": {"decode": [{batch, heads, layer_ms,
state_GBps, model_ms}], "prefill": [{seqs, tokens, heads, mode, layer_ms, tokens_per_s, model_ms}]}}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_long_context import _timeit  # noqa: E402  (the long-context probe's CUDA-event median)
from probe_moe_mla import _gpu_state, _graphed, run_probe  # noqa: E402  (graph replay, NVML, CLI)

K_HEADS, V_HEADS, DIM = 16, 32, 128
PART = "qwen3-next-gdn"
DECODE = (1, 8, 32, 64, 128, 256, 512)
PREFILL = ((1, 512), (1, 2048), (1, 8192), (1, 32768), (8, 2048), (32, 512))


def state_bytes(heads: int, read_b: int = 2, write_b: int = 4) -> int:
    """One sequence's state traffic in one step: read at `read_b`, written at `write_b` bytes an element."""
    return heads * DIM * DIM * (read_b + write_b)


def predict(p: dict, kind: str) -> float:
    """The cost model's ms for one linear layer's recurrence (H200, Qwen3-Next, TP 1 or 2 by heads)."""
    from agentkv.engine.cost import CostModel

    cm = CostModel("h200", "qwen3-next", tp=V_HEADS // p["heads"])
    m = cm.model
    g = next(x for x in cm.terms().groups if x.state_s)
    per_layer = m.layers / sum(x.num_layers for x in m.groups if x.is_state)  # the term is a layer mean
    if kind == "decode":
        b = p["batch"]
        return g.time(0, 0, 0, 0, 0, b, 0, 0) * per_layer * 1e3
    n = p["seqs"] * p["tokens"]
    return g.time(n, 0, 0, 0, p["seqs"], 0, 0, 0) * per_layer * 1e3


def compare(doc: dict) -> list[tuple[str, dict, float, float]]:
    """(kind, point, measured ms, predicted ms) for every point of a probe file."""
    part = doc["parts"][PART]
    return [
        (kind, p, p["layer_ms"], predict(p, kind))
        for kind in ("decode", "prefill")
        for p in part.get(kind, [])
        if "error" not in p
    ]


def _inputs(torch, seqs: int, tokens: int, heads: int):
    """q, k (L2-normalised), v, log-decay g, beta, a bf16 state per sequence, cu_seqlens (varlen)."""
    f, dt, dev = torch.nn.functional, torch.bfloat16, "cuda"
    n, kh = seqs * tokens, heads // 2
    q = torch.randn(1, n, kh, DIM, device=dev, dtype=dt)
    k = f.normalize(torch.randn(1, n, kh, DIM, device=dev, dtype=dt), p=2, dim=-1)
    v = torch.randn(1, n, heads, DIM, device=dev, dtype=dt)
    g = f.logsigmoid(torch.rand(1, n, heads, device=dev, dtype=torch.float32))
    beta = torch.rand(1, n, heads, device=dev, dtype=dt).sigmoid()
    h0 = torch.randn(seqs, heads, DIM, DIM, device=dev, dtype=dt) * 0.01
    cu = torch.arange(0, n + 1, tokens, device=dev, dtype=torch.long)
    return q, k, v, g, beta, h0, cu


def probe_decode(torch, fla_ops, batches, heads_list=(V_HEADS, V_HEADS // 2)) -> list[dict]:
    """One decode token per sequence from its state (graphed); a failing point is recorded, not fatal."""
    out = []
    for heads in heads_list:
        for b in batches:
            try:
                q, k, v, g, beta, h0, cu = _inputs(torch, b, 1, heads)

                def run(q=q, k=k, v=v, g=g, beta=beta, h0=h0, cu=cu):
                    fla_ops.fused_recurrent_gated_delta_rule(
                        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, cu_seqlens=cu
                    )

                ms = _timeit(_graphed(torch, run), 50, 5)
                p = {
                    "batch": b,
                    "heads": heads,
                    "mode": "graph",
                    "layer_ms": ms,
                    "state_GBps": b * state_bytes(heads) / ms / 1e6,
                }
                out.append({**p, "model_ms": predict(p, "decode")})
            except Exception as e:  # an API this fla/torch lacks: say so in the file
                out.append({"batch": b, "heads": heads, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"probe_linear: decode batch {b}: {out[-1]['error']}", file=sys.stderr)
    return out


def probe_prefill(torch, fla_ops, grid, heads=V_HEADS, modes=("eager", "graph")) -> list[dict]:
    """chunk_gated_delta_rule over `seqs` x `tokens` from cached states (varlen): `eager` as launched from
    Python, `graph` replayed from a CUDA graph (the GPU's own time, without the launches)."""
    out = []
    for seqs, tokens in grid:
        for mode in modes:
            p = {"seqs": seqs, "tokens": tokens, "heads": heads, "mode": mode}
            try:
                q, k, v, g, beta, h0, cu = _inputs(torch, seqs, tokens, heads)
                cu_cpu = cu.cpu()

                def run(q=q, k=k, v=v, g=g, beta=beta, h0=h0, cu=cu, cu_cpu=cu_cpu):
                    fla_ops.chunk_gated_delta_rule(
                        q,
                        k,
                        v,
                        g,
                        beta,
                        initial_state=h0,
                        output_final_state=True,
                        cu_seqlens=cu,
                        cu_seqlens_cpu=cu_cpu,
                    )

                ms = _timeit(run if mode == "eager" else _graphed(torch, run), 20, 3)
                p["layer_ms"] = ms
                out.append({**p, "tokens_per_s": seqs * tokens / ms * 1e3, "model_ms": predict(p, "prefill")})
            except Exception as e:
                out.append({**p, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"probe_linear: prefill {mode} {seqs}x{tokens}: {out[-1]['error']}", file=sys.stderr)
    return out


def _print_compare(path: str) -> None:
    for kind, p, meas, pred in compare(json.loads(Path(path).read_text())):
        grid = ", ".join(f"{k}={p[k]}" for k in ("batch", "seqs", "tokens", "heads") if k in p)
        print(
            f"{kind} {p.get('mode', 'eager')} {grid}: measured {meas:.4f} ms, predicted {pred:.4f} ms ({pred / meas - 1:+.1%})"
        )


def _measure(quick: bool) -> dict | int:
    try:
        import fla
        import torch
        from fla.ops import gated_delta_rule as fla_ops
    except ImportError as e:
        print(
            f"probe_linear: needs torch, a CUDA GPU and fla-core (pip install fla-core): {e}", file=sys.stderr
        )
        return 2
    if not torch.cuda.is_available():
        print("probe_linear: no CUDA device; nothing measured", file=sys.stderr)
        return 2
    dec, pre = (DECODE[::3], PREFILL[:2]) if quick else (DECODE, PREFILL)
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "fla": fla.__version__}
    doc["gpu_before"] = _gpu_state()
    doc["parts"] = {
        PART: {"decode": probe_decode(torch, fla_ops, dec), "prefill": probe_prefill(torch, fla_ops, pre)}
    }
    doc["gpu_after"] = _gpu_state()
    return doc


def main() -> int:
    return run_probe(
        "probe_linear",
        __doc__,
        _measure,
        _print_compare,
        (OSError, ValueError, KeyError, TypeError, StopIteration),
    )


if __name__ == "__main__":
    sys.exit(main())
