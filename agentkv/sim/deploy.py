"""What a simulated deployment is made of: its system (GPU, NVLink domain, NIC, provisioned power),
its GPU count, and the links a disaggregated run moves KV over."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from agentkv.engine.hardware import GPU, SYSTEMS, System, get_gpu, get_model, get_system, provisioned_power
from agentkv.errors import UserError
from agentkv.kv.transfer import LinkModel, nvlink, rdma
from agentkv.placement import check_kv_weights

if TYPE_CHECKING:
    from agentkv.engine.config import EngineConfig
    from agentkv.sim.cluster import SimConfig

DEFAULT_DOMAIN, DEFAULT_NIC_GBPS = 8, 50.0  # a GPU with no system in the catalogue: HGX-like, 400 Gb/s


@dataclass(frozen=True, slots=True)
class Deployment:
    """The hardware a run is priced on; `power_w_per_gpu` is the system's nameplate share per GPU
    when a system was named, else the GPU's own board power (as before systems existed)."""

    gpu: GPU
    system: System | None
    nvlink_domain: int
    nic_gbps: float
    power_w_per_gpu: float
    power_basis: str


def _system_of_gpu(gpu: GPU) -> System | None:
    return next((s for s in SYSTEMS if get_gpu(s.gpu) is gpu), None)


def deployment(cfg: SimConfig) -> Deployment:
    """The deployment of `cfg`: its named system, else the first catalogue system of its GPU for the
    topology (power stays the GPU's board power, since no system was chosen)."""
    if cfg.system is not None:
        s = get_system(cfg.system)
        w, basis = provisioned_power(s, None)
        return Deployment(get_gpu(s.gpu), s, s.nvlink_domain, s.nic_gbps, w, basis)
    gpu = get_gpu(cfg.engine.gpu)
    s = _system_of_gpu(gpu)
    domain, nic = (s.nvlink_domain, s.nic_gbps) if s else (DEFAULT_DOMAIN, DEFAULT_NIC_GBPS)
    w, basis = provisioned_power(None, gpu)
    return Deployment(gpu, None, domain, nic, w, basis)


def check_pools(cfg: SimConfig) -> None:
    """One-line errors for a pool's TP or DP below 1, EP on a model without experts, a pool's
    engines not filling whole DP groups (N engines of a D-rank group: N <= D is a slice of one),
    and a decode pool's kv_aware price that is negative, infinite or NaN."""
    check_kv_weights(cfg.decode_kv_weight or 0.0, cfg.decode_kv_queue_weight or 0.0, pool="decode-")
    for pool in ("prefill", "decode"):
        for what in ("tensor", "data"):
            v = getattr(cfg, f"{pool}_{what}_parallel_size")
            if v is not None and v < 1:
                raise UserError(f"--{pool}-{what}-parallel-size must be >= 1, got {v}")
        if getattr(cfg, f"{pool}_enable_expert_parallel") and get_model(cfg.engine.model).moe is None:
            raise UserError(f"--{pool}-enable-expert-parallel: model '{cfg.engine.model}' has no experts")
        dp = getattr(cfg, f"{pool}_data_parallel_size") or cfg.engine.data_parallel_size
        n = getattr(cfg, f"{pool}_workers")
        if n > dp and n % dp:
            raise UserError(
                f"--disagg {pool}={n}: the {pool} engines are ranks of DP groups of {dp} "
                f"(--{pool}-data-parallel-size): use at most {dp} (a slice) or a multiple of {dp}"
            )


def pool_tp(cfg: SimConfig) -> tuple[int, int]:
    """(prefill, decode) tensor-parallel sizes: their own flags, else --tensor-parallel-size."""
    tp = cfg.engine.tensor_parallel_size
    return cfg.prefill_tensor_parallel_size or tp, cfg.decode_tensor_parallel_size or tp


def pool_engine(cfg: SimConfig, ecfg: EngineConfig, pool: str) -> EngineConfig:
    """The engine config of one pool ("prefill" or "decode"): its own TP, DP and EP flags, else the
    global ones (a wide-EP decode pool: TP 1, DP D, EP, each decode engine one rank of D)."""
    tp = pool_tp(cfg)[pool == "decode"]
    dp = getattr(cfg, f"{pool}_data_parallel_size")
    ep = getattr(cfg, f"{pool}_enable_expert_parallel")
    return replace(
        ecfg,
        tensor_parallel_size=tp,
        data_parallel_size=ecfg.data_parallel_size if dp is None else dp,
        enable_expert_parallel=ecfg.enable_expert_parallel if ep is None else ep,
    )


def pool_label(e: EngineConfig) -> str:
    """`tp=1, dp=24, ep`: one pool engine's parallelism, for the run's one-line shape."""
    dp = f", dp={e.data_parallel_size}" if e.data_parallel_size > 1 else ""
    return f"tp={e.tensor_parallel_size}{dp}{', ep' if e.enable_expert_parallel else ''}"


def total_gpus(cfg: SimConfig) -> int:
    """GPUs the run occupies: workers x TP, or prefill x its TP + decode x its TP."""
    if cfg.prefill_workers > 0:
        tp_p, tp_d = pool_tp(cfg)
        return cfg.prefill_workers * tp_p + cfg.decode_workers * tp_d
    return cfg.workers * cfg.engine.tensor_parallel_size


def kv_links(dep: Deployment, override_gbps: float | None) -> tuple[LinkModel, LinkModel]:
    """(NVLink, RDMA) links of one GPU, per direction; `override_gbps` sets both (inf: free)."""
    nv = dep.gpu.gpu_link_gbps if override_gbps is None else override_gbps
    nic = dep.nic_gbps if override_gbps is None else override_gbps
    return nvlink(nv), rdma(nic)


def decode_weights(cfg: SimConfig) -> tuple[float, float]:
    """The decode pool's kv_aware prices: --decode-kv-weight and --decode-kv-queue-weight, each
    defaulting to the shared --kv-weight and --kv-queue-weight (Dynamo's decode stage fixes its
    overlap weight at 0 and tracks no prefill tokens, while its prefill router keeps them)."""
    w, q = cfg.decode_kv_weight, cfg.decode_kv_queue_weight
    return (cfg.kv_weight if w is None else w), (cfg.kv_queue_weight if q is None else q)


def kv_weights(cfg: SimConfig, pool: str = "router") -> dict[str, float]:
    """The kv_aware prices for the policy of `pool` ("router": the cluster's, or the prefill pool's,
    --kv-weight and --kv-queue-weight; "decode": --decode-router's, `decode_weights`; both pools
    share --kv-queue-cap), or {} when that policy is not kv_aware."""
    if pool == "decode":
        w, q = decode_weights(cfg)
        kw = dict(weight=w, queue_weight=q, queue_cap=cfg.kv_queue_cap)
        return kw if cfg.decode_router == "kv_aware" else {}
    kw = dict(weight=cfg.kv_weight, queue_weight=cfg.kv_queue_weight, queue_cap=cfg.kv_queue_cap)
    return kw if cfg.router == "kv_aware" else {}
