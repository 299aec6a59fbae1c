"""Step time of one engine step (chunked-prefill pieces + decodes), roofline terms fitted to an H200.

Per layer and TP rank (see docs/cost-model.md for the derivation and the fit):
  linear = ||(W/BW, 2 T P / R_gemm)||_k           weights streamed vs GEMM compute, p-norm overlap
  attn   = self_pairs x f / R_self + past_pairs x f / R_past + setup (if any piece has a cached past)
  kv     = prefill KV read / BW + max(decode KV read / BW, longest decode ctx x per-head bytes / BW_stream)
  layer  = ||(linear + attn + kv + 2 all-reduces, launch floor)||_kf
  step   = layers x layer + lm_head (one row per sequence) + logits gather
Other GPUs scale bandwidth terms by their HBM TB/s and compute terms by their dense TFLOP/s, both
relative to the H200 datasheet; per-layer launch costs do not scale. Other model kinds (MoE, MLA,
windows, sparse/compressed and linear attention) and DP/EP add terms in `agentkv.engine.cost_terms`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np

from agentkv.engine.cost_terms import (
    ModelTerms,
    RateCtx,
    a2a_s,
    dense_params,
    gemm_rate,
    group_terms,
    moe_terms,
)
from agentkv.engine.cost_terms import pnorm as _pnorm
from agentkv.engine.hardware import (
    ACT_BYTES,
    ALLREDUCE_LATENCY_S,
    DTYPE_BYTES,
    GPU,
    KV_DTYPES,
    GroupKind,
    ModelShape,
    get_gpu,
    get_model,
    ring_allreduce_s,
)
from agentkv.errors import UserError

COEFFICIENTS = "data/calibration/cost-h200.json"
REF_HBM_TBPS = 4.8  # H200 SXM datasheet, the part the calibration ran on
REF_BF16_TFLOPS = 989.0
ACTIVATION_FIXED_BYTES = 1 << 30  # CUDA context, cuBLAS/NCCL workspaces, graphs: outside the KV budget


@dataclass(frozen=True, slots=True)
class CostCoefficients:
    """Fitted constants of the step-time model (H200 scale) and the measured ceilings they refer to."""

    copy_gbps: float  # measured device copy bandwidth (read + write), the bandwidth roof
    gemm_tflops: float  # measured bf16 8192^3 GEMM rate, the compute roof
    gemm_eff: float  # layer GEMMs' rate / gemm_tflops
    overlap_k: float  # p-norm exponent joining weight streaming and GEMM compute (1: serial, inf: overlap)
    attn_self_eff: float  # causal attention among the new tokens: rate / gemm_tflops
    attn_past_eff: float  # new tokens attending to the cached past: rate / gemm_tflops
    stream_gbps: float  # one (sequence, KV head) decode attention program's read rate
    past_setup_s: float  # per layer, when a prefill piece attends to a cached past
    launch_floor_s: float  # per layer: kernel launches the GPU cannot run faster than
    floor_k: float  # p-norm exponent joining GPU time and the launch floor

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, int | float) and v >= 0 and v == v and v != float("inf")):
                raise UserError(f"cost coefficients: '{f.name}' must be a finite number >= 0, got {v!r}")
        if self.overlap_k < 1 or self.floor_k < 1:
            raise UserError("cost coefficients: 'overlap_k' and 'floor_k' must be >= 1")

    def to_dict(self) -> dict[str, float]:
        """Plain dict for JSON."""
        return asdict(self)


def load_coefficients(path: str | Path | None = None) -> CostCoefficients:
    """The bundled H200 fit, or a JSON file written by `scripts/fit_cost.py`; UserError names bad fields."""
    if path is None:
        return _bundled()
    try:
        doc = json.loads(Path(path).read_text())
        return CostCoefficients(**doc["coefficients"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a cost coefficient file ({type(e).__name__}: {e})") from None


def profile_name(path: str | Path) -> str:
    """The `name` a profile records (served model @ target), after checking it loads; else the path."""
    load_coefficients(path)
    name = json.loads(Path(path).read_text()).get("name")
    return str(name) if name else str(path)


@cache
def _bundled() -> CostCoefficients:
    doc = json.loads(resources.files("agentkv").joinpath(COEFFICIENTS).read_text())
    return CostCoefficients(**doc["coefficients"])


class CostModel:
    """Seconds of one engine step on one (GPU, model, TP, dtypes) replica; cheap enough to call every step."""

    def __init__(
        self,
        gpu: GPU | str,
        model: ModelShape | str,
        tp: int = 1,
        kv_dtype: str = "bf16",
        weight_dtype: str | None = None,
        coeffs: CostCoefficients | None = None,
        dp: int = 1,
        ep: bool = False,
        expert_imbalance: float = 1.0,
    ):
        """`dp`: data-parallel ranks sharing the expert group (tp x dp GPUs); `ep`: experts split by
        expert with all-to-all dispatch (vLLM's --enable-expert-parallel) rather than by width;
        `expert_imbalance`: under EP, the hottest GPU's routed load over the mean (1.0: balanced)."""
        self.gpu, self.model, self.tp = get_gpu(gpu), get_model(model), tp
        if not isinstance(dp, int) or dp < 1:
            raise UserError(f"data parallel size must be a positive integer, got {dp!r}")
        if ep and self.model.moe is None:
            raise UserError(f"--enable-expert-parallel: model '{self.model.name}' has no experts")
        self.dp, self.ep, self.expert_imbalance = dp, ep, expert_imbalance
        if kv_dtype not in KV_DTYPES:
            raise UserError(f"KV dtype '{kv_dtype}' is not one of {', '.join(KV_DTYPES)}")
        self.gpu.check_kv_dtype(kv_dtype)
        self.model.check_kv_dtype(kv_dtype)
        # weights default to the checkpoint's dtype (bf16 for the dense shapes, fp8 for DeepSeek's)
        weight_dtype = weight_dtype or self.model.weight_dtype
        self.kv_dtype, self.weight_dtype = kv_dtype, weight_dtype
        c = self.coeffs = coeffs or load_coefficients()
        g, m, r = self.gpu, self.model, self.model.shard(tp)
        self.rank = r
        bw = c.copy_gbps * 1e9 * g.hbm_tbps / REF_HBM_TBPS  # achievable HBM bytes/s (the roof)
        peak = c.gemm_tflops * 1e12 / REF_BF16_TFLOPS  # measured rate per datasheet TFLOP/s
        gemm = peak * g.tflops(weight_dtype) * c.gemm_eff
        attn = peak * g.bf16_tflops
        wb = DTYPE_BYTES[weight_dtype]
        self.bandwidth = bw
        self._w = r.layer_params * wb / bw
        self._flop_tok = 2.0 * r.layer_params / gemm
        pair_flops = 4.0 * r.heads * m.head_dim  # QK^T and PV, multiply-add = 2 flops
        self._self_pair = pair_flops / (attn * c.attn_self_eff)
        self._past_pair = pair_flops / (attn * c.attn_past_eff)
        # one token's KV in one layer (the mean over layers of the full-context bytes; dense: its K and V)
        self._kv_tok = m.kv_bytes_per_token(kv_dtype, tp) / m.layers / bw
        self._stream_tok = m.kv_stream_bytes(kv_dtype) / (c.stream_gbps * 1e9 * g.hbm_tbps / REF_HBM_TBPS)
        self._k, self._fk = c.overlap_k, c.floor_k
        self._setup, self._floor = c.past_setup_s, c.launch_floor_s
        act = m.hidden * ACT_BYTES
        link = g.gpu_link_gbps * 1e9
        # two all-reduces per layer (attention out, MLP out): bytes term per token, latency apart
        self._ar_tok = 2.0 * ring_allreduce_s(act, tp, g.gpu_link_gbps, latency_s=0.0)
        self._ar_lat = 2.0 * ALLREDUCE_LATENCY_S if tp > 1 else 0.0
        self._lm_w = r.lm_head_params * 2 / bw
        self._lm_row = 2.0 * r.lm_head_params / (peak * g.bf16_tflops * c.gemm_eff)
        self._gather_row = ((tp - 1) / tp * m.vocab * ACT_BYTES / link) if tp > 1 else 0.0
        self._gather_lat = ALLREDUCE_LATENCY_S if tp > 1 else 0.0
        self._layers = m.layers
        self._terms = None if self.is_legacy else self.terms()

    @property
    def is_legacy(self) -> bool:
        """True for the fitted dense layout (one full-attention group, no experts, no DP): the formula above."""
        m = self.model
        single = len(m.groups) == 1 and m.groups[0].kind is GroupKind.FULL
        return m.is_dense and single and (self.dp == 1 or m.moe is None)

    def terms(self) -> ModelTerms:
        """The per-kind layer terms (any model; for the dense layout they equal the formula above)."""
        c, g, m, tp, dp = self.coeffs, self.gpu, self.model, self.tp, self.dp
        peak = c.gemm_tflops * 1e12 / REF_BF16_TFLOPS
        scale = g.hbm_tbps / REF_HBM_TBPS
        wb, bw = DTYPE_BYTES[self.weight_dtype], self.bandwidth
        gemm = peak * g.tflops(self.weight_dtype) * c.gemm_eff
        rc = RateCtx(
            bw,
            c.stream_gbps * 1e9 * scale,
            peak * g.bf16_tflops,
            c.attn_self_eff,
            c.attn_past_eff,
            peak * gemm_rate(g, "fp8"),
        )
        ne, kvb = dense_params(m, tp, self.rank.layer_params)
        group = tp * dp
        ep = self.ep and m.moe is not None and group > 1
        hot = self.expert_imbalance if ep else 1.0  # split by width, every GPU holds each expert's slice
        moe = moe_terms(m, g, tp, dp, self.weight_dtype, bw, peak * c.gemm_eff, hot)
        act, ep = m.hidden * ACT_BYTES, ep and moe is not None
        a2a1 = a2a_s(1.0, m.moe.experts_per_token, m.hidden, group, g.gpu_link_gbps, hot) if ep else 0.0
        a2a_lat = 2.0 * ALLREDUCE_LATENCY_S if ep else 0.0
        moe_ar = 0.0
        if moe is not None and not ep and dp > 1:
            moe_ar = ring_allreduce_s(dp * act, group, g.gpu_link_gbps, latency_s=0.0)
        return ModelTerms(
            w_ne=ne * wb / bw,
            flop_ne=2.0 * ne / gemm,
            groups=group_terms(m, tp, self.kv_dtype, self.rank.heads, rc),
            moe=moe,
            kvb_past=2.0 * kvb / gemm,
            ar_half=ring_allreduce_s(act, tp, g.gpu_link_gbps, latency_s=0.0),
            ar_lat=ALLREDUCE_LATENCY_S if tp > 1 else 0.0,
            a2a_tok=(a2a1 - a2a_lat) / tp,  # each TP rank dispatches its share of the tokens
            a2a_lat=a2a_lat,
            moe_ar_tok=moe_ar,
            overlap_k=c.overlap_k,
            setup=c.past_setup_s,
            floor=c.launch_floor_s,
            floor_k=c.floor_k,
        )

    # -- sizes --------------------------------------------------------------------------------
    @property
    def weights_bytes(self) -> float:
        """Weight bytes on one rank: its linear-layer shard (every expert's share, experts in the
        checkpoint's expert dtype; with DP, experts spread over all tp x dp GPUs), lm_head/embedding
        shards, norms (bf16)."""
        b = self.model.rank_weight_bytes(self.tp, self.weight_dtype)
        moe = self._terms.moe if self._terms is not None else None
        return b - moe.expert_bytes_tp + moe.expert_bytes_group if moe is not None else b

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes per token on one rank, every layer group at full context: sliding-window and
        chunked layers are over-counted (as if they kept every token) until the KV pool is per group
        (issue #15 part 2); linear-attention/SSM states are reserved per sequence instead."""
        return self.model.kv_bytes_per_token(self.kv_dtype, self.tp)

    def state_reserve_bytes(self, max_num_seqs: int = 256) -> float:
        """Per-sequence states (linear attention, SSM, compressor buffers) for `max_num_seqs` on one rank."""
        return self.model.state_bytes_per_seq(self.tp) * max_num_seqs

    def activation_reserve_bytes(self, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256) -> float:
        """Peak non-KV working memory per rank: one layer's activations for a full token budget, fp32
        logits for one row per sequence, and a fixed 1 GiB for the CUDA context and workspaces."""
        m, r = self.model, self.rank
        per_tok = (
            m.hidden * 3 + (r.heads + 2 * r.kv_heads) * m.head_dim + 3 * m.intermediate // self.tp
        ) * ACT_BYTES
        logits = min(max_num_seqs, max_num_batched_tokens) * -(-m.vocab // self.tp) * 4
        return max_num_batched_tokens * per_tok + logits + ACTIVATION_FIXED_BYTES

    def kv_capacity_bytes(
        self, gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256
    ) -> float:
        """KV cache bytes per rank: HBM x utilization - weights - activation reserve (vLLM's budget rule),
        less the per-sequence states of `max_num_seqs` sequences for models that keep one."""
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise UserError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        free = (
            self.gpu.hbm_bytes * gpu_memory_utilization
            - self.weights_bytes
            - self.activation_reserve_bytes(max_num_batched_tokens, max_num_seqs)
        )
        state = self.state_reserve_bytes(max_num_seqs)
        if state:
            free -= state
        if free <= 0:
            raise UserError(
                f"{self.model.name} (tp={self.tp}, {self.weight_dtype}) does not fit on "
                f"{self.gpu.name} at gpu_memory_utilization={gpu_memory_utilization}"
            )
        return free

    # -- times --------------------------------------------------------------------------------
    def decode_roofline(self, batch: int, ctx: int) -> float:
        """Lower bound of a decode step: all weights read (layers + lm_head) and all KV read, at full BW."""
        if self._terms is not None:
            return self._layers * self._terms.roofline(batch, ctx) + self._lm_w
        return self._layers * (self._w + batch * ctx * self._kv_tok) + self._lm_w

    def layer_time_agg(
        self,
        new_tokens: int,
        past_tokens: int,
        self_pairs: float,
        past_pairs: float,
        any_past: bool,
        n_decode: int,
        decode_ctx_sum: int,
        decode_ctx_max: int,
        n_prefill: int | None = None,
    ) -> float:
        """One decoder layer on one rank (what the calibration probe timed) from batch aggregates;
        `n_prefill` (prefill pieces, default 1 if any new tokens) matters for windows and states."""
        if self._terms is not None:
            np_ = (1 if new_tokens else 0) if n_prefill is None else n_prefill
            args = (self_pairs, past_pairs, any_past, np_, n_decode, decode_ctx_sum, decode_ctx_max)
            return self._terms.layer(new_tokens, past_tokens, *args)
        t = new_tokens + n_decode
        lin = _pnorm(self._w, t * self._flop_tok, self._k)
        attn = (
            self_pairs * self._self_pair + past_pairs * self._past_pair + (self._setup if any_past else 0.0)
        )
        kv = (new_tokens + past_tokens) * self._kv_tok
        if n_decode:
            d_bw, d_stream = decode_ctx_sum * self._kv_tok, decode_ctx_max * self._stream_tok
            kv += d_bw if d_bw > d_stream else d_stream
        comm = t * self._ar_tok + self._ar_lat if t else 0.0
        return _pnorm(lin + attn + kv + comm, self._floor, self._fk)

    def step_time_agg(
        self,
        new_tokens: int,
        past_tokens: int,
        self_pairs: float,
        past_pairs: float,
        any_past: bool,
        n_prefill: int,
        n_decode: int,
        decode_ctx_sum: int,
        decode_ctx_max: int,
    ) -> float:
        """A whole step from aggregates: `new_tokens`/`past_tokens` summed over prefill pieces,
        `self_pairs` = sum n(n+1)/2, `past_pairs` = sum new x past, decode contexts summed and maxed."""
        rows = n_prefill + n_decode
        if rows == 0:
            return 0.0
        layer = self.layer_time_agg(
            new_tokens,
            past_tokens,
            self_pairs,
            past_pairs,
            any_past,
            n_decode,
            decode_ctx_sum,
            decode_ctx_max,
            n_prefill,
        )
        lm = _pnorm(self._lm_w, rows * self._lm_row, self._k)
        gather = rows * self._gather_row + self._gather_lat
        return self._layers * layer + lm + gather

    def decode_steps(self, n_decode: int, ctx_sum: int, ctx_max: int, steps: int) -> np.ndarray:
        """Seconds of `steps` consecutive pure-decode steps of the same `n_decode` sequences, each
        step one token longer: exactly `step_time([], decodes)` per step, vectorised for bursts."""
        k = np.arange(steps, dtype=np.float64)
        if self._terms is not None:
            layer = self._terms.decode_layers(n_decode, ctx_sum + k * n_decode, ctx_max + k)
            lm = _pnorm(self._lm_w, n_decode * self._lm_row, self._k)
            return self._layers * layer + lm + (n_decode * self._gather_row + self._gather_lat)
        lin = _pnorm(self._w, n_decode * self._flop_tok, self._k)
        kv = np.maximum((ctx_sum + k * n_decode) * self._kv_tok, (ctx_max + k) * self._stream_tok)
        comm = n_decode * self._ar_tok + self._ar_lat
        a = lin + kv + comm
        fk = self._fk
        layer = (a**fk + self._floor**fk) ** (1.0 / fk) if self._floor > 0.0 else a
        lm = _pnorm(self._lm_w, n_decode * self._lm_row, self._k)
        return self._layers * layer + lm + (n_decode * self._gather_row + self._gather_lat)

    def decode_step_ends(self, now: float, n: int, ctx_sum: int, ctx_max: int, k: int) -> list[float] | None:
        """End times of `k` pure-decode steps of `n` sequences from `now`, each as `step_time_agg` gives it
        to the last bit, its constant terms computed once; None outside the fitted formula (`is_legacy`)."""
        if self._terms is not None:
            return None
        lin, comm = _pnorm(self._w, n * self._flop_tok, self._k), n * self._ar_tok + self._ar_lat
        lm, gather = _pnorm(self._lm_w, n * self._lm_row, self._k), n * self._gather_row + self._gather_lat
        kv, st, fl, fk, ends = self._kv_tok, self._stream_tok, self._floor, self._fk, []
        for i in range(k):  # layer_time_agg with no prefill: its attention and past terms are 0.0
            d_bw, d_st = (ctx_sum + i * n) * kv, (ctx_max + i) * st
            now += self._layers * _pnorm(lin + (d_bw if d_bw > d_st else d_st) + comm, fl, fk) + lm + gather
            ends.append(now)
        return ends

    def step_time(self, prefills: Sequence[tuple[int, int]], decodes: Sequence[int]) -> float:
        """Seconds for one step: `prefills` are (new tokens, cached past tokens) chunks, `decodes` the
        context length (tokens already cached) of each decoding sequence."""
        new = past = 0
        self_pairs = past_pairs = 0.0
        for n, p in prefills:
            new += n
            past += p
            self_pairs += n * (n + 1) * 0.5
            past_pairs += n * p
        nd = len(decodes)
        return self.step_time_agg(
            new,
            past,
            self_pairs,
            past_pairs,
            past > 0,
            len(prefills),
            nd,
            sum(decodes) if nd else 0,
            max(decodes) if nd else 0,
        )

    def __repr__(self) -> str:
        return (
            f"CostModel({self.gpu.name}, {self.model.name}, tp={self.tp}, kv={self.kv_dtype}, "
            f"weights={self.weight_dtype}, dp={self.dp}, ep={self.ep})"
        )
