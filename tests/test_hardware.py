"""Hardware catalogue, model shapes, HF config reading and tensor-parallel shards."""

from __future__ import annotations

import json

import pytest

from agentkv.engine import calibrate
from agentkv.engine.hardware import (
    GPUS,
    MODELS,
    ModelShape,
    get_gpu,
    get_model,
    gpu_names,
    ring_allreduce_s,
)
from agentkv.errors import UserError

LLAMA8B_CONFIG = {
    "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def test_catalogue_has_every_part_with_its_datasheet_figures():
    assert gpu_names() == [
        "H100 SXM",
        "H200 SXM",
        "B200",
        "GB200",
        "B300",
        "GB300",
        "Rubin VR200",
        "MI300X",
        "MI325X",
        "MI355X",
    ]
    h200 = get_gpu("h200")
    assert (h200.hbm_gb, h200.hbm_tbps, h200.bf16_tflops, h200.fp8_tflops, h200.fp4_tflops) == (
        141,
        4.8,
        989,
        1979,
        None,
    )
    assert (h200.host_link_gbps, h200.gpu_link_gbps, h200.power_w) == (64, 450, 700)
    b300 = get_gpu("B300")
    assert (b300.hbm_gb, b300.fp4_tflops, b300.host_link_gbps) == (268, 13500, 128)
    mi355 = get_gpu("mi355x")
    assert (mi355.hbm_tbps, mi355.bf16_tflops, mi355.gpu_link_gbps, mi355.power_w) == (8.0, 2516, 576, 1400)
    assert get_gpu("vr200").hbm_tbps == 22.0
    for g in GPUS:  # every figure present and sane; fp8 never slower than bf16
        assert g.hbm_gb > 0 and g.hbm_tbps > 0 and g.bf16_tflops > 0 and g.power_w > 0
        assert g.fp8_tflops is None or g.fp8_tflops >= g.bf16_tflops
        assert g.hbm_bytes == g.hbm_gb * 2**30


@pytest.mark.parametrize("alias", ["h200", "H200", "h200-sxm", "H200 SXM", "h200_sxm", " nvidia/H200-SXM "])
def test_gpu_lookup_is_case_and_separator_insensitive(alias):
    assert get_gpu(alias).name == "H200 SXM"


def test_gpu_aliases_for_racks_and_rubin():
    assert get_gpu("gb200-nvl72").name == "GB200"
    assert get_gpu("Vera-Rubin").name == "Rubin VR200"
    assert get_gpu(get_gpu("b200")) is get_gpu("B200")


def test_unknown_gpu_lists_the_choices():
    with pytest.raises(UserError, match="unknown GPU 'a100'.*H100 SXM.*MI355X"):
        get_gpu("a100")


def test_missing_dtype_rate_is_a_user_error():
    assert get_gpu("b200").tflops("fp4") == 9000
    with pytest.raises(UserError, match="H100 SXM has no published dense fp4"):
        get_gpu("h100").tflops("fp4")
    with pytest.raises(UserError, match="MI300X has no published dense fp4"):
        get_gpu("mi300x").tflops("fp4")
    # NVIDIA: 1.2 EF FP8/FP6 per VR NVL72 rack, 17.5 PF per GPU (72 x 17.5 = 1.26 EF), dense
    assert get_gpu("rubin").tflops("fp8") == 17500
    with pytest.raises(UserError, match="int3"):
        get_gpu("h200").tflops("int3")


@pytest.mark.parametrize(
    ("name", "billions"), [("Llama-3.1-8B", 8.03), ("Llama-3.1-70B", 70.55), ("Qwen3-32B", 32.76)]
)
def test_parameter_counts_match_the_published_sizes(name, billions):
    m = get_model(name)
    assert m.params / 1e9 == pytest.approx(billions, abs=0.01)
    assert m.weight_bytes("bf16") == pytest.approx(2 * m.params)
    assert m.weight_bytes("fp8") < 0.6 * m.weight_bytes("bf16")  # embedding/lm_head stay bf16


def test_layer_params_match_the_probe_layers():
    for probe, name in (("llama3-8b", "Llama-3.1-8B"), ("llama3-70b", "Llama-3.1-70B")):
        measured_bytes = calibrate.calibration()["parts"][probe]["layer_weight_bytes"]
        assert get_model(name).layer_params * 2 == measured_bytes
        assert calibrate.probe_shape(probe).layer_params == get_model(name).layer_params


def test_model_lookup_by_alias_and_hf_id():
    assert get_model("llama3-8b").name == "Llama-3.1-8B"
    assert get_model("meta-llama/Llama-3.1-70B-Instruct").name == "Llama-3.1-70B"
    assert get_model("Qwen/Qwen3-32B").name == "Qwen3-32B"
    with pytest.raises(UserError, match="unknown model 'gpt-5'.*Llama-3.1-8B.*config.json"):
        get_model("gpt-5")


def test_kv_bytes_per_token_by_dtype_and_tp():
    m = get_model("llama3-8b")
    assert m.kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert m.kv_bytes_per_token("fp8") == 65536
    assert m.kv_bytes_per_token("bf16", tp=2) == 65536
    assert m.kv_bytes_per_token("bf16", tp=8) == 16384
    # 8 KV heads over 16 ranks: each rank keeps one (replicated), so no further saving
    assert m.kv_bytes_per_token("bf16", tp=16) == 16384
    with pytest.raises(UserError, match="dtype 'int4'"):
        m.kv_bytes_per_token("int4")


def test_tp_shards_split_weights_and_replicate_kv_heads():
    m = get_model("llama3-70b")
    for tp in (1, 2, 4, 8):
        r = m.shard(tp)
        assert (r.heads, r.kv_heads) == (64 // tp, 8 // tp)
        assert r.layer_params * tp == m.layer_params
    r16 = m.shard(16)
    assert (r16.heads, r16.kv_heads) == (4, 1)
    assert r16.layer_params * 16 > m.layer_params  # K/V projections replicated
    with pytest.raises(UserError, match="64 attention heads do not split over tp=3"):
        m.shard(3)
    with pytest.raises(UserError, match="tensor parallel size"):
        m.shard(0)
    odd = ModelShape("odd", 2, 96, 12, 6, 8, 64, 100)
    with pytest.raises(UserError, match="6 KV heads neither split over nor replicate to tp=4"):
        odd.shard(4)


def test_ring_allreduce_time():
    assert ring_allreduce_s(1e9, 1, 450) == 0.0
    assert ring_allreduce_s(1e9, 8, 450, latency_s=0.0) == pytest.approx(2 * 7 / 8 * 1e9 / 450e9)
    assert ring_allreduce_s(0, 2, 450) == pytest.approx(10e-6)
    assert ring_allreduce_s(1e6, 8, 450) > ring_allreduce_s(1e6, 2, 450)


def test_shape_validation():
    with pytest.raises(UserError, match="heads .*multiple of kv_heads"):
        ModelShape("bad", 2, 64, 6, 4, 16, 128, 100)
    with pytest.raises(UserError, match="layers must be a positive integer"):
        ModelShape("bad", 0, 64, 4, 4, 16, 128, 100)


def test_from_hf_config_file_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA8B_CONFIG))
    for path in (tmp_path, tmp_path / "config.json", str(tmp_path)):
        m = ModelShape.from_hf_config(path)
        ref = get_model("llama3-8b")
        assert (
            m.layers,
            m.hidden,
            m.heads,
            m.kv_heads,
            m.head_dim,
            m.intermediate,
            m.vocab,
            m.tie_embeddings,
        ) == (
            ref.layers,
            ref.hidden,
            ref.heads,
            ref.kv_heads,
            ref.head_dim,
            ref.intermediate,
            ref.vocab,
            False,
        )
        assert m.name == "meta-llama/Llama-3.1-8B-Instruct"
    assert get_model(tmp_path).params == get_model("llama3-8b").params


