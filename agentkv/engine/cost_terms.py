"""Step-time terms for models beyond the dense Llama layout: MoE (distinct experts read, grouped GEMMs,
expert parallelism), MLA (absorbed decode, un-absorbed prefill), windows, sparse top-k, compressed
caches and linear-attention states. Same coefficients as the dense formula, which it reduces to for a
single full-attention group (docs/cost-model.md, "Model kinds")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from agentkv.engine.hardware import ACT_BYTES, ALLREDUCE_LATENCY_S, DTYPE_BYTES, GPU, GroupKind, ModelShape
from agentkv.errors import UserError

INF = math.inf


def distinct_experts(experts: int, k: int, tokens: float) -> float:
    """Expected distinct experts `tokens` tokens touch when each picks `k` of `experts` uniformly:
    E (1 - (1 - k/E)^T); k at T = 1, E as T grows."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


def a2a_s(tokens: float, k: int, hidden: int, group: int, link_gbps: float, imbalance: float = 1.0) -> float:
    """EP dispatch + combine for one MoE layer on one GPU: `tokens` x k x hidden bf16 rows each way,
    the (group-1)/group share of them crossing the link, plus one latency each way; the hottest GPU
    receives `imbalance` x the mean rows (expert load imbalance) and everyone waits for it."""
    if group <= 1 or tokens <= 0:
        return 0.0
    nbytes = tokens * k * hidden * ACT_BYTES * (group - 1) / group * imbalance
    return 2.0 * (nbytes / (link_gbps * 1e9) + ALLREDUCE_LATENCY_S)


def gemm_rate(gpu: GPU, dtype: str) -> float:
    """Datasheet TFLOP/s for GEMMs on `dtype` weights; a part without that rate runs them weight-only
    (dequantised to bf16, as vLLM's Marlin kernels do)."""
    if dtype in ("fp8", "fp4") and (gpu.fp8_tflops if dtype == "fp8" else gpu.fp4_tflops) is None:
        return gpu.bf16_tflops
    return gpu.tflops(dtype)


@dataclass(frozen=True, slots=True)
class GroupTerm:
    """One layer group's attention and KV terms, in seconds at the rank's roofs (per layer of the group)."""

    frac: float  # the group's layers / all layers (terms are layer means)
    compress: int  # tokens per cached entry
    cap: float  # entries a query attends at most: window, top-k, or INF
    entry_s: float  # one entry read at the HBM roof
    stream_s: float  # one entry read by one (sequence, KV head) decode program (0 for MLA: split over SMs)
    self_pair: float  # one (new query, new key) pair
    past_pair: float  # one (new query, cached key) pair
    dec_pair: float  # one (decode query, cached key) pair: absorbed MLA's latent compute
    state_s: float = 0.0  # linear attention: a sequence's state read + written, per step
    state_tok: float = 0.0  # linear attention: one token's state update and output

    def time(self, new, past, self_pairs, past_pairs, n_prefill, n_decode, ctx_sum, ctx_max) -> float:
        """Attention + KV seconds of one layer of this group for a step's aggregates."""
        return groups_time(
            (self,), 0.0, new, past, self_pairs, past_pairs, n_prefill, n_decode, ctx_sum, ctx_max
        )

    def decode(self, n: int, ctx_sum: np.ndarray, ctx_max: np.ndarray):
        """`time` for pure-decode steps of `n` sequences, vectorised over steps (sum and max arrays)."""
        if self.state_s:
            return self.frac * n * (self.state_s + self.state_tok)
        c, cap = self.compress, self.cap
        e = ctx_sum / c
        if cap < INF:
            e = np.minimum(e, n * cap)
        if not self.stream_s:  # no per-sequence stream term: e >= 0, so max(e*a, e*b) is e*max(a, b)
            return self.frac * (e * (self.entry_s if self.entry_s >= self.dec_pair else self.dec_pair))
        emax = ctx_max / c
        if cap < INF:
            emax = np.minimum(emax, cap)
        return self.frac * np.maximum(np.maximum(e * self.entry_s, emax * self.stream_s), e * self.dec_pair)

    def roof(self, batch: int, ctx: int) -> float:
        """KV bytes a decode step must read, in seconds at the roof."""
        if self.state_s:
            return self.frac * batch * self.state_s / 2
        return self.frac * batch * min(ctx / self.compress, self.cap) * self.entry_s


