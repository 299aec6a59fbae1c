"""Readers of Hugging Face configs: Llama, Qwen2/Qwen3 (dense), Qwen3-MoE, gpt-oss, Gemma 3, Llama 4,
Qwen3-Next. Field names and defaults follow transformers' config classes and vLLM's model code."""

from __future__ import annotations

from agentkv.engine.models.groups import GroupKind, LayerGroup
from agentkv.engine.models.hf import MOE_FIELDS, Fields
from agentkv.engine.models.parts import Part, experts, gqa, mlp
from agentkv.engine.models.shape import ModelShape, MoE

FULL, SLIDING, CHUNKED, STATE = GroupKind.FULL, GroupKind.SLIDING, GroupKind.CHUNKED, GroupKind.STATE
# transformers' Gemma3TextConfig defaults, for the fields google/gemma-3-*-it configs leave out
GEMMA3_DEFAULTS = {
    "vocab_size": 262_208,
    "max_position_embeddings": 131_072,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}


def attention_groups(
    kinds: list[GroupKind], kv_heads: int, head_dim: int, window: int = 0
) -> list[LayerGroup]:
    """One group per attention kind present in `kinds` (per layer); windowed kinds get `window`."""
    out = []
    for kind in (FULL, SLIDING, CHUNKED):
        layers = tuple(i for i, k in enumerate(kinds) if k is kind)
        if layers:
            out.append(LayerGroup(kind, layers, kv_heads, head_dim, window=0 if kind is FULL else window))
    return out


def moe_layer_indices(f: Fields, layers: int) -> list[int]:
    """Qwen's MoE layers: every `decoder_sparse_step`-th layer not in `mlp_only_layers`."""
    step = f.num("decoder_sparse_step", 1)
    only = f.get("mlp_only_layers", [])
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise f.error("mlp_only_layers", f"expected a list of layer indices, got {only!r}")
    return [i for i in range(layers) if i not in only and (i + 1) % step == 0]


def read_dense(f: Fields) -> ModelShape:
    """Llama, Qwen2, Qwen3 (and configs without a model_type): GQA attention and a gated MLP per layer."""
    for field in MOE_FIELDS:
        v = f.get(field)
        if isinstance(v, int) and v > 1:
            raise f.error(
                field,
                "mixture-of-experts fields need a model_type that lays the experts out "
                f"(qwen3_moe, deepseek_v3, gpt_oss, ...); got {f.model_type or 'none'}",
            )
    c = f.common()
    layers = c["layers"]
    default = ["full_attention"] * layers
    window = 0
    if f.get("use_sliding_window") and f.has("sliding_window"):  # Qwen2: windows from max_window_layers on
        window, first = f.num("sliding_window"), f.num("max_window_layers", 0, minimum=0)
        default = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    kinds = f.layer_types(layers, default, {"full_attention": FULL, "sliding_attention": SLIDING})
    if SLIDING in kinds and not window:
        window = f.num("sliding_window")
    wd, _ = f.weight_dtypes()
    groups = attention_groups(kinds, c["kv_heads"], c["head_dim"], window) if window else ()
    family = f.model_type or "llama"
    return ModelShape(
        **c, intermediate=f.num("intermediate_size"), groups=tuple(groups), weight_dtype=wd, family=family
    )


def read_qwen3_moe(f: Fields) -> ModelShape:
    """Qwen3-MoE (Qwen3-235B-A22B, Qwen3-Coder-480B-A35B): GQA attention, routed experts, no shared expert."""
    c = f.common()
    h, layers = c["hidden"], c["layers"]
    n, k, mi = f.num("num_experts"), f.num("num_experts_per_tok"), f.num("moe_intermediate_size")
    moe_layers = len(moe_layer_indices(f, layers))
    inter = f.num("intermediate_size")
    parts = gqa(h, c["heads"], c["kv_heads"], c["head_dim"], layers)
    parts += mlp(h, inter, layers - moe_layers) + experts(h, mi, n, k, moe_layers)
    wd, ed = f.weight_dtypes()
    moe = MoE(n, k, mi, moe_layers=moe_layers)
    return ModelShape(
        **c,
        intermediate=inter,
        parts=tuple(parts),
        moe=moe,
        weight_dtype=wd,
        expert_dtype=ed,
        family="qwen3_moe",
    )


def read_gpt_oss(f: Fields) -> ModelShape:
    """gpt-oss: sliding-window and full layers alternating (attention sinks add no KV), MoE in every layer."""
    c = f.common()
    h, layers = c["hidden"], c["layers"]
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    kinds = f.layer_types(layers, default, {"sliding_attention": SLIDING, "full_attention": FULL})
    groups = attention_groups(kinds, c["kv_heads"], c["head_dim"], f.num("sliding_window"))
    n = f.num("num_local_experts")
    k = f.num("num_experts_per_tok" if f.has("num_experts_per_tok") else "experts_per_token")
    inter = f.num("intermediate_size")
    parts = gqa(h, c["heads"], c["kv_heads"], c["head_dim"], layers) + experts(h, inter, n, k, layers)
    wd, ed = f.weight_dtypes()
    return ModelShape(
        **c,
        intermediate=inter,
        groups=tuple(groups),
        parts=tuple(parts),
        moe=MoE(n, k, inter, moe_layers=layers),
        weight_dtype=wd,
        expert_dtype=ed,
        family="gpt_oss",
    )


