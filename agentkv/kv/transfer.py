"""Transfer-time models for moving KV blocks: the host link (PCIe), GPU fabrics (NVLink, RDMA), an SSD.

Small copies are slow: on an H200, pinned host->device copies of 16 KiB ran at 1.6 GB/s and of
16 MiB at 55 GB/s (bundled `data/calibration/h200-llama3-shapes.json`, part `h2d_chunks`). So a
copy's time depends on its chunk size, i.e. on the KV layout, not only on the bytes moved.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources

from agentkv.errors import UserError

CALIBRATION = "data/calibration/h200-llama3-shapes.json"


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Host<->device copies issued one per chunk: bandwidth by chunk size, plus a per-copy floor.

    Bandwidth is interpolated linearly in log(chunk size) between measured points and clamped at
    both ends; a copy never takes less than `min_copy_s` (launch/DMA setup), which the data
    implies: no measured chunk moved in under ~7 us, so tiny chunks cannot beat that.
    """

    chunk_bytes: tuple[int, ...]
    bandwidth_Bps: tuple[float, ...]
    min_copy_s: float = 0.0
    setup_s: float = 0.0  # once per transfer (handshake, completion notice), before its copies

    def __post_init__(self) -> None:
        if not self.chunk_bytes or len(self.chunk_bytes) != len(self.bandwidth_Bps):
            raise UserError("link model: need one bandwidth per chunk size, at least one point")
        if list(self.chunk_bytes) != sorted(set(self.chunk_bytes)) or self.chunk_bytes[0] <= 0:
            raise UserError(
                f"link model: chunk sizes must be positive and increasing, got {self.chunk_bytes}"
            )
        if any(not b > 0 or math.isnan(b) for b in self.bandwidth_Bps):
            raise UserError(f"link model: bandwidths must be positive, got {self.bandwidth_Bps}")
        if self.min_copy_s < 0 or self.setup_s < 0:
            raise UserError(
                f"link model: min_copy_s and setup_s must be >= 0, got {self.min_copy_s}, {self.setup_s}"
            )

    @classmethod
    def from_points(cls, points: list[tuple[int, float]], floor: bool = True) -> LinkModel:
        """A model from (chunk bytes, bytes/s) points; `floor` sets min_copy_s to the fastest measured copy."""
        pts = sorted(points)
        chunks = tuple(int(c) for c, _ in pts)
        bws = tuple(float(b) for _, b in pts)
        min_copy = min(c / b for c, b in zip(chunks, bws, strict=True)) if floor else 0.0
        return cls(chunks, bws, min_copy)

    def bandwidth(self, chunk_bytes: float) -> float:
        """Bytes/s a stream of `chunk_bytes` copies achieves (interpolated, clamped; before the floor)."""
        if chunk_bytes <= self.chunk_bytes[0]:
            return self.bandwidth_Bps[0]
        if chunk_bytes >= self.chunk_bytes[-1]:
            return self.bandwidth_Bps[-1]
        i = bisect.bisect_right(self.chunk_bytes, chunk_bytes)
        x0, x1 = math.log(self.chunk_bytes[i - 1]), math.log(self.chunk_bytes[i])
        b0, b1 = self.bandwidth_Bps[i - 1], self.bandwidth_Bps[i]
        return b0 + (b1 - b0) * (math.log(chunk_bytes) - x0) / (x1 - x0)

    def copy_seconds(self, chunk_bytes: float) -> float:
        """Time of one copy of `chunk_bytes`: size / bandwidth(size), at least `min_copy_s`."""
        if chunk_bytes <= 0:
            return 0.0
        return max(self.min_copy_s, chunk_bytes / self.bandwidth(chunk_bytes))

    def seconds(self, nbytes: int, chunk_bytes: int) -> float:
        """Time to move `nbytes` as copies of `chunk_bytes` each (the last one possibly shorter)."""
        if nbytes <= 0:
            return 0.0
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        full, rest = divmod(nbytes, chunk_bytes)
        return self.setup_s + full * self.copy_seconds(chunk_bytes) + self.copy_seconds(rest)


