"""An NVFP4 KV cache (`--kv-cache-dtype nvfp4`, vLLM's spelling): 4-bit values plus one fp8 scale per
16 elements, in sizing and in the cost model's KV reads; refused on GPUs without FP4 and for MLA
latents, in one line."""

from __future__ import annotations

import json

import pytest

from agentkv.cache.grid import make_grid
from agentkv.cli import main
from agentkv.engine.cost import CostModel
from agentkv.engine.models import get_model
from agentkv.errors import UserError


def test_llama_70b_nvfp4_kv_bytes_by_hand():
    m = get_model("Llama-3.1-70B")
    # 80 layers x 8 KV heads x head_dim 128 x (K, V), each element 4 bits + an 8-bit scale per 16
    hand = 80 * 8 * 128 * 2 * (4 + 8 / 16) / 8
    assert hand == 92_160 and m.kv_bytes_per_token("nvfp4") == hand
    assert m.kv_bytes_per_token("nvfp4", tp=2) == hand / 2
    f4, f8 = CostModel("b200", m, tp=2, kv_dtype="nvfp4"), CostModel("b200", m, tp=2, kv_dtype="fp8")
    assert f4.kv_bytes_per_token == hand / 2
    # the KV read of a long-context decode batch: the roofline's KV part scales by the bytes
    kv4 = f4.decode_roofline(64, 100_000) - f4.decode_roofline(64, 0)
    kv8 = f8.decode_roofline(64, 100_000) - f8.decode_roofline(64, 0)
    assert kv4 / kv8 == pytest.approx(0.5625)
    assert f4.step_time([], [100_000] * 64) < f8.step_time([], [100_000] * 64)
    assert make_grid("10GB", "16", "lru", "llama3-70b", "nvfp4").kv_bytes_per_token == hand


@pytest.mark.parametrize(
    ("gpu", "model", "says"),
    [
        ("h200", "llama3-70b", "the H200 SXM has no FP4 support (GPUs with it: B200"),
        # MI355X has FP4 (MXFP4), not NVIDIA's NVFP4: vLLM's nvfp4 KV is Blackwell-only
        ("mi355x", "llama3-70b", "the MI355X has no NVFP4 (AMD's FP4 is MXFP4) (GPUs with it: B200"),
        ("b200", "deepseek-v3", "DeepSeek-V3 caches an MLA latent"),
    ],
)
def test_nvfp4_is_refused_without_fp4_or_for_mla_in_one_line(capsys, gpu, model, says):
    argv = ["simulate", "--gpu", gpu, "--model", model, "-tp", "8", "--kv-cache-dtype", "nvfp4", "-q"]
    assert main([*argv, "--max-requests", "1", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "--kv-cache-dtype nvfp4" in err and "\n" not in err and "Traceback" not in err
    assert "MI355X" not in err.split("GPUs with it:")[-1]
    if model == "deepseek-v3":
        with pytest.raises(UserError, match="MLA latent"):
            make_grid("10GB", "16", "lru", model, "nvfp4")


def test_simulate_on_b200_with_nvfp4_kv_holds_more_tokens(capsys):
    """The bundled sample on a B200 at fp8 and at nvfp4: the pool holds 1/0.5625 the blocks."""
    blocks = {}
    for dtype in ("fp8", "nvfp4"):
        argv = ["simulate", "--gpu", "b200", "--model", "llama3-70b", "-tp", "2", "--kv-cache-dtype", dtype]
        assert main([*argv, "--max-requests", "4", "--lanes", "2", "-q", "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["valid"] and s["requests"] == 4 and s["failed"] == 0
        assert s["config"]["engine"]["kv_cache_dtype"] == dtype
        blocks[dtype] = s["config"]["num_gpu_blocks"]
    assert blocks["nvfp4"] / blocks["fp8"] == pytest.approx(1 / 0.5625, rel=1e-4)