def test_from_hf_config_defaults_and_nesting(tmp_path):
    cfg = {
        "text_config": {
            "num_hidden_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "intermediate_size": 512,
            "vocab_size": 1000,
            "tie_word_embeddings": True,
        }
    }
    f = tmp_path / "wrapped.json"
    f.write_text(json.dumps(cfg))
    m = ModelShape.from_hf_config(f)
    assert (m.kv_heads, m.head_dim, m.tie_embeddings) == (4, 64, True)
    assert m.params == 4 * (m.layer_params + 2 * 256) + 256 + 1000 * 256


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            {k: v for k, v in LLAMA8B_CONFIG.items() if k != "intermediate_size"},
            "missing field 'intermediate_size'",
        ),
        ({**LLAMA8B_CONFIG, "hidden_size": "4096"}, "field 'hidden_size' must be a positive integer"),
        ({**LLAMA8B_CONFIG, "num_local_experts": 8}, "field 'num_local_experts': mixture-of-experts"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_from_hf_config_errors_name_file_and_field(tmp_path, content, message):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(content))
    with pytest.raises(UserError, match=message) as e:
        ModelShape.from_hf_config(f)
    assert str(f) in str(e.value)


def test_from_hf_config_unreadable(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        ModelShape.from_hf_config(tmp_path / "nope.json")
    with pytest.raises(UserError, match="no such file"):
        ModelShape.from_hf_config(tmp_path)  # a folder without config.json
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not a readable JSON file"):
        ModelShape.from_hf_config(bad)


def test_builtin_models_are_valid():
    for m in MODELS:
        assert m.shard(1).layer_params == m.layer_params
        assert m.heads % m.kv_heads == 0
