"""The bytes a disaggregated prefill sends a decode worker, group by group (`engine/kv_move.py`):
full attention and MLA every arrived token, a sliding window only its tail blocks (vLLM's NIXL
connector clip), a state group one state; and the transfer time those bytes cost on a link."""

import math

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.kv_move import (
    group_transfer_bytes,
    kv_transfer_bytes,
    kv_transfer_seconds,
    window_tail_blocks,
)
from agentkv.engine.models import get_model
from agentkv.engine.models.groups import GroupKind
from agentkv.kv.transfer import fabric_link

LINK = fabric_link(50, 0.5e-6, 30e-6)


@pytest.mark.parametrize("name", ["Llama-3.1-70B", "Llama-3.1-8B", "DeepSeek-V3"])
@pytest.mark.parametrize(("start", "end"), [(0, 1), (0, 999), (992, 1000), (4096, 100_000)])
def test_a_dense_models_bytes_are_tokens_times_bytes_per_token(name, start, end):
    """Full attention and MLA keep every token: the bytes are what they were before groups counted."""
    m = get_model(name)
    for dtype, tp in (("bf16", 1), ("fp8", 8)):
        got = kv_transfer_bytes(m, start, end, 16, dtype, tp)
        assert got == (end - start) * m.kv_bytes_per_token(dtype, tp)


def test_nothing_arrives_nothing_moves():
    """A receiver that caches the whole arrival already (or an empty one) moves no bytes, no state."""
    for name in ("Llama-3.1-70B", "DeepSeek-V4-Pro", "Qwen3-Next-80B-A3B", "gpt-oss-120b"):
        m = get_model(name)
        assert kv_transfer_bytes(m, 0, 0, 16, "fp8", 1) == 0
        assert kv_transfer_bytes(m, 1024, 1000, 16, "fp8", 1) == 0


def test_a_window_groups_bytes_stop_at_its_tail_however_long_the_prompt():
    """gpt-oss-120b's 128-token window layers send the last cdiv(128, 16) + 1 = 9 blocks of the
    arrival (vLLM's `blocks_per_sw`); its full-attention layers every token."""
    m = get_model("gpt-oss-120b")
    full, win = (next(g for g in m.groups if g.kind is k) for k in (GroupKind.FULL, GroupKind.SLIDING))
    per_tok = win.entry_bytes("bf16") * win.num_layers
    assert window_tail_blocks(128, 16) == 9 and window_tail_blocks(100, 16) == 8
    for end in (4096, 100_000, 1_000_000):  # block-aligned: exactly 9 blocks
        assert group_transfer_bytes(win, 0, end, 16, "bf16", 1) == 9 * 16 * per_tok
        assert group_transfer_bytes(full, 0, end, 16, "bf16", 1) == end * per_tok
    assert group_transfer_bytes(win, 0, 999, 16, "bf16", 1) == (999 - 54 * 16) * per_tok  # 8 full + 1 partial
    assert group_transfer_bytes(win, 0, 100, 16, "bf16", 1) == 100 * per_tok  # shorter than the tail
    # the receiver caches the first 99,968 tokens: only the 32 new ones move, window or not
    assert group_transfer_bytes(win, 99_968, 100_000, 16, "bf16", 1) == 32 * per_tok
    long = kv_transfer_bytes(m, 0, 100_000, 16, "bf16", 1)
    assert long == pytest.approx(100_000 * per_tok + 144 * per_tok)
    assert long < 0.51 * 100_000 * m.kv_bytes_per_token("bf16")  # half the layers stop growing


def test_chunked_local_layers_send_the_current_chunk():
    """Llama-4-Scout's 8,192-token chunks: the receiver pads passed chunks with the null block, so
    only the current chunk's tokens move."""
    m = get_model("Llama-4-Scout")
    chunk = next(g for g in m.groups if g.kind is GroupKind.CHUNKED)
    per_tok = chunk.entry_bytes("bf16") * chunk.num_layers
    assert group_transfer_bytes(chunk, 0, 100_000, 16, "bf16", 1) == (100_000 - 12 * 8192) * per_tok
    assert group_transfer_bytes(chunk, 0, 8000, 16, "bf16", 1) == 8000 * per_tok


