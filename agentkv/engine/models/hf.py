"""Hugging Face `config.json` -> `ModelShape`: load the file, find the family by `model_type`, read it.

Each family's reader lives in `families.py` or `deepseek.py`; this module holds what they share: the
field accessors (every error names the file and the field), the checkpoint's weight dtypes and the
per-layer attention kinds of `layer_types`.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentkv.errors import UserError

_MISSING = object()
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
ENCODER_DECODER = ("t5", "mt5", "bart", "mbart", "whisper", "pegasus", "marian", "encoder-decoder", "umt5")


class Fields:
    """A config's fields, read with the file's name in every error."""

    def __init__(self, cfg: dict, origin: str, name: str, outer: dict | None = None):
        self.cfg, self.origin, self.name = cfg, origin, name
        self.outer = outer or cfg  # the top level when the decoder sits in text_config
        self.model_type = str(cfg.get("model_type") or self.outer.get("model_type") or "")

    def error(self, field: str, message: str) -> UserError:
        return UserError(f"{self.origin}: field '{field}': {message}")

    def has(self, field: str) -> bool:
        return self.cfg.get(field) is not None

    def get(self, field: str, default=None):
        v = self.cfg.get(field)
        return default if v is None else v

    def num(self, field: str, default=_MISSING, minimum: int = 1) -> int:
        """A whole number >= `minimum`; `default` when absent (a missing field with no default is an error)."""
        v = self.cfg.get(field)
        if v is None:
            if default is _MISSING:
                raise UserError(f"{self.origin}: missing field '{field}'")
            return default
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise UserError(f"{self.origin}: field '{field}' must be {what}, got {v!r}")
        return v

    def int_list(self, field: str, length: int, minimum: int = 0) -> list[int]:
        """A list of at least `length` whole numbers >= `minimum` (the first `length` are returned)."""
        v = self.cfg.get(field)
        if v is None:
            raise UserError(f"{self.origin}: missing field '{field}'")
        ok = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        if not ok or len(v) < length or min(v, default=minimum) < minimum:
            raise self.error(field, f"expected a list of {length} integers >= {minimum}, got {v!r}")
        return v[:length]

    def layer_types(self, layers: int, default: list[str], known: dict[str, str]) -> list[str]:
        """`layer_types` (or `default`) mapped through `known`; an unknown kind names its layer."""
        v = self.cfg.get("layer_types")
        kinds = default if v is None else v
        if not isinstance(kinds, list) or len(kinds) != layers:
            raise self.error("layer_types", f"expected a list of {layers} attention kinds, got {v!r}")
        out = []
        for i, k in enumerate(kinds):
            if k not in known:
                raise self.error(
                    "layer_types", f"unknown attention kind {k!r} at layer {i} (known: {', '.join(known)})"
                )
            out.append(known[k])
        return out

    def common(self, head_dim: int | None = None) -> dict:
        """The fields every decoder has, as `ModelShape` keywords (head_dim from the heads when absent)."""
        hidden, heads = self.num("hidden_size"), self.num("num_attention_heads")
        if head_dim is None:
            head_dim = self.num("head_dim", hidden // heads if hidden % heads == 0 else _MISSING)
        return dict(
            name=self.name,
            layers=self.num("num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=self.num("num_key_value_heads", heads),
            head_dim=head_dim,
            vocab=self.num("vocab_size"),
            tie_embeddings=bool(
                self.get("tie_word_embeddings", self.outer.get("tie_word_embeddings", False))
            ),
            max_position=self.num("max_position_embeddings", 131072),
        )

    def weight_dtypes(self) -> tuple[str, str | None]:
        """(linear layers, routed experts) dtypes of the checkpoint from `quantization_config`."""
        q = self.cfg.get("quantization_config") or self.outer.get("quantization_config")
        experts = self.get("expert_dtype")
        if experts is not None and experts not in ("fp4", "fp8"):
            raise self.error("expert_dtype", f"{experts!r} is not one of fp4, fp8")
        if not q:
            return "bf16", experts
        method = q.get("quant_method") if isinstance(q, dict) else None
        if method == "fp8":
            return "fp8", experts
        if method == "mxfp4":  # gpt-oss: experts in MXFP4, attention, router, embedding and lm_head bf16
            return "bf16", "fp4"
        raise self.error(
            "quantization_config.quant_method",
            f"{method!r} is not supported (fp8, mxfp4, or none for bf16 weights)",
        )


def load_config(path: str | Path) -> tuple[dict, str, str]:
    """(fields, the file's name, a default model name) of a config.json or its folder."""
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
    name = str(cfg.get("_name_or_path") or (p.name if p.is_dir() else f.parent.name) or f.stem)
    return cfg, str(f), name


def read_hf_config(path: str | Path):
    """A `ModelShape` from a Hugging Face config.json (the file or its folder)."""
    cfg, origin, name = load_config(path)
    return shape_from_config(cfg, origin, name)


def shape_from_config(cfg: dict, origin: str, name: str):
    """A `ModelShape` from a parsed config; `origin` names the source in errors."""
    from agentkv.engine.models.deepseek import DEEPSEEK_READERS
    from agentkv.engine.models.families import FAMILY_READERS

    if cfg.get("is_encoder_decoder") or cfg.get("model_type") in ENCODER_DECODER:
        field = "is_encoder_decoder" if cfg.get("is_encoder_decoder") else "model_type"
        raise UserError(
            f"{origin}: field '{field}': encoder-decoder models are not supported (decoders only)"
        )
    inner = cfg
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        inner = cfg["text_config"]  # multimodal wrappers keep the decoder here
    f = Fields(inner, origin, name, outer=cfg)
    readers = {**FAMILY_READERS, **DEEPSEEK_READERS}
    reader = readers.get(f.model_type)
    if reader is None:
        known = ", ".join(sorted(k for k in readers if k))
        raise f.error("model_type", f"{f.model_type!r} is not a supported family ({known})")
    return reader(f)
