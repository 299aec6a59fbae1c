"""`ModelShape`: a decoder's dimensions, its KV cache as layer groups, and its weights (dense or MoE).

A dense Llama/Qwen-style shape needs only its dimensions: one full-attention group and the gated-MLP
weights follow from them, with exactly the sizes agentkv has always computed. Other families (MLA,
sliding windows, chunked local attention, linear attention, mixtures of experts) come from the
readers in `agentkv.engine.models.hf` with their groups and weight parts spelled out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentkv.engine.models.dtypes import DTYPE_BYTES, KV_DTYPES, check_dtype
from agentkv.engine.models.groups import GroupKind, LayerGroup
from agentkv.engine.models.parts import Part
from agentkv.errors import UserError


@dataclass(frozen=True, slots=True)
class MoE:
    """A mixture-of-experts layout: routed experts, shared experts, and which layers keep a dense MLP."""

    experts: int
    experts_per_token: int
    intermediate: int  # moe_intermediate_size: one routed expert's width
    shared_experts: int = 0
    shared_intermediate: int = 0  # one shared expert's width
    first_k_dense: int = 0  # first_k_dense_replace: leading layers with a dense MLP
    moe_layers: int = 0  # layers with experts; the others use the dense MLP (`ModelShape.intermediate`)


@dataclass(frozen=True, slots=True)
class RankShape:
    """What one tensor-parallel rank holds: its heads, KV heads and parameter counts."""

    tp: int
    heads: int
    kv_heads: int  # KV heads stored on this rank (replicated when the model has fewer than tp)
    layer_params: int  # linear parameters one token uses in one decoder layer on this rank (layer mean)
    lm_head_params: int  # vocab-parallel lm_head share
    embed_params: int  # vocab-parallel embedding share (0 when tied: the lm_head is the embedding)


def _positive(name: str, field: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UserError(f"model '{name}': {field} must be a positive integer, got {v!r}")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder: dimensions the cost model reads, KV layer groups, linear weight parts (empty: the dense
    Llama layout), the MoE layout and the checkpoint's weight dtypes. Sizes derive from these."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    aliases: tuple[str, ...] = ()
    max_position: int = 131072  # max_position_embeddings: the default --max-model-len
    groups: tuple[LayerGroup, ...] = ()  # empty: one full-attention group of kv_heads x head_dim
    parts: tuple[Part, ...] = ()  # empty: q, k, v, o and a gated MLP of `intermediate` in every layer
    moe: MoE | None = None
    weight_dtype: str = "bf16"  # the checkpoint's linear layers (the cost model's default)
    expert_dtype: str | None = None  # the checkpoint's routed experts, when they differ (MXFP4: fp4)
    family: str = "llama"
    source: str = ""  # where the figures come from
    qk_rope_dim: int = 0  # MLA (DeepSeek V2/V3/V3.2, Kimi): RoPE dims of qk; > 0 means absorbed MLA decode
    index_topk: int = 0  # sparse attention (V3.2, V4): keys each query attends after the indexer (0: dense)
    index_heads: int = 0  # the lightning indexer's heads (its cost over all keys)

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            _positive(self.name, f, getattr(self, f))
        if self.heads % self.kv_heads:
            raise UserError(
                f"model '{self.name}': heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        check_dtype(self.weight_dtype, DTYPE_BYTES)
        if self.expert_dtype is not None:
            check_dtype(self.expert_dtype, DTYPE_BYTES)
        if not self.groups:
            full = LayerGroup(GroupKind.FULL, tuple(range(self.layers)), self.kv_heads, self.head_dim)
            object.__setattr__(self, "groups", (full,))
        for g in self.groups:
            if max(g.layers) >= self.layers:
                raise UserError(f"model '{self.name}': group '{g.name}' names a layer past {self.layers - 1}")

    # -- weights ---------------------------------------------------------------------------------
    @property
    def is_dense(self) -> bool:
        """True for the dense Llama layout (no explicit parts)."""
        return not self.parts

    @property
    def layer_params(self) -> int:
        """Linear weights one token uses in one layer (dense: q, k, v, o and the MLP; else the layer mean)."""
        if self.is_dense:
            h, d = self.hidden, self.head_dim
            return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.intermediate
        return round(sum(p.params * p.active_copies for p in self.parts) / self.layers)

    @property
    def _emb_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def _linear_params(self) -> int:
        if self.is_dense:
            return self.layers * self.layer_params
        return sum(p.params * p.copies for p in self.parts)

    @property
    def params(self) -> int:
        """All parameters (every expert): layers, norms, embedding and (unless tied) the lm_head."""
        if self.is_dense:
            return self.layers * (self.layer_params + 2 * self.hidden) + self.hidden + self._emb_params
        return self._linear_params + 2 * self.layers * self.hidden + self.hidden + self._emb_params

    @property
    def activated_params(self) -> int:
        """Parameters one token uses: the total less the routed experts it is not sent to."""
        if self.is_dense:
            return self.params
        active = sum(p.params * p.active_copies for p in self.parts)
        return active + 2 * self.layers * self.hidden + self.hidden + self._emb_params

    def _dtypes(self, dtype: str | None) -> tuple[float, float]:
        wd = check_dtype(dtype or self.weight_dtype, DTYPE_BYTES)
        return DTYPE_BYTES[wd], DTYPE_BYTES[self.expert_dtype or wd]

    def weight_bytes(self, dtype: str | None = None) -> float:
        """Checkpoint bytes: linear layers in `dtype` (default the checkpoint's; routed experts in the
        checkpoint's expert dtype when it has one); embedding, lm_head and norms stay bf16."""
        wb, eb = self._dtypes(dtype)
        lin = self._linear_params
        if self.is_dense:
            return lin * wb + (self.params - lin) * 2
        expert = sum(p.params * p.copies for p in self.parts if p.expert)
        return (lin - expert) * wb + expert * eb + (self.params - lin) * 2

    def rank_weight_bytes(self, tp: int = 1, dtype: str | None = None) -> float:
        """Weight bytes on one rank: its linear shard (every expert's share), lm_head/embedding shards, norms."""
        r = self.shard(tp)
        wb, eb = self._dtypes(dtype)
        norms = (2 * self.layers + 1) * self.hidden * 2
        if self.is_dense:
            linear = self.layers * r.layer_params * wb
        else:
            linear = sum(p.rank_params(tp) * p.copies * (eb if p.expert else wb) for p in self.parts)
        return linear + (r.lm_head_params + r.embed_params) * 2 + norms

    def shard(self, tp: int = 1) -> RankShape:
        """One rank's share under Megatron-style TP; UserError if `tp` cannot split the heads."""
        if not isinstance(tp, int) or tp < 1:
            raise UserError(f"tensor parallel size must be a positive integer, got {tp!r}")
        if self.heads % tp:
            raise UserError(f"model '{self.name}': {self.heads} attention heads do not split over tp={tp}")
        if self.kv_heads % tp and tp % self.kv_heads:
            raise UserError(
                f"model '{self.name}': {self.kv_heads} KV heads neither split over nor replicate to tp={tp}"
            )
        heads, kv = self.heads // tp, max(1, self.kv_heads // tp)
        h, d = self.hidden, self.head_dim
        if self.is_dense:
            layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * self.intermediate // tp
        else:
            layer = round(sum(p.rank_params(tp) * p.active_copies for p in self.parts) / self.layers)
        vocab_share = -(-self.vocab // tp) * h
        return RankShape(tp, heads, kv, layer, vocab_share, 0 if self.tie_embeddings else vocab_share)

    # -- KV cache --------------------------------------------------------------------------------
    @property
    def attention_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(g for g in self.groups if not g.is_state)

    def kv_bytes_per_token(self, dtype: str = "bf16", tp: int = 1) -> float:
        """KV bytes one token takes on one rank, every attention group at full context: sliding-window and
        chunked layers are counted as if they kept every token (over-counted until the KV pool is per
        group, issue #15 part 2); state groups take nothing per token (`state_bytes_per_seq`)."""
        check_dtype(dtype, KV_DTYPES)
        return sum(g.bytes_per_token(dtype, tp) for g in self.attention_groups)

    def check_kv_dtype(self, dtype: str) -> None:
        """UserError when engines cannot keep this model's KV in `dtype`: NVFP4 KV is attention's per-head
        K and V; vLLM's MLA backends cache the latent in fp8 at most (FlashInfer-MLA: auto, bf16, fp8)."""
        check_dtype(dtype, KV_DTYPES)
        mla = [g.name for g in self.groups if g.kind is GroupKind.MLA or g.fixed_entry_bytes]
        if dtype == "nvfp4" and mla:
            raise UserError(
                f"--kv-cache-dtype nvfp4: {self.name} caches an MLA latent ({mla[0]}); "
                "vLLM's MLA attention backends take fp8 KV at most"
            )

    def long_context_bytes_per_token(self, dtype: str = "bf16", tp: int = 1) -> float:
        """What one more token adds once the sequence is longer than every window and chunk: the full
        attention and MLA groups only (windowed groups and states stop growing)."""
        check_dtype(dtype, KV_DTYPES)
        grows = (GroupKind.FULL, GroupKind.MLA)
        return sum(g.bytes_per_token(dtype, tp) for g in self.groups if g.kind in grows)

    def state_bytes_per_seq(self, tp: int = 1) -> float:
        """Constant per-sequence state on one rank (linear attention, SSM, compressor buffers)."""
        return sum(g.state_bytes_per_seq(tp) for g in self.groups)

    def sequence_kv_bytes(self, context: int, dtype: str = "bf16", tp: int = 1) -> float:
        """What one sequence of `context` tokens holds on one rank, each group by its own rule."""
        return sum(g.sequence_bytes(context, dtype, tp) for g in self.groups)

    def kv_stream_bytes(self, dtype: str = "bf16") -> float:
        """One token's bytes for one KV head of the group with the most layers (a decode program's read)."""
        g = max(self.attention_groups, key=lambda g: g.num_layers)
        return g.head_token_bytes(dtype)

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelShape:
        """Read a Hugging Face `config.json` (the file or its folder); UserError names the file and field."""
        from agentkv.engine.models.hf import read_hf_config

        return read_hf_config(path)
