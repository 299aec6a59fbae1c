"""Memory tiers: demotion cascade, promotion cost by chunk size, write modes, events, capacity parsing."""

from __future__ import annotations

import json

import pytest

from agentkv.errors import UserError
from agentkv.kv.events import BlockRemoved, BlockStored
from agentkv.kv.tiers import TierSpec, TierStack
from agentkv.kv.transfer import DiskModel, LinkModel, h200_link, kv_bytes_per_token_layer, load_calibration
from agentkv.units import format_bytes, parse_capacity, parse_duration

MiB = 1 << 20
BLOCK = 2 * MiB  # Llama-3-8B bf16, 16 tokens: 16 x 32 layers x 4 KiB


def stack(cpu=2, disk=2, **kw) -> tuple[TierStack, list]:
    events: list = []
    specs = [TierSpec("CPU", capacity_blocks=cpu)] + (
        [TierSpec("DISK", capacity_blocks=disk)] if disk else []
    )
    kw.setdefault("num_layers", 32)
    return TierStack(specs, BLOCK, block_size=16, on_event=events.append, **kw), events


def test_demotion_cascade_gpu_cpu_disk_dropped():
    s, _ = stack()
    for h in range(1, 6):
        s.on_gpu_store(h)
        s.on_gpu_evict(h)
    # CPU keeps the two newest, DISK the two before, block 1 fell off the end.
    assert s.blocks("CPU") == [4, 5]
    assert s.blocks("DISK") == [2, 3]
    assert 1 not in s and s.where(1) is None
    assert s.counters.dropped_blocks == 1
    assert s.match([4, 5, 2, 3, 9], 0) == ["CPU", "CPU", "DISK", "DISK"]
    assert s.match([4, 5, 1, 2], 1) == ["CPU"]  # the run stops at the dropped block
    assert s.counters.tiers["CPU"].stored_blocks == 5 and s.counters.tiers["CPU"].removed_blocks == 3
    assert s.counters.tiers["DISK"].bytes_down == 3 * BLOCK


def test_lru_touch_on_promote_changes_victim_and_fifo_does_not():
    for policy, survivor in (("lru", 1), ("fifo", 2)):
        s, _ = stack(cpu=2, disk=0, policy=policy)
        s.on_gpu_evict(1)
        s.on_gpu_evict(2)
        s.promote([1])
        s.on_gpu_evict(3)
        assert s.blocks("CPU") == [survivor, 3], policy


def test_match_touches_the_run_so_it_is_evicted_last():
    s, _ = stack(cpu=3, disk=0)
    for h in (1, 2, 3):
        s.on_gpu_evict(h)
    assert s.match([1, 2, 9], 0) == ["CPU", "CPU"]
    s.on_gpu_evict(4)  # room is made by evicting 3, the only block not just looked up
    assert s.blocks("CPU") == [1, 2, 4]


