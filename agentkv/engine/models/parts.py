"""A model's linear weights as parts (attention projections, MLPs, experts): size, copies, TP rule, use.

Embeddings, the lm_head and norms are not parts: `ModelShape` adds them from the vocabulary and hidden
size. Builders here follow vLLM's layers: which projections are split over TP ranks, which replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.errors import UserError


@dataclass(frozen=True, slots=True)
class Part:
    """One kind of weight matrix: parameters of one copy, copies in the model, how TP shares a copy
    (`tp_heads` 0: split evenly; 1: replicated; n > 1: split by n heads, replicated when fewer than
    ranks) and how many copies one token uses (`active`, None: all)."""

    name: str
    params: int
    copies: int
    tp_heads: int = 0
    active: int | None = None
    expert: bool = False  # routed experts: stored in the checkpoint's expert dtype

    def __post_init__(self) -> None:
        if self.params < 0 or self.copies < 0 or self.tp_heads < 0:
            raise UserError(f"weights '{self.name}': sizes must be >= 0")
        if self.tp_heads > 1 and self.params % self.tp_heads:
            raise UserError(
                f"weights '{self.name}': {self.params} params do not split by {self.tp_heads} heads"
            )

    @property
    def active_copies(self) -> int:
        return self.copies if self.active is None else self.active

    def rank_params(self, tp: int = 1) -> float:
        """Parameters of one copy that one of `tp` ranks holds."""
        if self.tp_heads == 1:
            return float(self.params)
        if self.tp_heads > 1:
            return float(self.params // self.tp_heads * max(1, self.tp_heads // tp))
        return self.params / tp


def gqa(
    hidden: int, heads: int, kv_heads: int, head_dim: int, layers: int, q_gate: bool = False
) -> list[Part]:
    """Grouped-query attention: q and o split over ranks, k and v split by KV head (a gated q doubles q)."""
    q = hidden * heads * head_dim * (2 if q_gate else 1)
    return [
        Part("attention q, o", q + heads * head_dim * hidden, layers),
        Part("attention k, v", 2 * hidden * kv_heads * head_dim, layers, tp_heads=kv_heads),
    ]


def mlp(hidden: int, intermediate: int, layers: int, name: str = "mlp") -> list[Part]:
    """A gated MLP (gate, up, down), split over ranks."""
    return [Part(name, 3 * hidden * intermediate, layers)] if layers else []


def experts(hidden: int, intermediate: int, n: int, k: int, moe_layers: int) -> list[Part]:
    """Routed experts (gated MLPs, `k` of `n` used per token) and their router, on `moe_layers` layers."""
    if not moe_layers:
        return []
    return [
        Part("routed experts", 3 * hidden * intermediate, n * moe_layers, active=k * moe_layers, expert=True),
        Part("router", hidden * n, moe_layers, tp_heads=1),
    ]


def mla(
    hidden: int, heads: int, q_lora: int | None, kv_lora: int, nope: int, rope: int, v_dim: int, layers: int
) -> list[Part]:
    """DeepSeek's multi-head latent attention: the down projections are replicated (vLLM), the rest split."""
    parts = [
        Part("mla kv_a", hidden * (kv_lora + rope), layers, tp_heads=1),
        Part("mla kv_b", kv_lora * heads * (nope + v_dim), layers),
        Part("mla o", heads * v_dim * hidden, layers),
    ]
    if q_lora:
        parts += [
            Part("mla q_a", hidden * q_lora, layers, tp_heads=1),
            Part("mla q_b", q_lora * heads * (nope + rope), layers),
        ]
    else:
        parts.append(Part("mla q", hidden * heads * (nope + rope), layers))
    return parts


def sparse_indexer(hidden: int, q_lora: int, heads: int, head_dim: int, layers: int) -> list[Part]:
    """DeepSeek's lightning indexer (wq_b, wk, weights_proj), replicated on every rank as in vLLM."""
    if not layers:
        return []
    return [
        Part("indexer", q_lora * heads * head_dim + hidden * head_dim + hidden * heads, layers, tp_heads=1)
    ]
