"""KV bytes per token per layer group and in total, against hand calculations (one case per family);
the prefix-cache rule of each group kind; per-sequence states; TP sharding of each kind."""

from __future__ import annotations

import pytest

from agentkv.engine.cost import CostModel
from agentkv.engine.models import GroupKind, LayerGroup, get_model

# (built-in name, bf16 bytes per token at full context, fp8, the arithmetic)
HAND = [
    (
        "Llama-3.1-70B",
        80 * 8 * 128 * 2 * 2,
        80 * 8 * 128 * 2 * 1,
        "80 layers x 8 KV heads x 128 x (K, V) x 2 B",
    ),
    ("Llama-3.1-8B", 32 * 8 * 128 * 2 * 2, 32 * 8 * 128 * 2, "32 x 8 x 128 x 2 x 2 B"),
    ("Qwen2.5-7B", 28 * 4 * 128 * 2 * 2, 28 * 4 * 128 * 2, "qwen2: 28 x 4 x 128 x 2 x 2 B"),
    ("Qwen3-32B", 64 * 8 * 128 * 2 * 2, 64 * 8 * 128 * 2, "qwen3: 64 x 8 x 128 x 2 x 2 B"),
    ("Qwen3-235B-A22B", 94 * 4 * 128 * 2 * 2, 94 * 4 * 128 * 2, "qwen3_moe: 94 x 4 x 128 x 2 x 2 B"),
    ("Qwen3-Coder-480B", 62 * 8 * 128 * 2 * 2, 62 * 8 * 128 * 2, "qwen3_moe: 62 x 8 x 128 x 2 x 2 B"),
    ("DeepSeek-V3", 61 * (512 + 64) * 2, 61 * (512 + 64), "MLA: 61 x (kv_lora 512 + rope 64) x 2 B"),
    ("Kimi-K2", 61 * (512 + 64) * 2, 61 * (512 + 64), "kimi_k2 (MLA): 61 x 576 x 2 B"),
    ("DeepSeek-V2-Lite", 27 * (512 + 64) * 2, 27 * 576, "deepseek_v2: 27 x 576 x 2 B"),
    # V3.2: the latent plus indexer keys (128 fp8 + one fp32 scale = 132 B whatever the KV dtype);
    # at fp8 the latent is FlashMLA's 656-byte record (512 fp8 + 16 scale bytes + 64 bf16 RoPE)
    ("DeepSeek-V3.2-Exp", 61 * (576 * 2 + 132), 61 * (656 + 132), "61 x (576 x 2 + 132) B"),
    # gpt-oss: 36 layers (18 window 128, 18 full) x 8 x 64 x 2 x 2 B, windows counted at full context
    ("gpt-oss-120b", 36 * 8 * 64 * 2 * 2, 36 * 8 * 64 * 2, "36 x 8 x 64 x 2 x 2 B"),
    (
        "Gemma-3-27B",
        62 * 16 * 128 * 2 * 2,
        62 * 16 * 128 * 2,
        "62 (52 local, 10 global) x 16 x 128 x 2 x 2 B",
    ),
    (
        "Llama-4-Scout",
        48 * 8 * 128 * 2 * 2,
        48 * 8 * 128 * 2,
        "48 (36 chunked, 12 global) x 8 x 128 x 2 x 2 B",
    ),
    ("Qwen3-Next-80B-A3B", 12 * 2 * 256 * 2 * 2, 12 * 2 * 256 * 2, "12 full layers x 2 x 256 x 2 x 2 B"),
    # V4-Flash: a 128-token window on 43 layers (512 x 2 B; fp8 584 B), 21 CSA layers with a 1/4 cache and
    # 1/4 indexer keys (132 B), 20 HCA layers with a 1/128 cache
    (
        "DeepSeek-V4-Flash",
        43 * 1024 + 21 * 1024 / 4 + 21 * 132 / 4 + 20 * 1024 / 128,
        43 * 584 + 21 * 584 / 4 + 21 * 132 / 4 + 20 * 584 / 128,
        "50,261 B bf16, 28,962.25 B fp8",
    ),
    (
        "DeepSeek-V4-Pro",
        61 * 1024 + 30 * 1024 / 4 + 30 * 132 / 4 + 31 * 1024 / 128,
        61 * 584 + 30 * 584 / 4 + 30 * 132 / 4 + 31 * 584 / 128,
        "61 window layers, 30 CSA, 31 HCA",
    ),
]


