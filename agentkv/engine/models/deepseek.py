"""Readers of DeepSeek-family configs: V2/V3 and Kimi K2 (MLA + MoE), V3.2 (MLA + a sparse top-k
indexer), V4 (a sliding window on every layer, compressed caches with an indexer, compressor states).

KV layouts follow vLLM: an MLA latent of kv_lora_rank + qk_rope_head_dim elements per token per layer
(V3.2 at fp8: FlashMLA's 656-byte record); indexer keys of index_head_dim fp8 bytes plus one fp32 scale
per 128; V4's 512-element entries (at fp8, 448 fp8 + 64 bf16 RoPE + 8 scale bytes = 584).
"""

from __future__ import annotations

from agentkv.engine.models.groups import GroupKind, LayerGroup
from agentkv.engine.models.hf import Fields
from agentkv.engine.models.parts import Part, experts, mla, mlp, sparse_indexer
from agentkv.engine.models.shape import ModelShape, MoE

MLA, SLIDING, STATE = GroupKind.MLA, GroupKind.SLIDING, GroupKind.STATE
V32_FP8_ENTRY = 656  # FlashMLA sparse fp8_ds_mla: 512 fp8 NoPE + 16 scale bytes + 64 bf16 RoPE
V4_SWA_BLOCK = 64  # vLLM's DeepseekV4SWACache block size (the window's own blocks, not the engine's 256)
V4_RATIOS = (0, 1, 4, 128)  # 0/1: window only; 4: compressed sparse (CSA, with an indexer); 128: heavy (HCA)


def indexer_entry_bytes(index_head_dim: int) -> int:
    """An indexer key in vLLM's cache: fp8 elements plus one fp32 scale per 128 (132 bytes for 128)."""
    return index_head_dim + index_head_dim // 128 * 4


def read_deepseek(f: Fields) -> ModelShape:
    """DeepSeek-V2/V3, Kimi K2 and V3.2: MLA in every layer, a dense MLP in the first
    `first_k_dense_replace` layers, routed plus shared experts in the rest (every `moe_layer_freq`-th)."""
    nope, rope, v_dim = f.num("qk_nope_head_dim"), f.num("qk_rope_head_dim"), f.num("v_head_dim")
    kv_lora = f.num("kv_lora_rank")
    q_lora = f.num("q_lora_rank") if f.has("q_lora_rank") else None
    c = f.common(head_dim=nope + rope)
    h, layers, heads = c["hidden"], c["layers"], c["heads"]
    first_k, freq = f.num("first_k_dense_replace", 0, minimum=0), f.num("moe_layer_freq", 1)
    n, k, mi = f.num("n_routed_experts"), f.num("num_experts_per_tok"), f.num("moe_intermediate_size")
    shared = f.num("n_shared_experts", 0, minimum=0)
    moe_layers = sum(1 for i in range(first_k, layers) if i % freq == 0)
    inter = f.num("intermediate_size")
    parts = mla(h, heads, q_lora, kv_lora, nope, rope, v_dim, layers) + mlp(h, inter, layers - moe_layers)
    parts += experts(h, mi, n, k, moe_layers) + mlp(
        h, mi * shared, moe_layers if shared else 0, "shared experts"
    )
    all_layers = tuple(range(layers))
    sparse = f.model_type == "deepseek_v32"
    topk = idx_heads = 0
    groups = [
        LayerGroup(
            MLA,
            all_layers,
            1,
            kv_lora + rope,
            1,
            fp8_entry_bytes=V32_FP8_ENTRY if sparse else 0,
            label="mla latent",
        )
    ]
    if sparse:
        idx_dim, idx_heads = f.num("index_head_dim"), f.num("index_n_heads")
        topk = f.num("index_topk")  # the sparse top-k: keys each query attends (the cost model's)
        groups.append(
            LayerGroup(
                MLA,
                all_layers,
                1,
                idx_dim,
                1,
                fixed_entry_bytes=indexer_entry_bytes(idx_dim),
                label="indexer keys",
            )
        )
        parts += sparse_indexer(h, q_lora or h, idx_heads, idx_dim, layers)
    wd, ed = f.weight_dtypes()
    return ModelShape(
        **c,
        intermediate=inter,
        groups=tuple(groups),
        parts=tuple(parts),
        moe=MoE(n, k, mi, shared, mi, first_k, moe_layers),
        weight_dtype=wd,
        expert_dtype=ed,
        family=f.model_type,
        qk_rope_dim=rope,
        index_topk=topk,
        index_heads=idx_heads,
    )


def compressor_window(ratio: int) -> int:
    """Tokens a V4 compressor buffers: coff x ratio (coff 2 when windows overlap, at ratio 4), the
    `sliding_window` of vLLM's CompressorStateCache."""
    return (2 if ratio == 4 else 1) * ratio


def compressor_state_bytes(ratio: int, dim: int) -> int:
    """A V4 compressor's buffer per layer per sequence: fp32 KV and score states of 2 x coff x dim for
    each of its `compressor_window` tokens, as vLLM's CompressorStateCache."""
    coff = 2 if ratio == 4 else 1
    return compressor_window(ratio) * 2 * coff * dim * 4


