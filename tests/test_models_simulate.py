"""`agentkv simulate --model NAME` runs on the bundled sample for a model of every family (short runs)."""

from __future__ import annotations

import json

import pytest

from agentkv.cli import main

# (built-in, family, tensor-parallel size it needs on an H200 at 0.9 memory utilisation)
FAMILIES = [
    ("Llama-3.1-8B", "llama", 1),
    ("Qwen2.5-7B", "qwen2", 1),
    ("Qwen3-32B", "qwen3", 1),
    ("Qwen3-235B-A22B", "qwen3_moe", 4),
    ("Qwen3-Coder-480B", "qwen3_moe", 8),
    ("DeepSeek-V2-Lite", "deepseek_v2", 1),
    ("DeepSeek-V3", "deepseek_v3", 8),
    ("Kimi-K2", "kimi_k2", 8),
    ("DeepSeek-V3.2-Exp", "deepseek_v32", 8),
    ("DeepSeek-V4-Flash", "deepseek_v4", 2),
    ("DeepSeek-V4-Pro", "deepseek_v4", 8),
    ("gpt-oss-120b", "gpt_oss", 1),
    ("Gemma-3-27B", "gemma3", 1),
    ("Llama-4-Scout", "llama4", 2),
    ("Qwen3-Next-80B-A3B", "qwen3_next", 2),
]


@pytest.mark.parametrize(("name", "family", "tp"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_simulate_runs_every_family(capsys, name, family, tp):
    from agentkv.engine.models import get_model

    assert get_model(name).family == family
    argv = [
        "simulate",
        "--model",
        name,
        "-tp",
        str(tp),
        "--max-requests",
        "4",
        "--lanes",
        "2",
        "-q",
        "--json",
    ]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["valid"] and s["requests"] == 4 and s["failed"] == 0
    assert s["config"]["engine"]["model"] == name and s["config"]["num_gpu_blocks"] > 1000
    assert s["output_tokens"] > 0 and s["duration_s"] > 0


def test_simulate_a_model_that_does_not_fit_says_so(capsys):
    assert main(["simulate", "--model", "DeepSeek-V3", "-q", "--json", "--max-requests", "2"]) != 0
    assert "does not fit" in capsys.readouterr().err
