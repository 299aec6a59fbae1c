"""Accelerator catalogue: datasheet figures, systems (nodes and racks: NVLink domain, NIC, power),
the all-reduce model; model shapes re-exported.

GPU figures come from `shared/hardware.md` (dense peaks, sparse halved; [S]/[V] marks there say
how sure they are). Model shapes (layer groups, MoE, weights, Hugging Face config readers) live in
`agentkv.engine.models`; the names below keep `agentkv.engine.hardware` imports working.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.engine.models import (
    DTYPE_BYTES,
    KV_DTYPES,
    GroupKind,
    LayerGroup,
    ModelShape,
    MoE,
    RankShape,
    builtin_models,
    get_model,
    model_names,
)
from agentkv.engine.models.dtypes import lookup_key as _key
from agentkv.errors import UserError

ACT_BYTES = 2  # activations and all-reduce payloads stay bf16
ALLREDUCE_LATENCY_S = 10e-6  # one small all-reduce over NVLink (assumed, not measured here)
MODELS: tuple[ModelShape, ...] = builtin_models()

__all__ = [
    "ACT_BYTES",
    "ALLREDUCE_LATENCY_S",
    "DTYPE_BYTES",
    "GPU",
    "GPUS",
    "SYSTEMS",
    "System",
    "KV_DTYPES",
    "MODELS",
    "GroupKind",
    "LayerGroup",
    "MoE",
    "ModelShape",
    "RankShape",
    "get_gpu",
    "get_system",
    "get_model",
    "gpu_names",
    "model_names",
    "ring_allreduce_s",
    "system_names",
]


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator's datasheet: HBM, dense TFLOP/s by dtype, links (GB/s per direction), power."""

    name: str
    hbm_gb: float  # nameplate; in practice binary GB (an "80 GB" H100 reports 79.6 GiB)
    hbm_tbps: float
    bf16_tflops: float
    fp8_tflops: float | None
    fp4_tflops: float | None
    host_link_gbps: float
    gpu_link_gbps: float
    power_w: float
    aliases: tuple[str, ...] = ()
    note: str = ""
    vendor: str = "nvidia"  # "amd": FP4 is MXFP4 there, and vLLM has no NVFP4 KV cache on ROCm
    # NVIDIA compute capability x 10 (90 Hopper, 100/103 Blackwell, 107 Rubin): vLLM's attention backend
    sm: int = 0

    @property
    def hbm_bytes(self) -> float:
        """HBM capacity in bytes (nameplate GB read as GiB, which matches what the driver reports)."""
        return self.hbm_gb * 2**30

    def check_kv_dtype(self, dtype: str) -> None:
        """UserError for an NVFP4 KV cache on a GPU without FP4 (no fp4 rate here: before Blackwell),
        or on an AMD one (its FP4 is MXFP4; vLLM's nvfp4 KV needs Blackwell's FlashInfer kernels)."""
        if dtype != "nvfp4" or (self.fp4_tflops is not None and self.vendor == "nvidia"):
            return
        have = ", ".join(g.name for g in GPUS if g.fp4_tflops and g.vendor == "nvidia")
        why = "no FP4 support" if self.fp4_tflops is None else "no NVFP4 (AMD's FP4 is MXFP4)"
        raise UserError(f"--kv-cache-dtype nvfp4: the {self.name} has {why} (GPUs with it: {have})")

    def tflops(self, dtype: str) -> float:
        """Dense TFLOP/s for GEMMs whose weights are `dtype` (bf16/fp16 share a rate)."""
        rate = {
            "bf16": self.bf16_tflops,
            "fp16": self.bf16_tflops,
            "fp8": self.fp8_tflops,
            "fp4": self.fp4_tflops,
        }.get(dtype)
        if dtype not in DTYPE_BYTES:
            raise UserError(f"weight dtype '{dtype}' is not one of {', '.join(DTYPE_BYTES)}")
        if rate is None:
            raise UserError(f"{self.name} has no published dense {dtype} rate; use another weight dtype")
        return rate