def _compressor(layers: tuple[int, ...], ratio: int, dim: int, label: str) -> LayerGroup:
    """A compressor's buffer: a state vLLM keeps as a sliding window of `compressor_window` tokens, in
    blocks of 4 (ratio 4) or 8 tokens (ratio 128), whose pages match the compressed cache's."""
    return LayerGroup(
        STATE,
        layers,
        state_bytes=compressor_state_bytes(ratio, dim),
        window=compressor_window(ratio),
        page_tokens=4 if ratio == 4 else 8,
        label=label,
    )


def _v4_groups(f: Fields, layers: int, head_dim: int, rope: int, ratios: list[int]) -> list[LayerGroup]:
    """V4's caches: a window on every layer; per CSA layer a 1/4 compressed cache, 1/4 indexer keys and two
    compressor states; per HCA layer a 1/128 compressed cache and a compressor state."""
    fp8 = (head_dim - rope) + rope * 2 + (head_dim - rope) // 64 + 1  # vLLM's fp8_ds_mla entry: 584 for 512
    idx_dim = f.num("index_head_dim")
    csa = tuple(i for i, r in enumerate(ratios) if r == 4)
    hca = tuple(i for i, r in enumerate(ratios) if r == 128)
    groups = [
        LayerGroup(
            SLIDING,
            tuple(range(layers)),
            1,
            head_dim,
            1,
            window=f.num("sliding_window"),
            fp8_entry_bytes=fp8,
            page_tokens=V4_SWA_BLOCK,
            label="sliding window",
        )
    ]
    if csa:
        groups += [
            LayerGroup(MLA, csa, 1, head_dim, 1, compress=4, fp8_entry_bytes=fp8, label="CSA compressed 1/4"),
            LayerGroup(
                MLA,
                csa,
                1,
                idx_dim,
                1,
                compress=4,
                fixed_entry_bytes=indexer_entry_bytes(idx_dim),
                label="CSA indexer keys 1/4",
            ),
            _compressor(csa, 4, head_dim, "CSA compressor state"),
            _compressor(csa, 4, idx_dim, "indexer compressor state"),
        ]
    if hca:
        groups += [
            LayerGroup(
                MLA, hca, 1, head_dim, 1, compress=128, fp8_entry_bytes=fp8, label="HCA compressed 1/128"
            ),
            _compressor(hca, 128, head_dim, "HCA compressor state"),
        ]
    return groups


def _v4_attention_parts(f: Fields, c: dict, ratios: list[int]) -> list[Part]:
    """V4 attention: q low-rank, one shared 512-dim KV, a grouped low-rank output; compressors and indexers."""
    h, heads, hd, layers = c["hidden"], c["heads"], c["head_dim"], c["layers"]
    q_lora, o_lora, o_groups = f.num("q_lora_rank"), f.num("o_lora_rank"), f.num("o_groups")
    idx_dim, idx_heads = f.num("index_head_dim"), f.num("index_n_heads")
    n_csa, n_hca = ratios.count(4), ratios.count(128)
    return [
        Part("attention wq_a, wkv", h * (q_lora + hd), layers, tp_heads=1),
        Part("attention wq_b, wo_a", q_lora * heads * hd + o_lora * heads * hd, layers),
        Part("attention wo_b", o_groups * o_lora * h, layers),
        Part("compressor (CSA)", h * 2 * 2 * hd, n_csa, tp_heads=1),
        Part("compressor (HCA)", h * 2 * hd, n_hca, tp_heads=1),
        Part(
            "indexer", q_lora * idx_heads * idx_dim + h * idx_heads + h * 2 * 2 * idx_dim, n_csa, tp_heads=1
        ),
    ]


def read_deepseek_v4(f: Fields) -> ModelShape:
    """DeepSeek-V4 (Pro, Flash): per-layer `compress_ratios`, a `sliding_window` on every layer, MoE in every
    layer (routed + shared). The multi-token-prediction layer (the list's last entry) is not counted."""
    c = f.common()
    layers, rope = c["layers"], f.num("qk_rope_head_dim")
    ratios = f.int_list("compress_ratios", layers)
    for i, r in enumerate(ratios):
        if r not in V4_RATIOS:
            raise f.error("compress_ratios", f"ratio {r} at layer {i} is not one vLLM serves (0, 1, 4, 128)")
    topk = f.num("index_topk")  # the sparse top-k over the 1/4 compressed cache
    n, k, mi = f.num("n_routed_experts"), f.num("num_experts_per_tok"), f.num("moe_intermediate_size")
    shared = f.num("n_shared_experts", 0, minimum=0)
    h = c["hidden"]
    parts = _v4_attention_parts(f, c, ratios) + experts(h, mi, n, k, layers)
    parts += mlp(h, mi * shared, layers if shared else 0, "shared experts")
    wd, ed = f.weight_dtypes()
    return ModelShape(
        **c,
        intermediate=mi,
        groups=tuple(_v4_groups(f, layers, c["head_dim"], rope, ratios)),
        parts=tuple(p for p in parts if p.copies),
        moe=MoE(n, k, mi, shared, mi, 0, layers),
        weight_dtype=wd,
        expert_dtype=ed,
        family="deepseek_v4",
        index_topk=topk,
        index_heads=f.num("index_n_heads"),
    )


DEEPSEEK_READERS = {
    "deepseek_v2": read_deepseek,
    "deepseek_v3": read_deepseek,
    "kimi_k2": read_deepseek,
    "deepseek_v32": read_deepseek,
    "deepseek_v4": read_deepseek_v4,
}