def test_a_state_group_sends_one_state_whatever_the_length():
    """Qwen3-Next's gated-deltanet state: one state per transfer, at 10 tokens as at 100,000."""
    m = get_model("Qwen3-Next-80B-A3B")
    state = next(g for g in m.groups if g.is_state)
    sizes = {
        group_transfer_bytes(state, s, e, 16, "bf16", 2) for s, e in ((0, 10), (0, 100_000), (512, 1000))
    }
    assert sizes == {state.state_bytes_per_seq(2)} and state.state_bytes_per_seq(2) > 0
    full = next(g for g in m.groups if g.kind is GroupKind.FULL)
    one = group_transfer_bytes(full, 0, 1, 16, "bf16", 2)
    assert kv_transfer_bytes(m, 0, 100_000, 16, "bf16", 2) == 100_000 * one + state.state_bytes_per_seq(2)


# DeepSeek-V4-Pro, fp8 KV, by hand: 61 sliding-window layers (584 B an entry, window 128), 30 CSA
# layers (a 584 B latent and a 132 B indexer key per 4 tokens), 31 HCA layers (584 B per 128
# tokens), and three compressor states a sequence: 65,536 B x 30, 16,384 B x 30, 524,288 B x 31.
V4_STATES = 65_536 * 30 + 16_384 * 30 + 524_288 * 31


@pytest.mark.parametrize(
    ("prompt", "window_tokens", "csa_entries", "hca_entries"),
    [
        (1000, 1000 - (63 - 9) * 16, 250, 7),  # 63 blocks, the last 9 sent: 136 tokens
        (100_000, 100_000 - (6250 - 9) * 16, 25_000, 781),  # 144 tokens
    ],
)
def test_deepseek_v4_pro_by_hand(prompt, window_tokens, csa_entries, hca_entries):
    want = window_tokens * 584 * 61 + csa_entries * (584 + 132) * 30 + hca_entries * 584 * 31 + V4_STATES
    m = get_model("DeepSeek-V4-Pro")
    for tp in (1, 4):  # MLA latents and these states are whole on every rank
        assert kv_transfer_bytes(m, 0, prompt, 16, "fp8", tp) == want
    full_context = prompt * m.kv_bytes_per_token("fp8")  # what every transfer was priced at before
    assert want < (0.75 if prompt == 1000 else 0.15) * full_context


def _engine(model: str, tp: int) -> Engine:
    return Engine(EngineConfig(model=model, gpu="gb300", tensor_parallel_size=tp, max_model_len=200_000))


def test_transfer_time_grows_with_bytes_and_falls_with_link_speed():
    """Seconds and bytes from one function: more arrived tokens cost more, a slower link more, the
    decode TP multiplies the bytes (one shard a rank); a free link costs nothing."""
    llama, v4 = _engine("llama3-70b", 4), _engine("deepseek-v4-pro", 4)
    slow = fabric_link(5, 0.5e-6, 30e-6)  # 3.3 us a 16 KiB copy, not the 0.5 us floor
    for e in (llama, v4):
        s1, b1 = kv_transfer_seconds(e, 0, 10_000, 4, LINK)
        s2, b2 = kv_transfer_seconds(e, 0, 50_000, 4, LINK)
        assert b2 > b1 > 0 and s2 > s1 > 0
        assert kv_transfer_seconds(e, 0, 50_000, 4, slow)[0] > 5 * s2
        assert kv_transfer_seconds(e, 0, 50_000, 4, fabric_link(math.inf, 1, 1)) == (0.0, b2)
        assert kv_transfer_seconds(e, 50_000, 50_000, 4, LINK) == (0.0, 0)
    _, dense = kv_transfer_seconds(llama, 992, 1000, 4, LINK)
    assert dense == 8 * llama.cost.kv_bytes_per_token * 4
    _, v4_bytes = kv_transfer_seconds(v4, 0, 100_000, 4, LINK)
    m = v4.model_shape
    assert v4_bytes == int(kv_transfer_bytes(m, 0, 100_000, v4.config.block_size, v4.cost.kv_dtype, 4) * 4)
    # the narrower TP bounds the links: a TP 8 prefill into a TP 4 decode uses 4 of them
    assert kv_transfer_seconds(llama, 0, 50_000, 8, LINK) == kv_transfer_seconds(llama, 0, 50_000, 4, LINK)
    assert (
        kv_transfer_seconds(llama, 0, 50_000, 2, LINK)[0] > kv_transfer_seconds(llama, 0, 50_000, 4, LINK)[0]
    )