def test_promotion_is_inclusive_and_costs_transfer_time():
    s, _ = stack()
    for h in (1, 2):
        s.on_gpu_evict(h)
    seconds = s.promote([1, 2])
    expected = 2 * h200_link().seconds(BLOCK, BLOCK // 32)
    assert seconds == pytest.approx(expected)
    assert s.blocks("CPU") == [1, 2]  # copies stay below
    before = s.counters.demote_s
    s.on_gpu_evict(1)  # already in CPU: no second copy
    assert s.counters.demote_s == before
    c = s.counters.tiers["CPU"]
    assert (c.hit_blocks, c.hit_tokens, c.bytes_up) == (2, 32, 2 * BLOCK)
    with pytest.raises(KeyError, match="no lower tier"):
        s.promote([77])


def test_disk_promotion_adds_ssd_read_to_the_host_copy():
    disk = DiskModel(read_Bps=7e9, write_Bps=5e9, io_latency_s=80e-6)
    s = TierStack(
        [TierSpec("CPU", capacity_blocks=1), TierSpec("DISK", capacity_blocks=4, disk=disk)],
        BLOCK,
        num_layers=32,
    )
    s.on_gpu_evict(1)
    s.on_gpu_evict(2)
    assert s.where(1) == "DISK"
    link = s.link.seconds(BLOCK, BLOCK // 32)
    assert s.promote([1]) == pytest.approx(link + 80e-6 + BLOCK / 7e9)
    assert s.promote([2]) == pytest.approx(link)
    assert s.counters.tiers["DISK"].seconds_down == pytest.approx(80e-6 + BLOCK / 5e9)


def test_small_chunks_are_slower_per_byte():
    link = h200_link()
    small = TierStack([TierSpec("CPU", capacity_blocks=8)], BLOCK, chunk_bytes=16 << 10)
    large = TierStack([TierSpec("CPU", capacity_blocks=8)], BLOCK, chunk_bytes=16 * MiB)
    for s in (small, large):
        s.on_gpu_evict(1)
    t_small, t_large = small.promote([1]), large.promote([1])
    assert t_small > 20 * t_large
    assert BLOCK / t_small == pytest.approx(1.648e9, rel=0.01)  # the measured 16 KiB figure
    assert link.bandwidth(16 * MiB) == pytest.approx(54.9e9, rel=0.01)
    # monotone interpolation between the 64 KiB and 256 KiB points, clamped beyond the ends
    assert 9.2e9 < link.bandwidth(128 << 10) < 36e9
    assert link.bandwidth(1 << 30) == link.bandwidth(16 * MiB)
    assert link.bandwidth(1024) == link.bandwidth(16 << 10)
    # the per-copy floor: a 4 KiB copy costs as much as the fastest measured copy
    assert link.copy_seconds(4096) == pytest.approx(link.min_copy_s) and link.min_copy_s > 5e-6


def test_link_model_interpolates_in_log_chunk_space():
    link = LinkModel.from_points([(1024, 1e9), (4096, 3e9)], floor=False)
    assert link.bandwidth(2048) == pytest.approx(2e9)  # halfway in log2 space
    assert link.seconds(10_000, 4096) == pytest.approx(2 * 4096 / 3e9 + 1808 / link.bandwidth(1808))
    with pytest.raises(UserError, match="increasing"):
        LinkModel((4096, 1024), (1e9, 2e9))


def test_default_chunk_is_one_layer_of_one_block():
    per_token_layer = kv_bytes_per_token_layer(num_kv_heads=8, head_dim=128)
    assert per_token_layer == 4096
    s, _ = stack()
    assert s.chunk_bytes == 16 * per_token_layer


def test_write_through_pays_at_store_write_back_at_evict():
    wt, _ = stack(write_mode="write_through")
    wb, _ = stack(write_mode="write_back")
    for s in (wt, wb):
        s.on_gpu_store(1)
        s.on_gpu_store(1)  # a repeated store is not copied twice
    assert wt.counters.store_copy_s > 0 and wt.blocks("CPU") == [1]
    assert wb.counters.store_copy_s == 0 and wb.blocks("CPU") == []
    for s in (wt, wb):
        s.on_gpu_evict(1)
    assert wt.counters.evict_copy_s == 0
    assert wb.counters.evict_copy_s == pytest.approx(wt.counters.store_copy_s)
    assert wt.counters.demote_s == pytest.approx(wb.counters.demote_s)


def test_events_report_tier_moves_with_medium():
    s, events = stack(cpu=1, disk=1)
    s.on_gpu_evict(10)
    s.on_gpu_evict(11)
    s.on_gpu_evict(12)
    moves = [(type(e).__name__, e.medium, e.block_hashes) for e in events]
    assert moves == [
        ("BlockStored", "CPU", [10]),
        ("BlockStored", "DISK", [10]),
        ("BlockRemoved", "CPU", [10]),
        ("BlockStored", "CPU", [11]),
        ("BlockRemoved", "DISK", [10]),
        ("BlockStored", "DISK", [11]),
        ("BlockRemoved", "CPU", [11]),
        ("BlockStored", "CPU", [12]),
    ]
    assert all(e.block_size == 16 for e in events if isinstance(e, BlockStored))
    events.clear()
    s.clear()
    assert events == [
        BlockRemoved(block_hashes=[12], medium="CPU"),
        BlockRemoved(block_hashes=[11], medium="DISK"),
    ]
    assert s.occupancy() == {"CPU": (0, 1), "DISK": (0, 1)}


def test_specs_and_capacities():
    s = TierStack([TierSpec.parse("CPU", "8MiB"), TierSpec.parse("DISK", "1GB")], BLOCK)
    assert s.occupancy() == {"CPU": (0, 4), "DISK": (0, 476)}
    assert TierStack([], BLOCK).match([1], 0) == []
    bad = [
        ([TierSpec("DISK", capacity_blocks=1), TierSpec("CPU", capacity_blocks=1)], {}, "order"),
        ([TierSpec("GPU", capacity_blocks=1)], {}, "CPU and/or DISK"),
        ([TierSpec("CPU")], {}, "exactly one"),
        ([TierSpec("CPU", capacity_bytes=1000)], {}, "holds no block"),
        ([], {"write_mode": "sometimes"}, "write_mode"),
        ([], {"policy": "random"}, "policy"),
    ]
    for specs, kw, msg in bad:
        with pytest.raises(UserError, match=msg):
            TierStack(specs, BLOCK, **kw)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512GB", 512 * 10**9),
        ("1.5TiB", int(1.5 * 2**40)),
        ("200GiB", 200 * 2**30),
        ("200 gib", 200 * 2**30),
        ("4096", 4096),
        (4096, 4096),
        ("64KiB", 65536),
        ("1e3MB", 10**9),
        ("1_000B", 1000),
    ],
)
def test_parse_capacity(text, expected):
    assert parse_capacity(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "12XB", "-5GB", "1.2.3GB", "nan", "inf GB", None, True, "5 G B"])
def test_parse_capacity_rejects_bad_input(text):
    with pytest.raises(UserError, match="cpu capacity"):
        parse_capacity(text, "cpu capacity")


def test_parse_duration_and_format():
    assert parse_duration("60s") == 60 and parse_duration("2m") == 120 and parse_duration("1h") == 3600
    assert parse_duration("50ms") == pytest.approx(0.05) and parse_duration("250us") == pytest.approx(2.5e-4)
    assert parse_duration(3) == 3.0
    for bad in ("5 parsecs", "m", "-1s", ""):
        with pytest.raises(UserError, match="--duration"):
            parse_duration(bad, "--duration")
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 B"


def test_bundled_calibration_matches_shared(shared_dir):
    shared = json.loads((shared_dir / "calibration" / "h200-llama3-shapes.json").read_text())
    assert load_calibration()["parts"]["h2d_chunks"] == shared["parts"]["h2d_chunks"]
