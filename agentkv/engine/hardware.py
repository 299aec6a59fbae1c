"""Accelerator and model-shape catalogue: datasheet figures, weight/KV sizes, tensor-parallel shards.

GPU figures come from `shared/hardware.md` (dense peaks, sparse halved; [S]/[V] marks there say
how sure they are). Model shapes are the dense decoder's dimensions; anything else can be read
from a Hugging Face `config.json` with `ModelShape.from_hf_config`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from agentkv.errors import UserError

DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5}
KV_DTYPES = ("bf16", "fp16", "fp8")
ACT_BYTES = 2  # activations and all-reduce payloads stay bf16
ALLREDUCE_LATENCY_S = 10e-6  # one small all-reduce over NVLink (assumed, not measured here)


def _key(name: str) -> str:
    """Lookup key: lower case, org prefix and '-instruct' dropped, separators removed."""
    s = name.strip().lower().rsplit("/", 1)[-1]
    s = re.sub(r"[-_ ]instruct$", "", s)
    return re.sub(r"[\s_.\-]", "", s)


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

    @property
    def hbm_bytes(self) -> float:
        """HBM capacity in bytes (nameplate GB read as GiB, which matches what the driver reports)."""
        return self.hbm_gb * 2**30

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
    GPU("H100 SXM", 80, 3.35, 989, 1979, None, 64, 450, 700, ("h100", "h100-sxm")),
    GPU("H200 SXM", 141, 4.8, 989, 1979, None, 64, 450, 700, ("h200", "h200-sxm")),
    GPU("B200", 180, 8.0, 2250, 4500, 9000, 64, 900, 1000, ("b200", "b200-hgx"), "180 GB usable"),
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
    ),
    GPU("B300", 268, 8.0, 2250, 4500, 13500, 128, 900, 1100, ("b300", "b300-hgx"), "268 GB usable; PCIe 6"),
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
    ),
    GPU(
        "Rubin VR200",
        288,
        22.0,
        4000,
        None,
        50000,
        900,
        1800,
        2050,
        ("rubin", "vr200", "vera-rubin", "rubin-vr200", "vr200-nvl72"),
        "preliminary: 22 TB/s (earlier 13), ~4,000 bf16 TFLOP/s, fp8 unpublished, 1,800-2,300 W (midpoint)",
    ),
    GPU("MI300X", 192, 5.3, 1307, 2615, None, 64, 448, 750, ("mi300x", "mi300")),
    GPU("MI325X", 256, 6.0, 1307, 2615, None, 64, 448, 1000, ("mi325x", "mi325")),
    GPU("MI355X", 288, 8.0, 2516, 5033, 10066, 64, 576, 1400, ("mi355x", "mi355")),
)
_GPU_INDEX = {_key(a): g for g in GPUS for a in (g.name, *g.aliases)}


def gpu_names() -> list[str]:
    """Catalogue names, in table order."""
    return [g.name for g in GPUS]


def get_gpu(name: str | GPU) -> GPU:
    """The GPU called `name` (case-insensitive; aliases like 'h200', 'h200-sxm'); UserError lists the choices."""
    if isinstance(name, GPU):
        return name
    gpu = _GPU_INDEX.get(_key(name))
    if gpu is None:
        raise UserError(f"unknown GPU '{name}'; choose one of: {', '.join(gpu_names())}")
    return gpu


def ring_allreduce_s(
    nbytes: float, tp: int, link_gbps: float, latency_s: float = ALLREDUCE_LATENCY_S
) -> float:
    """Ring all-reduce of `nbytes` over `tp` ranks: 2 (tp-1)/tp x bytes / link bandwidth + latency."""
    if tp <= 1:
        return 0.0
    return 2.0 * (tp - 1) / tp * nbytes / (link_gbps * 1e9) + latency_s


@dataclass(frozen=True, slots=True)
class RankShape:
    """What one tensor-parallel rank holds: its heads, KV heads and parameter counts."""

    tp: int
    heads: int
    kv_heads: int  # KV heads stored on this rank (replicated when the model has fewer than tp)
    layer_params: int  # linear-layer parameters of one decoder layer on this rank
    lm_head_params: int  # vocab-parallel lm_head share
    embed_params: int  # vocab-parallel embedding share (0 when tied: the lm_head is the embedding)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A dense decoder's dimensions (Llama/Qwen style: GQA attention, gated MLP); sizes derive from them."""

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

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"model '{self.name}': {f} must be a positive integer, got {v!r}")
        if self.heads % self.kv_heads:
            raise UserError(
                f"model '{self.name}': heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )

    @property
    def layer_params(self) -> int:
        """Linear weights of one layer: q, k, v, o projections and the gate/up/down MLP (norms excluded)."""
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.intermediate

    @property
    def params(self) -> int:
        """All parameters: layers, norms, embedding and (unless tied) the lm_head."""
        emb = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layers * (self.layer_params + 2 * self.hidden) + self.hidden + emb

    def weight_bytes(self, dtype: str = "bf16") -> float:
        """Checkpoint bytes: linear layers in `dtype`; embedding, lm_head and norms stay bf16."""
        lin = self.layers * self.layer_params
        return lin * DTYPE_BYTES[_check_dtype(dtype, DTYPE_BYTES)] + (self.params - lin) * 2

    def kv_bytes_per_token(self, dtype: str = "bf16", tp: int = 1) -> float:
        """KV cache bytes one token takes on one rank: 2 (K, V) x layers x kv heads x head dim x dtype."""
        kv = self.shard(tp).kv_heads
        return 2 * self.layers * kv * self.head_dim * DTYPE_BYTES[_check_dtype(dtype, KV_DTYPES)]

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
        layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * self.intermediate // tp
        vocab_share = -(-self.vocab // tp) * h
        return RankShape(tp, heads, kv, layer, vocab_share, 0 if self.tie_embeddings else vocab_share)

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelShape:
        """Read a Hugging Face `config.json` (the file or its folder); UserError names the file and field."""
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        if not f.is_file():
            raise UserError(f"{f}: no such file (expected a Hugging Face config.json or its folder)")
        try:
            cfg = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{f}: not a readable JSON file ({e})") from None
        if not isinstance(cfg, dict):
            raise UserError(f"{f}: expected a JSON object")
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]  # multimodal wrappers keep the decoder here
        for moe in ("num_experts", "num_local_experts", "n_routed_experts"):
            if (cfg.get(moe) or 0) > 1:
                raise UserError(
                    f"{f}: field '{moe}': mixture-of-experts models are not supported (dense only)"
                )

        def need(field: str, default: int | None = None) -> int:
            v = cfg.get(field, default)
            if v is None:
                raise UserError(f"{f}: missing field '{field}'")
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"{f}: field '{field}' must be a positive integer, got {v!r}")
            return v

        layers, hidden, heads = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
        kv = need("num_key_value_heads", heads)
        head_dim = need("head_dim", hidden // heads if hidden % heads == 0 else None)
        name = str(cfg.get("_name_or_path") or (p.name if p.is_dir() else f.parent.name) or f.stem)
        return cls(
            name,
            layers,
            hidden,
            heads,
            kv,
            head_dim,
            need("intermediate_size"),
            need("vocab_size"),
            bool(cfg.get("tie_word_embeddings", False)),
            max_position=need("max_position_embeddings", 131072),
        )


def _check_dtype(dtype: str, allowed) -> str:
    if dtype not in allowed:
        raise UserError(f"dtype '{dtype}' is not one of {', '.join(allowed)}")
    return dtype


MODELS: tuple[ModelShape, ...] = (
    ModelShape(
        "Llama-3.1-8B",
        32,
        4096,
        32,
        8,
        128,
        14336,
        128256,
        False,
        ("llama3-8b", "llama-3-8b", "llama3.1-8b", "meta-llama-3.1-8b"),
    ),
    ModelShape(
        "Llama-3.1-70B",
        80,
        8192,
        64,
        8,
        128,
        28672,
        128256,
        False,
        ("llama3-70b", "llama-3-70b", "llama3.1-70b", "meta-llama-3.1-70b"),
    ),
    ModelShape("Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, False, ("qwen3-32b",), 40960),
)
_MODEL_INDEX = {_key(a): m for m in MODELS for a in (m.name, *m.aliases)}


def model_names() -> list[str]:
    """Built-in model shape names."""
    return [m.name for m in MODELS]


def get_model(name: str | Path | ModelShape) -> ModelShape:
    """A built-in shape by name/alias (case-insensitive), or a path to a HF config.json or its folder."""
    if isinstance(name, ModelShape):
        return name
    m = _MODEL_INDEX.get(_key(str(name)))
    if m is not None:
        return m
    if Path(name).exists():
        return ModelShape.from_hf_config(name)
    raise UserError(
        f"unknown model '{name}'; choose one of: {', '.join(model_names())}, "
        "or give the path of a Hugging Face config.json"
    )
