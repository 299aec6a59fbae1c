"""Hugging Face config readers: every bundled family fixture, parameter counts against the published
sizes, MoE weight memory, the built-in names, and one-line errors naming the file and the field."""

from __future__ import annotations

import json

import pytest

from agentkv.engine.cost import CostModel
from agentkv.engine.models import BUILTIN_NAMES, GroupKind, ModelShape, builtin_models, get_model
from agentkv.engine.models.catalogue import CHECK_FIXTURES, FIXTURES, fixture_config, load_fixture
from agentkv.errors import UserError

# (built-in, total params B, activated params B, tolerance): model cards and papers; the counts here
# are the decoder's linear weights, embedding, lm_head and norms (no vision tower, no MTP layer)
PUBLISHED = [
    ("DeepSeek-V3", 671, 37, 0.02),
    ("Kimi-K2", 1030, 32, 0.03),  # "1T total, 32B activated"; safetensors 1.03T
    ("Qwen3-235B-A22B", 235, 22, 0.02),
    ("Qwen3-Coder-480B", 480, 35, 0.02),
    ("gpt-oss-120b", 116.8, 5.1, 0.12),  # OpenAI counts the unembedding, not the embedding, as active
    ("Qwen3-Next-80B-A3B", 79.674, 3.875, 0.001),  # safetensors: 79,674,391,296 total
    ("Llama-4-Scout", 109, 17, 0.02),  # 109B includes the vision encoder (~1B)
    ("DeepSeek-V4-Flash", 284, 13, 0.06),
    ("DeepSeek-V4-Pro", 1600, 49, 0.03),
    ("DeepSeek-V2-Lite", 15.7, 2.4, 0.11),
    ("Gemma-3-27B", 27.0, 27.0, 0.02),  # 27.4B with the 0.4B vision tower
]


@pytest.mark.parametrize(("name", "total", "active", "tol"), PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_parameter_counts_near_the_published_sizes(name, total, active, tol):
    m = get_model(name)
    assert m.params / 1e9 == pytest.approx(total, rel=tol)
    assert m.activated_params / 1e9 == pytest.approx(active, rel=tol)
    assert m.activated_params <= m.params


def test_moe_shape_fields():
    v3 = get_model("DeepSeek-V3")
    assert (v3.moe.experts, v3.moe.experts_per_token, v3.moe.shared_experts) == (256, 8, 1)
    assert (v3.moe.intermediate, v3.moe.first_k_dense, v3.moe.moe_layers) == (2048, 3, 58)
    assert (v3.hidden, v3.layers, v3.heads, v3.head_dim, v3.intermediate, v3.vocab) == (
        7168,
        61,
        128,
        192,
        18432,
        129280,
    )
    scout = get_model("Llama-4-Scout")
    assert (scout.moe.experts, scout.moe.shared_experts, scout.intermediate) == (16, 1, 16384)
    assert get_model("Llama-3.1-8B").moe is None


def test_moe_weights_in_memory_are_every_expert():
    """Memory leaves room for KV after all experts; the cost model's weight reads stay on active ones."""
    cm = CostModel("h200", "DeepSeek-V3", tp=8)
    assert cm.weight_dtype == "fp8"  # the checkpoint's dtype by default
    assert cm.weights_bytes > get_model("DeepSeek-V3").params / 8 * 0.99
    # the weight-read and GEMM terms use the parameters a token activates (replicated MLA down projections
    # included), a few percent of every expert's
    assert cm.rank.layer_params * 61 * 8 < 0.1 * get_model("DeepSeek-V3").params
    oss = get_model("gpt-oss-120b")
    assert oss.expert_dtype == "fp4" and oss.weight_dtype == "bf16"  # MXFP4 experts
    assert oss.weight_bytes() < 0.55 * oss.weight_bytes("bf16") or oss.weight_bytes() < 70e9
    assert CostModel("h200", "gpt-oss-120b").kv_capacity_bytes() > 60 * 2**30


@pytest.mark.parametrize(("file", "name"), [(f, n) for f, n, _ in FIXTURES])
def test_every_fixture_reads_and_is_a_builtin(file, name):
    cfg = fixture_config(file)
    assert cfg["_source"].startswith("https://huggingface.co/") and cfg["_source"].endswith("config.json")
    m = load_fixture(file, name)
    assert get_model(name).groups == m.groups and get_model(name).params == m.params
    assert m.attention_groups and all(max(g.layers) < m.layers for g in m.groups)
    assert name in BUILTIN_NAMES


def test_fixture_families_cover_the_issue():
    families = {m.family for m in builtin_models()}
    assert {
        "llama",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "deepseek_v2",
        "deepseek_v3",
        "kimi_k2",
        "deepseek_v32",
        "deepseek_v4",
        "gpt_oss",
        "gemma3",
        "llama4",
        "qwen3_next",
    } <= families


@pytest.mark.parametrize(("file", "builtin"), [("llama.json", "Llama-3.1-70B"), ("qwen3.json", "Qwen3-32B")])
def test_public_configs_read_as_the_hand_written_dense_shapes(file, builtin):
    assert file in CHECK_FIXTURES
    m, ref = load_fixture(file), get_model(builtin)
    fields = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "max_position")
    assert [getattr(m, f) for f in fields] == [getattr(ref, f) for f in fields]
    assert (m.params, m.layer_params, m.kv_bytes_per_token("fp8", 4)) == (
        ref.params,
        ref.layer_params,
        ref.kv_bytes_per_token("fp8", 4),
    )