def groups_time(groups, a, new, past, self_pairs, past_pairs, n_prefill, n_decode, ctx_sum, ctx_max) -> float:
    """`a` plus each group's attention + KV seconds of one layer for a step's aggregates, added in
    order (`GroupTerm.time` is one group's; a step's layer loops here, without a call a group)."""
    for g in groups:
        if g.state_s:
            a += g.frac * ((n_prefill + n_decode) * g.state_s + (new + n_decode) * g.state_tok)
            continue
        c, cap, t = g.compress, g.cap, 0.0  # (`x if x < y else y` is `min(y, x)`, without a call)
        if new:
            ps, pp, e = self_pairs / c, past_pairs / c, (new + past) / c
            if cap < INF:  # new keys first (within the window when n <= it), the past fills the rest
                lim = new * cap
                ps = lim if lim < ps else ps
                pp = lim - ps if lim - ps < pp else pp
                x = n_prefill * cap + new / c
                e = x if x < e else e
            t += ps * g.self_pair + pp * g.past_pair + e * g.entry_s
        if n_decode:
            e, emax = ctx_sum / c, ctx_max / c
            if cap < INF:
                x = n_decode * cap
                e = x if x < e else e
                emax = cap if cap < emax else emax
            m, x, y = e * g.entry_s, emax * g.stream_s, e * g.dec_pair  # (max(m, x, y), in its order)
            m = x if x > m else m
            t += y if y > m else m
        a += g.frac * t
    return a


@dataclass(frozen=True, slots=True)
class RateCtx:
    """The roofs a CostModel derived: HBM and per-stream bytes/s, attention FLOP/s, efficiencies."""

    bw: float
    stream_bw: float
    attn: float  # attention FLOP/s (bf16 datasheet x measured/datasheet)
    self_eff: float
    past_eff: float
    fp8_attn: float  # the indexer's FLOP/s (fp8 where the part has it)


def _is_indexer(g) -> bool:
    return g.fixed_entry_bytes > 0


