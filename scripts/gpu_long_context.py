"""Long-context step times on an NVIDIA GPU, beyond the shared calibration's 131K tokens.

Agentic sessions run at 100K-540K tokens of context, past the points the cost model was fitted on
(prefill to 131K past tokens, decode to 131K context). This measures, with the same method as the
shared probe (one Llama-shaped bf16 layer with random weights, SDPA attention with GQA, CUDA
events, median of repeats, x layers), prefill chunks and decode steps out to 524K tokens, and
writes them in the calibration file's record shape so `docs/cost-model.md` can set them beside the
model's predictions. Needs PyTorch with CUDA.

    python scripts/gpu_long_context.py [--out long_context.json] [--budget-s 240]
"""

from __future__ import annotations

import argparse
import json
import time

SHAPES = {
    "llama3-8b": dict(h=4096, nh=32, nkv=8, hd=128, inter=14336, layers=32),
    "llama3-70b": dict(h=8192, nh=64, nkv=8, hd=128, inter=28672, layers=80),
}
# (new tokens, past tokens): 131072 repeats a fitted point, to compare machines
PREFILL = {
    "llama3-8b": [(8192, 131072), (2048, 262144), (8192, 262144), (2048, 524288), (8192, 524288)],
    "llama3-70b": [(8192, 131072), (8192, 262144), (8192, 524288)],
}
# (batch, context per sequence)
DECODE = {
    "llama3-8b": [
        (1, 131072),
        (1, 262144),
        (1, 524288),
        (8, 131072),
        (8, 262144),
        (8, 524288),
        (32, 131072),
        (64, 65536),
    ],
    "llama3-70b": [(1, 262144), (8, 131072), (8, 524288)],
}


DEV = "cuda"


def _timeit(fn, reps: int, warm: int) -> float:
    """Median milliseconds of `reps` timed calls of `fn` (CUDA events) after `warm` untimed ones."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def _rnd(*shape):
    import torch

    return torch.randn(*shape, device=DEV, dtype=torch.bfloat16) * 0.02


def _prefill_ms(c: dict, layer, new: int, past: int) -> float:
    """One layer's median time to prefill `new` tokens after `past` cached ones (causal, GQA)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    x = torch.randn(new, c["h"], device=DEV, dtype=torch.bfloat16)
    kc = torch.randn(1, c["nkv"], past + new, c["hd"], device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    mask = causal_lower_right(new, past + new)

    def attn(qkv):
        q = qkv[:, : c["nh"] * c["hd"]].view(1, new, c["nh"], c["hd"]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
        return o.transpose(1, 2).reshape(new, -1)

    return _timeit(lambda: layer(x, attn), reps=5, warm=2)


def _decode_ms(c: dict, layer, batch: int, ctx: int) -> tuple[float, int]:
    """One layer's median decode step for `batch` sequences of `ctx` tokens, and the KV bytes it reads."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(batch, c["h"], device=DEV, dtype=torch.bfloat16)
    kc = torch.randn(batch, c["nkv"], ctx, c["hd"], device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    g = c["nh"] // c["nkv"]

    def attn(qkv):
        q = qkv[:, : c["nh"] * c["hd"]].view(batch, c["nkv"], g, c["hd"])
        return F.scaled_dot_product_attention(q, kc, vc).reshape(batch, -1)

    return _timeit(lambda: layer(x, attn), reps=10, warm=3), kc.numel() * 2 * 2


def _part(name: str, c: dict, t_start: float, budget_s: float) -> dict:
    """Every prefill and decode point of shape `name` that starts within the budget."""
    import torch
    import torch.nn.functional as F

    wqkv, wo = _rnd(c["h"], (c["nh"] + 2 * c["nkv"]) * c["hd"]), _rnd(c["nh"] * c["hd"], c["h"])
    wgu, wd = _rnd(c["h"], 2 * c["inter"]), _rnd(c["inter"], c["h"])
    wbytes = sum(t.numel() * 2 for t in (wqkv, wo, wgu, wd))

    def layer(x, attn):
        x = x + attn(x @ wqkv) @ wo
        g, u = (x @ wgu).chunk(2, dim=-1)
        return x + (F.silu(g) * u) @ wd

    part = {"shape": c, "layer_weight_bytes": wbytes, "prefill": [], "decode": []}
    for new, past in PREFILL[name]:
        if time.time() - t_start > budget_s:
            break
        ms = _prefill_ms(c, layer, new, past)
        part["prefill"].append({"new": new, "past": past, "layer_ms": ms, "model_ms": ms * c["layers"]})
        print(f"{name} prefill new={new} past={past}: {ms * c['layers']:.1f} ms/step", flush=True)
        torch.cuda.empty_cache()
    for batch, ctx in DECODE[name]:
        if time.time() - t_start > budget_s:
            break
        ms, kv_bytes = _decode_ms(c, layer, batch, ctx)
        gbps = (wbytes + kv_bytes) / (ms / 1e3) / 1e9
        part["decode"].append(
            {"batch": batch, "ctx": ctx, "layer_ms": ms, "model_ms": ms * c["layers"], "layer_GBps": gbps}
        )
        print(
            f"{name} decode batch={batch} ctx={ctx}: {ms * c['layers']:.1f} ms/step, {gbps:,.0f} GB/s",
            flush=True,
        )
        torch.cuda.empty_cache()
    return part


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="long_context.json")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new points after this")
    a = ap.parse_args()
    import torch

    t_start = time.time()
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "parts": {}}
    for name, c in SHAPES.items():
        out["parts"][name] = _part(name, c, t_start, a.budget_s)
        torch.cuda.empty_cache()  # the shape's weights and caches are freed with _part's frame
    out["seconds"] = time.time() - t_start
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out} in {out['seconds']:.0f} s")


if __name__ == "__main__":
    main()
