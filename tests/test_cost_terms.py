"""Cost terms for MoE, MLA, windows, sparse top-k, linear attention, EP/DP and weight dtypes
(agentkv.engine.cost_terms), on constructed cases; dense step times stay as fitted."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.engine.cost import CostModel
from agentkv.engine.cost_terms import a2a_s, distinct_experts, pnorm
from agentkv.engine.hardware import GroupKind, LayerGroup, ModelShape, get_model
from agentkv.errors import UserError

# step times computed with main's CostModel before the per-kind terms existed (commit 318aeae)
MAIN = {
    ("h200", "llama3-8b", 1, "bf16"): (0.14955357080187667, 0.013517943489603763, 0.04521219355630721),
    ("h200", "llama3-70b", 4, "fp8"): (0.2590167797263938, 0.01938047895073633, 0.0861654748562457),
    ("b200", "qwen3-32b", 2, "bf16"): (0.1454240141280183, 0.015284206387253968, 0.05590520652443152),
    ("h100", "llama3-70b", 8, "bf16"): (0.14948915276608904, 0.019303838315554968, 0.11097008662333158),
}
STEPS = [
    ([(2048, 30000)], []),
    ([], [4096] * 64),
    ([(512, 8192), (128, 0)], [1000, 50000, 7]),
]


@pytest.mark.parametrize("case", list(MAIN))
def test_dense_step_times_are_unchanged(case):
    gpu, model, tp, kv = case
    cm = CostModel(gpu, model, tp=tp, kv_dtype=kv)
    assert cm.is_legacy
    for (pre, dec), want in zip(STEPS, MAIN[case], strict=True):
        assert cm.step_time(pre, dec) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("model,tp", [("llama3-8b", 1), ("llama3-70b", 4)])
def test_per_kind_terms_reduce_to_the_fitted_formula_for_a_dense_model(model, tp):
    cm = CostModel("h200", model, tp=tp)
    terms = cm.terms()
    for agg in [
        (2048, 0, 2048 * 2049 / 2, 0.0, False, 1, 0, 0, 0),
        (512, 30000, 512 * 513 / 2, 512 * 30000.0, True, 1, 16, 16 * 9000, 20000),
        (0, 0, 0.0, 0.0, False, 0, 256, 256 * 1024, 1024),
        (0, 0, 0.0, 0.0, False, 0, 1, 131072, 131072),
    ]:
        legacy = cm.layer_time_agg(*agg[:5], *agg[6:])
        assert terms.layer(*agg) == pytest.approx(legacy, rel=1e-12)


def test_distinct_experts_from_one_token_to_all():
    assert distinct_experts(256, 8, 1) == pytest.approx(8)
    assert distinct_experts(256, 8, 0) == 0.0
    assert distinct_experts(256, 8, 10_000) == pytest.approx(256)
    seq = [distinct_experts(256, 8, t) for t in (1, 2, 8, 32, 128, 512)]
    assert seq == sorted(seq) and seq[-1] < 256
    assert distinct_experts(256, 8, 2) == pytest.approx(8 + 8 * (1 - 8 / 256))  # 2nd token: 8 x P(new)


def test_deepseek_v3_decode_is_expert_bound_then_flattens():
    cm = CostModel("h200", "deepseek-v3", tp=8)
    moe = cm.terms().moe
    w = [moe.weights_s(b) for b in (1, 8, 64, 256, 1024, 4096)]
    assert w == sorted(w)
    assert w[2] > 20 * w[0]  # 64 tokens touch ~222 of 256 experts, one token 8
    full = moe.frac * 256 * moe.expert_s
    assert w[-1] == pytest.approx(full, rel=1e-9) and w[-2] == pytest.approx(full, rel=1e-6)
    # short contexts: the step follows the experts read, then grows only with compute
    t = [cm.step_time((), [64] * b) for b in (1, 16, 64, 256, 512)]
    assert t[2] > 1.5 * t[0]
    assert (t[4] - t[3]) / 256 < 0.3 * (t[2] - t[0]) / 63
    assert CostModel("h200", "llama3-70b", tp=8).step_time((), [64] * 64) < 1.2 * CostModel(
        "h200", "llama3-70b", tp=8
    ).step_time((), [64])


def test_mla_decode_reads_one_latent_per_token():
    m = get_model("deepseek-v3")
    for kv, entry in (("bf16", (512 + 64) * 2), ("fp8", 512 + 64)):
        cm = CostModel("h200", m, tp=8, kv_dtype=kv)
        d = cm.decode_roofline(4, 10_001) - cm.decode_roofline(4, 10_000)
        assert d * cm.bandwidth == pytest.approx(4 * m.layers * entry, rel=1e-6)
    # absorbed decode attends the latent (576 + 512 dims per head), prefill the 192 + 128 dims
    g = CostModel("h200", m, tp=1).terms().groups[0]
    assert g.dec_pair / g.past_pair == pytest.approx((576 + 512) / (192 + 128))


def _windowed(window: int) -> ModelShape:
    full = ModelShape("w", 8, 4096, 32, 8, 128, 14336, 128256)
    group = LayerGroup(GroupKind.SLIDING, tuple(range(8)), 8, 128, window=window)
    return ModelShape("w", 8, 4096, 32, 8, 128, 14336, 128256, groups=(group,), parts=full.parts)


def test_window_attention_stops_growing_past_the_window():
    cm = CostModel("h200", _windowed(4096))
    dec = [cm.step_time((), [c] * 16) for c in (1024, 4096, 16384, 131072)]
    assert dec[0] < dec[1] == pytest.approx(dec[2], rel=1e-12) == pytest.approx(dec[3], rel=1e-12)
    pre = [cm.step_time([(512, p)], ()) for p in (1024, 8192, 65536)]
    assert pre[0] < pre[1] == pytest.approx(pre[2], rel=1e-12)
    full = CostModel("h200", "llama3-8b")
    assert full.step_time((), [131072] * 16) > 5 * dec[3]


def test_sparse_topk_stops_growing_past_k_but_the_indexer_does_not():
    v32, v3 = CostModel("h200", "deepseek-v3.2", tp=8), CostModel("h200", "deepseek-v3", tp=8)
    latent, indexer = v32.terms().groups
    assert latent.cap == 2048 and indexer.cap == float("inf")
    a = latent.time(0, 0, 0, 0, 0, 32, 32 * 4096, 4096)
    assert a == pytest.approx(latent.time(0, 0, 0, 0, 0, 32, 32 * 131072, 131072), rel=1e-12)
    assert indexer.time(0, 0, 0, 0, 0, 32, 32 * 131072, 131072) > indexer.time(
        0, 0, 0, 0, 0, 32, 32 * 4096, 4096
    )
    slope = {
        n: cm.step_time((), [65536] * 32) - cm.step_time((), [32768] * 32)
        for n, cm in (("32", v32), ("3", v3))
    }
    assert 0 < slope["32"] < 0.25 * slope["3"]
    v4 = CostModel("h200", "deepseek-v4-pro", tp=8)
    assert v4.step_time((), [1_000_000] * 8) < v3.step_time((), [131072] * 8)


def test_linear_attention_state_is_constant_in_context():
    cm = CostModel("h200", "qwen3-next", tp=4)
    state = [g for g in cm.terms().groups if g.state_s]
    assert len(state) == 1
    s = state[0]
    assert s.time(0, 0, 0, 0, 0, 8, 8 * 1000, 1000) == s.time(0, 0, 0, 0, 0, 8, 8 * 500_000, 500_000) > 0
    assert s.time(4096, 0, 4096 * 4097 / 2, 0, 1, 0, 0, 0) > s.time(512, 0, 512 * 513 / 2, 0, 1, 0, 0, 0)


def test_expert_parallel_all_to_all_scales_with_group_and_link():
    one = a2a_s(64, 8, 7168, 2, 450) - 2 * 10e-6
    assert a2a_s(64, 8, 7168, 8, 450) - 2 * 10e-6 == pytest.approx(one * (7 / 8) / (1 / 2))
    assert a2a_s(64, 8, 7168, 8, 900) - 2e-5 == pytest.approx((a2a_s(64, 8, 7168, 8, 450) - 2e-5) / 2)
    assert a2a_s(64, 8, 7168, 1, 450) == 0.0
    ep = {dp: CostModel("h200", "deepseek-v3", tp=1, dp=dp, ep=True).terms() for dp in (2, 8)}
    assert ep[8].comm(64) > ep[2].comm(64) > 0
    b200 = CostModel("b200", "deepseek-v3", tp=1, dp=8, ep=True).terms()
    assert b200.comm(256) < ep[8].comm(256)  # 900 vs 450 GB/s links
    # DP x EP spreads the experts: each GPU holds 1/8 of them, attention replicated
    tp8, dp8 = CostModel("h200", "deepseek-v3", tp=8), CostModel("h200", "deepseek-v3", dp=8, ep=True)
    assert dp8.terms().moe.expert_bytes_group == pytest.approx(tp8.terms().moe.expert_bytes_tp)
    assert dp8.weights_bytes > tp8.weights_bytes  # attention and shared experts are not split


def test_fp8_halves_weight_bytes_and_fp4_quarters_them():
    m = get_model("qwen3-235b")
    bf, f8 = CostModel("h200", m, tp=8), CostModel("h200", m, tp=8, weight_dtype="fp8")
    emb = (m.shard(8).lm_head_params + m.shard(8).embed_params) * 2 + (2 * m.layers + 1) * m.hidden * 2
    assert f8.weights_bytes - emb == pytest.approx((bf.weights_bytes - emb) / 2)
    assert f8.terms().w_ne == pytest.approx(bf.terms().w_ne / 2)
    assert f8.terms().moe.expert_s == pytest.approx(bf.terms().moe.expert_s / 2)
    assert f8.step_time((), [1024] * 64) < bf.step_time((), [1024] * 64)
    f4 = CostModel("b200", m, tp=8, weight_dtype="fp4")
    assert f4.terms().moe.expert_s == pytest.approx(CostModel("b200", m, tp=8).terms().moe.expert_s / 4)


@pytest.mark.parametrize("model", ["deepseek-v3", "deepseek-v4-pro", "gpt-oss-120b", "qwen3-next"])
def test_moe_decode_never_beats_its_roofline(model):
    cm = CostModel("h200", model, tp=8 if model != "qwen3-next" else 4)
    for batch in (1, 16, 256):
        for ctx in (1, 4096, 131072):
            assert cm.step_time((), [ctx] * batch) >= cm.decode_roofline(batch, ctx) * (1 - 1e-9)
    steps = cm.decode_steps(16, 16 * 5000, 5000, 3)
    assert steps[1] == pytest.approx(cm.step_time((), [5001] * 16), rel=1e-12)


def test_bad_parallel_settings_are_one_line_errors():
    with pytest.raises(UserError, match="has no experts"):
        CostModel("h200", "llama3-8b", ep=True)
    with pytest.raises(UserError, match="data parallel size"):
        CostModel("h200", "deepseek-v3", dp=0)
    with pytest.raises(UserError, match="do not spread over 512 GPUs"):
        CostModel("h200", "deepseek-v3", tp=8, dp=64, ep=True)


def _group_time_reference(g, new, past, self_pairs, past_pairs, n_prefill, n_decode, ctx_sum, ctx_max):
    """One group's layer seconds as the formula reads, with min and max (the reference for the fast loop)."""
    if g.state_s:
        return g.frac * ((n_prefill + n_decode) * g.state_s + (new + n_decode) * g.state_tok)
    c, cap, t = g.compress, g.cap, 0.0
    if new:
        ps, pp, e = self_pairs / c, past_pairs / c, (new + past) / c
        if cap < float("inf"):
            lim = new * cap
            ps = min(ps, lim)
            pp = min(pp, lim - ps)
            e = min(e, n_prefill * cap + new / c)
        t += ps * g.self_pair + pp * g.past_pair + e * g.entry_s
    if n_decode:
        e, emax = ctx_sum / c, ctx_max / c
        if cap < float("inf"):
            e, emax = min(e, n_decode * cap), min(emax, cap)
        t += max(e * g.entry_s, emax * g.stream_s, e * g.dec_pair)
    return g.frac * t