@pytest.mark.parametrize(("name", "bf16", "fp8", "why"), HAND, ids=[h[0] for h in HAND])
def test_kv_bytes_per_token_match_hand_calculations(name, bf16, fp8, why):
    m = get_model(name)
    assert m.kv_bytes_per_token("bf16") == pytest.approx(bf16, abs=1e-9), why
    assert m.kv_bytes_per_token("fp8") == pytest.approx(fp8, abs=1e-9), why
    assert sum(g.bytes_per_token("bf16") for g in m.groups) == pytest.approx(bf16)
    assert CostModel("h200", m, tp=8 if m.heads % 8 == 0 else 1).kv_bytes_per_token > 0


def test_the_issue_figures():
    assert get_model("DeepSeek-V3").kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2 == 70_272
    assert get_model("Llama-3.1-70B").kv_bytes_per_token("bf16") == 80 * 8 * 128 * 2 * 2 == 327_680


def test_v4_flash_groups_one_by_one():
    m = get_model("DeepSeek-V4-Flash")
    by = {g.name: g for g in m.groups}
    assert by["sliding window"].kind is GroupKind.SLIDING and by["sliding window"].window == 128
    assert by["sliding window"].bytes_per_token("fp8") == 43 * 584 == 25_112
    assert by["CSA compressed 1/4"].bytes_per_token("fp8") == 21 * 584 / 4 == 3_066
    assert by["CSA indexer keys 1/4"].bytes_per_token("bf16") == 21 * 132 / 4 == 693
    assert by["HCA compressed 1/128"].bytes_per_token("fp8") == 20 * 584 / 128 == 91.25
    # long context: the window stops growing; compressed caches and indexer keys do not
    assert m.long_context_bytes_per_token("fp8") == 3_066 + 693 + 91.25
    # compressor buffers: coff x ratio tokens of fp32 (kv, score) states of 2 x coff x dim
    assert by["CSA compressor state"].state_bytes == 8 * (2 * 2 * 512) * 4 == 65_536
    assert by["indexer compressor state"].state_bytes == 8 * (2 * 2 * 128) * 4 == 16_384
    assert by["HCA compressor state"].state_bytes == 128 * (2 * 512) * 4 == 524_288
    assert m.state_bytes_per_seq() == 21 * (65_536 + 16_384) + 20 * 524_288 == 12_206_080


def test_v4_pro_stays_near_a_tenth_of_v32_at_long_context():
    """DeepSeek's V4 report: at 1M tokens V4-Pro keeps ~10% of V3.2's KV cache (here per token, fp8)."""
    pro, v32 = get_model("DeepSeek-V4-Pro"), get_model("DeepSeek-V3.2-Exp")
    ratio = pro.sequence_kv_bytes(1 << 20, "fp8") / v32.sequence_kv_bytes(1 << 20, "fp8")
    assert 0.08 < ratio < 0.14, ratio


def test_long_context_and_sequence_bytes_by_rule():
    oss = get_model("gpt-oss-120b")
    per_layer = 8 * 64 * 2 * 2  # 2,048 B
    assert oss.long_context_bytes_per_token() == 18 * per_layer == 36_864
    assert oss.sequence_kv_bytes(100_000) == 18 * per_layer * 100_000 + 18 * per_layer * 128
    scout = get_model("Llama-4-Scout")
    assert scout.sequence_kv_bytes(100_000) == 12 * 4096 * 100_000 + 36 * 4096 * 8192
    gemma = get_model("Gemma-3-27B")
    assert gemma.long_context_bytes_per_token() == 10 * 16 * 128 * 2 * 2 == 81_920
    assert get_model("DeepSeek-V3").sequence_kv_bytes(1000) == 70_272 * 1000