GPUS: tuple[GPU, ...] = (
    GPU("H100 SXM", 80, 3.35, 989, 1979, None, 64, 450, 700, ("h100", "h100-sxm"), sm=90),
    GPU("H200 SXM", 141, 4.8, 989, 1979, None, 64, 450, 700, ("h200", "h200-sxm"), sm=90),
    GPU("B200", 180, 8.0, 2250, 4500, 9000, 64, 900, 1000, ("b200", "b200-hgx"), "180 GB usable", sm=100),
    GPU(
        "GB200",
        186,
        8.0,
        2500,
        5000,
        10000,
        450,
        900,
        1200,
        ("gb200", "gb200-nvl72"),
        "host link is NVLink-C2C, 900 GB/s bidirectional per Grace shared by its 2 GPUs",
        sm=100,
    ),
    GPU(
        "B300",
        268,
        8.0,
        2250,
        4500,
        13500,
        128,
        900,
        1100,
        ("b300", "b300-hgx"),
        "268 GB usable; PCIe 6",
        sm=103,
    ),
    GPU(
        "GB300",
        288,
        8.0,
        2500,
        5000,
        15000,
        450,
        900,
        1400,
        ("gb300", "gb300-nvl72"),
        "host link is NVLink-C2C, shared by the 2 GPUs of a Grace",
        sm=103,
    ),
    GPU(
        "Rubin VR200",
        288,
        22.0,
        4000,
        17500,
        50000,
        900,
        1800,
        2050,
        ("rubin", "vr200", "vera-rubin", "rubin-vr200", "vr200-nvl72"),
        "preliminary: 22 TB/s (earlier 13), ~4,000 bf16 TFLOP/s [?]; fp8 17,500: NVIDIA's CES 2026 "
        "'FP8/FP6 training' figure, 1.2 EF per VR NVL72 rack (72 x 17.5 PF = 1.26 EF; half the 35 PF NVFP4 "
        "training rate), dense: NVIDIA calls it 3.3x GB300 NVL72, whose dense fp8 is 0.36 EF (0.72 EF with "
        "sparsity) [S: press coverage of NVIDIA's announcement]; fp4 50,000 is the 'NVFP4 inference' figure "
        "(adaptive compression; 35,000 for training) [S]; 1,800-2,300 W (midpoint) [?]",
        sm=107,  # vLLM's sm_107 (its all-reduce tables call it Rubin)
    ),
    GPU("MI300X", 192, 5.3, 1307, 2615, None, 64, 448, 750, ("mi300x", "mi300"), vendor="amd"),
    GPU("MI325X", 256, 6.0, 1307, 2615, None, 64, 448, 1000, ("mi325x", "mi325"), vendor="amd"),
    GPU("MI355X", 288, 8.0, 2516, 5033, 10066, 64, 576, 1400, ("mi355x", "mi355"), vendor="amd"),
)
_GPU_INDEX = {_key(a): g for g in GPUS for a in (g.name, *g.aliases)}


def gpu_names() -> list[str]:
    """Catalogue names, in table order."""
    return [g.name for g in GPUS]


def _lookup(index: dict, name: str, what: str, names: list[str]):
    """`name` in a catalogue index (case and separators ignored); UserError lists the choices."""
    found = index.get(_key(name))
    if found is None:
        raise UserError(f"unknown {what} '{name}'; choose one of: {', '.join(names)}")
    return found


def get_gpu(name: str | GPU) -> GPU:
    """The GPU called `name` (case-insensitive; aliases like 'h200', 'h200-sxm'); UserError lists the choices."""
    return name if isinstance(name, GPU) else _lookup(_GPU_INDEX, name, "GPU", gpu_names())


@dataclass(frozen=True, slots=True)
class System:
    """A node or rack as sold: `gpus` of one GPU, `nvlink_domain` GPUs per NVLink domain, a NIC per GPU
    (GB/s per direction) between domains, and provisioned (nameplate) power for the whole system."""

    name: str
    gpu: str
    gpus: int
    nvlink_domain: int
    nic_gbps: float
    power_kw: float
    aliases: tuple[str, ...] = ()
    source: str = ""

    @property
    def power_w_per_gpu(self) -> float:
        """The system's provisioned power shared over its GPUs (host, switches, NICs, fans included)."""
        return self.power_kw * 1e3 / self.gpus


