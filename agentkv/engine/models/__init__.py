"""Model shapes: dimensions, KV cache layer groups, weights; built-ins and Hugging Face config readers."""

from agentkv.engine.models.catalogue import BUILTIN_NAMES, builtin_models, get_model, model_names
from agentkv.engine.models.dtypes import DTYPE_BYTES, KV_DTYPES
from agentkv.engine.models.groups import GroupKind, LayerGroup
from agentkv.engine.models.parts import Part
from agentkv.engine.models.shape import ModelShape, MoE, RankShape

__all__ = [
    "BUILTIN_NAMES",
    "DTYPE_BYTES",
    "KV_DTYPES",
    "GroupKind",
    "LayerGroup",
    "MoE",
    "ModelShape",
    "Part",
    "RankShape",
    "builtin_models",
    "get_model",
    "model_names",
]