def fabric_link(gbps: float, min_copy_s: float, setup_s: float) -> LinkModel:
    """A GPU-to-GPU link (NVLink, RDMA NIC): `gbps` GB/s per direction for any chunk size, each copy
    taking at least `min_copy_s` (so small chunks cost their count, not their bytes), plus `setup_s`
    once per transfer. `gbps` may be inf: a free link (every copy and the setup cost nothing)."""
    if not gbps > 0:
        raise UserError(f"link bandwidth must be > 0 GB/s, got {gbps}")
    if math.isinf(gbps):
        return LinkModel((1,), (math.inf,), 0.0, 0.0)
    return LinkModel((1,), (gbps * 1e9,), min_copy_s, setup_s)


# Per-copy floors and per-transfer setup of KV moves between GPUs (assumed, not measured here): a copy
# of one layer's block costs at least this (descriptor issue and completion), a transfer adds a handshake.
NVLINK_MIN_COPY_S, NVLINK_SETUP_S = 0.5e-6, 10e-6
RDMA_MIN_COPY_S, RDMA_SETUP_S = 0.5e-6, 30e-6


def nvlink(gbps: float) -> LinkModel:
    """A GPU's NVLink to a peer in its NVLink domain, `gbps` GB/s per direction (inf: free)."""
    return fabric_link(gbps, NVLINK_MIN_COPY_S, NVLINK_SETUP_S)


def rdma(gbps: float) -> LinkModel:
    """A GPU's RDMA NIC to a GPU on another node, `gbps` GB/s per direction (inf: free)."""
    return fabric_link(gbps, RDMA_MIN_COPY_S, RDMA_SETUP_S)


@dataclass(frozen=True, slots=True)
class DiskModel:
    """An NVMe SSD: sequential read/write bandwidth plus a latency per IO, `queue_depth` IOs in flight.

    Defaults (7 GB/s read, 5 GB/s write, 80 us per IO, queue depth 1) describe one PCIe 4/5 data-centre
    drive accessed one IO at a time, the conservative case; raise `queue_depth` to hide latency.
    """

    read_Bps: float = 7e9
    write_Bps: float = 5e9
    io_latency_s: float = 80e-6
    queue_depth: int = 1

    def __post_init__(self) -> None:
        if not (self.read_Bps > 0 and self.write_Bps > 0):
            raise UserError(f"disk model: bandwidths must be positive, got {self.read_Bps}, {self.write_Bps}")
        if self.io_latency_s < 0 or self.queue_depth < 1:
            raise UserError("disk model: io_latency_s must be >= 0 and queue_depth >= 1")

    def seconds(self, nbytes: int, n_ios: int, write: bool) -> float:
        """Time to read (or write) `nbytes` in `n_ios` IOs."""
        if nbytes <= 0:
            return 0.0
        waves = math.ceil(max(n_ios, 1) / self.queue_depth)
        return waves * self.io_latency_s + nbytes / (self.write_Bps if write else self.read_Bps)


@cache
def load_calibration() -> dict:
    """The bundled H200 calibration file (parsed once)."""
    text = resources.files("agentkv").joinpath(CALIBRATION).read_text(encoding="utf-8")
    return json.loads(text)


@cache
def h200_link() -> LinkModel:
    """Pinned host<->device copies on an H200, from the bundled `h2d_chunks` measurements.

    Only host->device was measured by chunk; device->host uses the same curve (their large-copy
    ceilings agree within 0.3%: 55.5 vs 55.3 GB/s).
    """
    rows = load_calibration()["parts"]["h2d_chunks"]
    return LinkModel.from_points([(int(r["chunk_bytes"]), float(r["h2d_GBps"]) * 1e9) for r in rows])


def kv_bytes_per_token_layer(num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """K and V of one token in one layer: 2 x kv heads x head dim x dtype bytes (Llama-3-8B bf16: 4 KiB)."""
    return 2 * num_kv_heads * head_dim * dtype_bytes