@pytest.mark.parametrize(
    "model",
    ["DeepSeek-V4-Pro", "DeepSeek-V4-Flash", "gpt-oss-120b", "Gemma-3-27B", "Qwen3-Next-80B-A3B", "Kimi-K2"],
)
def test_a_layer_is_its_groups_terms_to_the_last_bit(model):
    """`ModelTerms.layer` (its token-count terms kept by count, its groups in one loop) gives what the
    formula gives, bit for bit, over random steps: windows, top-k caps, states, prefill and decode."""
    terms = CostModel("h200", get_model(model), tp=8 if "Pro" in model or "Kimi" in model else 2).terms()

    @settings(max_examples=300, deadline=None)
    @given(
        st.integers(0, 16_384),
        st.integers(0, 1 << 20),
        st.integers(0, 8),
        st.integers(0, 256),
        st.integers(0, 1 << 20),
        st.booleans(),
    )
    def check(new, past, n_prefill, n_decode, ctx_max, any_past):
        n_prefill = n_prefill if new else 0
        self_pairs, past_pairs = new * (new + 1) * 0.5, float(new * past)
        ctx_sum = ctx_max * n_decode
        args = (new, past, self_pairs, past_pairs, any_past, n_prefill, n_decode, ctx_sum, ctx_max)
        t = new + n_decode
        w, fl = terms.w_ne, t * terms.flop_ne
        if terms.moe is not None:
            w += terms.moe.weights_s(t)
            fl += t * terms.moe.flop_tok
        a = pnorm(w, fl, terms.overlap_k) + past * terms.kvb_past + (terms.setup if any_past else 0.0)
        for g in terms.groups:
            a += _group_time_reference(
                g, new, past, self_pairs, past_pairs, n_prefill, n_decode, ctx_sum, ctx_max
            )
            assert g.time(new, past, self_pairs, past_pairs, n_prefill, n_decode, ctx_sum, ctx_max) == (
                _group_time_reference(
                    g, new, past, self_pairs, past_pairs, n_prefill, n_decode, ctx_sum, ctx_max
                )
            )
        a += terms.comm(t)
        want = pnorm(a, terms.floor, terms.floor_k)
        assert terms.layer(*args) == want
        assert terms.layer(*args) == want  # again, from the kept token-count terms

    check()


def test_the_kept_token_count_terms_stay_bounded():
    """A what-if pricing many token counts keeps at most 65,536 of them, and prices the same after."""
    terms = CostModel("h200", get_model("DeepSeek-V4-Flash"), tp=2).terms()
    first = terms.layer(5, 0, 15.0, 0.0, False, 1, 0, 0, 0)
    for t in range(1, 70_000):
        terms.layer(t, 0, t * (t + 1) * 0.5, 0.0, False, 1, 0, 0, 0)
    assert len(terms._by_tokens) <= 1 << 16
    assert terms.layer(5, 0, 15.0, 0.0, False, 1, 0, 0, 0) == first