def read_gemma3(f: Fields) -> ModelShape:
    """Gemma 3: five sliding-window layers to one global (`sliding_window_pattern`), a dense gated MLP."""
    f = Fields({**GEMMA3_DEFAULTS, **f.cfg}, f.origin, f.name, outer=f.outer)
    c = f.common()
    layers = c["layers"]
    pattern = f.num(
        "_sliding_window_pattern" if f.has("_sliding_window_pattern") else "sliding_window_pattern"
    )
    default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    kinds = f.layer_types(layers, default, {"sliding_attention": SLIDING, "full_attention": FULL})
    groups = attention_groups(kinds, c["kv_heads"], c["head_dim"], f.num("sliding_window"))
    wd, _ = f.weight_dtypes()
    return ModelShape(
        **c, intermediate=f.num("intermediate_size"), groups=tuple(groups), weight_dtype=wd, family="gemma3"
    )


def read_llama4(f: Fields) -> ModelShape:
    """Llama 4: chunked local attention on RoPE layers, global attention on the NoPE ones (every
    `no_rope_layer_interval`-th by default); MoE (routed + one shared expert) every
    `interleave_moe_layer_step`-th layer, a dense MLP of `intermediate_size_mlp` elsewhere."""
    c = f.common()
    h, layers = c["hidden"], c["layers"]
    interval = f.num("no_rope_layer_interval", 4)
    nope = f.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(nope, list) or len(nope) != layers:
        raise f.error("no_rope_layers", f"expected {layers} flags (1: RoPE, chunked; 0: NoPE, global)")
    chunk = f.num("attention_chunk_size")
    kinds = [CHUNKED if r else FULL for r in nope]
    step = f.num("interleave_moe_layer_step", 1)
    moe_layers = sum(1 for i in range(layers) if (i + 1) % step == 0)
    n, k, inter = f.num("num_local_experts"), f.num("num_experts_per_tok"), f.num("intermediate_size")
    dense = f.num("intermediate_size_mlp")
    parts = gqa(h, c["heads"], c["kv_heads"], c["head_dim"], layers) + mlp(h, dense, layers - moe_layers)
    parts += experts(h, inter, n, k, moe_layers) + mlp(h, inter, moe_layers, "shared expert")
    wd, ed = f.weight_dtypes()
    return ModelShape(
        **c,
        intermediate=dense,
        groups=tuple(attention_groups(kinds, c["kv_heads"], c["head_dim"], chunk)),
        parts=tuple(parts),
        moe=MoE(n, k, inter, 1, inter, moe_layers=moe_layers),
        weight_dtype=wd,
        expert_dtype=ed,
        family="llama4",
    )


def read_qwen3_next(f: Fields) -> ModelShape:
    """Qwen3-Next: Gated DeltaNet linear attention (a constant state per sequence) with a gated full
    attention layer every `full_attention_interval`; routed experts plus one shared expert."""
    c = f.common()
    h, layers = c["hidden"], c["layers"]
    interval = f.num("full_attention_interval", 4)
    default = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    kinds = f.layer_types(layers, default, {"linear_attention": STATE, "full_attention": FULL})
    full = tuple(i for i, k in enumerate(kinds) if k is FULL)
    linear = tuple(i for i, k in enumerate(kinds) if k is STATE)
    nk, nv = f.num("linear_num_key_heads"), f.num("linear_num_value_heads")
    dk, dv, kernel = (
        f.num("linear_key_head_dim"),
        f.num("linear_value_head_dim"),
        f.num("linear_conv_kernel_dim"),
    )
    conv_dim = 2 * nk * dk + nv * dv
    ssm_bytes = (
        4 if f.get("mamba_ssm_dtype") in ("float32", "fp32") else 2
    )  # vLLM: the model dtype unless set
    groups = (
        [
            LayerGroup(
                STATE,
                linear,
                state_bytes=conv_dim * (kernel - 1) * 2 + nv * dk * dv * ssm_bytes,
                state_heads=nk,
                label="gated deltanet state",
            )
        ]
        if linear
        else []
    )
    if full:
        groups.insert(0, LayerGroup(FULL, full, c["kv_heads"], c["head_dim"]))
    gdn = h * (2 * nk * dk + 2 * nv * dv) + h * 2 * nv + conv_dim * kernel + nv * dv * h
    n, k, mi = f.num("num_experts"), f.num("num_experts_per_tok"), f.num("moe_intermediate_size")
    shared = f.num("shared_expert_intermediate_size", 0, minimum=0)
    moe_layers = len(moe_layer_indices(f, layers))
    parts = gqa(
        h, c["heads"], c["kv_heads"], c["head_dim"], len(full), q_gate=bool(f.get("attn_output_gate", True))
    )
    parts += [Part("gated deltanet", gdn, len(linear))] if linear else []
    parts += mlp(h, f.num("intermediate_size"), layers - moe_layers) + experts(h, mi, n, k, moe_layers)
    parts += mlp(h, shared, moe_layers, "shared expert") if shared else []
    wd, ed = f.weight_dtypes()
    return ModelShape(
        **c,
        intermediate=f.num("intermediate_size"),
        groups=tuple(groups),
        parts=tuple(parts),
        moe=MoE(n, k, mi, 1 if shared else 0, shared, moe_layers=moe_layers),
        weight_dtype=wd,
        expert_dtype=ed,
        family="qwen3_next",
    )


FAMILY_READERS = {
    "": read_dense,
    "llama": read_dense,
    "qwen2": read_dense,
    "qwen3": read_dense,
    "qwen3_moe": read_qwen3_moe,
    "gpt_oss": read_gpt_oss,
    "gemma3": read_gemma3,
    "gemma3_text": read_gemma3,
    "llama4": read_llama4,
    "llama4_text": read_llama4,
    "qwen3_next": read_qwen3_next,
}