def test_layer_patterns():
    oss = get_model("gpt-oss-120b")
    kinds = {g.kind: g for g in oss.groups}
    assert (
        kinds[GroupKind.SLIDING].layers == tuple(range(0, 36, 2)) and kinds[GroupKind.SLIDING].window == 128
    )
    gemma = get_model("Gemma-3-27B")
    full = next(g for g in gemma.groups if g.kind is GroupKind.FULL)
    assert full.layers == tuple(range(5, 62, 6)) and gemma.vocab == 262_208 and gemma.tie_embeddings
    scout = get_model("Llama-4-Scout")
    chunked = next(g for g in scout.groups if g.kind is GroupKind.CHUNKED)
    assert chunked.window == 8192 and len(chunked.layers) == 36 and 3 not in chunked.layers
    nxt = get_model("Qwen3-Next-80B-A3B")
    assert next(g for g in nxt.groups if g.kind is GroupKind.FULL).layers == tuple(range(3, 48, 4))
    qwen2 = get_model("Qwen2.5-7B")  # use_sliding_window false: every layer full
    assert [g.kind for g in qwen2.groups] == [GroupKind.FULL]


def test_qwen2_sliding_window_from_max_window_layers(tmp_path):
    cfg = {k: v for k, v in fixture_config("qwen2.json").items() if not k.startswith("_")}
    cfg.update(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = ModelShape.from_hf_config(tmp_path)
    sliding = next(g for g in m.groups if g.kind is GroupKind.SLIDING)
    assert sliding.layers == tuple(range(20, 28)) and sliding.window == 4096


@pytest.mark.parametrize(
    "alias",
    [
        "deepseek-v4-pro",
        "DEEPSEEK-V4-FLASH",
        "deepseek-ai/DeepSeek-V3",
        "moonshotai/Kimi-K2-Instruct",
        "openai/gpt-oss-120b",
        "Qwen/Qwen3-235B-A22B",
        "Qwen/Qwen3-Coder-480B-A35B-Instruct",
        "kimi_k2",
    ],
)
def test_builtin_lookup(alias):
    assert get_model(alias).name in BUILTIN_NAMES


def _write(tmp_path, base: str, **change):
    cfg = {k: v for k, v in fixture_config(base).items() if not k.startswith("_")}
    for k, v in change.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    return f


@pytest.mark.parametrize(
    ("base", "change", "message"),
    [
        (
            "llama.json",
            {"model_type": "t5", "is_encoder_decoder": True},
            "field 'is_encoder_decoder': encoder-decoder",
        ),
        ("llama.json", {"model_type": "bart"}, "field 'model_type': encoder-decoder"),
        ("llama.json", {"model_type": "mamba2"}, "field 'model_type': 'mamba2' is not a supported family"),
        (
            "gpt_oss.json",
            {"layer_types": ["sliding_attention", "cross_attention"] * 18},
            "field 'layer_types': unknown attention kind 'cross_attention' at layer 1",
        ),
        (
            "gpt_oss.json",
            {"layer_types": ["full_attention"] * 3},
            "field 'layer_types': expected a list of 36",
        ),
        ("gpt_oss.json", {"sliding_window": None}, "missing field 'sliding_window'"),
        ("deepseek_v4_flash.json", {"compress_ratios": None}, "missing field 'compress_ratios'"),
        (
            "deepseek_v4_flash.json",
            {"compress_ratios": [8] * 44},
            "field 'compress_ratios': ratio 8 at layer 0",
        ),
        ("deepseek_v32.json", {"index_head_dim": None}, "missing field 'index_head_dim'"),
        ("deepseek_v3.json", {"kv_lora_rank": 0}, "field 'kv_lora_rank' must be a positive integer"),
        ("qwen3_moe.json", {"num_experts": None}, "missing field 'num_experts'"),
        ("qwen3_next.json", {"linear_num_value_heads": None}, "missing field 'linear_num_value_heads'"),
        (
            "llama.json",
            {"quantization_config": {"quant_method": "awq"}},
            "field 'quantization_config.quant_method': 'awq' is not supported",
        ),
        (
            "llama.json",
            {"model_type": "llama", "num_local_experts": 8},
            "field 'num_local_experts': mixture-of-experts",
        ),
    ],
)
def test_unsupported_configs_are_one_line_errors_naming_file_and_field(tmp_path, base, change, message):
    f = _write(tmp_path, base, **change)
    with pytest.raises(UserError, match=message) as e:
        ModelShape.from_hf_config(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_nested_text_config_errors_still_name_the_file(tmp_path):
    f = _write(tmp_path, "llama4.json", text_config={"model_type": "llama4_text", "num_hidden_layers": 4})
    with pytest.raises(UserError, match="missing field 'hidden_size'") as e:
        get_model(f)
    assert str(f) in str(e.value)


def test_docs_tables_are_what_the_script_prints():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("model_kv_table", root / "scripts/model_kv_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    docs = (root / "docs/simulate.md").read_text()
    for table in (mod.capacity_table(), mod.group_table()):
        assert "\n".join(table) in docs, "docs/simulate.md is stale: paste scripts/model_kv_table.py output"