def test_qwen3_next_linear_layers_keep_a_constant_state():
    m = get_model("Qwen3-Next-80B-A3B")
    state = next(g for g in m.groups if g.is_state)
    conv = (2 * 16 * 128 + 32 * 128) * (4 - 1) * 2  # conv_dim x (kernel - 1) x bf16
    ssm = 32 * 128 * 128 * 2  # value heads x key dim x value dim x bf16
    assert state.num_layers == 36 and state.state_bytes == conv + ssm == 1_097_728
    assert m.state_bytes_per_seq() == 36 * 1_097_728
    assert m.state_bytes_per_seq(tp=2) == 36 * 1_097_728 / 2  # heads split over ranks
    assert m.sequence_kv_bytes(10) == m.sequence_kv_bytes(10_000) - 12 * 2 * 256 * 2 * 2 * 9_990


def test_tp_splits_kv_heads_and_replicates_latents():
    assert get_model("Llama-3.1-70B").kv_bytes_per_token("bf16", tp=8) == 327_680 / 8
    assert get_model("DeepSeek-V3").kv_bytes_per_token("bf16", tp=8) == 70_272  # one latent on every rank
    assert get_model("gpt-oss-120b").kv_bytes_per_token("bf16", tp=8) == 73_728 / 8
    v4 = get_model("DeepSeek-V4-Pro")
    assert v4.kv_bytes_per_token("fp8", tp=8) == v4.kv_bytes_per_token("fp8")
    assert v4.state_bytes_per_seq(tp=8) == v4.state_bytes_per_seq()  # compressors are replicated


@pytest.mark.parametrize(
    ("kind", "window", "cut", "blocks"),
    [
        (GroupKind.FULL, 0, 1000, range(0, 63)),
        (GroupKind.MLA, 0, 1000, range(0, 63)),
        (GroupKind.SLIDING, 128, 1000, range((1000 - 127) // 16, 63)),  # the last window - 1 tokens
        (GroupKind.SLIDING, 128, 64, range(0, 4)),
        (GroupKind.CHUNKED, 8192, 10_000, range(8192 // 16, 625)),  # the current chunk
        (GroupKind.CHUNKED, 8192, 8192, range(512, 512)),  # a cut on a chunk boundary needs nothing
    ],
)
def test_prefix_cache_rule_of_each_kind(kind, window, cut, blocks):
    g = LayerGroup(kind, (0,), 1, 64, window=window)
    assert g.prefix_blocks(cut, 16) == blocks
    assert g.prefix_rule


def test_state_groups_need_no_blocks_and_hold_no_tokens():
    g = LayerGroup(GroupKind.STATE, (0, 1), state_bytes=1000, state_heads=4)
    assert g.prefix_blocks(10_000, 16) == range(0)
    assert g.bytes_per_token() == 0 and g.resident_tokens(10_000) == 0
    assert g.state_bytes_per_seq(tp=2) == 2 * 500 and g.state_bytes_per_seq(tp=8) == 2 * 250
    assert "saved at the cut" in g.prefix_rule


def test_engine_pool_sizing_counts_full_context_and_reserves_states():
    """Until part 2 the pool is one: full-context bytes per token, per-sequence states set aside."""
    cm = CostModel("h200", "Qwen3-Next-80B-A3B", tp=2)
    assert cm.kv_bytes_per_token == 12 * 1 * 256 * 2 * 2  # 2 KV heads split over 2 ranks
    plain = cm.gpu.hbm_bytes * 0.9 - cm.weights_bytes - cm.activation_reserve_bytes()
    assert cm.state_reserve_bytes(256) == 256 * 36 * 1_097_728 / 2
    assert cm.kv_capacity_bytes() == pytest.approx(plain - cm.state_reserve_bytes(256))
    assert CostModel("h200", "llama3-8b").state_reserve_bytes() == 0
