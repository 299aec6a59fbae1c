"""`--data-parallel-size`, `--enable-expert-parallel` and `--quantization` (vLLM's names) reach the
engine's cost model: capacity and step times change, bad values are one-line errors."""

from __future__ import annotations

import json

import pytest

from agentkv.cli import main
from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.errors import UserError


def test_expert_parallel_spreads_experts_and_frees_kv():
    tp8 = Engine(EngineConfig(model="deepseek-v3", tensor_parallel_size=8))
    ep = Engine(EngineConfig(model="deepseek-v3", data_parallel_size=8, enable_expert_parallel=True))
    assert ep.cost.dp == 8 and ep.cost.ep and ep.cost.tp == 1
    assert ep.cost.weights_bytes > tp8.cost.weights_bytes  # attention replicated per DP rank
    assert ep.cost.terms().a2a_tok > 0 and tp8.cost.terms().a2a_tok == 0


def test_quantization_shrinks_weights_and_grows_the_kv_cache():
    bf = Engine(EngineConfig(model="qwen3-235b", tensor_parallel_size=4))
    f8 = Engine(EngineConfig(model="qwen3-235b", tensor_parallel_size=4, quantization="fp8"))
    assert f8.cost.weight_dtype == "fp8" and bf.cost.weight_dtype == "bf16"
    assert f8.num_gpu_blocks > 1.5 * bf.num_gpu_blocks
    assert f8.cost.step_time((), [4096] * 32) < bf.cost.step_time((), [4096] * 32)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"data_parallel_size": 0}, "--data-parallel-size"),
        ({"quantization": "int3"}, "--quantization"),
    ],
)
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(UserError, match=flag):
        EngineConfig(**kwargs)


def test_simulate_takes_the_flags(capsys):
    argv = ["simulate", "--model", "DeepSeek-V3", "-tp", "1", "-dp", "8", "--enable-expert-parallel"]
    assert main([*argv, "--workers", "2", "--max-requests", "4", "--lanes", "2", "-q", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    eng = s["config"]["engine"]
    assert (
        s["valid"] and s["requests"] == 4 and eng["data_parallel_size"] == 8 and eng["enable_expert_parallel"]
    )
    assert (
        main(["simulate", "--model", "llama3-8b", "--enable-expert-parallel", "-q", "--max-requests", "1"])
        != 0
    )
    assert "has no experts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--quantization", "int3", "-q"])


def test_deepseek_v4_runs_with_vllms_256_token_blocks(capsys):
    """vLLM's V4 sparse-MLA and indexer kernels take only 256-token blocks and it overrides
    `--block-size` for V4 (platforms/cpu.py; get_supported_kernel_block_sizes): so does agentkv."""
    for asked in (16, 64, 256):
        assert EngineConfig(model="deepseek-v4-pro", block_size=asked).block_size == 256
        assert EngineConfig(model="deepseek-v4-flash", block_size=asked).block_size == 256
    assert EngineConfig(model="llama3-8b", block_size=64).block_size == 64
    assert EngineConfig(model="deepseek-v3", block_size=16).block_size == 16
    with pytest.raises(UserError, match="--max-num-batched-tokens: must be >= the block size \\(256\\)"):
        EngineConfig(model="deepseek-v4-flash", max_num_batched_tokens=128)
    argv = [
        "simulate",
        "--model",
        "DeepSeek-V4-Flash",
        "-tp",
        "2",
        "--max-requests",
        "2",
        "--lanes",
        "2",
        "-q",
        "--json",
    ]
    for flags, note in (([], False), (["--block-size", "256"], False), (["--block-size", "32"], True)):
        assert main([*argv, *flags]) == 0
        out = capsys.readouterr()
        assert json.loads(out.out)["config"]["engine"]["block_size"] == 256
        assert ("--block-size 32 overridden" in out.err) is note  # vLLM warns likewise