def group_terms(m: ModelShape, tp: int, kv_dtype: str, heads: int, rc: RateCtx) -> tuple[GroupTerm, ...]:
    """Every group's terms on one rank with `heads` query heads (see GroupTerm)."""
    out = []
    idx_layers = {g.layers for g in m.groups if _is_indexer(g)}
    state = sum(g.state_bytes_per_seq(tp) for g in m.groups if g.is_state) / m.layers  # layer mean
    if state:  # all states as one term: read + written once per sequence; ~10 flops per 2-byte element a
        # token: the chunked delta rule's 6 K x V and 4 chunk x (K + V) products (chunk 64, K = V = 128)
        out.append(
            GroupTerm(1.0, 1, INF, 0, 0, 0, 0, 0, 2.0 * state / rc.bw, 5.0 * state / (rc.attn * rc.self_eff))
        )
    for g in m.groups:
        frac = g.num_layers / m.layers
        if g.is_state:
            continue
        entry, stream = g.entry_bytes(kv_dtype, tp), g.entry_bytes(kv_dtype, g.kv_heads)
        if _is_indexer(g):  # scores every key at its small dim, fp8
            pair = 2.0 * m.index_heads * g.head_dim / (rc.fp8_attn * rc.past_eff)
            out.append(GroupTerm(frac, g.compress, INF, entry / rc.bw, 0.0, pair, pair, pair))
            continue
        cap = INF
        if g.kind in (GroupKind.SLIDING, GroupKind.CHUNKED):
            cap = float(g.window)
        elif m.index_topk and g.layers in idx_layers:
            cap = float(m.index_topk)
        hd, rope = m.head_dim, m.qk_rope_dim
        if rope:  # MLA: prefill on K = nope + rope, V = nope dims; decode absorbed onto the latent
            pf, dec = 2.0 * heads * (2 * hd - rope), 2.0 * heads * (2 * g.head_dim - rope)
        else:
            pf = dec = 4.0 * heads * hd
        out.append(
            GroupTerm(
                frac,
                g.compress,
                cap,
                entry / rc.bw,
                0.0 if g.kind is GroupKind.MLA else stream / rc.stream_bw,
                pf / (rc.attn * rc.self_eff),
                pf / (rc.attn * rc.past_eff),
                dec / (rc.attn * rc.past_eff),
            )
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class MoETerms:
    """Routed experts on one GPU of the expert group (tp x dp GPUs, by expert under EP, else by width)."""

    frac: float  # MoE layers / all layers
    experts: int
    k: int
    dp: int
    expert_s: float  # one distinct expert's bytes on this GPU, read at the roof (per MoE layer)
    flop_tok: float  # one token of this DP rank's routed GEMM work on this GPU (layer mean)
    expert_bytes_tp: float  # all routed experts' bytes on a rank split over tp alone
    expert_bytes_group: float  # the same split over the whole expert group
    hot: float = 1.0  # EP: the hottest GPU's routed load over the mean (1.0: balanced)

    def weights_s(self, tokens: float) -> float:
        """Routed-expert weights read in one layer (mean) when this DP rank runs `tokens` tokens; under
        imbalance the hottest GPU's experts are each hit `hot` x as often (capped at every token)."""
        k = min(self.k * self.hot, float(self.experts))
        return self.frac * distinct_experts(self.experts, k, self.dp * tokens) * self.expert_s


def moe_terms(
    m: ModelShape, gpu: GPU, tp: int, dp: int, wdtype: str, bw: float, gemm_per_tflop: float, hot: float = 1.0
):
    """MoETerms for `m` (None for a model without routed experts); `hot`: expert load imbalance, the
    hottest GPU's routed tokens over the mean (pass 1.0 unless experts are split by expert, EP)."""
    if not (math.isfinite(hot) and hot >= 1.0):
        raise UserError(f"--expert-imbalance: must be a finite number >= 1.0, got {hot}")
    routed = [p for p in m.parts if p.expert]
    if m.moe is None or not routed:
        return None
    p, group = routed[0], tp * dp
    if group > m.moe.experts:
        raise UserError(f"model '{m.name}': {m.moe.experts} experts do not spread over {group} GPUs")
    ed = m.expert_dtype or wdtype
    eb = DTYPE_BYTES[ed]
    moe_layers = p.copies // m.moe.experts
    gemm = gemm_per_tflop * gemm_rate(gpu, ed)
    total = sum(q.params * q.copies for q in routed) * eb
    return MoETerms(
        frac=moe_layers / m.layers,
        experts=m.moe.experts,
        k=m.moe.experts_per_token,
        dp=dp,
        expert_s=p.params * eb / group / bw,
        flop_tok=hot * moe_layers / m.layers * m.moe.experts_per_token * 2.0 * p.params / tp / gemm,
        expert_bytes_tp=sum(q.rank_params(tp) * q.copies for q in routed) * eb,
        expert_bytes_group=total / group,
        hot=hot,
    )


def dense_params(m: ModelShape, tp: int, rank_layer_params: int) -> tuple[float, float]:
    """(non-routed linear params one token uses per layer on a rank, MLA kv_b params per layer on it)."""
    if m.is_dense:
        return float(rank_layer_params), 0.0
    ne = sum(p.rank_params(tp) * p.active_copies for p in m.parts if not p.expert) / m.layers
    kvb = sum(p.rank_params(tp) * p.copies for p in m.parts if p.name == "mla kv_b") / m.layers
    return ne, kvb


def pnorm(a: float, b: float, k: float) -> float:
    """(a^k + b^k)^(1/k): at least max(a, b), at most a + b."""
    if a <= 0.0 or b <= 0.0:
        return a if a > b else b
    return (a**k + b**k) ** (1.0 / k)


@dataclass(frozen=True, slots=True)
class ModelTerms:
    """One decoder layer (mean over layers) on one GPU for any model kind: the dense formula with
    routed experts, per-group attention/KV and the expert group's collectives added."""

    w_ne: float  # non-routed weights read (s)
    flop_ne: float  # non-routed GEMMs per token (s)
    groups: tuple[GroupTerm, ...]
    moe: MoETerms | None
    kvb_past: float  # MLA un-absorbed prefill: the cached past's latents up-projected by kv_b (s/token)
    ar_half: float  # one all-reduce over the TP group, per token (s)
    ar_lat: float  # one all-reduce's latency (0 when tp = 1)
    a2a_tok: float  # EP dispatch + combine per token (s, bytes part)
    a2a_lat: float  # EP dispatch + combine latency
    moe_ar_tok: float  # MoE layers without EP under DP: all-reduce of the DP group's tokens (per token)
    overlap_k: float
    setup: float
    floor: float
    floor_k: float
    _by_tokens: dict[int, tuple[float, float]] = field(default_factory=dict, compare=False, repr=False)

    def comm(self, t: int) -> float:
        """TP all-reduces (attention out; dense MLP out) and the MoE layers' collective."""
        if not t:
            return 0.0
        attn = t * self.ar_half + self.ar_lat
        if self.moe is None:
            return 2.0 * attn
        f = self.moe.frac
        if self.a2a_tok or self.a2a_lat:
            moe = t * self.a2a_tok + self.a2a_lat
        elif self.moe_ar_tok:
            moe = t * self.moe_ar_tok + self.ar_lat
        else:
            moe = attn
        return attn + (1.0 - f) * attn + f * moe

    def layer(self, new, past, self_pairs, past_pairs, any_past, n_prefill, n_decode, ctx_sum, ctx_max):
        """Seconds of one layer (mean) for a step's aggregates, launch floor included."""
        t = new + n_decode
        by_t = self._by_tokens.get(t)
        if by_t is None:
            if len(self._by_tokens) >= 1 << 16:  # (a bound: what-if sweeps may price many counts)
                self._by_tokens.clear()
            by_t = self._by_tokens[t] = self._token_terms(t)
        a = by_t[0] + past * self.kvb_past + (self.setup if any_past else 0.0)
        a = groups_time(
            self.groups, a, new, past, self_pairs, past_pairs, n_prefill, n_decode, ctx_sum, ctx_max
        )
        a += by_t[1]
        return pnorm(a, self.floor, self.floor_k)

    def _token_terms(self, t: int) -> tuple[float, float]:
        """What a step's layer costs by its token count alone: the weights and GEMMs (routed experts
        too), and the collectives (`layer` keeps them by count: a simulation's steps repeat few counts)."""
        w, fl = self.w_ne, t * self.flop_ne
        if self.moe is not None:
            w += self.moe.weights_s(t)
            fl += t * self.moe.flop_tok
        return pnorm(w, fl, self.overlap_k), self.comm(t)

    def decode_layers(self, n: int, ctx_sum: np.ndarray, ctx_max: np.ndarray) -> np.ndarray:
        """`layer` for pure-decode steps of the same `n` sequences, vectorised over steps."""
        w, fl = self.w_ne, n * self.flop_ne
        if self.moe is not None:
            w += self.moe.weights_s(n)
            fl += n * self.moe.flop_tok
        a = pnorm(w, fl, self.overlap_k) + self.comm(n)
        for g in self.groups:
            a = a + g.decode(n, ctx_sum, ctx_max)
        if self.floor <= 0.0:
            return a
        return (a**self.floor_k + self.floor**self.floor_k) ** (1.0 / self.floor_k)

    def roofline(self, batch: int, ctx: int) -> float:
        """A decode layer's bytes at the roof: non-routed weights, the experts the batch touches, its KV."""
        w = self.w_ne + (self.moe.weights_s(batch) if self.moe is not None else 0.0)
        return w + sum(g.roof(batch, ctx) for g in self.groups)