SYSTEMS: tuple[System, ...] = (
    System(
        "DGX H200",
        "h200",
        8,
        8,
        50,
        10.2,
        ("h200-hgx", "dgx-h200", "8xh200"),
        "NVIDIA DGX H200 datasheet: 8x H200, ~10.2 kW max; 8x ConnectX-7 400 Gb/s [V]",
    ),
    System(
        "DGX B200",
        "b200",
        8,
        8,
        50,
        14.3,
        ("b200-hgx-8", "dgx-b200", "8xb200"),
        "NVIDIA DGX B200 datasheet: ~14.3 kW max; 8x ConnectX-7 400 Gb/s [V]",
    ),
    System(
        "DGX B300",
        "b300",
        8,
        8,
        100,
        14.5,
        ("b300-hgx-8", "dgx-b300", "8xb300"),
        "NVIDIA DGX B300 page: ~14.5 kW [S, unsure]; 8x ConnectX-8 800 Gb/s [S]",
    ),
    System(
        "MI355X 8-GPU",
        "mi355x",
        8,
        8,
        50,
        14.0,
        ("mi355x-8", "8xmi355x", "mi355x"),
        "AMD Instinct MI355X: 1,400 W per GPU [S]; node ~14 kW = 8x 1.4 kW + ~2.8 kW host, an estimate [?]; "
        "Pollara 400 Gb/s NIC per GPU [S]",
    ),
    System(
        "GB300 NVL72",
        "gb300",
        72,
        72,
        100,
        142.0,
        ("gb300-nvl72-rack", "nvl72-gb300"),
        "NVIDIA GB300 NVL72: one 72-GPU NVLink 5 domain (130 TB/s); rack up to 142 kW provisioned [V] "
        "(Supermicro: 8x 33 kW shelves, 132-140 kW typical [S]); ConnectX-8 800 Gb/s per GPU [V]",
    ),
    System(
        "Vera Rubin NVL72",
        "rubin",
        72,
        72,
        200,
        230.0,
        ("vr-nvl72", "rubin-nvl72", "vera-rubin-nvl72"),
        "NVIDIA Vera Rubin NVL72 (preliminary): one 72-GPU NVLink 6 domain (260 TB/s, 3.6 TB/s per GPU "
        "bidirectional) [S]; ~190 kW (Max Q) to ~230 kW (Max P), the Max P figure used [S/?]; "
        "ConnectX-9 1.6 Tb/s per GPU [S]",
    ),
)
_SYSTEM_INDEX = {_key(a): s for s in SYSTEMS for a in (s.name, *s.aliases)}


def system_names() -> list[str]:
    """System catalogue names, in table order."""
    return [s.name for s in SYSTEMS]


def get_system(name: str | System) -> System:
    """The system called `name` (case-insensitive, aliases); UserError lists the choices."""
    return name if isinstance(name, System) else _lookup(_SYSTEM_INDEX, name, "system", system_names())


def ring_allreduce_s(
    nbytes: float, tp: int, link_gbps: float, latency_s: float = ALLREDUCE_LATENCY_S
) -> float:
    """Ring all-reduce of `nbytes` over `tp` ranks: 2 (tp-1)/tp x bytes / link bandwidth + latency."""
    if tp <= 1:
        return 0.0
    return 2.0 * (tp - 1) / tp * nbytes / (link_gbps * 1e9) + latency_s


def provisioned_power(system: str | System | None, gpu: str | GPU | None) -> tuple[float | None, str]:
    """(watts per GPU, basis) that per-MW figures divide by: a named system's provisioned share per
    GPU, else the GPU's board power; (None, why) when neither is known."""
    if system is not None:
        s = get_system(system)
        return s.power_w_per_gpu, f"{s.name} provisioned {s.power_kw:g} kW / {s.gpus} GPUs"
    if gpu is None:
        return None, "power unknown: name the target's system with --system"
    g = get_gpu(gpu)
    return g.power_w, f"{g.name} board power {g.power_w:g} W"
